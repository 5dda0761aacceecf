"""Planning by memory (mvp_core/memory_plan.py): what a stage needs, ranges that fit each
node's memory with the most even work, and a clear rejection of a fleet too small."""

from __future__ import annotations

import itertools
import random

import pytest

from mvp_core.memory_plan import (
    KV_BYTES,
    MARGIN_PERCENT,
    RUNTIME_BYTES,
    SCRATCH_ROWS,
    stage_need,
)
from mvp_core.models import LayerRange, LayerSplit, ModelBytes, ModelFacts
from mvp_core.planner import PlanningError, build_plan, least_work_ranges

MIB = 1 << 20
GIB = 1 << 30
# An 8B-like shape scaled down: 32 layers of 200 MiB, a 1 GiB embedding, a 1 GiB head.
SIZES = ModelBytes(
    layers=[200 * MIB] * 32, embedding=GIB, output=GIB, tied_head=False, kv_elements=2048
)
FACTS = ModelFacts(
    architecture="llama",
    name="m",
    block_count=32,
    embedding_length=4096,
    context_length=8192,
    layer_work=[1000] * 32,
    output_work=2000,
    sizes=SIZES,
)


def plan(stages: int, memory: list[int] | None, **kw: object):
    return build_plan(
        run_id=7,
        orchestrator_node_id=0,
        base_node_id=1,
        stage_count=stages,
        max_context=1024,
        facts=FACTS,
        model_path="/m.gguf",
        tokenizer_path="/m.gguf",
        node_memory=memory,
        **kw,  # type: ignore[arg-type]
    )


