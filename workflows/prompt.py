"""A prompt's serving (PromptServing), and PromptWorkflow, the workflow that hosts one.

A PromptWorkflow is started by the run at admission (so a client can subscribe while the
prompt waits), activated by the run when it is this prompt's turn, then it schedules the
generate activity on the head node's queue and returns the terminal event. A run whose
``prompt_host`` is ``run`` serves each prompt in its own Update instead, with the same
PromptServing (DECISIONS 66).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.contrib.workflow_streams import WorkflowStream
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, TimeoutType
from temporalio.exceptions import TimeoutError as TimeoutError_

with workflow.unsafe.imports_passed_through():
    from mvp_core import metrics, names
    from mvp_core.models import (
        Fault,
        GenerateCheckpoint,
        GenerateInput,
        NodeLossPolicy,
        PromptHead,
        PromptInput,
        PromptOutcome,
        PromptStatus,
        StopGenerateInput,
        TextDelta,
    )
    from workflows import calls

STATUS_KEY = SearchAttributeKey.for_keyword(names.SEARCH_ATTRIBUTE_PROMPT)
# A generate whose heartbeats stopped, in a run that replaces lost nodes: how long its
# prompt waits for the run to say its head node is lost (the provider watch names it).
HEAD_LOSS_NEWS = 10.0


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


class PromptServing:
    """One prompt's serving, wherever it is hosted (DECISIONS 66): wait for its turn,
    schedule the generate activity on the head node, push a cancel's stop there, and
    make its one outcome. Its PromptWorkflow runs it, or its run's Update does."""

    def __init__(
        self,
        inp: PromptInput,
        key: str,
        *,
        temporal_text: bool = True,
        turn: Callable[[], bool] | None = None,
        published_tokens: Callable[[], int | None] | None = None,
    ) -> None:
        self.inp = inp
        self.key = key  # the generate's key on the head node (its workflow id)
        self.temporal_text = temporal_text
        self.turn = turn  # the host says the prompt's turn has come (else: activate())
        # The generated tokens whose text the prompt's stream holds (None: no stream).
        self.published_tokens = published_tokens
        # Stage recovery of the head (DECISIONS 68): the run says the head is lost, then
        # which node serves instead.
        self.head_lost = False
        self.head_moves = 0
        self.activated = False
        self.activated_at: datetime | None = None  # workflow time: the prompt's turn came
        self.cancel_reason: str | None = None
        # Ids only (never the prompt's text): the Web UI's details line.
        self.label = f"run {inp.run_id} · request {inp.prompt.request_id}"

    def activate(self) -> None:
        if not self.activated:
            self.activated_at = workflow.now()
        self.activated = True

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason or "cancelled"

    def move_head(self, head: PromptHead) -> bool:
        """The run's news of the head node: lost, or its replacement serving (in a run
        that replaces lost nodes; in a fail-stop run only that its head is lost), and only
        of a node of this run's (its task queue and readiness id as the run names them):
        False, and nothing changes, otherwise."""
        inp = self.inp
        nonce8 = inp.readiness_id.split("-", 1)[0]
        if (
            head.task_queue != names.node_task_queue(inp.run_id, head.node_id, nonce8)
            or head.readiness_id != f"{nonce8}-{head.node_id}-0"
        ):
            return False
        if inp.on_node_loss is not NodeLossPolicy.REPLACE:
            # Fail-stop: only the news that this prompt's head is gone (no replacement
            # comes): its generate is not waited for (DECISIONS 101).
            if head.ready or head.task_queue != inp.head_task_queue:
                return False
            self.head_lost = True
            return True
        if not head.ready:
            self.head_lost = True
            return True
        if head.task_queue == inp.head_task_queue:
            self.head_lost = False
            return True
        self.inp = self.inp.model_copy(
            update={
                "head_task_queue": head.task_queue,
                "readiness_id": head.readiness_id,
                "head_node_id": head.node_id,
            }
        )
        self.head_lost = False
        self.head_moves += 1
        return True

    def _turn_came(self) -> bool:
        return self.turn is not None and self.turn()

    def cancelled(self, text: str | None = None, tokens: int | None = None) -> PromptOutcome:
        """The cancel's outcome (``text``: what a run-hosted prompt had generated, in
        ``tokens`` tokens)."""
        return PromptOutcome(
            terminal=Fault(
                request_id=self.inp.prompt.request_id,
                error=self.cancel_reason or "cancelled",
                text=text,
                tokens_generated=tokens,
            ),
            status=PromptStatus.CANCELLED,
        )

    async def serve(self, *, details: bool = True) -> PromptOutcome:
        """Until the prompt's outcome (``details``: say how it goes in the Web UI's details
        line of the workflow running it)."""
        inp = self.inp
        if inp.start_active:
            self.activate()  # next in line at admission: no activation comes
        if details:
            workflow.set_current_details(f"{self.label}: queued, waiting for its turn")
        await workflow.wait_condition(
            lambda: self.activated or self.cancel_reason is not None or self._turn_came()
        )
        if self.cancel_reason is not None:
            return self.cancelled()
        self.activate()
        resume: list[int] = []
        text_from: int | None = None
        recoveries = 0
        while True:
            outcome, lost = await self._generate(resume, text_from, details)
            if lost is None:
                break
            # The head node was lost (DECISIONS 68): on from the tokens its last
            # heartbeat held, on the replacement head, once the run has one.
            if len(lost) > len(resume):
                resume = lost
            if not await self._new_head():
                if self.cancel_reason is None:
                    outcome = PromptOutcome(
                        terminal=Fault(
                            request_id=inp.prompt.request_id,
                            error="prompt serving fault: the head node was lost and no "
                            f"replacement served within {inp.recovery_wait_s:g} s",
                        ),
                        status=PromptStatus.FAULTED,
                    )
                break
            recoveries += 1
            # No stream (a run-hosted prompt): the new head's text stream carries the
            # whole text, and a direct reader skips what it has (temporal/client/text.py).
            text_from = 0
            if self.published_tokens is not None:
                text_from = self.published_tokens()
                if text_from is None:
                    outcome = PromptOutcome(
                        terminal=Fault(
                            request_id=inp.prompt.request_id,
                            error="prompt serving fault: the head node was lost and its "
                            "stream cannot say which text its readers have",
                        ),
                        status=PromptStatus.FAULTED,
                    )
                    break
        if recoveries and outcome.terminal.type == "done":
            outcome.terminal.recoveries += recoveries
        return outcome

    async def _generate(
        self, resume: list[int], text_from: int | None, details: bool
    ) -> tuple[PromptOutcome, list[int] | None]:
        """One generate on the head node: the outcome, and with a head that was lost in a
        run that replaces lost nodes, the tokens of its last checkpoint (else None)."""
        inp = self.inp
        request_id = inp.prompt.request_id
        where = f"node {inp.head_node_id}" if inp.head_node_id is not None else "the head node"
        replace = inp.on_node_loss is NodeLossPolicy.REPLACE
        moves = self.head_moves  # the run's news of the head from here on
        if details:
            workflow.set_current_details(
                f"{self.label}: generating on {where} (at most {_limit(inp.max_new_tokens)} tokens)"
            )
        handle = calls.generate(
            GenerateInput(
                run_id=inp.run_id,
                readiness_id=inp.readiness_id,
                prompt_workflow_id=self.key,
                prompt=inp.prompt,
                max_new_tokens=inp.max_new_tokens,
                stream_batch_ms=inp.stream_batch_ms,
                temporal_text=self.temporal_text,
                checkpoint=replace,
                resume=resume,
                text_from=text_from,
            ),
            inp.head_task_queue,
            inp.generate_heartbeat_s,
            f"generate request {request_id} on {where} (run {inp.run_id})",
        )

        def head_gone() -> bool:
            # A fail-stop run says only that the head is gone (DECISIONS 101).
            return self.head_lost or (replace and self.head_moves > moves)

        await workflow.wait_condition(
            lambda: handle.done() or self.cancel_reason is not None or head_gone()
        )
        if not handle.done() and self.cancel_reason is None:
            if replace:
                # The run says the head node is lost (DECISIONS 68): its generate is left
                # to its heartbeat timeout, and the prompt goes on on the replacement head
                # from the text its stream holds (regenerated there: the same tokens).
                handle.add_done_callback(retrieve)
                handle.cancel()
                return self.cancelled(), []
            if workflow.patched(names.PATCH_HEAD_LOSS_ENDS_GENERATE):
                # Fail-stop: no replacement comes, and the dead head's generate would end
                # only at its heartbeat timeout.
                handle.add_done_callback(retrieve)
                handle.cancel()
                return self._head_gone_fault(where), None
            await workflow.wait_condition(lambda: handle.done() or self.cancel_reason is not None)
        stop = None
        if not handle.done():
            handle.cancel()  # reaches the node with its next heartbeat's answer
            if workflow.patched(names.PATCH_STOP_GENERATE):
                # ... and this at once: the slot is free at the engine's next step.
                stop = calls.stop_generate(
                    StopGenerateInput(
                        run_id=inp.run_id,
                        readiness_id=inp.readiness_id,
                        prompt_workflow_id=self.key,
                    ),
                    inp.head_task_queue,
                    f"stop request {request_id} on {where} (run {inp.run_id})",
                )
        lost: list[int] | None = None
        if not handle.done():
            # A cancel: its generate's end, unless the run says its head is gone (then
            # no end comes before its heartbeat timeout; DECISIONS 101, histories from
            # before it waited).
            await workflow.wait_condition(lambda: handle.done() or self.head_lost)
        if not handle.done() and workflow.patched(names.PATCH_HEAD_LOSS_ENDS_GENERATE):
            handle.add_done_callback(retrieve)
            outcome = self.cancelled()
        else:
            outcome, lost = await self._generate_end(handle, moves)
        if stop is not None:
            await self._stopped(stop)
        terminal = outcome.terminal
        if isinstance(terminal, Fault) and outcome.status is PromptStatus.DONE:
            # A prompt-local fault from the node (too long, or stopped: then it says why).
            if self.cancel_reason is not None:
                outcome = self.cancelled(terminal.text, terminal.tokens_generated)
            elif terminal.error == "cancelled":
                outcome.status = PromptStatus.CANCELLED
            else:
                outcome.status = PromptStatus.FAULTED
        return outcome, lost

    async def _generate_end(
        self, handle: workflow.ActivityHandle[PromptOutcome], moves: int
    ) -> tuple[PromptOutcome, list[int] | None]:
        """A generate's end as the prompt's outcome, and the checkpoint's tokens where
        its head was lost in a run that replaces lost nodes (else None)."""
        inp, request_id = self.inp, self.inp.prompt.request_id
        replace = inp.on_node_loss is NodeLossPolicy.REPLACE
        lost: list[int] | None = None
        try:
            outcome: PromptOutcome = await handle
        except ActivityError as err:
            if self.cancel_reason is not None:
                outcome = self.cancelled()
            elif replace and heartbeat_lost(err) and await self._head_was_lost(moves):
                lost = _checkpoint(err)
                outcome = self.cancelled()  # replaced by the resumed generate's
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
        return outcome, lost

    def _head_gone_fault(self, where: str) -> PromptOutcome:
        """A fail-stop run's prompt whose head node is gone: its Fault (the run's own
        fault names the node and how it was lost)."""
        return PromptOutcome(
            terminal=Fault(
                request_id=self.inp.prompt.request_id,
                error=f"prompt serving fault: {where} was lost while it generated",
            ),
            status=PromptStatus.FAULTED,
        )

    async def _head_was_lost(self, moves: int) -> bool:
        """The run says the head node is lost (or has replaced it since the generate
        started: ``moves``), within HEAD_LOSS_NEWS: a generate whose heartbeats stopped
        with its node alive (the control plane away) is no loss."""
        try:
            await workflow.wait_condition(
                lambda: self.head_lost or self.head_moves > moves or self.cancel_reason is not None,
                timeout=HEAD_LOSS_NEWS,
            )
        except TimeoutError:
            return False
        return (self.head_lost or self.head_moves > moves) and self.cancel_reason is None

    async def _new_head(self) -> bool:
        """Wait for the replacement head (at most the run's recovery bound): True once
        it serves, False on a cancel or when none came."""
        try:
            await workflow.wait_condition(
                lambda: not self.head_lost or self.cancel_reason is not None,
                timeout=self.inp.recovery_wait_s,
            )
        except TimeoutError:
            return False
        return self.cancel_reason is None

    async def _stopped(self, stop: workflow.ActivityHandle[Any]) -> None:
        """The pushed stop's end, once the generate has ended."""
        if not stop.done():
            # The generate has ended: its stop has nothing left to do (and a node that
            # is gone would hold it to its bound, past the run's drain of its prompts).
            stop.cancel()
        try:
            await stop
        except ActivityError as err:
            if not isinstance(err.cause, CancelledError):
                workflow.logger.info(
                    "stop of request %d: %s", self.inp.prompt.request_id, failure_cause(err)
                )

    def ended(self, outcome: PromptOutcome, admitted_at: datetime) -> PromptOutcome:
        """The outcome with its queue wait (``admitted_at`` to its turn), its metrics
        recorded (mvp_core.metrics: nothing while replaying, nothing with metrics off)."""
        if self.activated_at is not None:
            queued = self.activated_at - admitted_at
            outcome.queued_ms = max(0.0, queued.total_seconds() * 1000)
        record_metrics(outcome)
        return outcome


