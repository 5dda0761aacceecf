"""The gateway's HTTP routes: each handler turns a request into a call of the service
(``service.Gateway``) and its answer into OpenAI's response, whole or as server-sent
events; errors become OpenAI's error objects.

- ``GET /v1/models`` (and ``/v1/models/{id}``): the models of the runs served, each
  named after its GGUF file (``SmolLM2-135M-Instruct.Q4_1``, from the plan in the run's
  ``snapshot``) or the alias the operator gave its run; replicas are listed once.
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: each request is one
  prompt of the run its ``model`` names (of replicas, the one with the shortest queue:
  ``runs.py``), streamed as server-sent events or returned whole.
- ``GET /health``: 200 while a run is prompt-ready, else 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mvp_core.models import Fault, RunPhase
from mvp_core.run_state import RunState
from workers.gateway.completion import Finish, Piece, Prepared, collect, drive, fault_error
from workers.gateway.logprobs import Placed, chat_logprobs, completion_logprobs
from workers.gateway.runs import RunSet
from workers.gateway.service import Gateway, PromptSession, ServedModel
from workers.gateway.streaming import ClientGone, EventStream, unless_disconnected
from workers.gateway.wire import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    invalid,
    model_object,
    parse_body,
    sse,
    usage,
)

log = logging.getLogger("mvp.gateway")

MAX_BODY_BYTES = 1 << 20  # a request body over this is a 413


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


def _runs(request: Request) -> RunSet:
    runs: RunSet = request.app.state.runs
    return runs


async def list_models(request: Request) -> Response:
    models = await _runs(request).models()
    data = [model_object(served.id, served.created) for served in models]
    return JSONResponse({"object": "list", "data": data})


async def get_model(request: Request) -> Response:
    served = await _runs(request).model(request.path_params["model"])
    return JSONResponse(model_object(served.id, served.created))


async def health(request: Request) -> Response:
    """One run: its phase, as ever. Several: each run's, and 200 while any serves."""
    gateways = _runs(request).gateways()
    if len(gateways) == 1:
        gateway = gateways[0]
        state = await gateway.snapshot()
        ready = state.phase is RunPhase.PROMPT_READY and not state.stopping
        body = {"status": "ok" if ready else "unavailable", "run": gateway.workflow_id}
        return JSONResponse({**body, "phase": state.phase.value}, status_code=200 if ready else 503)
    states = await asyncio.gather(*(g.snapshot() for g in gateways), return_exceptions=True)
    runs = [_run_health(g, s) for g, s in zip(gateways, states, strict=True)]
    ready = any(run["ready"] for run in runs)
    status = "ok" if ready else "unavailable"
    return JSONResponse({"status": status, "runs": runs}, status_code=200 if ready else 503)


def _run_health(gateway: Gateway, state: RunState | BaseException) -> dict[str, Any]:
    served = gateway.known()
    model = served.id if served is not None else gateway.alias
    if isinstance(state, BaseException):  # an ApiError: the run cannot answer now
        return {"run": gateway.workflow_id, "model": model, "phase": None, "ready": False}
    ready = state.phase is RunPhase.PROMPT_READY and not state.stopping
    return {"run": gateway.workflow_id, "model": model, "phase": state.phase.value, "ready": ready}


async def completions(request: Request) -> Response:
    req: CompletionRequest = parse_body(await read_body(request), CompletionRequest)
    candidates = await _runs(request).select(req.model)
    text = req.prompt_text()
    if not text:
        raise invalid("the prompt must not be empty", "prompt", "invalid_value")
    prep = Prepared.of(req, {"prompt_text": text, "chat": False}, "prompt")
    return await _respond(request, candidates, prep, chat=False)


async def chat_completions(request: Request) -> Response:
    req: ChatRequest = parse_body(await read_body(request), ChatRequest)
    candidates = await _runs(request).select(req.model)
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
    return await _respond(request, candidates, prep, chat=True)


async def _open_all(
    request: Request, gateway: Gateway, prep: Prepared
) -> list[PromptSession] | None:
    """Admit each choice's prompt (None: the client went away meanwhile). A refusal of
    any choice closes (cancels) those admitted before it and raises its error."""
    sessions: list[PromptSession] = []
    try:
        for index in range(prep.n):
            fields = prep.choice_fields(index)
            sessions.append(await unless_disconnected(request, gateway.open(fields)))
    except ClientGone:
        await _close_all(sessions)
        return None
    except BaseException:
        await _close_all(sessions)
        raise
    return sessions


async def _close_all(sessions: list[PromptSession]) -> None:
    for session in sessions:
        await session.close()


async def _open_on_one(
    request: Request, candidates: list[Gateway], prep: Prepared
) -> tuple[Gateway, ServedModel, list[PromptSession] | None]:
    """Every choice's prompt in one run: the first candidate that admits them (a run
    whose queue is full, or that is not prompt-ready, passes the request on to the next
    replica; the last one's refusal is the answer)."""
    for index, gateway in enumerate(candidates):
        served = await gateway.served()  # known: it was chosen by its model
        try:
            return gateway, served, await _open_all(request, gateway, prep)
        except ApiError as err:
            if err.status not in (429, 503) or index + 1 == len(candidates):
                raise
            log.info("%s refused a prompt (%s): next replica", gateway.workflow_id, err.code)
    raise AssertionError("no candidate run")  # select() returns at least one


