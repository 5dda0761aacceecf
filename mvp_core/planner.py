"""The run planner: model facts in, a committed RunPlan out (CONTRACTS "Run planner").

Pure: the activity that calls it reads the GGUF metadata; this module only computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mvp_core.memory_plan import KV_BYTES, closest_ranges, size_text, stage_needs
from mvp_core.models import (
    MAX_TOP_LOGPROBS,
    ActivationDtype,
    EdgeKind,
    EdgePlan,
    LayerRange,
    LayerSplit,
    ModelFacts,
    RingSpec,
    RunPlan,
    StagePlan,
)

DEFAULT_MAX_CONTEXT = 512
RECORD_HEADER_BYTES = 40
# DECISIONS 19: the begin record of token-in carries a sampling header ahead of the
# prompt tokens. Keep in step with workers.node.dataplane.records.SAMPLING_HEADER_BYTES.
SAMPLING_HEADER_BYTES = 40
# A token-out record: the u32 token, and for a prompt that asked for logprobs its f32
# logprob and up to MAX_TOP_LOGPROBS (u32 id, f32 logprob) pairs. Keep in step with
# workers.node.dataplane.records.token_out_max_extent.
TOKEN_OUT_BYTES = 8 + 8 * MAX_TOP_LOGPROBS
MAX_RING_BYTES = 1 << 32
MAX_BALANCED_SEARCH = 2_000_000  # stages x layers^2: 16 stages of 350 layers, about 1 s


class PlanningError(ValueError):
    """A plan cannot be made; the run is rejected before anything is provisioned."""


def stage_layer_ranges(layer_count: int, stages: int) -> list[LayerRange]:
    """Stage i of N gets layers floor(L*i/N) .. floor(L*(i+1)/N), end exclusive."""
    if stages <= 0:
        raise PlanningError("--pipeline-stages must be greater than 0")
    if stages > layer_count:
        raise PlanningError(
            f"--pipeline-stages={stages} exceeds GGUF layer count {layer_count}; "
            f"choose N <= {layer_count}"
        )
    return [
        LayerRange(start=layer_count * i // stages, end=layer_count * (i + 1) // stages)
        for i in range(stages)
    ]


def balanced_layer_ranges(layer_work: list[int], output_work: int, stages: int) -> list[LayerRange]:
    """Contiguous ranges, one or more layers each, whose largest stage work (its layers'
    work, plus ``output_work`` on the last stage) is the least any split allows: the
    slowest stage sets a full pipeline's pace (DECISIONS 67). Of those splits, the one
    with the least sum of squared stage work (the others as even as the largest allows),
    and of those the one whose stages end earliest."""
    n = len(layer_work)
    if stages <= 0:
        raise PlanningError("--pipeline-stages must be greater than 0")
    if stages > n:
        raise PlanningError(
            f"--pipeline-stages={stages} exceeds GGUF layer count {n}; choose N <= {n}"
        )
    if stages * n * n > MAX_BALANCED_SEARCH:
        raise PlanningError(
            f"layer_split 'balanced': {stages} stages of {n} layers is past the planner's "
            f"search bound (stages x layers^2 <= {MAX_BALANCED_SEARCH:,}); use 'even'"
        )
    ranges = least_work_ranges(stages, n, work_of(layer_work, output_work))
    assert ranges is not None  # every split is allowed
    return ranges


def work_of(layer_work: Sequence[int], output_work: int) -> Callable[[int, int], int]:
    """work(a, b): layers [a, b)'s work, the output head's added on the last stage's."""
    n = len(layer_work)
    prefix = [0]
    for w in layer_work:
        prefix.append(prefix[-1] + w)
    return lambda a, b: prefix[b] - prefix[a] + (output_work if b == n else 0)


