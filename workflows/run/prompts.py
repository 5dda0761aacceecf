"""Serving prompts: each admitted prompt is served in its turn, in a child
PromptWorkflow of its own or in the run itself (DECISIONS 66), and ends with its one
terminal event. The run keeps the ends of its run-hosted prompts for a re-attach, tells
open prompts when their head node is replaced, and cancels them on request or shutdown."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Sequence
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError, ChildWorkflowError

with workflow.unsafe.imports_passed_through():
    from mvp_core import names
    from mvp_core.errors import ErrorType
    from mvp_core.generation import effective_max_tokens
    from mvp_core.models import (
        AdmissionAnswer,
        AdmissionAnswers,
        CancelPrompt,
        Fault,
        PromptAdmissions,
        PromptAdmitted,
        PromptEnd,
        PromptHead,
        PromptHost,
        PromptInput,
        PromptOutcome,
        PromptStatus,
        PromptTerminal,
        ServedPrompt,
        SubmitPrompt,
    )
    from mvp_core.run_records import NodeState, PromptRecord
    from workflows.prompt import PromptServing, PromptWorkflow
    from workflows.run.admission import prompt_of
    from workflows.run.context import WORKFLOW_TASK_TIMEOUT, RunContext, slack

# Characters of ended prompts' texts one prompt_ends answer holds (the first always):
# well under a query result's 4 MB gRPC limit, whatever the texts' lengths.
PROMPT_ENDS_TEXT = 1 << 20
PROMPT_DRAIN_S = 5.0  # beyond a generate's heartbeat timeout, for its prompt to end
# A run-hosted prompt's end is kept for its client (the ``prompt_end`` query, DECISIONS
# 77), a re-attach and the dashboard (DECISIONS 66): the latest SERVED_HELD, their texts
# SERVED_TEXT_HELD characters in all, the latest one always; continue-as-new carries the
# latest SERVED_KEPT of them within SERVED_TEXT_KEPT characters (one payload, under the
# server's 512 KB warning even at 4 bytes a character).
SERVED_HELD = 1024
SERVED_TEXT_HELD = 4 * 1024 * 1024
SERVED_KEPT = 32
SERVED_TEXT_KEPT = 96 * 1024


class Prompts:
    """The run's open prompts (child workflows and run-hosted) and the ends it keeps."""

    def __init__(
        self,
        ctx: RunContext,
        served: Sequence[ServedPrompt],
        on_run_fault: Callable[[str], None],
    ) -> None:
        self._ctx = ctx
        self._on_run_fault = on_run_fault  # a prompt saw its pipeline fail
        self._children: dict[str, Any] = {}  # prompt workflows open
        self._hosted: dict[str, PromptServing] = {}  # run-hosted prompts open (DECISIONS 66)
        self._told_gone: set[int] = set()  # heads whose prompts were told they are gone
        self._served: OrderedDict[str, ServedPrompt] = OrderedDict(  # ... that ended
            (p.workflow_id, p) for p in served[-SERVED_KEPT:]
        )
        self._served_text = sum(_text_size(p) for p in self._served.values())
        self._started_children: set[str] = set()  # prompt workflows started (this run)
        self._early_cancels: dict[str, str] = {}  # cancels that came before their start
        # Prompts admitted by ``admit_prompt`` and served on without their Update (DECISIONS
        # 77): the tasks serving them, their keys until they end, and the keys of the
        # latest that ended (``prompt_end`` says so until the run has counted them).
        self._tasks: set[asyncio.Task[PromptTerminal | None]] = set()
        self._open: set[str] = set()
        self._closed: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ serving
    async def serve(self, args: Sequence[Any]) -> PromptTerminal:
        """``submit_prompt``: admit the prompt, serve it in its turn, and return its one
        terminal event (the Update is in flight all along)."""
        _, serving = self._admit(prompt_of(args), awaited=True)
        return await serving

    def admit(self, args: Sequence[Any]) -> PromptAdmitted:
        """``admit_prompt`` (DECISIONS 77): admit the prompt and return at once; it is
        served on in a task of the run's, its end kept as ``submit_prompt``'s is."""
        return self._admit_on(prompt_of(args), None)

    def admit_all(
        self, batch: PromptAdmissions, check: Callable[[SubmitPrompt], None]
    ) -> AdmissionAnswers:
        """``admit_prompts`` (DECISIONS 106): each prompt in its order, refused by
        ``check`` (``admit_prompt``'s validator) or admitted as ``admit`` admits one, its
        id made of its client's key; a key that names a prompt the run knows already is
        refused (a client that sent one prompt twice)."""
        answers: list[AdmissionAnswer] = []
        for item in batch.items:
            try:
                check(item.prompt)
                self._check_key(item.prompt.request_id, item.key)
            except ApplicationError as err:
                answers.append(AdmissionAnswer(refused_type=err.type, refused=err.message))
                continue
            answers.append(AdmissionAnswer(admitted=self._admit_on(item.prompt, item.key)))
        if all(a.admitted is None for a in answers):
            # An Update in history all the same: counted toward the execution's limit on
            # Updates, which ``admitted`` bounds (serve.ADMITTED_PER_EXECUTION).
            self._ctx.admitted += 1
        return AdmissionAnswers(answers=answers)

    def _check_key(self, request_id: int, key: str) -> None:
        wf_id = self._prompt_id(request_id, key)
        if wf_id in self._open or wf_id in self._closed or wf_id in self._served:
            raise ApplicationError(
                f"{ErrorType.DUPLICATE_REQUEST_ID.value}: prompt {wf_id} was admitted "
                "already (its key is in use)",
                type=ErrorType.DUPLICATE_REQUEST_ID.value,
                non_retryable=True,
            )

    def _prompt_id(self, request_id: int, key: str) -> str:
        """The id of the prompt admitted under ``key`` (its Update's id, or its client's
        key in an ``admit_prompts`` Update)."""
        return names.prompt_workflow_id(self._ctx.state.run_id, request_id, names.update_key(key))

    def _admit_on(self, prompt: SubmitPrompt, key: str | None) -> PromptAdmitted:
        admitted, serving = self._admit(prompt, awaited=False, key=key)
        self._open.add(admitted.prompt_id)
        task = asyncio.create_task(self._serve_on(admitted, serving))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return admitted

    async def one_shot(self, prompt: SubmitPrompt) -> PromptTerminal | None:
        """A one-shot run's prompt (actor spec 8): admitted as ``admit_prompt`` admits
        one (no Update), served in its turn, its end kept; its terminal event (None: a
        defect past serving's guard, which faulted the run)."""
        admitted, serving = self._admit(prompt, awaited=False)
        self._open.add(admitted.prompt_id)
        return await self._serve_on(admitted, serving)

    async def _serve_on(
        self, admitted: PromptAdmitted, serving: Coroutine[Any, Any, PromptTerminal]
    ) -> PromptTerminal | None:
        self._ctx.busy_handlers += 1  # teardown drains it as it drains a prompt's Update
        try:
            return await serving
        except Exception as err:  # a defect past serving's own guard: the run faults
            workflow.logger.warning("prompt %s: %s", admitted.prompt_id, type(err).__name__)
            self._on_run_fault(
                f"prompt serving: prompt {admitted.prompt_id} failed ({type(err).__name__})"
            )
            return None
        finally:
            self._ctx.busy_handlers -= 1
            self._open.discard(admitted.prompt_id)
            self._closed[admitted.prompt_id] = None
            while len(self._closed) > SERVED_HELD:
                self._closed.popitem(last=False)

    def _admit(
        self, prompt: SubmitPrompt, *, awaited: bool, key: str | None = None
    ) -> tuple[PromptAdmitted, Coroutine[Any, Any, PromptTerminal]]:
        """Admit the prompt (its place in the run's FIFO is fixed from here on) and return
        it with the coroutine that serves it. ``awaited``: its Update waits for the end
        (a re-attach can wait on that Update too). ``key``: what its id is made of (its
        Update's id where None)."""
        ctx, state, req = self._ctx, self._ctx.state, self._ctx.request
        if state.draws_seed(prompt.temperature, prompt.seed):
            # Its seed is drawn here, recorded in its input: a resume on a replacement
            # head node draws the same tokens (DECISIONS 68).
            prompt = prompt.model_copy(update={"seed": workflow.random().getrandbits(63)})
        update_id = (workflow.current_update_info() or _NoUpdate()).id
        wf_id = self._prompt_id(prompt.request_id, update_id if key is None else key)
        hosted = state.prompt_host is PromptHost.RUN
        record = state.admit(prompt.request_id, wf_id, update_id if hosted and awaited else None)
        ctx.admitted += 1
        admitted_at = workflow.now()
        head = state.head()
        # Next in line: the prompt is active from its start, so its workflow schedules
        # the generate activity in its first task instead of waiting for a signal (two
        # workflow tasks off the time to first token; DECISIONS 40).
        start_active = False
        if (
            state.may_activate(req.max_active_prompts)
            and state.pending[:1] == [record]
            and workflow.patched(names.PATCH_PROMPT_STARTS_ACTIVE)
        ):
            start_active = state.activate_next(req.max_active_prompts) is record
        max_new = effective_max_tokens(prompt.max_tokens, req.default_max_tokens)
        inp = PromptInput(
            run_id=state.run_id,
            readiness_id=head.readiness_id,
            prompt=prompt,
            max_new_tokens=max_new,
            head_task_queue=head.task_queue,
            head_node_id=head.node_id,
            generate_heartbeat_s=req.timeouts.generate_heartbeat_s,
            stream_batch_ms=req.stream_batch_ms,
            start_active=start_active,
            on_node_loss=req.on_node_loss,
            recovery_wait_s=slack(req.recovery.replacement_timeout_s),
        )

        async def serving() -> PromptTerminal:
            if hosted:
                outcome = await self._host(inp, wf_id, record, admitted_at)
            else:
                outcome = await self._child(inp, wf_id, record, head)
            ok = outcome.terminal.type == "done"
            state.finish_prompt(
                wf_id,
                ok,
                "" if ok else getattr(outcome.terminal, "error", ""),
                prompt.request_id,
                cancelled=outcome.status is PromptStatus.CANCELLED,
            )
            ctx.view.show()
            if outcome.run_fault is not None and not state.is_recovering():
                # The head's driver saw its pipeline fail: maybe a peer died (the watch
                # names it).
                self._on_run_fault(outcome.run_fault)
            return outcome.terminal

        admitted = PromptAdmitted(request_id=prompt.request_id, prompt_id=wf_id, hosted=hosted)
        return admitted, serving()

    async def _host(
        self, inp: PromptInput, wf_id: str, record: PromptRecord, admitted_at: datetime
    ) -> PromptOutcome:
        """Serve the prompt in this Update (DECISIONS 66): no workflow of its own, its text
        to the head node's direct readers only, its end kept for a re-attach."""
        serving = PromptServing(inp, wf_id, temporal_text=False, turn=lambda: record.active)
        self._hosted[wf_id] = serving
        self._ctx.view.show()
        try:
            outcome = await serving.serve(details=False)
        except Exception as err:  # a defect in serving it: this prompt ends, then the run
            outcome = PromptOutcome(
                terminal=Fault(
                    request_id=inp.prompt.request_id,
                    # The type only: an error's text may quote what the prompt generated.
                    error=f"prompt serving failed: {type(err).__name__}",
                ),
                run_fault=f"prompt serving: prompt {wf_id} failed",
                status=PromptStatus.FAULTED,
            )
        finally:
            self._hosted.pop(wf_id, None)
        serving.ended(outcome, admitted_at)
        self._keep_served(
            ServedPrompt(
                workflow_id=wf_id,
                outcome=outcome,
                admitted_ms=int(admitted_at.timestamp() * 1000),
                stop=list(inp.prompt.stop),
            )
        )
        return outcome

    def _keep_served(self, served: ServedPrompt) -> None:
        """Keep ``served`` as the latest, within SERVED_HELD and SERVED_TEXT_HELD."""
        self._served.pop(served.workflow_id, None)
        self._served[served.workflow_id] = served
        self._served_text += _text_size(served)
        while len(self._served) > 1 and (
            len(self._served) > SERVED_HELD or self._served_text > SERVED_TEXT_HELD
        ):
            _, dropped = self._served.popitem(last=False)
            self._served_text -= _text_size(dropped)

    async def _child(
        self, inp: PromptInput, wf_id: str, record: PromptRecord, head: NodeState
    ) -> PromptOutcome:
        """Serve the prompt in a child PromptWorkflow of its own."""
        state = self._ctx.state
        prompt = inp.prompt
        child = await workflow.start_child_workflow(
            PromptWorkflow.run,
            inp,
            id=wf_id,
            task_queue=workflow.info().task_queue,
            parent_close_policy=workflow.ParentClosePolicy.ABANDON,
            execution_timeout=timedelta(days=1),
            task_timeout=WORKFLOW_TASK_TIMEOUT,
            # Ids and counts only: the prompt's text never goes into user metadata.
            static_summary=f"prompt {prompt.request_id} of run {state.run_id}",
            static_details=(
                f"run {state.run_id} · request {prompt.request_id} · "
                f"{'chat' if prompt.chat else 'completion'} · max tokens "
                f"{inp.max_new_tokens} · "
                f"head node {head.node_id} (stage {head.stage_index})"
            ),
        )
        self._children[wf_id] = child
        self._started_children.add(wf_id)
        self._ctx.view.show()
        news = state.head_news(inp.head_task_queue)
        if news is not None:  # its head was replaced, or is being, since it was admitted
            await _tell(child, wf_id, names.SIGNAL_PROMPT_HEAD, news)
        early = self._early_cancels.pop(wf_id, None)
        if early is not None:
            await self.cancel_one(wf_id, early)
        await workflow.wait_condition(lambda: record.active or child.done() or state.stopping)
        if record.active and not child.done() and not inp.start_active:
            await _tell(child, wf_id, names.SIGNAL_PROMPT_ACTIVATE)
        elif state.stopping and not child.done():
            await self.cancel_one(wf_id, "run is shutting down")
        try:
            outcome: PromptOutcome = await child
        except ChildWorkflowError as err:
            outcome = PromptOutcome(
                terminal=Fault(
                    request_id=prompt.request_id, error=f"prompt workflow failed: {err}"
                ),
                run_fault=f"prompt serving: prompt workflow {wf_id} failed",
                status=PromptStatus.FAULTED,
            )
        self._children.pop(wf_id, None)
        return outcome

    # ------------------------------------------------------------------ news and cancels
    async def tell_head(self, news: PromptHead) -> None:
        """Every open prompt learns that the head node is lost, or which node serves it
        now: one generating goes on there from its last checkpoint, one waiting goes there."""
        for serving in self._hosted.values():
            serving.move_head(news)
        for wf_id, child in list(self._children.items()):
            if not child.done():
                await _tell(child, wf_id, names.SIGNAL_PROMPT_HEAD, news, always_tolerated=True)

    async def tell_head_gone(self, head: NodeState) -> None:
        """Head node ``head`` is gone and no replacement will serve its prompts: the open
        ones are told (once per node), and end now rather than at their generates'
        heartbeat timeout (DECISIONS 101; histories from before it: nothing is told)."""
        if head.node_id in self._told_gone or not (self._hosted or self._children):
            return
        if not workflow.patched(names.PATCH_HEAD_LOSS_ENDS_GENERATE):
            return
        self._told_gone.add(head.node_id)
        await self.tell_head(
            PromptHead(
                node_id=head.node_id,
                task_queue=head.task_queue,
                readiness_id=head.readiness_id,
                ready=False,
            )
        )

    async def cancel(self, cancel: CancelPrompt) -> bool:
        """The ``cancel_prompt`` signal: a pending prompt leaves the queue, an active one
        is told to stop. False where no such prompt is open (the caller ignores it)."""
        state = self._ctx.state
        record = state.prompt(cancel.request_id)
        if record is None:
            return False
        state.remove_pending(cancel.request_id)
        await self.cancel_one(record.workflow_id, "cancelled")
        return True

    async def cancel_one(self, wf_id: str, reason: str) -> None:
        hosted = self._hosted.get(wf_id)
        if hosted is not None:
            hosted.cancel(reason)
            return
        child = self._children.get(wf_id)
        if (
            child is None
            and wf_id not in self._started_children
            and workflow.patched(names.PATCH_CANCEL_BEFORE_CHILD_START)
        ):
            # Admitted (maybe active already) but its PromptWorkflow not started yet: the
            # cancel is sent once it has started (serve), not lost.
            self._early_cancels.setdefault(wf_id, reason)
            return
        if child is None or child.done():
            return
        await _tell(child, wf_id, names.SIGNAL_PROMPT_CANCEL, reason, always_tolerated=True)

    async def cancel_all(self, reason: str) -> None:
        """Teardown: every open prompt is told the run ends."""
        for wf_id in [*self._hosted, *self._children]:
            await self.cancel_one(wf_id, reason)

    async def drain(self) -> None:
        """Every admitted prompt has its one terminal event before RunTornDown. A prompt
        whose head node is gone was told so (tell_head_gone); one whose generate ends on
        nothing else (a head cut off from Temporal) ends when its heartbeat times out."""
        t = self._ctx.request.timeouts
        try:
            await workflow.wait_condition(
                lambda: not self._children and not self._hosted and not self._tasks,
                timeout=t.generate_heartbeat_s + PROMPT_DRAIN_S,
            )
        except TimeoutError:
            self._ctx.state.stop_error(
                f"prompt(s) {sorted([*self._hosted, *self._children])} had no terminal "
                "event in time"
            )

    # ------------------------------------------------------------------ what the run keeps
    def served(self, request_id: int) -> ServedPrompt | None:
        """The latest run-hosted prompt ``request_id`` that ended, while the run keeps it."""
        for served in reversed(self._served.values()):
            if served.outcome.terminal.request_id == request_id:
                return served
        return None

    def stops(self, request_id: int) -> list[str] | None:
        """The stop strings of run-hosted prompt ``request_id``, in flight or kept."""
        for serving in reversed(self._hosted.values()):
            if serving.inp.prompt.request_id == request_id:
                return list(serving.inp.prompt.stop)
        served = self.served(request_id)
        return None if served is None else served.stop

    def end(self, prompt_id: str) -> PromptEnd | None:
        """The ``prompt_end`` query: prompt ``prompt_id`` open, or ended (counted by the
        run: a run-hosted one with its terminal event as the run keeps it; a
        PromptWorkflow's end is that workflow's result); None where the run knows no such
        prompt (or no longer keeps it)."""
        served = self._served.get(prompt_id)
        if served is not None:
            return PromptEnd(prompt_id=prompt_id, open=False, terminal=served.outcome.terminal)
        if prompt_id in self._open or prompt_id in self._hosted or prompt_id in self._children:
            return PromptEnd(prompt_id=prompt_id, open=True)
        if prompt_id in self._closed:
            return PromptEnd(prompt_id=prompt_id, open=False)
        return None

    def ends(self, prompt_ids: object) -> list[PromptEnd | None]:
        """The ``prompt_ends`` query: ``end`` of each key, in order. A query's argument
        is untrusted: anything but a list of at most PROMPT_ENDS_PER_QUERY strings fails
        the query (only the query) with what was wrong. One answer holds at most
        PROMPT_ENDS_TEXT characters of ended prompts' texts (the first always): a prompt
        past that is answered open, and its client asks again."""
        if not isinstance(prompt_ids, list) or not all(isinstance(p, str) for p in prompt_ids):
            raise ValueError("prompt_ends takes a list of prompt keys (strings)")
        if len(prompt_ids) > names.PROMPT_ENDS_PER_QUERY:
            raise ValueError(
                f"prompt_ends takes at most {names.PROMPT_ENDS_PER_QUERY} prompt keys, "
                f"not {len(prompt_ids)}"
            )
        answers: list[PromptEnd | None] = []
        text = 0
        for key in prompt_ids:
            end = self.end(key)
            if end is not None and end.terminal is not None:
                size = _terminal_size(end.terminal)
                if text and text + size > PROMPT_ENDS_TEXT:
                    # This answer is full: that prompt is asked for again in the next.
                    end = PromptEnd(prompt_id=key, open=True)
                else:
                    text += size
            answers.append(end)
        return answers

    def kept(self) -> list[ServedPrompt]:
        """The ends continue-as-new carries: the latest SERVED_KEPT, their texts within
        SERVED_TEXT_KEPT characters, the latest always."""
        carried: list[ServedPrompt] = []
        text = 0
        for served in reversed(self._served.values()):
            text += _text_size(served)
            if carried and (len(carried) == SERVED_KEPT or text > SERVED_TEXT_KEPT):
                break
            carried.append(served)
        return carried[::-1]


