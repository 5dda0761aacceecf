"""The gateway's Starlette app: OpenAI's HTTP API over one run's prompt API.

``create_app(client, run_id)`` serves run ``mvp-run-<run_id>``:

- ``GET /v1/models`` (and ``/v1/models/{id}``): the run's model, named after its GGUF
  file (``SmolLM2-135M-Instruct.Q4_1``), from the plan in the run's ``snapshot``.
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: each request is one
  ``submit_prompt`` Update (``temporal.client.RunHandle.stream``) with a request id the
  gateway allots, its text the prompt's stream, streamed as server-sent events or
  returned whole.
- ``GET /health``: 200 while the run is prompt-ready, else 503.
- ``GET /v1/chat/completions/{id}`` and ``GET /v1/completions/{id}`` (``?stream=true``):
  re-attach to a completion of this run, running or finished (``attach.py``).

The run decides admission (a full queue is a 429, a run that is not prompt-ready a 503)
and generation; the head node encodes the prompt (rendering a conversation with the
model's chat template), counts its tokens and refuses, typed, a prompt that does not fit
(``Fault.kind``). The gateway adds what OpenAI has and the run has not: stop strings
(held back, cut, the prompt cancelled at once) and a client that goes away (its prompt
cancelled at once). It never loads the model's tokenizer (nor the engine, nor torch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.client import Client, WorkflowQueryFailedError, WorkflowQueryRejectedError
from temporalio.service import RPCError, RPCStatusCode

from mvp_core.errors import ErrorType
from mvp_core.models import Done, Fault, RunPhase, SubmitPrompt, TextDelta
from mvp_core.request_ids import RequestIds
from mvp_core.run_state import RunState
from temporal import telemetry
from temporal.client import PromptRejected, RunHandle
from workers.gateway.attach import attach_routes
from workers.gateway.dashboard import dashboard_routes
from workers.gateway.stops import StopMatcher, cut_at_stop
from workers.gateway.streaming import ClientGone, EventStream, unless_disconnected
from workers.gateway.wire import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    invalid,
    model_not_found,
    model_object,
    parse_body,
    sse,
    unavailable,
    usage,
)

log = logging.getLogger("mvp.gateway")

MAX_BODY_BYTES = 1 << 20  # a request body over this is a 413
QUERY_TIMEOUT = timedelta(seconds=5)
CANCEL_TIMEOUT_S = 5.0
ADMIT_TRIES = 4  # a duplicate id (another client's) or a rollover: try again
ROLLOVER_RETRY_S = 0.5
ADMIT_WAIT_S = 30.0  # a request gone while its admission is in flight: wait this long for it
T = TypeVar("T")
# Rejections that mean "not now": the run is starting, stopping or rolling over (a 503).
_NOT_SERVING = (
    ErrorType.RUN_NOT_PROMPT_READY,
    ErrorType.RUN_SHUTTING_DOWN,
    ErrorType.RUN_ROLLING_OVER,
)


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class ServedModel:
    """What the gateway serves, from the run's committed plan (it never changes)."""

    id: str
    aliases: frozenset[str]
    created: int
    max_seq_len: int

    def check(self, name: str) -> None:
        if name != self.id and name not in self.aliases:
            raise model_not_found(name)


def model_id_of(model_path: str) -> str:
    base = os.path.basename(model_path)
    return base[: -len(".gguf")] if base.lower().endswith(".gguf") else base


class Gateway:
    """One run's prompt API, as the HTTP handlers need it."""

    def __init__(self, client: Client, run_id: int, *, poll_cooldown_ms: int = 20) -> None:
        self.client = client
        self.run_id = run_id
        self.run = RunHandle(client, run_id)
        self.workflow_id = self.run.workflow_id
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

    def close_viewers(self) -> None:
        """End the streams that only watch (they would hold the server's shutdown for its
        whole grace); prompts in flight finish."""
        for close in self.viewers:
            close()

    # ------------------------------------------------------------------ run facts
    def handle(self) -> Any:
        return self.run.workflow

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
            self._served = ServedModel(
                id=model_id,
                aliases=frozenset({plan.model_facts.name, os.path.basename(plan.model_path)}),
                created=created,
                max_seq_len=plan.max_seq_len,
            )
            return self._served

    # ------------------------------------------------------------------ prompts
    async def open(self, fields: Mapping[str, Any]) -> PromptSession:
        """Submit a prompt with a fresh request id; returns once the run admitted it, or
        raises the ApiError of its rejection."""
        for attempt in range(ADMIT_TRIES):
            prompt = SubmitPrompt(request_id=next(self._ids), **fields)
            session = PromptSession(self, prompt)
            try:
                await session.open()
                return session
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
                    # The Temporal server's limit on a workflow's Updates in flight (each
                    # prompt is one until it ends: history.maxInFlightUpdates), or its rate
                    # limits: overload, as a full queue is.
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
        while True:
            try:
                await self.served()
                return
            except Exception:
                await asyncio.sleep(1.0)

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
            self.ended = True  # refused: nothing to cancel
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
        if isinstance(item, BaseException):
            self.ended = True  # lost: the run, if it is there, still has the prompt
            log.warning("prompt %d lost: %s: %s", self.request_id, type(item).__name__, item)
            self.gateway.cancel_soon(self.request_id)
            raise unavailable(
                f"lost run {self.gateway.workflow_id} mid-prompt: {type(item).__name__}",
                "run_unreachable",
            )
        if not isinstance(item, TextDelta):
            self.ended = True
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
        self.ended = True
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


