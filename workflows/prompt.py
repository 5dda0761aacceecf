"""PromptWorkflow: one prompt, hosting the stream its text deltas travel through.

Started by the run at admission (so a client can subscribe while the prompt waits),
activated by the run when it is this prompt's turn, then it schedules the generate
activity on the head node's queue and returns the terminal event.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, TimeoutType
from temporalio.exceptions import TimeoutError as TimeoutError_

with workflow.unsafe.imports_passed_through():
    from mvp_core import metrics, names
    from mvp_core.models import (
        Fault,
        GenerateInput,
        PromptInput,
        PromptOutcome,
        PromptStatus,
        StopGenerateInput,
    )
    from workflows import calls

STATUS_KEY = SearchAttributeKey.for_keyword(names.SEARCH_ATTRIBUTE_PROMPT)


def failure_cause(err: BaseException) -> str:
    """The innermost message of an activity failure, for people to read."""
    cause: BaseException | None = err
    while cause is not None and isinstance(cause, ActivityError) and cause.cause is not None:
        cause = cause.cause
    if isinstance(cause, ApplicationError):
        return cause.message
    return str(cause) if cause is not None else str(err)


def heartbeat_lost(err: ActivityError) -> bool:
    """The activity's heartbeats stopped reaching the server (its node may be alive)."""
    cause = err.cause
    return isinstance(cause, TimeoutError_) and cause.type == TimeoutType.HEARTBEAT