class _NoUpdate:
    id = "noupdate"


def _text_size(served: ServedPrompt) -> int:
    terminal = served.outcome.terminal
    text = terminal.final_text if terminal.type == "done" else terminal.text
    return len(text or "")


def _terminal_size(terminal: PromptTerminal) -> int:
    """The characters of text a terminal event carries (a Done's whole text, a run-hosted
    Fault's text so far)."""
    if isinstance(terminal, Fault):
        return len(terminal.text or "")
    return len(getattr(terminal, "final_text", "") or "")


async def _tell(
    child: workflow.ChildWorkflowHandle[Any, Any],
    wf_id: str,
    name: str,
    *arg: Any,
    always_tolerated: bool = False,
) -> None:
    """Signal prompt workflow ``wf_id``. One the server cannot deliver found the child
    ended (on a cancel that reached it first, or closed from outside): its end comes by
    its result, so this is no fault of the run's (DECISIONS 105). Unguarded, an
    activation sent on the heels of a cancel once faulted a whole run ("prompt serving:
    ... (ApplicationError)"); a history recorded so replays that way. A cancel and a
    head's news (``always_tolerated``) were always only logged when not delivered."""
    try:
        await child.signal(name, *arg)
    except Exception as err:
        # ApplicationError: the SDK's word for "external workflow not found".
        if not always_tolerated and not (
            isinstance(err, ApplicationError) and workflow.patched(names.PATCH_SIGNAL_ENDED_CHILD)
        ):
            raise
        workflow.logger.warning("%s to prompt %s not delivered: %s", name, wf_id, err)