def test_a_stage_needs_its_weights_kv_scratch_margin_and_runtime() -> None:
    need = stage_need(
        SIZES, LayerRange(start=30, end=32), first=False, last=True, max_seq_len=1024,
        slots=2, hidden=4096,
    )  # fmt: skip
    assert need.weights == 2 * 200 * MIB + GIB  # its layers and the head (not tied)
    assert need.kv == 2 * 1024 * 2 * 2048 * KV_BYTES
    assert need.scratch == SCRATCH_ROWS * 1024 * 4096 * 4
    held = need.weights + need.kv + need.scratch
    assert need.total == -(-held * (100 + MARGIN_PERCENT) // 100) + RUNTIME_BYTES
    tied = SIZES.model_copy(update={"tied_head": True})
    last = stage_need(
        tied, LayerRange(start=31, end=32), first=False, last=True, max_seq_len=8, slots=1,
        hidden=4096,
    )  # fmt: skip
    assert last.weights == 200 * MIB + GIB + GIB  # the tied head reads the embedding too


def test_the_even_split_stays_where_it_fits_and_the_plan_says_each_need() -> None:
    p = plan(2, [16 * GIB])
    assert [(s.layers.start, s.layers.end) for s in p.stages] == [(0, 16), (16, 32)]
    assert all(s.node_memory == 16 * GIB for s in p.stages)
    assert all(s.memory_need is not None and s.memory_need <= 16 * GIB for s in p.stages)
    # Without node memory the plan still says what each stage needs.
    assert all(s.memory_need is not None and s.node_memory is None for s in plan(2, None).stages)


def test_nodes_of_different_memory_get_different_shares() -> None:
    memory = [8 * GIB, 2 * GIB, 8 * GIB]
    p = plan(3, memory)
    sizes = [s.layers.end - s.layers.start for s in p.stages]
    assert sum(sizes) == 32 and sizes[1] < sizes[0] and sizes[1] < sizes[2]
    for s in p.stages:
        assert s.memory_need is not None and s.memory_need <= memory[s.stage_index]
    # The even split would not have fitted the small node.
    even = plan(3, None).stages[1]
    assert even.memory_need is not None and even.memory_need > 2 * GIB


def test_a_fleet_too_small_is_rejected_naming_each_nodes_shortfall() -> None:
    with pytest.raises(PlanningError) as info:
        plan(2, [3 * GIB, 3 * GIB])
    text = str(info.value)
    assert text.startswith("the model does not fit 2 node(s) of 6.00 GiB in all")
    assert "stage 0 (layers 0-" in text and "its node has 3.00 GiB: short by " in text
    assert "stage 1 (layers " in text


@pytest.mark.parametrize(
    ("memory", "message"),
    [
        ([GIB, GIB, GIB], "node_memory gives 3 values for 2 stages"),
        ([MIB], f"node_memory {MIB} is not {64 * MIB}.."),
    ],
)
def test_node_memory_that_is_not_a_fleet_is_refused(memory: list[int], message: str) -> None:
    with pytest.raises(PlanningError, match=message):
        plan(2, memory)


def test_planning_by_memory_needs_the_models_sizes() -> None:
    facts = FACTS.model_copy(update={"sizes": None})
    with pytest.raises(PlanningError, match="planning by node memory needs each tensor's size"):
        build_plan(
            run_id=7, orchestrator_node_id=0, base_node_id=1, stage_count=2, max_context=64,
            facts=facts, model_path="/m.gguf", tokenizer_path="/m.gguf", node_memory=[GIB],
        )  # fmt: skip


def test_the_split_that_fits_has_the_least_work_as_a_search_finds() -> None:
    """Against every split of small random models: a split that fits exists exactly when
    least_work_ranges returns one; its largest work is the least of those that fit, and of
    those its sum of squared work is the least."""
    rng = random.Random(35)
    for _ in range(300):
        n, stages = rng.randint(1, 9), rng.randint(1, 4)
        if stages > n:
            continue
        size = [rng.randint(1, 9) for _ in range(n)]
        work_of = [rng.randint(1, 9) for _ in range(n)]
        memory = [rng.randint(3, 25) for _ in range(stages)]

        def need(stage: int, a: int, b: int, size: list[int] = size) -> int:
            return sum(size[a:b]) + (2 if stage == 0 else 0)

        def work(a: int, b: int, work_of: list[int] = work_of) -> int:
            return sum(work_of[a:b])

        best: tuple[int, int] | None = None
        for cuts in itertools.combinations(range(1, n), stages - 1):
            bounds = list(zip((0, *cuts), (*cuts, n), strict=True))
            if all(need(i, a, b) <= memory[i] for i, (a, b) in enumerate(bounds)):
                works = [work(a, b) for a, b in bounds]
                score = (max(works), sum(w * w for w in works))
                best = score if best is None else min(best, score)
        got = least_work_ranges(
            stages, n, work, lambda i, a, b, m=memory, f=need: f(i, a, b) <= m[i]
        )
        if best is None:
            assert got is None
            continue
        assert got is not None and got[0].start == 0 and got[-1].end == n
        assert all(x.end == y.start for x, y in itertools.pairwise(got))
        assert all(need(i, r.start, r.end) <= memory[i] for i, r in enumerate(got))
        works = [work(r.start, r.end) for r in got]
        assert (max(works), sum(w * w for w in works)) == best


def test_layer_split_balanced_still_applies_without_node_memory() -> None:
    p = plan(2, None, layer_split=LayerSplit.BALANCED)
    assert p.stages[0].layers.end > 16  # the head's work counts on the last stage


def test_the_plan_uses_the_requests_node_memory_else_the_docker_containers_limit() -> None:
    from mvp_core.models import DockerSettings, ProviderKind, RunRequest
    from mvp_core.providers import TRAITS

    docker = TRAITS[ProviderKind.DOCKER]
    limited = RunRequest(provider=ProviderKind.DOCKER, docker=DockerSettings(memory=2 * GIB))
    assert docker.node_memory(limited) == [2 * GIB] and docker.memory(limited) == 2 * GIB
    both = limited.model_copy(update={"node_memory": [GIB, 3 * GIB]})
    assert docker.node_memory(both) == [GIB, 3 * GIB]
    assert docker.node_memory(RunRequest(provider=ProviderKind.DOCKER)) is None
    process = TRAITS[ProviderKind.PROCESS]
    assert process.node_memory(RunRequest()) is None and process.memory(limited) is None


def test_a_container_per_stage_is_limited_to_its_own_stages_need() -> None:
    from mvp_core.models import DockerSettings, ProviderKind, RunRequest
    from mvp_core.providers import TRAITS

    docker = TRAITS[ProviderKind.DOCKER]
    per_stage = RunRequest(
        provider=ProviderKind.DOCKER, docker=DockerSettings(memory_per_stage=True)
    )
    assert docker.node_memory(per_stage) is None  # planned as without a limit
    assert docker.stage_memory(per_stage, 700 << 20) == 700 << 20
    assert docker.stage_memory(per_stage, None) is None  # no sizes in the header: no limit
    one = RunRequest(provider=ProviderKind.DOCKER, docker=DockerSettings(memory=2 * GIB))
    assert docker.stage_memory(one, 700 << 20) == 2 * GIB
    assert TRAITS[ProviderKind.PROCESS].stage_memory(per_stage, 700 << 20) is None
