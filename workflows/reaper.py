"""ReaperWorkflow: one sweep of one host's provider resources (DECISIONS 30).

Thin by design: it lists what the host's providers report (provider queue), checks the
liveness of the runs those resources name (shared queue), lets the pure rule of
``mvp_core.reaper`` decide, and destroys what the rule gives it (provider queue). Its
result, a ReapReport, says what it destroyed, kept and failed to destroy, and why. A
schedule per host starts it (``workers/orchestrator/reaper_schedule.py``); overlap SKIP keeps two
sweeps of one host from running at once.
"""

from __future__ import annotations

import asyncio

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.errors import ErrorType
    from mvp_core.reaper import (
        DestroyInput,
        LivenessInput,
        ReapDecision,
        ReapInput,
        ReapReport,
        decide,
        run_ids_of,
    )
    from workflows import calls
    from workflows.prompt import failure_cause


@workflow.defn(name=names.REAPER_WORKFLOW)
class ReaperWorkflow:
    @workflow.run
    async def run(self, inp: ReapInput) -> ReapReport:
        queue = names.provider_task_queue(inp.host)
        try:
            listing = await calls.list_resources(inp.host, queue)
            liveness = await calls.run_liveness(
                LivenessInput(run_workflow_ids=run_ids_of(listing.resources))
            )
        except ActivityError as err:
            raise ApplicationError(
                f"reaper of {inp.host}: {failure_cause(err)}",
                type=ErrorType.REAPER_FAILED,
                non_retryable=True,
            ) from None
        plan = decide(listing.resources, liveness.runs)
        report = ReapReport(
            host=inp.host,
            listed=len(listing.resources),
            kept=plan.keep,
            errors=listing.errors,
            unavailable=listing.unavailable,
        )
        # Nodes first, then the networks they were attached to (a network goes once its
        # containers are gone).
        first = [d for d in plan.destroy if d.resource.kind != "network"]
        then = [d for d in plan.destroy if d.resource.kind == "network"]
        results = await asyncio.gather(*(self._destroy(queue, d, inp) for d in first))
        results += await asyncio.gather(*(self._destroy(queue, d, inp) for d in then))
        for decision, (destroyed, error) in zip([*first, *then], results, strict=True):
            if destroyed:
                report.destroyed.append(decision)
            else:
                report.failed.append(
                    ReapDecision(resource=decision.resource, reason=f"{decision.reason}; {error}")
                )
        self._log(report)
        return report

    @staticmethod
    async def _destroy(queue: str, decision: ReapDecision, inp: ReapInput) -> tuple[bool, str]:
        try:
            result = await calls.destroy_resource(
                DestroyInput(resource=decision.resource), queue, inp.destroy_timeout_s
            )
        except ActivityError as err:
            return False, f"destroy failed: {failure_cause(err)}"
        return result.destroyed, f"destroy failed: {result.error}"

    @staticmethod
    def _log(report: ReapReport) -> None:
        log = workflow.logger
        for d in report.destroyed:
            log.info(
                "reaper %s: destroyed %s %s: %s",
                report.host,
                d.resource.kind,
                d.resource.name,
                d.reason,
            )
        for d in report.failed:
            log.warning(
                "reaper %s: could not destroy %s %s: %s",
                report.host,
                d.resource.kind,
                d.resource.name,
                d.reason,
            )
        for d in report.kept:
            log.info(
                "reaper %s: kept %s %s: %s", report.host, d.resource.kind, d.resource.name, d.reason
            )
        for e in report.errors:
            log.warning("reaper %s: provider could not list: %s", report.host, e)
        for u in report.unavailable:
            # The provider's host logs this once (activities/reaper.py); every sweep of an
            # unconfigured provider would repeat it.
            log.debug("reaper %s: provider not swept (unavailable here): %s", report.host, u)
        log.info(
            "reaper %s: %d listed, %d destroyed, %d kept, %d failed",
            report.host,
            report.listed,
            len(report.destroyed),
            len(report.kept),
            len(report.failed),
        )