def least_work_ranges(
    stages: int,
    n: int,
    work: Callable[[int, int], int],
    allowed: Callable[[int, int, int], bool] | None = None,
) -> list[LayerRange] | None:
    """Of the contiguous splits of ``n`` layers into ``stages`` ranges, each
    ``allowed(stage, a, b)`` (layers [a, b)) where given, the one whose largest
    ``work(a, b)`` is least; of those, the least sum of squared work; of those, the
    earliest ends. None where no split is allowed."""
    ok = allowed or (lambda stage, a, b: True)

    def ends(i: int, k: int) -> range:  # where a stage from layer i may end, k stages left
        return range(i + 1, n - k + 2)

    # most[k][i]: the least largest stage work of layers [i, n) in the last k stages.
    inf = float("inf")
    most: list[list[float]] = [[inf] * (n + 1) for _ in range(stages + 1)]
    most[0][n] = 0
    for k in range(1, stages + 1):
        stage = stages - k
        for i in range(n - k, -1, -1):
            most[k][i] = min(
                (max(work(i, j), most[k - 1][j]) for j in ends(i, k) if ok(stage, i, j)),
                default=inf,
            )
    limit = most[stages][0]
    if limit == inf:
        return None
    # squares[k][i]: the least sum of squares of [i, n) in k stages of at most ``limit``.
    squares: list[list[float]] = [[inf] * (n + 1) for _ in range(stages + 1)]
    squares[0][n] = 0
    for k in range(1, stages + 1):
        stage = stages - k
        for i in range(n - k, -1, -1):
            squares[k][i] = min(
                (
                    work(i, j) ** 2 + squares[k - 1][j]
                    for j in ends(i, k)
                    if work(i, j) <= limit and ok(stage, i, j)
                ),
                default=inf,
            )
    ranges, start = [], 0
    for k in range(stages, 0, -1):
        end = next(
            j
            for j in ends(start, k)
            if work(start, j) <= limit
            and ok(stages - k, start, j)
            and work(start, j) ** 2 + squares[k - 1][j] == squares[k][start]
        )
        ranges.append(LayerRange(start=start, end=end))
        start = end
    return ranges


def stage_node_id(base_node_id: int, stage_index: int, stage_count: int) -> int:
    """Worker node ids: ``node_id`` for one stage, ``node_id + 1 + i`` in a pipeline."""
    if stage_count == 1:
        return base_node_id
    return base_node_id + 1 + stage_index


def max_seq_len_for(facts: ModelFacts, max_context: int | None) -> int:
    return min(max_context or DEFAULT_MAX_CONTEXT, facts.context_length)


def plan_edges(
    stage_count: int,
    max_seq_len: int,
    hidden: int,
    activation_dtype: ActivationDtype = ActivationDtype.FLOAT32,
) -> list[EdgePlan]:
    """Edge ids: token-in 1, activation 2..N, token-out N+1. None for direct mode.

    An activation edge carries ``[T, hidden]`` rows of ``b`` bytes (4 for float32, 2 for
    float16): max extent ``max_seq_len*hidden*b``, alignment ``b``.
    """
    if stage_count == 1:
        return []
    token_extent = max_seq_len * 4
    b = activation_dtype.itemsize
    activation_extent = max_seq_len * hidden * b
    edges = [
        EdgePlan(
            edge_id=1,
            kind=EdgeKind.TOKEN_IN,
            src_stage=None,
            dst_stage=0,
            max_extent=token_extent + SAMPLING_HEADER_BYTES,
            alignment=4,
        )
    ]
    for i in range(stage_count - 1):
        edges.append(
            EdgePlan(
                edge_id=i + 2,
                kind=EdgeKind.ACTIVATION,
                src_stage=i,
                dst_stage=i + 1,
                max_extent=activation_extent,
                alignment=b,
                activation_dtype=activation_dtype,
            )
        )
    edges.append(
        EdgePlan(
            edge_id=stage_count + 1,
            kind=EdgeKind.TOKEN_OUT,
            src_stage=stage_count - 1,
            dst_stage=None,
            max_extent=TOKEN_OUT_BYTES,
            alignment=4,
        )
    )
    return edges


EPOCH_SHIFT = 16  # an edge id is u32: the plan's id in the low bits, the epoch above


def epoch_edges(edges: list[EdgePlan], epoch: int) -> list[EdgePlan]:
    """The plan's edges for pipeline ``epoch`` (DECISIONS 68): the same edges under ids of
    their own, so that nothing of an earlier pipeline (a record in flight, a node that was
    replaced) can connect to or be taken for an edge of this one. Epoch 0 is the plan."""
    if epoch == 0:
        return list(edges)
    return [e.model_copy(update={"edge_id": (epoch << EPOCH_SHIFT) | e.edge_id}) for e in edges]


