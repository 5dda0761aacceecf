"""The gateway's HTTP routes: each handler turns a request into a call of the service
(``service.Gateway``) and its answer into OpenAI's response, whole or as server-sent
events; errors become OpenAI's error objects.

- ``GET /v1/models`` (and ``/v1/models/{id}``): the run's model, named after its GGUF
  file (``SmolLM2-135M-Instruct.Q4_1``), from the plan in the run's ``snapshot``.
- ``POST /v1/completions`` and ``POST /v1/chat/completions``: each request is one
  prompt of the run, streamed as server-sent events or returned whole.
- ``GET /health``: 200 while the run is prompt-ready, else 503.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mvp_core.models import Fault, RunPhase
from workers.gateway.completion import Finish, Prepared, collect, drive, fault_error
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
    """The OpenAI routes and the health check (the service is ``app.state.gateway``)."""
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
