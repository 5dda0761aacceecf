"""Re-attach through the gateway: ``GET /v1/chat/completions/{id}`` and
``GET /v1/completions/{id}`` return a completion of this run by the id the gateway gave
it (``chatcmpl-<run>-<request>``, ``cmpl-<run>-<request>``), running or finished, from
any client (``temporal.client.RunHandle.attach``).

Without ``?stream=true`` the answer waits for the prompt's end and is the completion
object; with it, server-sent events as ``POST`` streams them: the whole text so far in
one chunk, then the rest as it is generated, then the finish and ``[DONE]``. It only
reads: a viewer that goes away cancels nothing.

The text is the run's: a stop string that cut the original response is not known here
(the run generated past it until the gateway cancelled the prompt). A prompt that was
cancelled or faulted ends with ``finish_reason`` null and ``mvp_status`` saying why.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mvp_core.models import Done, Fault, TextDelta
from temporal.client import PromptNotFound
from workers.gateway.wire import SSE_DONE, ApiError, sse

if TYPE_CHECKING:
    from workers.gateway.app import Gateway

_ID = re.compile(r"^(chatcmpl|cmpl)-(\d{1,18})-(\d{1,18})$")


def not_found(message: str) -> ApiError:
    return ApiError(404, message, type="invalid_request_error", code="not_found")


def parse_id(raw: str, chat: bool, run_id: int) -> int:
    """The request id behind a completion id of this run, or a 404 saying why not."""
    m = _ID.match(raw)
    kind = "chatcmpl" if chat else "cmpl"
    if m is None or m.group(1) != kind:
        raise not_found(f"No completion found with id '{raw[:80]}' (expected {kind}-RUN-REQUEST)")
    if int(m.group(2)) != run_id:
        raise not_found(
            f"completion '{raw}' belongs to run {m.group(2)}; this gateway serves {run_id}"
        )
    return int(m.group(3))


def finish_of(terminal: Done | Fault) -> tuple[str | None, dict[str, Any]]:
    """OpenAI's finish_reason, and our own status fields for a prompt that did not end
    by itself."""
    if isinstance(terminal, Done):
        return ("stop" if terminal.stop_reason == "eos" else "length"), {}
    status = "cancelled" if "cancel" in terminal.error else "faulted"
    return None, {"mvp_status": status, "mvp_error": terminal.error}


def attach_routes(gateway: Gateway) -> list[Route]:
    async def chat(request: Request) -> Response:
        return await retrieve(request, gateway, chat=True)

    async def completion(request: Request) -> Response:
        return await retrieve(request, gateway, chat=False)

    return [
        Route("/v1/chat/completions/{completion_id}", chat, methods=["GET"]),
        Route("/v1/completions/{completion_id}", completion, methods=["GET"]),
    ]


async def retrieve(request: Request, gateway: Gateway, *, chat: bool) -> Response:
    ident = request.path_params["completion_id"]
    request_id = parse_id(ident, chat, gateway.run_id)
    served = await gateway.served()
    events = gateway.run.attach(request_id, poll_cooldown_ms=gateway.poll_cooldown_ms)
    try:
        first = await anext(events)
    except PromptNotFound:
        raise not_found(f"No completion found with id '{ident}'") from None
    head = {"id": ident, "created": int(time.time()), "model": served.id}
    if request.query_params.get("stream", "").lower() in ("1", "true"):
        from workers.gateway.app import EventStream  # (app imports this module)

        async def nothing() -> None:
            return None  # a viewer that goes away cancels nothing

        return EventStream(_chunks(first, events, head, chat), on_close=nothing)
    pieces: list[str] = []
    event: TextDelta | Done | Fault = first
    while isinstance(event, TextDelta):
        pieces.append(event.text)
        event = await anext(events)
    await events.aclose()
    reason, extra = finish_of(event)
    text = event.final_text if isinstance(event, Done) else "".join(pieces)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": reason,
        }
        body = {**head, "object": "chat.completion", "choices": [choice], **extra}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body = {**head, "object": "text_completion", "choices": [choice], **extra}
    if isinstance(event, Done):
        body["usage"] = {"completion_tokens": event.tokens_generated}
    return JSONResponse(body)


async def _chunks(
    first: TextDelta | Done | Fault,
    events: AsyncGenerator[TextDelta | Done | Fault, None],
    head: dict[str, Any],
    chat: bool,
) -> AsyncGenerator[bytes, None]:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(text: str | None, reason: str | None, extra: dict[str, Any]) -> bytes:
        if chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        return sse({**head, "choices": [choice], **extra})

    try:
        if chat:
            role = {"role": "assistant", "content": ""}
            yield sse({**head, "choices": [{"index": 0, "delta": role, "finish_reason": None}]})
        # The text generated before this viewer came arrives first, in a burst.
        event = first
        while isinstance(event, TextDelta):
            yield chunk(event.text, None, {})
            event = await anext(events)
        reason, extra = finish_of(event)
        yield chunk(None, reason, extra)
        yield SSE_DONE
    finally:
        await events.aclose()
