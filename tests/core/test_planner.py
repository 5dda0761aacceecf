import itertools

import pytest

from mvp_core.models import EdgeKind, ModelFacts
from mvp_core.planner import PlanningError, build_plan, stage_layer_ranges, stage_node_id

FACTS = ModelFacts(
    architecture="llama",
    name="m",
    block_count=30,
    embedding_length=576,
    context_length=8192,
    eos_token_id=2,
)


def plan(stages: int, max_context: int | None = None):
    return build_plan(
        run_id=7,
        orchestrator_node_id=0,
        base_node_id=1,
        stage_count=stages,
        max_context=max_context,
        facts=FACTS,
        model_path="/m.gguf",
        tokenizer_path="/m.gguf",
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
    act = p.edges[1]
    assert act.max_extent == 256 * 576 * 2 and act.alignment == 2
    assert (act.src_stage, act.dst_stage) == (0, 1)
    ring = {r.edge_id: r for r in p.rings}
    assert ring[2].capacity == 40 + 256 * 576 * 2 and ring[2].alignment == 64
    assert ring[4].capacity == 40 + 256 * 4 and ring[4].alignment == 8


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
