import itertools

import pytest

from mvp_core.models import ActivationDtype, EdgeKind, LayerSplit, ModelFacts, RunRequest
from mvp_core.planner import (
    PlanningError,
    balanced_layer_ranges,
    build_plan,
    stage_layer_ranges,
    stage_node_id,
)

FACTS = ModelFacts(
    architecture="llama",
    name="m",
    block_count=30,
    embedding_length=576,
    context_length=8192,
    eos_token_id=2,
)


def plan(stages: int, max_context: int | None = None, **dtype: ActivationDtype):
    return build_plan(
        run_id=7,
        orchestrator_node_id=0,
        base_node_id=1,
        stage_count=stages,
        max_context=max_context,
        facts=FACTS,
        model_path="/m.gguf",
        tokenizer_path="/m.gguf",
        **dtype,
    )


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 30])
def test_layer_ranges_are_contiguous_and_cover_every_layer(n):
    ranges = stage_layer_ranges(30, n)
    assert ranges[0].start == 0 and ranges[-1].end == 30
    for a, b in itertools.pairwise(ranges):
        assert a.end == b.start
    assert [r.start for r in ranges] == [30 * i // n for i in range(n)]


def test_stage_count_above_layer_count_is_rejected_with_the_contract_text():
    with pytest.raises(
        PlanningError, match=r"--pipeline-stages=31 exceeds GGUF layer count 30; choose N <= 30"
    ):
        stage_layer_ranges(30, 31)
    with pytest.raises(PlanningError, match="must be greater than 0"):
        stage_layer_ranges(30, 0)


def test_direct_mode_has_one_stage_no_edges_and_uses_node_id():
    p = plan(1)
    assert p.stage_count == 1 and p.edges == [] and p.rings == []
    assert p.stages[0].node_id == 1 and p.stages[0].holds_embedding and p.stages[0].holds_output
    assert p.max_seq_len == 512


def test_pipeline_edges_ids_and_object_specs():
    p = plan(3, max_context=256)
    assert [s.node_id for s in p.stages] == [2, 3, 4]
    assert [e.edge_id for e in p.edges] == [1, 2, 3, 4]
    kinds = [e.kind for e in p.edges]
    assert kinds == [
        EdgeKind.TOKEN_IN,
        EdgeKind.ACTIVATION,
        EdgeKind.ACTIVATION,
        EdgeKind.TOKEN_OUT,
    ]
    # activations travel as float32 by default (DECISIONS 53): b = 4 bytes per element
    act = p.edges[1]
    assert act.max_extent == 256 * 576 * 4 and act.alignment == 4
    assert act.activation_dtype is ActivationDtype.FLOAT32
    assert (act.src_stage, act.dst_stage) == (0, 1)
    assert [e.activation_dtype for e in p.edges if e.kind is not EdgeKind.ACTIVATION] == [None] * 2
    # Token-out carries one u32 token per record (DECISIONS 82): anything longer is
    # refused at its header.
    assert (p.edges[-1].max_extent, p.edges[-1].alignment) == (8 + 8 * 20, 4)
    ring = {r.edge_id: r for r in p.rings}
    assert ring[2].capacity == 40 + 256 * 576 * 4 and ring[2].alignment == 64
    assert ring[4].capacity == 40 + 256 * 4 and ring[4].alignment == 8


def test_a_float16_run_plans_half_the_activation_bytes():
    p = plan(3, max_context=256, activation_dtype=ActivationDtype.FLOAT16)
    acts = [e for e in p.edges if e.kind is EdgeKind.ACTIVATION]
    assert [(e.max_extent, e.alignment, e.activation_dtype) for e in acts] == [
        (256 * 576 * 2, 2, ActivationDtype.FLOAT16)
    ] * 2
    ring = {r.edge_id: r for r in p.rings}
    assert ring[2].capacity == ring[3].capacity == 40 + 256 * 576 * 2
    assert ring[1].capacity == 40 + 256 * 4 + 40  # token edges do not change


def test_activation_dtype_is_a_run_request_field_defaulting_to_float32():
    assert RunRequest().activation_dtype is ActivationDtype.FLOAT32  # old requests stay valid
    req = RunRequest.model_validate({"pipeline_stages": 2, "activation_dtype": "float16"})
    assert req.activation_dtype is ActivationDtype.FLOAT16
    with pytest.raises(ValueError, match="activation_dtype") as err:
        RunRequest.model_validate({"activation_dtype": "bfloat16"})
    assert "'float32' or 'float16'" in str(err.value)


def test_float32_ring_overflow_names_the_edge():
    # float32 doubles an activation ring: 40 + 65536 * 16384 * 4 > 4 GiB, float16 fits
    big = FACTS.model_copy(update={"embedding_length": 1 << 14, "context_length": 1 << 16})
    kw = {"run_id": 1, "orchestrator_node_id": 0, "base_node_id": 1, "stage_count": 2,
          "max_context": 1 << 16, "facts": big, "model_path": "m", "tokenizer_path": "m"}  # fmt: skip
    with pytest.raises(PlanningError, match="on edge 2: 4294967336 bytes exceeds 4294967296"):
        build_plan(**kw)
    assert build_plan(**kw, activation_dtype=ActivationDtype.FLOAT16).rings[1].capacity == (
        40 + (1 << 16) * (1 << 14) * 2
    )


def test_max_seq_len_is_capped_by_the_model_context():
    assert plan(1, max_context=100_000).max_seq_len == 8192


def test_ring_overflow_is_a_planning_error():
    huge = FACTS.model_copy(update={"embedding_length": 1 << 20, "context_length": 1 << 20})
    with pytest.raises(PlanningError, match="ring capacity overflow"):
        build_plan(
            run_id=1,
            orchestrator_node_id=0,
            base_node_id=1,
            stage_count=2,
            max_context=1 << 20,
            facts=huge,
            model_path="m",
            tokenizer_path="m",
        )


def test_node_ids():
    assert stage_node_id(5, 0, 1) == 5
    assert [stage_node_id(5, i, 3) for i in range(3)] == [6, 7, 8]


def _brute(work: list[int], out: int, n: int) -> int:
    """The least largest stage work over every contiguous split (small cases)."""
    layers = len(work)
    best = None
    for cuts in itertools.combinations(range(1, layers), n - 1):
        bounds = [0, *cuts, layers]
        most = max(
            sum(work[a:b]) + (out if b == layers else 0) for a, b in itertools.pairwise(bounds)
        )
        best = most if best is None else min(best, most)
    assert best is not None
    return best


@pytest.mark.parametrize("seed", range(40))
def test_a_balanced_split_is_contiguous_and_its_slowest_stage_is_the_least_possible(seed):
    import random

    rng = random.Random(seed)
    layers = rng.randint(1, 12)
    work = [rng.randint(1, 50) for _ in range(layers)]
    out = rng.choice([0, rng.randint(1, 200)])
    n = rng.randint(1, layers)
    ranges = balanced_layer_ranges(work, out, n)
    assert len(ranges) == n and ranges[0].start == 0 and ranges[-1].end == layers
    assert all(r.end > r.start for r in ranges)
    for a, b in itertools.pairwise(ranges):
        assert a.end == b.start
    most = max(sum(work[r.start : r.end]) + (out if r.end == layers else 0) for r in ranges)
    assert most == _brute(work, out, n)


def test_a_balanced_split_counts_the_output_head_on_the_last_stage():
    # SmolLM2's figures: 30 equal layers, the output head 8 layers' worth.
    facts = FACTS.model_copy(update={"layer_work": [3_538_944] * 30, "output_work": 28_311_552})
    ranges = [
        s.layers
        for s in build_plan(
            run_id=7, orchestrator_node_id=0, base_node_id=1, stage_count=2, max_context=None,
            facts=facts, model_path="/m.gguf", tokenizer_path="/m.gguf",
            layer_split=LayerSplit.BALANCED,
        ).stages
    ]  # fmt: skip
    assert [(r.start, r.end) for r in ranges] == [(0, 19), (19, 30)]
    # Where the head alone outweighs the rest, the other stages still share theirs evenly.
    assert [(r.start, r.end) for r in balanced_layer_ranges([1] * 18, 30, 3)] == [
        (0, 8), (8, 17), (17, 18)
    ]  # fmt: skip
    # The default stays the contract's even split, figures or not.
    even = build_plan(
        run_id=7, orchestrator_node_id=0, base_node_id=1, stage_count=2, max_context=None,
        facts=facts, model_path="/m.gguf", tokenizer_path="/m.gguf",
    )  # fmt: skip
    assert [(s.layers.start, s.layers.end) for s in even.stages] == [(0, 15), (15, 30)]


def test_a_balanced_split_without_figures_or_past_the_bound_is_a_planning_error():
    with pytest.raises(PlanningError, match="layer_split 'balanced' needs each layer's tensors"):
        build_plan(
            run_id=7, orchestrator_node_id=0, base_node_id=1, stage_count=2, max_context=None,
            facts=FACTS, model_path="/m.gguf", tokenizer_path="/m.gguf",
            layer_split=LayerSplit.BALANCED,
        )  # fmt: skip
    with pytest.raises(PlanningError, match="past the planner's search bound"):
        balanced_layer_ranges([1] * 1000, 0, 4)
    with pytest.raises(PlanningError, match="exceeds GGUF layer count 3"):
        balanced_layer_ranges([1] * 3, 0, 4)
