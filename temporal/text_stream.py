"""The client half of a run's text stream (DECISIONS 63): a prompt's text deltas straight
from the run's head node, beside Temporal (workers/node/textpath.py is the node half).

A client on a host that holds the deployment's edge secret (``MVP_EDGE_SECRET``, or the
state directory's ``edge-secret``, as the orchestrator worker's providers use it) derives
the run's text-stream token from the run's snapshot, connects to the head node's
data-plane port with the data plane's handshake, names the prompt, and reads its deltas.
Only text comes this way, and the end: the prompt's one terminal event is Temporal's,
except that the end line of a prompt the node generated to its end in one go carries its
Done, the run's own (DECISIONS 95), so its reader need not ask the run for it.

A client without that secret reads the prompts it admitted itself, each with the random
key it admitted it with (``SubmitPrompt.text_key``, DECISIONS 80): its hello shows
TEXT_READER_TOKEN, its request the key, and the head node checks the key against the
prompt's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from mvp_core.edge_auth import (
    ANSWER,
    ANSWER_OK,
    ANSWER_RETRY,
    TEXT_READER_TOKEN,
    TEXT_STREAM_EDGE_ID,
    hello,
    read_edge_secret,
    text_stream_token,
)
from mvp_core.models import Done, TextDelta
from mvp_core.run_state import RunState

log = logging.getLogger("mvp.text_stream")

CONNECT_TIMEOUT_S = 5.0
MAX_LINE = 1 << 22  # a delta's JSON line: the text of one flush
# An early start's request line at most (the head node takes up to 4 MiB): a longer
# prompt is read without one (DECISIONS 103).
MAX_START_LINE = 1 << 20


class TextStreamError(Exception):
    """The stream could not be opened or broke off before its end; the message says why."""


class TextStreamRefused(TextStreamError):
    """The head node refused the handshake (this host's secret is not the run's)."""


class TextStreamUnreachable(TextStreamError):
    """The head node's address cannot be reached from here (no route, refused, slow)."""


class TextNotYet(TextStreamError):
    """Ask again a little later: a keyed reader's prompt is not on the head node yet
    (still queued), or the node serves as many keyed readers as it may."""


@dataclass(frozen=True)
class TextStreamTarget:
    host: str
    port: int
    token: str | None  # None: no secret here; a prompt is read with its own key


def target_of(
    state: RunState, run_workflow_id: str, secret: bytes | None
) -> TextStreamTarget | None:
    """Where the run's head node serves its text stream, and its token (None without the
    deployment's secret: keyed readers only); None before the head node has reported its
    endpoint."""
    if not state.nodes:
        return None
    head = min(state.nodes, key=lambda n: n.stage_index)
    if head.runtime_ready is None:
        return None
    host, sep, port = head.runtime_ready.endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return None
    token = None if secret is None else text_stream_token(secret, run_workflow_id, state.nonce)
    return TextStreamTarget(host.strip("[]"), int(port), token)


def host_secret() -> bytes | None:
    """This host's edge secret, as a client may read it (None: no direct stream here)."""
    return read_edge_secret()


async def _connect(target: TextStreamTarget) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            return await asyncio.open_connection(target.host, target.port, limit=MAX_LINE)
    except (OSError, TimeoutError) as err:
        raise TextStreamUnreachable(
            f"cannot connect to {target.host}:{target.port}: {err or type(err).__name__}"
        ) from None


async def probe(target: TextStreamTarget) -> None:
    """Whether the head node's text stream can be reached from here, before any prompt:
    TextStreamUnreachable where it cannot connect (why), else nothing. It shows the
    public TEXT_READER_TOKEN (never the run's token: no secret leaves for a probe), reads
    the node's answer and leaves before its request line, which the node takes quietly
    (a keyed reader's refusal is logged at debug level, DECISIONS 80)."""
    reader, writer = await _connect(target)
    try:
        writer.write(hello(TEXT_STREAM_EDGE_ID, TEXT_READER_TOKEN))
        await writer.drain()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            await reader.readexactly(ANSWER.size)
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as err:
        raise TextStreamError(f"text stream handshake failed: {err!r}") from None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def read_text(
    target: TextStreamTarget,
    prompt_workflow_id: str,
    start: int = 0,
    key: str | None = None,
    on_terminal: Callable[[Done], None] | None = None,
    early: dict[str, Any] | None = None,
) -> AsyncGenerator[TextDelta, None]:
    """The prompt's deltas from the ``start``-th; returns at the node's end line. Raises
    TextStreamError when the stream cannot be opened or breaks off before its end. Without
    the run's token (no secret here) the reader shows ``key``, the prompt's ``text_key``.
    ``on_terminal`` gets the prompt's Done where the end line carries it (DECISIONS 95).
    ``early``: the prompt to start now, before its generate comes (a reader with the
    run's token only; DECISIONS 103): ``{"prompt": SubmitPrompt, "max_new_tokens": n}``,
    sent with the request where that line stays within MAX_START_LINE."""
    if key is None and target.token is None:
        raise TextStreamError("no text-stream token here and no key for this prompt")
    reader, writer = await _connect(target)
    try:
        try:
            writer.write(hello(TEXT_STREAM_EDGE_ID, target.token or TEXT_READER_TOKEN))
            await writer.drain()
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                answer = await reader.readexactly(ANSWER.size)
            status, size = ANSWER.unpack(answer)
            reason = (await reader.readexactly(size)).decode(errors="replace") if size else ""
            if status == ANSWER_RETRY:
                raise TextNotYet(f"the head node is busy: {reason}")
            if status != ANSWER_OK:
                raise TextStreamRefused(f"the head node refused the text stream: {reason}")
            request: dict[str, object] = {"prompt_workflow_id": prompt_workflow_id, "from": start}
            if target.token is None:
                request["key"] = key
            line = json.dumps(request).encode()
            if early is not None and target.token is not None:
                started = json.dumps({**request, "start": early}).encode()
                line = started if len(started) < MAX_START_LINE else line
            writer.write(line + b"\n")
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as err:
            raise TextStreamError(f"text stream handshake failed: {err!r}") from None
        while True:
            try:
                line = await reader.readline()
            except (OSError, ValueError) as err:  # ValueError: a line past MAX_LINE
                raise TextStreamError(f"text stream broke off: {err!r}") from None
            if not line.endswith(b"\n"):
                raise TextStreamError("text stream closed before its end")
            try:
                event = json.loads(line)
                kind = event.get("type")
                if kind == "end":
                    if on_terminal is not None and (done := _terminal(event)) is not None:
                        on_terminal(done)
                    return
                if kind == "error":
                    why = f"the head node: {event.get('error')}"
                    raise TextNotYet(why) if event.get("retry") is True else TextStreamError(why)
                delta = TextDelta.model_validate(event)
            except (ValueError, AttributeError) as err:
                raise TextStreamError(f"bad line from the head node: {err}") from None
            yield delta
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def _terminal(end: dict[str, Any]) -> Done | None:
    """The Done an end line carries; None where it carries none, or none that reads as a
    Done (the reader then asks the run for the end, as without one)."""
    raw = end.get("terminal")
    if raw is None:
        return None
    try:
        return Done.model_validate(raw)
    except ValueError:
        log.info("the head node's end line carries no valid Done: ignored")
        return None
