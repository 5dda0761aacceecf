"""How a run shows itself while it runs: its phase in the search attribute
``MvpRunPhase``, its current details in the Web UI, its gauges and its time to
prompt-ready. Names, ids and counts only: never a prompt's text or a secret."""

from __future__ import annotations

from temporalio import workflow
from temporalio.common import SearchAttributeKey

with workflow.unsafe.imports_passed_through():
    from mvp_core import metrics, names
    from mvp_core.models import RunPhase, RunRequest
    from mvp_core.run_records import NODE_CONDITIONS
    from mvp_core.run_state import RunState

PHASE_KEY = SearchAttributeKey.for_keyword(names.SEARCH_ATTRIBUTE_PHASE)


class RunView:
    """The run's phase, details and gauges, as Temporal and the metrics show them."""

    def __init__(self, request: RunRequest, state: RunState) -> None:
        self._request = request
        self._state = state
        self._ready_seen = False  # time to prompt-ready recorded

    def set_phase(self, phase: RunPhase) -> None:
        self._state.phase = phase
        workflow.upsert_search_attributes([PHASE_KEY.value_set(phase.value)])
        if phase is RunPhase.PROMPT_READY and not self._state.continued and not self._ready_seen:
            # Time to prompt-ready, in workflow time from the run's start (its first
            # execution; a continued run was ready before).
            self._ready_seen = True
            elapsed = workflow.now() - workflow.info().start_time
            metrics.sink().record_prompt_ready(self._state.run_id, elapsed.total_seconds() * 1000)
        self.show()

    def observe(self) -> None:
        """The run's gauges: its prompt queue and its nodes by state (nothing while the
        workflow replays, nothing at all with metrics off: mvp_core.metrics)."""
        state = self._state
        counts = dict.fromkeys(NODE_CONDITIONS, 0)
        for node in state.nodes:
            counts[node.condition()] += 1
        queued = state.prompts_in_flight()
        metrics.sink().record_run_gauges(state.run_id, queued, counts)

    def model_name(self) -> str:
        """The model's name: the request's bundled name or file name, else the plan's."""
        name = self._request.model.display_name()
        if name is not None:
            return name
        if self._state.plan is not None:
            return self._state.plan.model_facts.name
        return "the default model"

    def show(self) -> None:
        """The run's current details in the Web UI: model, stages, provider, phase and
        prompt counts. Names, ids and counts only (never prompt text or secrets); it lives
        in the worker and is served by the metadata query, so history is unchanged."""
        state, req = self._state, self._request
        stages = state.plan.stage_count if state.plan is not None else req.pipeline_stages
        ids = [str(p.request_id) for p in state.actives()]
        active = f", request{'s' if len(ids) > 1 else ''} {', '.join(ids)} active" if ids else ""
        lines = [  # the phase first: the line the Web UI's workflow view shows on top
            f"**phase: {state.phase.value}**",
            f"**run {state.run_id}**: {self.model_name()} in {stages} stage(s), "
            f"provider {req.provider.value}",
            f"prompts: {state.prompts_completed} completed, {len(state.pending)} queued{active}",
        ]
        if state.continued:
            lines.append(f"continued as new {state.continued} time(s)")
        if state.first_fault is not None:
            lines.append("faulted (see the run's outcome)")
        workflow.set_current_details("\n\n".join(lines))
        self.observe()