# Outside the SDK's sandbox: a run starts one of these per prompt, and each start in the
# sandbox costs ~12 ms of the worker's CPU (re-importing this module in a fresh sandbox;
# scripts/bench_control_plane.py). What the sandbox guards is held here by
# the import contract (workflows import only the core and temporalio) and the replay tests;
# the long-lived RunWorkflow keeps it (DECISIONS 65).
@workflow.defn(name=names.PROMPT_WORKFLOW, sandboxed=False)
class PromptWorkflow:
    @workflow.init
    def __init__(self, inp: PromptInput) -> None:
        self._stream = WorkflowStream()
        self._activated = False
        self._activated_at: datetime | None = None  # workflow time: the prompt's turn came
        self._cancel_reason: str | None = None
        # Ids only (never the prompt's text): the Web UI's details line.
        self._label = f"run {inp.run_id} · request {inp.prompt.request_id}"

    @workflow.signal(name=names.SIGNAL_PROMPT_ACTIVATE)
    def activate(self) -> None:
        if not self._activated:
            self._activated_at = workflow.now()
        self._activated = True

    @workflow.signal(name=names.SIGNAL_PROMPT_CANCEL)
    def cancel(self, reason: str) -> None:
        if self._cancel_reason is None:
            self._cancel_reason = reason or "cancelled"

    @workflow.run
    async def run(self, inp: PromptInput) -> PromptOutcome:
        request_id = inp.prompt.request_id
        where = f"node {inp.head_node_id}" if inp.head_node_id is not None else "the head node"
        if inp.start_active:
            self.activate()  # next in line at admission: no activation signal comes
        workflow.set_current_details(f"{self._label}: queued, waiting for its turn")
        await workflow.wait_condition(lambda: self._activated or self._cancel_reason is not None)
        if self._cancel_reason is not None:
            return self._finish(self._cancelled(request_id))
        workflow.set_current_details(
            f"{self._label}: generating on {where} (at most {_limit(inp.max_new_tokens)} tokens)"
        )
        handle = calls.generate(
            GenerateInput(
                run_id=inp.run_id,
                readiness_id=inp.readiness_id,
                prompt_workflow_id=workflow.info().workflow_id,
                prompt=inp.prompt,
                max_new_tokens=inp.max_new_tokens,
                stream_batch_ms=inp.stream_batch_ms,
            ),
            inp.head_task_queue,
            inp.generate_heartbeat_s,
            f"generate request {request_id} on {where} (run {inp.run_id})",
        )
        await workflow.wait_condition(lambda: handle.done() or self._cancel_reason is not None)
        stop = None
        if not handle.done():
            handle.cancel()  # reaches the node with its next heartbeat's answer
            if workflow.patched(names.PATCH_STOP_GENERATE):
                # ... and this at once: the slot is free at the engine's next step.
                stop = calls.stop_generate(
                    StopGenerateInput(
                        run_id=inp.run_id,
                        readiness_id=inp.readiness_id,
                        prompt_workflow_id=workflow.info().workflow_id,
                    ),
                    inp.head_task_queue,
                    f"stop request {request_id} on {where} (run {inp.run_id})",
                )
        try:
            outcome = await handle
        except ActivityError as err:
            if self._cancel_reason is not None:
                outcome = self._cancelled(request_id)
            else:
                reason = failure_cause(err)
                outcome = PromptOutcome(
                    terminal=Fault(request_id=request_id, error=f"prompt serving fault: {reason}"),
                    # A generate that lost its heartbeat says nothing about the pipeline: the
                    # control plane may have been away while the node kept going (it stops on
                    # its own when its next heartbeat is refused). A dead node faults the run
                    # through the provider watch or its lease, naming the node.
                    run_fault=None
                    if heartbeat_lost(err)
                    else f"prompt serving: generate on {inp.head_task_queue} failed: {reason}",
                    status=PromptStatus.FAULTED,
                )
        if stop is not None:
            if not stop.done():
                # The generate has ended: its stop has nothing left to do (and a node that
                # is gone would hold it to its bound, past the run's drain of its prompts).
                stop.cancel()
            try:
                await stop
            except ActivityError as err:
                if not isinstance(err.cause, CancelledError):
                    workflow.logger.info("stop of request %d: %s", request_id, failure_cause(err))
        if outcome.terminal.type == "fault" and outcome.status is PromptStatus.DONE:
            # A prompt-local fault from the node (too long, or stopped: then it says why).
            if self._cancel_reason is not None:
                outcome = self._cancelled(request_id)
            elif outcome.terminal.error == "cancelled":
                outcome.status = PromptStatus.CANCELLED
            else:
                outcome.status = PromptStatus.FAULTED
        return self._finish(outcome)

    def _cancelled(self, request_id: int) -> PromptOutcome:
        return PromptOutcome(
            terminal=Fault(request_id=request_id, error=self._cancel_reason or "cancelled"),
            status=PromptStatus.CANCELLED,
        )

    def _finish(self, outcome: PromptOutcome) -> PromptOutcome:
        """Publish the one terminal event, and show how the prompt ended: its result, its
        search attribute (MvpPromptStatus), its details line in the Web UI, and its metrics."""
        if self._activated_at is not None:
            queued = self._activated_at - workflow.info().start_time
            outcome.queued_ms = max(0.0, queued.total_seconds() * 1000)
        self._record(outcome)
        self._stream.topic(names.PROMPT_STREAM_TOPIC).publish(outcome.terminal)
        workflow.upsert_search_attributes([STATUS_KEY.value_set(outcome.status.value)])
        terminal = outcome.terminal
        if terminal.type == "done":
            detail = f"done: {terminal.tokens_generated} tokens ({terminal.stop_reason})"
        else:
            detail = f"{outcome.status.value}: {terminal.error}"
        workflow.set_current_details(f"{self._label}: {detail}"[:400])
        return outcome

    def _record(self, outcome: PromptOutcome) -> None:
        """The prompt's metrics (nothing while the workflow replays, nothing at all with
        metrics off: mvp_core.metrics): how it ended, and for a finished one its time to first token (queue wait
        + the head node's encode, prefill and first delta) and decode rate."""
        timing = outcome.timing
        if timing is None or outcome.terminal.type != "done":
            metrics.sink().record_prompt(outcome.status.value)
            return
        queued = outcome.queued_ms or 0.0
        metrics.sink().record_prompt(
            outcome.status.value,
            ttft_ms=queued + timing.encode_ms + timing.prefill_ms + timing.first_delta_ms,
            tokens_per_s=timing.decode_tokens_per_s,
        )


def _limit(max_new_tokens: int | None) -> str:
    return "the context's" if max_new_tokens is None else str(max_new_tokens)
