"""The gateway's service: what an HTTP request does against a run, apart from HTTP.

:class:`Gateway` is one run's prompt API as the routes need it: the run's model (from
its committed plan, under the operator's alias where given), admission of a prompt with
a request id the gateway allots (a refusal becomes its HTTP error: a full queue a 429, a
run that is not prompt-ready a 503), cancellation, and what choosing among replicas
needs of the run without asking it (its prompts in flight from this gateway, its
capacity, whether it was prompt-ready; ``runs.py``, ``selection.py``).
:class:`PromptSession` is one admitted prompt: its events in order, peeked before a
stream commits to 200, and cancelled when the request ends first (a stop string, a
client gone). The run is reached only through ``temporal.client.RunHandle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.service import RPCError, RPCStatusCode

from mvp_core.errors import ErrorType
from mvp_core.models import Done, Fault, RunPhase, SubmitPrompt, TextDelta
from mvp_core.request_ids import RequestIds
from mvp_core.run_state import RunState
from temporal.client import (
    ADMIT_WAIT_S,
    CANCEL_TIMEOUT_S,
    QUERY_TIMEOUT,
    PromptRejected,
    RunHandle,
)
from workers.gateway.wire import ApiError, invalid, model_not_found, unavailable

log = logging.getLogger("mvp.gateway")

ADMIT_TRIES = 4  # a duplicate id (another client's) or a rollover: try again
ROLLOVER_RETRY_S = 0.5
WARM_EVERY_S = 1.0  # how often a run is asked its state until it is prompt-ready
ROUTE_TRIES = 10  # a prompt-ready run's state read for its head's endpoint (DECISIONS 94)
NOT_READY_HOLD_S = 2.0  # a run that refused a prompt as not ready is tried last this long
# Rejections that mean "not now": the run is starting, stopping or rolling over (a 503).
_NOT_SERVING = (
    ErrorType.RUN_NOT_PROMPT_READY,
    ErrorType.RUN_SHUTTING_DOWN,
    ErrorType.RUN_ROLLING_OVER,
)
# Faults of the prompt itself; any other may be the run's end (asked before it is told).
_PROMPT_FAULTS = (
    ErrorType.PROMPT_TOO_LONG,
    ErrorType.CHAT_TEMPLATE_REFUSED,
    ErrorType.INVALID_PROMPT,
)


@dataclass(frozen=True)
class ServedModel:
    """What the gateway serves, from the run's committed plan (it never changes)."""

    id: str
    aliases: frozenset[str]
    created: int
    max_seq_len: int

    def answers(self, name: str) -> bool:
        return name == self.id or name in self.aliases

    def check(self, name: str) -> None:
        if not self.answers(name):
            raise model_not_found(name)


def model_id_of(model_path: str) -> str:
    base = os.path.basename(model_path)
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


def run_ended(workflow_id: str, how: str) -> ApiError:
    """What a request in flight in a run that ended gets (DECISIONS 90)."""
    return ApiError(
        503,
        f"run {workflow_id} ended ({how}) while this prompt was in flight; the gateway no "
        "longer serves it",
        type="server_error",
        code="run_ended",
        retry_after_s=1,
    )