def epoch_rings(rings: list[RingSpec], epoch: int) -> list[RingSpec]:
    """The plan's rings under their edges' ids for pipeline ``epoch``."""
    if epoch == 0:
        return list(rings)
    return [r.model_copy(update={"edge_id": (epoch << EPOCH_SHIFT) | r.edge_id}) for r in rings]


def plan_rings(edges: list[EdgePlan], max_seq_len: int, hidden: int) -> list[RingSpec]:
    """Ring capacities: activation ``40 + max_seq_len*hidden*b`` (alignment 64), token
    ``40 + max_seq_len*4`` (alignment 8), plus the sampling header on token-in."""
    rings: list[RingSpec] = []
    for edge in edges:
        if edge.kind is EdgeKind.ACTIVATION:
            b = (edge.activation_dtype or ActivationDtype.FLOAT32).itemsize
            capacity, alignment = RECORD_HEADER_BYTES + max_seq_len * hidden * b, 64
        else:
            capacity, alignment = RECORD_HEADER_BYTES + max_seq_len * 4, 8
            if edge.kind is EdgeKind.TOKEN_IN:
                capacity += SAMPLING_HEADER_BYTES
        if capacity > MAX_RING_BYTES:
            raise PlanningError(
                f"ring capacity overflow on edge {edge.edge_id}: {capacity} bytes exceeds "
                f"{MAX_RING_BYTES}; lower max_context"
            )
        rings.append(RingSpec(edge_id=edge.edge_id, capacity=capacity, alignment=alignment))
    return rings


MAX_NODE_MEMORY = 1 << 50  # 1 PiB: past this a figure is a mistake, not a machine
MIN_NODE_MEMORY = 64 << 20


def _node_memory(node_memory: Sequence[int], stage_count: int) -> list[int]:
    values = list(node_memory)
    if len(values) not in (1, stage_count):
        raise PlanningError(
            f"node_memory gives {len(values)} values for {stage_count} stages: give one "
            "(every node's) or one per stage"
        )
    for v in values:
        if not MIN_NODE_MEMORY <= v <= MAX_NODE_MEMORY:
            raise PlanningError(
                f"node_memory {v} is not {MIN_NODE_MEMORY}..{MAX_NODE_MEMORY} bytes"
            )
    return values * stage_count if len(values) == 1 else values


def _stage_needs(
    facts: ModelFacts, stage_count: int, max_seq_len: int, slots: int, kv_bytes: int
) -> Callable[[int, int, int], int] | None:
    """need(stage, a, b): the bytes stage ``stage`` needs for layers [a, b) (memory_plan);
    None where the facts lack the model's sizes."""
    sizes = facts.sizes
    if sizes is None or len(sizes.layers) != facts.block_count:
        return None
    return stage_needs(
        sizes,
        stage_count,
        max_seq_len=max_seq_len,
        slots=slots,
        hidden=facts.embedding_length,
        kv_bytes=kv_bytes,
    )


def _fitting_ranges(
    facts: ModelFacts,
    ranges: list[LayerRange],
    layer_split: LayerSplit,
    memory: list[int],
    need: Callable[[int, int, int], int],
    stage_count: int,
) -> list[LayerRange]:
    """The asked-for split where every stage fits its node; else the most even work (the
    layers' work where the facts give it, else their count) among the splits that fit;
    PlanningError naming each node's shortfall where none does."""
    if all(need(i, r.start, r.end) <= memory[i] for i, r in enumerate(ranges)):
        return ranges
    n = facts.block_count
    if stage_count * n * n > MAX_BALANCED_SEARCH:
        raise PlanningError(
            f"the even split does not fit the nodes' memory, and {stage_count} stages of {n} "
            f"layers is past the planner's search bound (stages x layers^2 <= "
            f"{MAX_BALANCED_SEARCH:,})"
        )
    layer_work = facts.layer_work if facts.layer_work and len(facts.layer_work) == n else [1] * n
    fitted = least_work_ranges(
        stage_count,
        n,
        work_of(layer_work, facts.output_work or 0),
        lambda stage, a, b: need(stage, a, b) <= memory[stage],
    )
    if fitted is not None:
        return fitted
    closest = closest_ranges(stage_count, n, need, memory)
    short = []
    for i, r in enumerate(closest):
        gap = need(i, r.start, r.end) - memory[i]
        if gap > 0:
            short.append(
                f"stage {i} (layers {r.start}-{r.end - 1}) needs "
                f"{size_text(need(i, r.start, r.end))}, its node has {size_text(memory[i])}: "
                f"short by {gap} bytes ({size_text(gap)})"
            )
    total = sum(need(i, r.start, r.end) for i, r in enumerate(closest))
    raise PlanningError(
        f"the model does not fit {stage_count} node(s) of {size_text(sum(memory))} in all "
        f"(it needs about {size_text(total)} in {stage_count} stage(s)); on the closest "
        "split, " + "; ".join(short)
    )


