"""The run planner: model facts in, a committed RunPlan out (CONTRACTS "Run planner").

Pure: the activity that calls it reads the GGUF metadata; this module only computes.
"""

from __future__ import annotations

from mvp_core.models import (
    ActivationDtype,
    EdgeKind,
    EdgePlan,
    LayerRange,
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
MAX_RING_BYTES = 1 << 32


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
            max_extent=4,
            alignment=4,
        )
    )
    return edges


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
) -> RunPlan:
    """Commit the execution shape of a run from locally inspected model facts."""
    if facts.block_count <= 0:
        raise PlanningError(f"GGUF {model_path} declares {facts.block_count} layers")
    if facts.embedding_length <= 0:
        raise PlanningError(f"GGUF {model_path} declares embedding length {facts.embedding_length}")
    ranges = stage_layer_ranges(facts.block_count, stage_count)
    max_seq_len = max_seq_len_for(facts, max_context)
    stages = [
        StagePlan(
            stage_index=i,
            node_id=stage_node_id(base_node_id, i, stage_count),
            layers=r,
            holds_embedding=i == 0,
            holds_output=i == stage_count - 1,
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