@dataclass
class Prepared:
    """A request turned into the run's prompt."""

    fields: dict[str, Any]
    param: Literal["prompt", "messages"]  # what a refusal of the prompt names
    stops: list[str]
    include_usage: bool
    stream: bool

    @classmethod
    def of(
        cls,
        req: CompletionRequest | ChatRequest,
        fields: dict[str, Any],
        param: Literal["prompt", "messages"],
    ) -> Prepared:
        """``fields`` (the prompt) with the request's limit, stop strings and sampling."""
        return cls(
            fields={
                **fields,
                "max_tokens": req.token_limit(),
                "stop": req.stops(),
                **req.sampling(),
            },
            param=param,
            stops=req.stops(),
            include_usage=req.include_usage(),
            stream=bool(req.stream),
        )


@dataclass
class Finish:
    reason: Literal["stop", "length"]
    completion_tokens: int
    prompt_tokens: int  # as the head node encoded the prompt (0: a node that did not say)
    final_text: str | None = None  # the run's whole text, when no stop string cut it


@dataclass
class Collected:
    text: str = ""
    finish: Finish | None = None
    pieces: list[str] = field(default_factory=list)


async def drive(
    session: PromptSession, prep: Prepared, served: ServedModel
) -> AsyncIterator[str | Finish]:
    """The prompt's text with stop strings applied, then one Finish. A Fault raises its
    ApiError. Token counts are the head node's: the prompt's from its first delta (or its
    Done), the completion's at a stop string the tokens of the deltas up to the one that
    completed it."""
    matcher = StopMatcher(prep.stops)
    prompt_tokens: int | None = None
    tokens = 0
    async for event in session.events():
        if isinstance(event, TextDelta):
            if prompt_tokens is None:
                prompt_tokens = event.prompt_tokens
            tokens += event.tokens or 0
            text, hit = matcher.push(event.text)
            if text:
                yield text
            if hit:
                session.cancel()
                yield Finish("stop", tokens, prompt_tokens or 0)
                return
        elif isinstance(event, Done):
            tail = matcher.flush()
            if tail:
                yield tail
            reason: Literal["stop", "length"] = "stop" if event.stop_reason == "eos" else "length"
            n_prompt = event.prompt_tokens if event.prompt_tokens is not None else prompt_tokens
            yield Finish(reason, event.tokens_generated, n_prompt or 0, event.final_text)
            return
        else:
            raise fault_error(event, prep.param, served)


def fault_error(fault: Fault, param: str, served: ServedModel) -> ApiError:
    """The HTTP answer to a prompt's Fault, by its type (never by its text)."""
    if fault.kind == ErrorType.PROMPT_TOO_LONG:
        has = "" if fault.prompt_tokens is None else f"; your prompt has {fault.prompt_tokens}"
        return invalid(
            f"This model's maximum context length is {served.max_seq_len} tokens{has} (the "
            f"prompt and at least one generated token must fit).",
            param,
            "context_length_exceeded",
        )
    if fault.kind == ErrorType.CHAT_TEMPLATE_REFUSED:
        return invalid(fault.error, "messages", "chat_template_refused")
    if fault.kind == ErrorType.INVALID_PROMPT:
        return invalid(fault.error, param, "invalid_prompt")
    return ApiError(
        500, f"the prompt faulted: {fault.error}", type="server_error", code="prompt_fault"
    )


async def collect(session: PromptSession, prep: Prepared, served: ServedModel) -> Collected:
    out = Collected()
    async for item in drive(session, prep, served):
        if isinstance(item, str):
            out.pieces.append(item)
        else:
            out.finish = item
    out.text = "".join(out.pieces)
    finish = out.finish
    assert finish is not None
    if finish.final_text is not None and finish.final_text != out.text:
        # The run's own text is the reference (the stream is its batched copy).
        out.text, hit = cut_at_stop(finish.final_text, prep.stops)
        if hit:
            finish.reason = "stop"
    return out


# --------------------------------------------------------------------------- HTTP


async def read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def list_models(request: Request) -> Response:
    served = await _gateway(request).served()
    return JSONResponse({"object": "list", "data": [model_object(served.id, served.created)]})


async def get_model(request: Request) -> Response:
    served = await _gateway(request).served()
    served.check(request.path_params["model"])
    return JSONResponse(model_object(served.id, served.created))


async def health(request: Request) -> Response:
    gateway = _gateway(request)
    state = await gateway.snapshot()
    ready = state.phase is RunPhase.PROMPT_READY and not state.stopping
    body = {"status": "ok" if ready else "unavailable", "run": gateway.workflow_id}
    return JSONResponse({**body, "phase": state.phase.value}, status_code=200 if ready else 503)