async def _respond(
    request: Request,
    candidates: list[Gateway],
    prep: Prepared,
    *,
    chat: bool,
) -> Response:
    gateway, served, sessions = await _open_on_one(request, candidates, prep)
    if sessions is None:
        return Response(status_code=499)
    created = int(time.time())
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{gateway.run_id}-{sessions[0].request_id}"
    if prep.stream:
        # No byte goes out before each prompt's first event: a prompt the head node
        # refuses is an HTTP error, not a 200 stream that carries one.
        try:
            firsts = await unless_disconnected(
                request, asyncio.gather(*(session.peek() for session in sessions))
            )
        except ClientGone:
            await _close_all(sessions)
            return Response(status_code=499)
        except BaseException:
            await _close_all(sessions)
            raise
        for first in firsts:
            if isinstance(first, Fault):
                await _close_all(sessions)
                raise fault_error(first, prep.param, served)
        chunks = _stream(sessions, prep, served, ident, created, chat)
        return EventStream(chunks, on_close=lambda: _close_all(sessions))
    try:
        outs = await unless_disconnected(
            request, asyncio.gather(*(collect(session, prep, served) for session in sessions))
        )
    except ClientGone:
        return Response(status_code=499)
    finally:
        await _close_all(sessions)
    body: dict[str, Any] = {"id": ident, "created": created, "model": served.id}
    choices: list[dict[str, Any]] = []
    for index, out in enumerate(outs):
        assert out.finish is not None
        if chat:
            message = {"role": "assistant", "content": out.text, "refusal": None}
            choice: dict[str, Any] = {"index": index, "message": message}
        else:
            choice = {"index": index, "text": out.text}
        logprobs = _logprobs(prep, chat, out.logprobs, out.finish.logprobs_missing)
        choices.append({**choice, "logprobs": logprobs, "finish_reason": out.finish.reason})
    body["object"] = "chat.completion" if chat else "text_completion"
    body["choices"] = choices
    body["usage"] = _usage([out.finish for out in outs if out.finish is not None])
    return JSONResponse(body)


def _logprobs(
    prep: Prepared, chat: bool, placed: list[Placed], missing: bool = False
) -> dict[str, Any] | None:
    """A choice's ``logprobs``: None where not asked for, or where its text came without
    them (whole, with the prompt's end: docs/gateway.md)."""
    if not prep.logprobs or (missing and not placed):
        return None
    return chat_logprobs(placed) if chat else completion_logprobs(placed)


def _usage(finishes: list[Finish]) -> dict[str, Any]:
    """The request's usage: its prompt once (every choice encodes the same; its cached
    tokens the first choice's), the completions of every choice."""
    prompt = finishes[0].prompt_tokens if finishes else 0
    cached = finishes[0].cached_tokens if finishes else None
    return usage(prompt, sum(f.completion_tokens for f in finishes), cached)


async def _merged(
    sessions: list[PromptSession], prep: Prepared, served: ServedModel
) -> AsyncGenerator[tuple[int, Piece | Finish], None]:
    """Every choice's text and Finish as they come, tagged with the choice's index; an
    ApiError of any choice ends it (the others are closed by the stream's end)."""
    if len(sessions) == 1:
        async for item in drive(sessions[0], prep, served):
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Piece | Finish] | BaseException] = asyncio.Queue()

    async def pump(index: int, session: PromptSession) -> None:
        try:
            async for item in drive(session, prep, served):
                queue.put_nowait((index, item))
        except Exception as err:
            queue.put_nowait(err)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sessions)]
    try:
        open_choices = len(sessions)
        while open_choices:
            got = await queue.get()
            if isinstance(got, BaseException):
                raise got
            if isinstance(got[1], Finish):
                open_choices -= 1
            yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(
    sessions: list[PromptSession],
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

    def chunk(index: int, piece: Piece | None, finish: str | None = None) -> bytes:
        logprobs = None if piece is None else _logprobs(prep, chat, piece.logprobs)
        if chat:
            delta: dict[str, Any] = {} if piece is None else {"content": piece.text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {
                "index": index,
                "text": "" if piece is None else piece.text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }
        body = {**head, "choices": [choice]}
        if prep.include_usage:
            body["usage"] = None
        return sse(body)

    try:
        if chat:
            for index in range(len(sessions)):
                role = {"index": index, "delta": {"role": "assistant", "content": ""}}
                first = {**head, "choices": [{**role, "logprobs": None, "finish_reason": None}]}
                if prep.include_usage:
                    first["usage"] = None
                yield sse(first)
        finishes: list[Finish] = []
        async for index, item in _merged(sessions, prep, served):
            if isinstance(item, Piece):
                yield chunk(index, item)
            else:
                finishes.append(item)
                yield chunk(index, None, item.reason)
        if prep.include_usage:
            yield sse({**head, "choices": [], "usage": _usage(finishes)})
        yield SSE_DONE
    except ApiError as err:
        # Headers are gone: the error travels as an event (the openai client raises it).
        yield sse(err.body())
    finally:
        await _close_all(sessions)


async def api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = ApiError(exc.status_code, str(exc.detail), code=code)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)


async def server_error(request: Request, exc: Exception) -> Response:
    log.exception("request %s %s failed", request.method, request.url.path, exc_info=exc)
    err = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
    return JSONResponse(err.body(), status_code=500)


def api_routes() -> list[Route]:
    """The OpenAI routes and the health check (the runs are ``app.state.runs``)."""
    return [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]


EXCEPTION_HANDLERS = {
    ApiError: api_error,
    HTTPException: http_error,
    Exception: server_error,
}