def record_metrics(outcome: PromptOutcome) -> None:
    """A prompt's metrics: how it ended, and for a finished one its time to first token
    (queue wait + the head node's encode, prefill and first delta) and decode rate."""
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
        self._serving = PromptServing(
            inp, workflow.info().workflow_id, published_tokens=self._published_tokens
        )

    @workflow.signal(name=names.SIGNAL_PROMPT_ACTIVATE)
    def activate(self) -> None:
        self._serving.activate()

    @workflow.signal(name=names.SIGNAL_PROMPT_CANCEL)
    def cancel(self, reason: str) -> None:
        self._serving.cancel(reason)

    @workflow.signal(name=names.SIGNAL_PROMPT_HEAD)
    def head(self, head: PromptHead) -> None:
        if not self._serving.move_head(head):
            workflow.logger.warning("ignored head news for another run or policy: %s", head)

    def _published_tokens(self) -> int | None:
        """The generated tokens whose text this prompt's stream holds: a generate resumed
        on a new head publishes from there on, so its readers get no text twice. None
        where the stream cannot say (its log is the SDK's own: no public read of it
        inside the workflow)."""
        converter = workflow.payload_converter()
        tokens = 0
        log = getattr(self._stream, "_log", None)
        if not isinstance(log, list):
            return None
        for item in log:
            try:
                delta = converter.from_payload(item.data, TextDelta)
            except Exception:
                continue
            if isinstance(delta, TextDelta):
                tokens += delta.tokens or 0
        return tokens

    @workflow.run
    async def run(self, inp: PromptInput) -> PromptOutcome:
        outcome = await self._serving.serve()
        return self._finish(outcome)

    def _finish(self, outcome: PromptOutcome) -> PromptOutcome:
        """Publish the one terminal event, and show how the prompt ended: its result, its
        search attribute (MvpPromptStatus), its details line in the Web UI, and its metrics."""
        self._serving.ended(outcome, workflow.info().start_time)
        self._stream.topic(names.PROMPT_STREAM_TOPIC).publish(outcome.terminal)
        workflow.upsert_search_attributes([STATUS_KEY.value_set(outcome.status.value)])
        terminal = outcome.terminal
        if terminal.type == "done":
            detail = f"done: {terminal.tokens_generated} tokens ({terminal.stop_reason})"
        else:
            detail = f"{outcome.status.value}: {terminal.error}"
        workflow.set_current_details(f"{self._serving.label}: {detail}"[:400])
        return outcome


def retrieve(task: Any) -> None:
    """Take the end of an activity the workflow no longer waits for (a cancel, or a left
    generate's heartbeat timeout): unread, it would be logged as "Task exception was
    never retrieved"."""
    if not task.cancelled():
        task.exception()


def _checkpoint(err: ActivityError) -> list[int]:
    """The tokens of a generate's last heartbeat (GenerateCheckpoint); [] without one."""
    cause = err.cause
    details = getattr(cause, "last_heartbeat_details", None) or ()
    for item in details:
        try:
            return GenerateCheckpoint.model_validate(item).tokens
        except Exception:
            continue
    return []


def _limit(max_new_tokens: int | None) -> str:
    return "the context's" if max_new_tokens is None else str(max_new_tokens)