async def completions(request: Request) -> Response:
    gateway = _gateway(request)
    req: CompletionRequest = parse_body(await read_body(request), CompletionRequest)
    served = await gateway.served()
    served.check(req.model)
    text = req.prompt_text()
    if not text:
        raise invalid("the prompt must not be empty", "prompt", "invalid_value")
    prep = Prepared.of(req, {"prompt_text": text, "chat": False}, "prompt")
    return await _respond(request, gateway, served, prep, chat=False)


async def chat_completions(request: Request) -> Response:
    gateway = _gateway(request)
    req: ChatRequest = parse_body(await read_body(request), ChatRequest)
    served = await gateway.served()
    served.check(req.model)
    messages = [{"role": m.template_role(), "content": m.text()} for m in req.messages]
    # The head node renders the conversation with the model's own chat template and
    # encodes its control tokens as such; a model without one, or a template that refuses
    # the conversation, ends the prompt with a typed Fault (a 400 here).
    if len(messages) == 1 and messages[0]["role"] == "user":
        content = messages[0]["content"]
        if not content:
            raise invalid("the message must not be empty", "messages.0.content", "invalid_value")
        fields: dict[str, Any] = {"prompt_text": content, "chat": True}
    else:
        fields = {"prompt_text": "", "messages": messages, "chat": True}
    prep = Prepared.of(req, fields, "messages")
    return await _respond(request, gateway, served, prep, chat=True)


async def _respond(
    request: Request,
    gateway: Gateway,
    served: ServedModel,
    prep: Prepared,
    *,
    chat: bool,
) -> Response:
    try:
        session = await unless_disconnected(request, gateway.open(prep.fields))
    except ClientGone:
        return Response(status_code=499)
    created = int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{gateway.run_id}-{session.request_id}"
    if prep.stream:
        # No byte goes out before the prompt's first event: a prompt the head node
        # refuses is an HTTP error, not a 200 stream that carries one.
        try:
            first = await unless_disconnected(request, session.peek())
        except ClientGone:
            await session.close()
            return Response(status_code=499)
        except BaseException:
            await session.close()
            raise
        if isinstance(first, Fault):
            await session.close()
            raise fault_error(first, prep.param, served)
        chunks = _stream(session, prep, served, ident, created, chat)
        return EventStream(chunks, on_close=session.close)
    try:
        out = await unless_disconnected(request, collect(session, prep, served))
    except ClientGone:
        return Response(status_code=499)
    finally:
        await session.close()
    assert out.finish is not None
    body: dict[str, Any] = {"id": ident, "created": created, "model": served.id}
    if chat:
        body["object"] = "chat.completion"
        body["choices"] = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": out.text, "refusal": None},
                "logprobs": None,
                "finish_reason": out.finish.reason,
            }
        ]
    else:
        body["object"] = "text_completion"
        body["choices"] = [
            {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish.reason}
        ]
    body["usage"] = usage(out.finish.prompt_tokens, out.finish.completion_tokens)
    return JSONResponse(body)


async def _stream(
    session: PromptSession,
    prep: Prepared,
    served: ServedModel,
    ident: str,
    created: int,
    chat: bool,
) -> AsyncGenerator[bytes, None]:
    head: dict[str, Any] = {
        "id": ident,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": served.id,
    }

    def chunk(text: str | None, finish: str | None = None) -> bytes:
        if chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = {**head, "choices": [choice]}
        if prep.include_usage:
            body["usage"] = None
        return sse(body)

    try:
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            first = {**head, "choices": [{**role, "finish_reason": None}]}
            if prep.include_usage:
                first["usage"] = None
            yield sse(first)
        finish: Finish | None = None
        async for item in drive(session, prep, served):
            if isinstance(item, str):
                yield chunk(item)
            else:
                finish = item
        assert finish is not None
        yield chunk(None, finish.reason)
        if prep.include_usage:
            yield sse(
                {
                    **head,
                    "choices": [],
                    "usage": usage(finish.prompt_tokens, finish.completion_tokens),
                }
            )
        yield SSE_DONE
    except ApiError as err:
        # Headers are gone: the error travels as an event (the openai client raises it).
        yield sse(err.body())
    finally:
        await session.close()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = ApiError(exc.status_code, str(exc.detail), code=code)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("request %s %s failed", request.method, request.url.path, exc_info=exc)
    err = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def create_app(client: Client, run_id: int, *, poll_cooldown_ms: int = 20) -> Starlette:
    """The gateway of run ``mvp-run-<run_id>``, on an open Temporal client."""
    gateway = Gateway(client, run_id, poll_cooldown_ms=poll_cooldown_ms)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        gateway.start()
        try:
            yield
        finally:
            await gateway.aclose()

    app = Starlette(
        routes=[
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            *attach_routes(gateway),
            *dashboard_routes(gateway),
        ],
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    if telemetry.current().tracing:  # off: no middleware at all
        app.add_middleware(telemetry.TracingMiddleware)
    return app
