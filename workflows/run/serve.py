"""Serving: admitted prompts are activated as slots free, until the run stops or rolls
over. Rolling over (continue-as-new, DECISIONS 13) waits for the prompts in flight and
for any stage recovery, then hands the run's state to its next execution."""

from __future__ import annotations

from enum import StrEnum

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from mvp_core.models import RunPhase
    from workflows.run.context import RunContext


# A run continues as new after this many admissions at most, well before the server's
# limit of 2,000 Updates in one execution's history (history.maxTotalUpdates, DECISIONS
# 77), whatever its history's length.
ADMITTED_PER_EXECUTION = 1500


class ServeEnd(StrEnum):
    STOP = "stop"
    CONTINUE_AS_NEW = "continue_as_new"


async def serve(ctx: RunContext) -> ServeEnd:
    """Activate prompts in their turn until the run stops or may continue as new."""
    state, max_active = ctx.state, ctx.request.max_active_prompts

    def roll_over_now() -> bool:
        suggested = workflow.info().is_continue_as_new_suggested()
        return state.should_roll_over(suggested or ctx.admitted >= ADMITTED_PER_EXECUTION)

    while True:
        await workflow.wait_condition(
            lambda: (
                state.stopping
                or state.may_activate(max_active)
                or roll_over_now()
                or state.rolled_over()
            )
        )
        if state.stopping:
            return ServeEnd.STOP
        if state.rolled_over():
            await workflow.wait_condition(
                lambda: workflow.all_handlers_finished() or state.stopping
            )
            if state.stopping:
                return ServeEnd.STOP
            if state.is_recovering():
                continue  # a node was lost meanwhile: its recovery first
            return ServeEnd.CONTINUE_AS_NEW
        if roll_over_now():
            state.begin_rolling_over()
            ctx.view.set_phase(RunPhase.ROLLING_OVER)
            continue
        while state.activate_next(max_active) is not None:
            pass
        ctx.view.show()