def build_plan(
    *,
    run_id: int,
    orchestrator_node_id: int,
    base_node_id: int,
    stage_count: int,
    max_context: int | None,
    facts: ModelFacts,
    model_path: str,
    tokenizer_path: str,
    activation_dtype: ActivationDtype = ActivationDtype.FLOAT32,
    layer_split: LayerSplit = LayerSplit.EVEN,
    node_memory: Sequence[int] | None = None,
    slots: int = 1,
    kv_bytes: int = KV_BYTES,
) -> RunPlan:
    """Commit the execution shape of a run from locally inspected model facts.

    ``node_memory``: each stage's node's memory in bytes (one value: every node's), to plan
    by (mvp_core.memory_plan): ranges that fit, of those the most even work; ``slots``: the
    prompts a stage holds KV cache for at once (the run's max_active_prompts); ``kv_bytes``:
    a KV cache element's size at the run's precision (memory_plan.kv_bytes_for)."""
    if facts.block_count <= 0:
        raise PlanningError(f"GGUF {model_path} declares {facts.block_count} layers")
    if facts.embedding_length <= 0:
        raise PlanningError(f"GGUF {model_path} declares embedding length {facts.embedding_length}")
    ranges = stage_layer_ranges(facts.block_count, stage_count)  # also checks the count
    if layer_split is LayerSplit.BALANCED and stage_count > 1:
        if facts.layer_work is None or facts.output_work is None:
            raise PlanningError(
                f"layer_split 'balanced' needs each layer's tensors in {model_path}'s "
                "tensor table; use 'even'"
            )
        if len(facts.layer_work) != facts.block_count:
            raise PlanningError(
                f"GGUF {model_path}: work figures for {len(facts.layer_work)} layers, "
                f"{facts.block_count} declared"
            )
        ranges = balanced_layer_ranges(facts.layer_work, facts.output_work, stage_count)
    max_seq_len = max_seq_len_for(facts, max_context)
    need = _stage_needs(facts, stage_count, max_seq_len, slots, kv_bytes)
    memory: list[int] | None = None
    if node_memory is not None:
        memory = _node_memory(node_memory, stage_count)
        if need is None:
            raise PlanningError(
                f"planning by node memory needs each tensor's size and the KV cache's width "
                f"from {model_path}'s header, which it does not give"
            )
        ranges = _fitting_ranges(facts, ranges, layer_split, memory, need, stage_count)
    stages = [
        StagePlan(
            stage_index=i,
            node_id=stage_node_id(base_node_id, i, stage_count),
            layers=r,
            holds_embedding=i == 0,
            holds_output=i == stage_count - 1,
            memory_need=None if need is None else need(i, r.start, r.end),
            node_memory=None if memory is None else memory[i],
        )
        for i, r in enumerate(ranges)
    ]
    edges = plan_edges(stage_count, max_seq_len, facts.embedding_length, activation_dtype)
    return RunPlan(
        run_id=run_id,
        orchestrator_node_id=orchestrator_node_id,
        stage_count=stage_count,
        stages=stages,
        edges=edges,
        rings=plan_rings(edges, max_seq_len, facts.embedding_length),
        max_seq_len=max_seq_len,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        model_facts=facts,
    )