class Gateway:
    """One run's prompt API, as the HTTP handlers need it."""

    def __init__(
        self,
        client: Client,
        run_id: int,
        *,
        poll_cooldown_ms: int = 20,
        alias: str | None = None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.alias = alias  # the model id the operator gave the run (else its file's)
        # A refusal past the server's limits is a 429 within a second (issue 37).
        self.run = RunHandle(client, run_id, quick_refusals=True)
        self.workflow_id = self.run.workflow_id
        log.info(
            "text of %s's prompts: from its head node, %s",
            self.workflow_id,
            "with this host's edge secret"
            if self.run.holds_secret
            else "with a key per prompt (no edge secret here: DECISIONS 80)",
        )
        self.poll_cooldown_ms = poll_cooldown_ms
        self._served: ServedModel | None = None
        self._served_lock = asyncio.Lock()
        # The run's request ids: unique for this gateway's lifetime, and (random high
        # bits) all but surely distinct from another client's; a clash is retried. Each
        # is a JavaScript-safe integer (mvp_core.request_ids).
        self._ids = RequestIds()
        self._background: set[asyncio.Task[Any]] = set()
        self._warm: asyncio.Task[None] | None = None
        self.viewers: list[Callable[[], None]] = []  # end the read-only streams (dashboard)
        # What choosing among replicas knows without asking the run (selection.py).
        self._live: set[PromptSession] = set()  # prompts of this gateway not ended yet
        self.max_active = 1  # the run's max_active_prompts, once read
        self.ready_seen = False  # the run was prompt-ready when last asked or admitting
        self._not_ready_until = 0.0  # a refusal as not ready: tried last until then
        self.last_chosen = 0  # set by the RunSet each time it sends the run a request
        self.ended_how: str | None = None  # how the run ended, once the gateway knows

    def close_viewers(self) -> None:
        """End the streams that only watch (they would hold the server's shutdown for its
        whole grace); prompts in flight finish."""
        for close in self.viewers:
            close()

    # ------------------------------------------------------------------ run facts
    def handle(self) -> Any:
        return self.run.workflow

    @property
    def in_flight(self) -> int:
        """This gateway's prompts in the run: being admitted, queued or generating."""
        return len(self._live)

    @property
    def ready(self) -> bool:
        """Prompt-ready as far as the gateway knows, without asking the run."""
        return self.ready_seen and time.monotonic() >= self._not_ready_until

    def known(self) -> ServedModel | None:
        """The run's model once learned (None before its plan was read)."""
        return self._served

    def mark_ended(self, how: str) -> None:
        """The run ended (``how``: completed, failed, terminated): every request in
        flight in it gets ``run_ended`` now."""
        self.ended_how = how
        err = run_ended(self.workflow_id, how)
        for session in list(self._live):
            session.abort(err)

    async def closed_how(self) -> str | None:
        """How the run ended, or None while it runs (a continued run runs) or cannot be
        asked: one ``describe``, asked only when a prompt of the run failed (a Fault, a
        stream lost), so that a run's end reaches its requests as ``run_ended`` whichever
        news comes first."""
        if self.ended_how is not None:
            return self.ended_how
        try:
            status = (await self.run.describe()).status
        except Exception:
            return None
        if status is None or status is WorkflowExecutionStatus.RUNNING:
            return None
        return status.name.lower()

    async def snapshot(self) -> RunState:
        try:
            state = await self.run.snapshot(rpc_timeout=QUERY_TIMEOUT)
        except RPCError as err:
            if err.status is RPCStatusCode.NOT_FOUND:
                raise unavailable(f"no run {self.workflow_id}", "run_not_found") from None
            raise unavailable(
                f"run {self.workflow_id} is not reachable: {err.message}", "run_unreachable"
            ) from None
        except (WorkflowQueryFailedError, WorkflowQueryRejectedError) as err:
            raise unavailable(
                f"run {self.workflow_id} did not answer: {err}", "run_unreachable"
            ) from None
        return state

    async def served(self) -> ServedModel:
        """The run's model; a 503 until the run has a plan."""
        if self._served is not None:
            return self._served
        async with self._served_lock:
            if self._served is not None:
                return self._served
            state = await self.snapshot()
            plan = state.plan
            if plan is None:
                raise unavailable(
                    f"run {self.workflow_id} is {state.phase.value}: not prompt-ready yet",
                    "run_not_ready",
                )
            created = int(time.time())
            with contextlib.suppress(RPCError):
                desc = await self.run.describe()
                if desc.start_time is not None:
                    created = int(desc.start_time.timestamp())
            model_id = model_id_of(plan.model_path)
            other = {plan.model_facts.name, os.path.basename(plan.model_path), model_id}
            served_id = self.alias or model_id
            self._served = ServedModel(
                id=served_id,
                aliases=frozenset(other - {served_id}),
                created=created,
                max_seq_len=plan.max_seq_len,
            )
            if state.phase is RunPhase.PROMPT_READY:
                self.ready_seen = True
            return self._served

    # ------------------------------------------------------------------ prompts
    async def open(self, fields: Mapping[str, Any]) -> PromptSession:
        """Submit a prompt with a fresh request id; returns once the run admitted it, or
        raises the ApiError of its rejection."""
        for attempt in range(ADMIT_TRIES):
            prompt = SubmitPrompt(request_id=next(self._ids), **fields)
            session = PromptSession(self, prompt)
            self._live.add(session)
            try:
                await session.open()
                self.ready_seen, self._not_ready_until = True, 0.0
                return session
            except ApiError:
                raise  # the run ended under it (abort)
            except PromptRejected as err:
                if err.kind == ErrorType.DUPLICATE_REQUEST_ID and attempt + 1 < ADMIT_TRIES:
                    continue
                if err.kind == "RunRollingOver" and attempt + 1 < ADMIT_TRIES:
                    await asyncio.sleep(ROLLOVER_RETRY_S)
                    continue
                raise self._rejection(err) from None
            except RPCError as err:
                if err.status is RPCStatusCode.NOT_FOUND:
                    raise unavailable(
                        f"run {self.workflow_id} is not running: {err.message}", "run_not_found"
                    ) from None
                if err.status is RPCStatusCode.RESOURCE_EXHAUSTED:
                    # The Temporal server's limit on a workflow's Updates in flight
                    # (history.maxInFlightUpdates: admissions at that very moment, DECISIONS
                    # 77), or its rate limits: overload, as a full queue is.
                    raise ApiError(
                        429,
                        f"the Temporal server takes no more prompts for run {self.workflow_id} "
                        f"now ({err.message}); retry later",
                        type="rate_limit_error",
                        code="server_limit",
                        retry_after_s=1,
                    ) from None
                raise unavailable(
                    f"run {self.workflow_id} is not reachable: {err.message}", "run_unreachable"
                ) from None
            except Exception as err:  # the SDK's own (an update timeout, a lost server)
                log.warning("submit to %s: %s: %s", self.workflow_id, type(err).__name__, err)
                raise unavailable(
                    f"run {self.workflow_id} is not reachable: {type(err).__name__}",
                    "run_unreachable",
                ) from None
        raise AssertionError("unreachable")

    def _rejection(self, err: PromptRejected) -> ApiError:
        if err.kind == ErrorType.PROMPT_QUEUE_FULL:
            return ApiError(
                429,
                f"the prompt queue of run {self.workflow_id} is full; retry later",
                type="rate_limit_error",
                code="prompt_queue_full",
                retry_after_s=1,
            )
        if err.kind in _NOT_SERVING:
            self._not_ready_until = time.monotonic() + NOT_READY_HOLD_S
            return unavailable(
                f"run {self.workflow_id} is not prompt-ready ({err})", "run_not_ready"
            )
        if err.kind == ErrorType.INVALID_PROMPT:
            return invalid(str(err), code="invalid_prompt")
        return ApiError(500, f"{err.kind}: {err}", type="server_error", code="prompt_rejected")

    def cancel_soon(self, request_id: int) -> None:
        """Ask the run to end a prompt (``cancel_prompt``) without waiting for it."""
        self.spawn(self._cancel(request_id))

    async def _cancel(self, request_id: int) -> None:
        with contextlib.suppress(Exception):
            await self.run.cancel_prompt(request_id)  # bounded by the client

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Learn the run's model in the background so the first request does not pay
        for it."""
        self._warm = asyncio.ensure_future(self._warm_up())

    async def _warm_up(self) -> None:
        """The run's capacity (its request, read once), then its model, then whether it is
        prompt-ready (asked every second until it is), then whether its prompts' text can
        be read live from its head node here: where it cannot, the gateway says why now,
        once, not at a first prompt (issue 37)."""
        try:
            request = await self.run.request()
        except Exception as err:  # no such run yet, a server gone: assume 1
            log.info("capacity of %s: %s: %s", self.workflow_id, type(err).__name__, err)
            request = None
        if request is not None:
            self.max_active = request.max_active_prompts
        while True:
            try:
                await self.served()
                break
            except Exception:
                await asyncio.sleep(WARM_EVERY_S)
        while not self.ready_seen:
            state = await self.run.try_snapshot()
            if state is not None and state.phase is RunPhase.PROMPT_READY:
                self.ready_seen = True
            elif state is not None and state.stopping:
                return
            else:
                await asyncio.sleep(WARM_EVERY_S)
        for _ in range(ROUTE_TRIES):
            try:
                if await self.run.check_text_route():
                    return
            except Exception as err:  # a server gone: a first prompt says why, if need be
                log.info("text route of %s: %s: %s", self.workflow_id, type(err).__name__, err)
                return
            await asyncio.sleep(WARM_EVERY_S)

    def retire(self) -> None:
        """No longer served (removed, or ended): stop learning about the run; prompts in
        flight finish."""
        if self._warm is not None:
            self._warm.cancel()

    async def aclose(self) -> None:
        if self._warm is not None:
            self._warm.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._warm
        if self._background:
            await asyncio.wait(set(self._background), timeout=CANCEL_TIMEOUT_S + 1)


class PromptSession:
    """One admitted prompt: its events in order, and its cancellation."""

    def __init__(self, gateway: Gateway, prompt: SubmitPrompt) -> None:
        self.gateway = gateway
        self.prompt = prompt
        self.request_id = prompt.request_id
        self._events: asyncio.Queue[TextDelta | Done | Fault | BaseException] = asyncio.Queue()
        self._admitted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._peeked: TextDelta | Done | Fault | None = None
        self.ended = False  # the terminal event arrived, or the prompt was cancelled

    def _end(self) -> None:
        self.ended = True
        self.gateway._live.discard(self)  # no longer in flight for choosing a replica

    def abort(self, err: ApiError) -> None:
        """The run ended under the prompt: its reader gets ``err`` next (an admission in
        flight raises it)."""
        if self.ended:
            return
        self._error = err
        self._events.put_nowait(err)
        task = self._task
        if task is not None and not self._admitted.is_set():
            task.cancel()

    async def open(self) -> None:
        self._task = asyncio.ensure_future(self._pump())
        admitted = asyncio.ensure_future(self._admitted.wait())
        try:
            await asyncio.wait({self._task, admitted}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            await self.close()
            raise
        finally:
            admitted.cancel()
        if not self._admitted.is_set():
            self._end()  # refused: nothing to cancel
            assert self._error is not None
            raise self._error

    async def _pump(self) -> None:
        try:
            async for event in self.gateway.run.stream(
                self.prompt,
                poll_cooldown_ms=self.gateway.poll_cooldown_ms,
                on_admitted=self._admitted.set,
            ):
                self._events.put_nowait(event)
        except Exception as err:
            self._error = err
            self._events.put_nowait(err)

    async def _next(self) -> TextDelta | Done | Fault:
        if self._peeked is not None:
            event, self._peeked = self._peeked, None
            return event
        item = await self._events.get()
        if isinstance(item, ApiError):
            self._end()  # the run ended under it (abort)
            raise item
        if isinstance(item, (Fault, Exception)) and not (
            isinstance(item, Fault) and item.kind in _PROMPT_FAULTS
        ):
            how = await self.gateway.closed_how()
            if how is not None:
                self._end()
                raise run_ended(self.gateway.workflow_id, how)
        if isinstance(item, BaseException):
            self._end()  # lost: the run, if it is there, still has the prompt
            log.warning("prompt %d lost: %s: %s", self.request_id, type(item).__name__, item)
            self.gateway.cancel_soon(self.request_id)
            raise unavailable(
                f"lost run {self.gateway.workflow_id} mid-prompt: {type(item).__name__}",
                "run_unreachable",
            )
        if not isinstance(item, TextDelta):
            self._end()
        return item

    async def peek(self) -> TextDelta | Done | Fault:
        """The prompt's first event, without taking it (``events`` starts with it): a
        stream waits for it before it commits to 200, since a prompt the head node
        refuses (too long, a template that refuses it) ends with its first event."""
        if self._peeked is None:
            self._peeked = await self._next()
        return self._peeked

    async def events(self) -> AsyncIterator[TextDelta | Done | Fault]:
        while True:
            item = await self._next()
            yield item
            if self.ended:
                return

    def cancel(self) -> None:
        """End the prompt now (a stop string, a client gone): the run cancels it."""
        if self.ended:
            return
        self._end()
        task = self._task
        if self._admitted.is_set() or task is None or task.done():
            if self._admitted.is_set():
                self.gateway.cancel_soon(self.request_id)
        else:
            # Its admission is in flight: a cancel that reached the run first would be
            # ignored, so wait for the run's answer, then cancel what it admitted.
            self.gateway.spawn(self._cancel_once_admitted(task))

    async def _cancel_once_admitted(self, task: asyncio.Task[None]) -> None:
        admitted = asyncio.ensure_future(self._admitted.wait())
        await asyncio.wait(
            {task, admitted}, timeout=ADMIT_WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
        admitted.cancel()
        if not task.done():
            # Cancelled while its admission is in flight, the run handle's stream cancels
            # whatever the run admits. A cancel sent now could reach the run before the
            # prompt and be ignored, and the handle sends one cancel per prompt.
            task.cancel()
        if self._admitted.is_set():
            await self.gateway._cancel(self.request_id)

    async def close(self) -> None:
        """Whatever ended the request before the prompt did: the run ends the prompt."""
        admitting = self._task is not None and not self._admitted.is_set()
        self.cancel()
        task = self._task
        if task is not None and not task.done() and not admitting:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


# --------------------------------------------------------------------------- generation
