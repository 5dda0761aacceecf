"""Planning: the provider host's queue, then a committed plan (GGUF facts, stages,
edges, rings) and a node record per stage. A planning failure is a rejection (actor
spec 6.2): nothing was provisioned."""

from __future__ import annotations

from collections.abc import Callable

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.models import LifecycleKind, PreparePlanInput, RunPhase
    from mvp_core.run_records import NodeState
    from workflows import calls
    from workflows.prompt import failure_cause
    from workflows.run.context import Rejected, RunContext


async def plan(ctx: RunContext, on_provider_queue: Callable[[], None]) -> None:
    """Commit a plan, or raise Rejected; a shutdown while planning stops the run at once.
    ``on_provider_queue`` runs once the provider host's queue is known."""
    state, req = ctx.state, ctx.request
    ctx.view.set_phase(RunPhase.PLANNING)
    state.record(LifecycleKind.RUN_PLANNING_STARTED)
    try:
        queue: str = await ctx.guard(
            calls.provider_queue(f"provider queue of run {state.run_id} ({req.provider.value})")
        )
        state.provider_queue = queue
        on_provider_queue()
        committed = await ctx.guard(
            calls.prepare_plan(
                PreparePlanInput(
                    run_id=state.run_id,
                    orchestrator_node_id=req.orchestrator_node_id,
                    node_id=req.node_id,
                    model=req.model,
                    tokenizer=req.tokenizer,
                    pipeline_stages=req.pipeline_stages,
                    max_context=req.max_context,
                    activation_dtype=req.activation_dtype,
                    precision=req.engine.precision,
                    layer_split=req.layer_split,
                    node_memory=ctx.traits.node_memory(req),
                    max_active_prompts=req.max_active_prompts,
                    provider=req.provider,
                    gpus=ctx.traits.gpus(req),
                    vastai=ctx.traits.vastai(req),
                ),
                queue,
                f"plan {ctx.view.model_name()} in {req.pipeline_stages} stage(s)",
            )
        )
    except ActivityError as err:
        raise Rejected(f"planning failed: {failure_cause(err)}") from None
    state.plan = committed
    ctx.view.show()
    for stage in committed.stages:
        state.nodes.append(
            NodeState(
                node_id=stage.node_id,
                stage_index=stage.stage_index,
                task_queue=names.node_task_queue(state.run_id, stage.node_id, state.nonce),
                readiness_id=f"{state.nonce[:8]}-{stage.node_id}-{stage.stage_index}",
            )
        )
    state.record(
        LifecycleKind.RUN_PLANNING_READY,
        f"{committed.stage_count} stage(s) of {committed.model_facts.name}, "
        f"max_seq_len {committed.max_seq_len}",
    )
