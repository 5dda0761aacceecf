"""Re-attach through the gateway: ``GET /v1/chat/completions/{id}`` and
``GET /v1/completions/{id}`` return a completion of a run the gateway serves by the id
the gateway gave it (``chatcmpl-<run>-<request>``, ``cmpl-<run>-<request>``: the id names
the run), running or finished, from any client (``temporal.client.RunHandle.attach``).

Without ``?stream=true`` the answer waits for the prompt's end and is the completion
object; with it, server-sent events as ``POST`` streams them: the whole text so far in
one chunk, then the rest as it is generated, then the finish and ``[DONE]``. It only
reads: a viewer that goes away cancels nothing.

The text is the run's, cut at the original request's stop strings (they travel with the
prompt, ``SubmitPrompt.stop``, read back from its workflow's input): a viewer sees what
the original response returned, with ``finish_reason`` ``stop``, though the run generated
past the stop string until the gateway cancelled the prompt. A prompt that was cancelled
or faulted otherwise ends with ``finish_reason`` null and ``mvp_status`` saying why.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.client import Client

from mvp_core.models import Done, Fault, PromptInput, TextDelta
from temporal.client import PromptNotFound, PromptUnavailable, RunHandle
from workers.gateway.runs import RunSet
from workers.gateway.service import Gateway
from workers.gateway.stops import StopMatcher, cut_at_stop
from workers.gateway.streaming import EventStream
from workers.gateway.wire import SSE_DONE, ApiError, sse

log = logging.getLogger("mvp.gateway")

_ID = re.compile(r"^(chatcmpl|cmpl)-(\d{1,18})-(\d{1,18})$")


def not_found(message: str) -> ApiError:
    return ApiError(404, message, type="invalid_request_error", code="not_found")


def parse_id(raw: str, chat: bool) -> tuple[int, int]:
    """The run and request ids behind a completion id, or a 404 saying why not."""
    m = _ID.match(raw)
    kind = "chatcmpl" if chat else "cmpl"
    if m is None or m.group(1) != kind:
        raise not_found(f"No completion found with id '{raw[:80]}' (expected {kind}-RUN-REQUEST)")
    return int(m.group(2)), int(m.group(3))


def served_run(runs: RunSet, raw: str, run_id: int) -> Gateway:
    """The gateway of the run a completion id names, or a 404 naming the runs served."""
    gateway = runs.get(run_id)
    if gateway is None:
        served = ", ".join(str(g.run_id) for g in runs.gateways()) or "none"
        raise not_found(f"completion '{raw}' belongs to run {run_id}; this gateway serves {served}")
    return gateway


def finish_of(terminal: Done | Fault) -> tuple[str | None, dict[str, Any]]:
    """OpenAI's finish_reason, and our own status fields for a prompt that did not end
    by itself."""
    if isinstance(terminal, Done):
        return ("stop" if terminal.stop_reason == "eos" else "length"), {}
    status = "cancelled" if "cancel" in terminal.error else "faulted"
    return None, {"mvp_status": status, "mvp_error": terminal.error}


async def original_stops(client: Client, run: RunHandle, request_id: int) -> list[str]:
    """The stop strings of the request behind prompt ``request_id``: its workflow's input
    (``PromptInput.prompt.stop``), or for a run-hosted one what its run holds of it
    (DECISIONS 66); none when the prompt cannot be read back."""
    try:
        found = await run.locate(request_id)
        if found is None:
            return []
        if found.hosted:
            return await run.hosted_stops(request_id)
        wf_id = found.workflow_id
        async for event in client.get_workflow_handle(wf_id).fetch_history_events(page_size=1):
            payloads = event.workflow_execution_started_event_attributes.input.payloads
            (inp,) = await client.data_converter.decode(payloads, [PromptInput])
            return list(cast(PromptInput, inp).prompt.stop)
    except PromptUnavailable:
        raise  # without its stops the text could run past them: the caller's 503
    except Exception as err:  # an old prompt's input, a history no longer retained
        log.warning("stop strings of prompt %d: %s: %s", request_id, type(err).__name__, err)
    return []


@dataclass
class Viewed:
    """How a re-attached completion ends, as the original response ended."""

    reason: str | None
    extra: dict[str, Any] = field(default_factory=dict)
    completion_tokens: int | None = None
    final_text: str | None = None  # the run's whole text, when no stop string cut it


async def view(
    first: TextDelta | Done | Fault,
    events: AsyncIterator[TextDelta | Done | Fault],
    stops: list[str],
) -> AsyncIterator[str | Viewed]:
    """The prompt's text cut at the first of ``stops`` (as the original response was),
    then one Viewed."""
    matcher = StopMatcher(stops)
    tokens = 0
    event = first
    while isinstance(event, TextDelta):
        tokens += event.tokens or 0
        text, hit = matcher.push(event.text)
        if text:
            yield text
        if hit:
            yield Viewed("stop", completion_tokens=tokens)
            return
        event = await anext(events)
    tail = matcher.flush()
    if tail:
        yield tail
    reason, extra = finish_of(event)
    if isinstance(event, Done):
        yield Viewed(reason, extra, event.tokens_generated, event.final_text)
    else:
        yield Viewed(reason, extra)


def attach_routes(runs: RunSet) -> list[Route]:
    async def chat(request: Request) -> Response:
        return await retrieve(request, runs, chat=True)

    async def completion(request: Request) -> Response:
        return await retrieve(request, runs, chat=False)

    return [
        Route("/v1/chat/completions/{completion_id}", chat, methods=["GET"]),
        Route("/v1/completions/{completion_id}", completion, methods=["GET"]),
    ]


async def retrieve(request: Request, runs: RunSet, *, chat: bool) -> Response:
    ident = request.path_params["completion_id"]
    run_id, request_id = parse_id(ident, chat)
    gateway = served_run(runs, ident, run_id)
    served = await gateway.served()
    events = gateway.run.attach(request_id, poll_cooldown_ms=gateway.poll_cooldown_ms)
    try:
        first = await anext(events)
    except PromptNotFound:
        raise not_found(f"No completion found with id '{ident}'") from None
    except PromptUnavailable as err:
        raise _unavailable(err) from None
    try:
        stops = await original_stops(gateway.client, gateway.run, request_id)
    except PromptUnavailable as err:
        await events.aclose()
        raise _unavailable(err) from None
    head = {"id": ident, "created": int(time.time()), "model": served.id}
    if request.query_params.get("stream", "").lower() in ("1", "true"):

        async def nothing() -> None:
            return None  # a viewer that goes away cancels nothing

        return EventStream(_chunks(view(first, events, stops), events, head, chat), nothing)
    pieces: list[str] = []
    end: Viewed | None = None
    try:
        async for item in view(first, events, stops):
            if isinstance(item, str):
                pieces.append(item)
            else:
                end = item
    except PromptUnavailable as err:  # the run stopped answering midway: ask again later
        raise _unavailable(err) from None
    finally:
        await events.aclose()
    assert end is not None
    text = "".join(pieces)
    if end.final_text is not None and end.final_text != text:
        # The run's own text is the reference (the stream is its batched copy).
        text, hit = cut_at_stop(end.final_text, stops)
        if hit:
            end.reason, end.extra = "stop", {}
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": None,
            "finish_reason": end.reason,
        }
        body = {**head, "object": "chat.completion", "choices": [choice], **end.extra}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": end.reason}
        body = {**head, "object": "text_completion", "choices": [choice], **end.extra}
    if end.completion_tokens is not None:
        body["usage"] = {"completion_tokens": end.completion_tokens}
    return JSONResponse(body)


async def _chunks(
    viewed: AsyncIterator[str | Viewed],
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
        async for item in viewed:
            if isinstance(item, str):
                yield chunk(item, None, {})
            else:
                yield chunk(None, item.reason, item.extra)
        yield SSE_DONE
    except PromptUnavailable as err:
        # Headers are gone: the error travels as an event (the openai client raises it),
        # and a retrieve later gives the whole text again.
        yield sse(_unavailable(err).body())
    finally:
        await events.aclose()


def _unavailable(err: PromptUnavailable) -> ApiError:
    return ApiError(503, str(err), type="server_error", code="run_unavailable", retry_after_s=1)
