"""The text path of a prompt on its head node: tokens -> text -> the prompt's readers.

- ``Detokenizer`` (the engine's thread): each generated token to the text it completes,
  and the whole text for the terminal event.
- ``TextPipe``: that text from the engine's thread to the generate activity's event loop,
  woken at most once per batch.
- ``TextFanout`` (the event loop): each delta to the node's text stream at once, and to
  the prompt workflow's stream (Temporal) only while no client reads it directly
  (``NoTemporalText`` where the prompt has no workflow stream: DECISIONS 66).
- ``TextHub``: the head node's text stream, each prompt's deltas straight to the clients
  that read them, beside Temporal (DECISIONS 63).

The text stream: a client on a host with the deployment's edge secret connects to the
node's data-plane port with the text-stream token (mvp_core.edge_auth), names a prompt
by its workflow id, and reads the prompt's deltas as JSON lines (``TextDelta``) from the
first one, then ``{"type": "end"}`` once the node has made its last text. A client
without the secret shows TEXT_READER_TOKEN and, in its request, the key its prompt was
admitted with (``SubmitPrompt.text_key``, DECISIONS 80): it is held until the prompt is
on this node (at most KEYED_WAIT_S), then served if the key is the prompt's. The prompt's
one terminal event comes from Temporal (the Update's or the prompt workflow's result),
except that a prompt the node generated to its end in one go, as the run serves it, has
its Done in the end line (``"terminal"``: the run's own, DECISIONS 95) and its reader
need not ask the run. A client that loses the stream falls back to the prompt
workflow's stream and the result. While a client reads a prompt here, the node
publishes nothing of its text to Temporal (the run's history stays a few events per
prompt whatever its length); when the last reader leaves, the node publishes the text it
owes at once and then as before.

Nothing here imports the engine or torch (the agent imports them in the background).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from mvp_core.models import Done, TextDelta, TokenLogprob, TopLogprob
from workers.node.dataplane.sockets import readable_now

if TYPE_CHECKING:
    from workers.node.dataplane.records import TokenLogprobs
    from workers.node.engine.tokenizer import Tokenizer

__all__ = [
    "END_LINE",
    "Detokenizer",
    "NoTemporalText",
    "TextFanout",
    "TextHub",
    "TextPipe",
    "TextRequestError",
]

log = logging.getLogger("mvp.textstream")

# ------------------------------------------------------------------ detokenise


class Detokenizer:
    """Generated tokens -> text: each complete piece goes to ``on_text`` as it forms, and
    the whole is kept for the terminal event. ``logprobs``: a list that gets one entry per
    generated token, its logprobs with its and its alternatives' texts (None for a token
    that came without: one resumed after a stage recovery); None: not asked for."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        on_text: Callable[[str, int], None],
        quiet: int = 0,
        ids: list[int] | None = None,
        logprobs: list[TokenLogprob | None] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self.logprobs = logprobs
        self._decoder = tokenizer.incremental_decoder()
        self._on_text = on_text
        self._pieces: list[str] = []
        self._quiet = quiet  # the text of the first ``quiet`` tokens, the reader has it
        self.ids: list[int] = ids if ids is not None else []  # the generated tokens
        self.tokens = 0
        self.first_at: float | None = None  # perf_counter of the first token

    def _emit(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            if self.tokens > self._quiet:
                self._on_text(piece, self.tokens)

    def prime(self, tokens: Sequence[int]) -> None:
        """Tokens generated before (a resumed prompt): their text is the result's, and
        goes to ``on_text`` only past what the reader has."""
        for token in tokens:
            self.ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append(None)
            self.tokens += 1
            self._emit(self._decoder.push(token))

    def push(self, token: int, logprobs: TokenLogprobs | None = None) -> None:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(None if logprobs is None else self._entry(token, logprobs))
        self.tokens += 1
        self._emit(self._decoder.push(token))

    def _top(self, token: int, logprob: float) -> TopLogprob:
        raw = self._tokenizer.token_to_bytes(token)
        return TopLogprob(token=raw.decode("utf-8", "replace"), logprob=logprob, bytes=list(raw))

    def _entry(self, token: int, lp: TokenLogprobs) -> TokenLogprob:
        """OpenAI's shape: each token's text is its own bytes (as UTF-8)."""
        top = [self._top(t, v) for t, v in lp.top]
        return TokenLogprob(**self._top(token, lp.logprob).model_dump(), top_logprobs=top)

    def finish(self) -> str:
        self._emit(self._decoder.flush())
        return "".join(self._pieces)


# ------------------------------------------------------------------ pipe


class TextPipe:
    """Text from the engine thread to the event loop, woken at most once per batch.

    The engine thread appends; it wakes the loop only when the loop has taken everything
    before, so a fast token loop costs one wake-up per batch, not one per token.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pieces: list[str] = []
        self._tokens = 0  # generated tokens whose text was put
        self.tokens_taken = 0  # ... of the text taken so far
        self._closed = False
        self._ready = asyncio.Event()
        self._signalled = False

    def _wake(self) -> None:
        if not self._signalled:
            self._signalled = True
            self._loop.call_soon_threadsafe(self._ready.set)

    def put(self, piece: str, tokens: int | None = None) -> None:
        """Append ``piece``; ``tokens``: the generated tokens whose text is complete with it."""
        with self._lock:
            self._pieces.append(piece)
            if tokens is not None:
                self._tokens = tokens
            self._wake()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake()

    async def take(self, quiet_s: float) -> str | None:
        """The text since the last take ("" after ``quiet_s`` without text); None at the end.
        ``tokens_taken`` then counts the tokens of all the text taken."""
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the inner result
        # when a cancel comes in the same turn, and the activity's one cancel is lost.
        try:
            async with asyncio.timeout(quiet_s):
                await self._ready.wait()
        except TimeoutError:
            return ""
        with self._lock:
            text, self._pieces = "".join(self._pieces), []
            self.tokens_taken = self._tokens
            if self._closed:
                return text or None  # the event stays set: the next take ends at once
            self._ready.clear()
            self._signalled = False
            return text


# ------------------------------------------------------------------ fan-out


class TextFanout:
    """A prompt's text deltas: each to the head node's text stream at once, and to the
    prompt workflow's stream (Temporal) only while no client reads it directly; what a
    direct reader took is owed to Temporal and published in one delta as soon as no one
    reads directly any more (DECISIONS 63)."""

    def __init__(self, hub: TextHub, key: str, topic: Any, reader_key: str | None = None) -> None:
        self.hub, self.key, self.topic = hub, key, topic
        self.first_at: float | None = None  # perf_counter: the first delta went out
        self._owed: list[TextDelta] = []
        hub.open(key, reader_key)

    def put(self, delta: TextDelta) -> None:
        first = self.first_at is None
        if first:
            self.first_at = time.perf_counter()
        self.hub.put(self.key, delta)
        if self.hub.readers(self.key):
            self._owed.append(delta)
            return
        # The first delta goes out at once: it is the time to first text.
        self.topic.publish(self._settle(delta), force_flush=first)

    def _settle(self, delta: TextDelta | None = None) -> TextDelta:
        """The owed deltas and ``delta`` as one."""
        parts = [*self._owed, *([delta] if delta is not None else [])]
        self._owed = []
        counts = [p.prompt_tokens for p in parts if p.prompt_tokens is not None]
        cached = [p.cached_tokens for p in parts if p.cached_tokens is not None]
        has_logprobs = any(p.logprobs is not None for p in parts)
        return TextDelta(
            request_id=parts[0].request_id,
            text="".join(p.text for p in parts),
            tokens=sum(p.tokens or 0 for p in parts),
            prompt_tokens=counts[0] if counts else None,
            cached_tokens=cached[0] if cached else None,
            logprobs=[e for p in parts for e in p.logprobs or ()] if has_logprobs else None,
        )

    def end(self, *, done: bool, terminal: Done | None = None) -> None:
        """No more text: direct readers get the end (with ``terminal``, the prompt's Done
        where the node's is the run's: DECISIONS 95); an unfinished prompt's owed text
        goes to Temporal (a finished one's is in its Done)."""
        self.hub.end(self.key, terminal)
        if self._owed and not done:
            self.topic.publish(self._settle())
        self._owed = []


class NoTemporalText:
    """The Temporal side of a run-hosted prompt's text: none. Its direct readers get every
    delta from the head node; a client that cannot read there gets the whole text with
    the terminal event (DECISIONS 66)."""

    def topic(self, name: str, *, type: Any = None) -> NoTemporalText:
        return self

    def publish(self, item: Any, *, force_flush: bool = False) -> None:
        pass

    async def flush(self) -> None:
        pass

    async def __aenter__(self) -> NoTemporalText:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


# ------------------------------------------------------------------ the text stream

END_LINE = b'{"type":"end"}\n'
# An end line carries its prompt's Done only up to this size (the whole text is in it);
# a longer one is a plain end, and the reader asks the run for the end as before.
MAX_TERMINAL_LINE = 1 << 20
MAX_REQUEST = 4096  # bytes of a client's one request line
# ... of one with the run's text-stream token, which may carry its prompt (an early
# start, DECISIONS 103): a long prompt's text.
MAX_START_REQUEST = 4 << 20
REQUEST_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 30.0  # a client that takes no text this long is dropped
LINGER_S = 60.0  # an ended prompt's text stays readable this long
# A keyed reader waits this long for its prompt to be on this node (a queued prompt's
# client connects at admission), then is told to ask again.
KEYED_WAIT_S = 120.0
READER_KEY = re.compile(r"[0-9a-f]{32}")


class TextRequestError(ValueError):
    """A client's request line is not one this stream serves; the message says why.
    ``retry``: the client may ask again (its prompt is not on this node yet)."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


@dataclass
class _Text:
    lines: list[bytes] = field(default_factory=list)  # one JSON line per delta
    ended_at: float | None = None
    reader_key: bytes | None = None  # the key a keyed reader must show (DECISIONS 80)
    end_line: bytes = END_LINE


class EarlyStartSink(Protocol):
    """Where a reader's ``start`` goes (workers/node/early.py, DECISIONS 103)."""

    def offer(self, key: str, raw: object) -> object: ...

    def left(self, key: str, ticket: object) -> None: ...


class TextHub:
    """Every prompt this node generates (by prompt workflow id): its deltas so far, and
    how many clients read it. ``early``: where a reader with the run's token may start
    its prompt before the prompt's generate comes (None: such a start is ignored)."""

    def __init__(self, linger_s: float = LINGER_S) -> None:
        self.linger_s = linger_s
        self.early: EarlyStartSink | None = None
        self._cond = threading.Condition()
        self._texts: dict[str, _Text] = {}
        self._readers: dict[str, int] = {}
        self._closed = False

    # ------------------------------------------------------------------ the generate side
    def open(self, key: str, reader_key: str | None = None) -> None:
        with self._cond:
            self._prune()
            self._texts[key] = _Text(reader_key=reader_key.encode() if reader_key else None)
            self._cond.notify_all()

    def put(self, key: str, delta: TextDelta) -> None:
        line = delta.model_dump_json(exclude_none=True).encode() + b"\n"
        with self._cond:
            text = self._texts.get(key)
            if text is not None and text.ended_at is None:
                text.lines.append(line)
                self._cond.notify_all()

    def end(self, key: str, terminal: Done | None = None) -> None:
        line = END_LINE if terminal is None else end_line(terminal)
        with self._cond:
            text = self._texts.get(key)
            if text is not None and text.ended_at is None:
                text.ended_at = time.monotonic()
                text.end_line = line
                self._cond.notify_all()

    def readers(self, key: str) -> int:
        with self._cond:
            return self._readers.get(key, 0)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _prune(self) -> None:
        now = time.monotonic()
        for key in [
            k
            for k, t in self._texts.items()
            if t.ended_at is not None and now - t.ended_at > self.linger_s
        ]:
            del self._texts[key]

    # ------------------------------------------------------------------ the client side
    def serve(self, sock: socket.socket, peer: str, keyed: bool = False) -> None:
        """One authenticated client (DataPlaneServer.serve_text): its request line, then
        the prompt's deltas from the one it asks for, then the end line. ``keyed``: it
        showed no text-stream token, and is served only once its request's key is the
        prompt's (DECISIONS 80); it counts as a reader from then on."""
        ticket: object | None = None
        try:
            key, start, shown, early = _read_request(sock, keyed)
            if keyed:
                self._check_key(sock, key, shown)
        except TextRequestError as err:
            # A keyed reader needs no secret to get here: its refusal is no alarm, and
            # what it sent is quoted, never written as it came.
            level = logging.DEBUG if keyed else logging.WARNING
            log.log(level, "text stream: refused %s: %r", peer, str(err))
            line = {"type": "error", "error": str(err)} | ({"retry": True} if err.retry else {})
            _send(sock, json.dumps(line).encode() + b"\n")
            return
        if early is not None and self.early is not None:
            # A start is advice (DECISIONS 103): one that is wrong is said here, and the
            # reader reads its prompt all the same, once its generate opened it.
            try:
                ticket = self.early.offer(key, early)
            except TextRequestError as err:
                log.warning("text stream: %s: early start refused: %s", peer, err)
        with self._cond:
            self._readers[key] = self._readers.get(key, 0) + 1
        try:
            self._stream(sock, key, start)
        finally:
            if ticket is not None and self.early is not None:
                self.early.left(key, ticket)  # a no-op once its generate adopted it
            with self._cond:
                left = self._readers[key] - 1
                if left:
                    self._readers[key] = left
                else:
                    del self._readers[key]

    def _check_key(self, sock: socket.socket, key: str, shown: bytes) -> None:
        """Wait until prompt ``key`` is on this node (KEYED_WAIT_S at most, while the
        reader stays), then check that ``shown`` is its reader key: TextRequestError
        where it is not, or the prompt never came."""
        deadline = time.monotonic() + KEYED_WAIT_S
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or key in self._texts,
                    timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                )
                text = self._texts.get(key)
                closed = self._closed
            if text is not None:
                if text.reader_key is None or not hmac.compare_digest(shown, text.reader_key):
                    raise TextRequestError(f"wrong key for prompt {key!r}")
                return
            if closed:
                raise TextRequestError("this node's text stream is closed")
            if time.monotonic() >= deadline:
                raise TextRequestError(f"prompt {key!r} is not on this node yet", retry=True)
            if _peer_gone(sock):
                raise TextRequestError("left before its prompt came")

    def _stream(self, sock: socket.socket, key: str, pos: int) -> None:
        while True:
            with self._cond:

                def ready(at: int = pos) -> bool:
                    return self._closed or self._news(key, at)

                self._cond.wait_for(ready, timeout=1.0)
                if self._closed:
                    return
                text = self._texts.get(key)
                lines = text.lines[pos:] if text is not None else []
                ended = text is not None and text.ended_at is not None
                last = text.end_line if text is not None else END_LINE
            if lines:
                _send(sock, b"".join(lines))
                pos += len(lines)
            elif ended:
                _send(sock, last)
                return
            elif _peer_gone(sock):
                return

    def _news(self, key: str, pos: int) -> bool:
        text = self._texts.get(key)
        return text is not None and (len(text.lines) > pos or text.ended_at is not None)


def end_line(terminal: Done) -> bytes:
    """The end line with the prompt's Done: ``{"type": "end", "terminal": {...}}``, or a
    plain end where that would be longer than MAX_TERMINAL_LINE."""
    line = b'{"type":"end","terminal":' + terminal.model_dump_json().encode() + b"}\n"
    return line if len(line) <= MAX_TERMINAL_LINE else END_LINE


def _read_request(
    sock: socket.socket, keyed: bool = False
) -> tuple[str, int, bytes, object | None]:
    """``{"prompt_workflow_id": str, "from": int}``: which prompt, from which delta; a
    keyed reader's with ``"key"``, 32 lowercase hex digits (returned as bytes; b"" for a
    reader with the text-stream token); a reader with the token's may carry ``"start"``,
    its prompt to start early (returned as it came, checked by the early starts)."""
    limit = MAX_REQUEST if keyed else MAX_START_REQUEST
    sock.settimeout(REQUEST_TIMEOUT_S)
    data = b""
    while b"\n" not in data:
        try:
            chunk = sock.recv(min(1 << 16, limit + 1 - len(data)))
        except TimeoutError:
            raise TextRequestError("no request line within 10 s") from None
        if not chunk:
            raise TextRequestError("closed before its request line")
        data += chunk
        if len(data) > limit:
            raise TextRequestError(f"request line longer than {limit} bytes")
    try:
        req = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        raise TextRequestError("request line is not JSON") from None
    if not isinstance(req, dict):
        raise TextRequestError("request line is not a JSON object")
    key, start = req.get("prompt_workflow_id"), req.get("from", 0)
    if not isinstance(key, str) or not key or len(key) > 1000:
        raise TextRequestError("prompt_workflow_id must be a non-empty string")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise TextRequestError("from must be a non-negative integer")
    shown = b""
    if keyed:
        reader_key = req.get("key")
        if not isinstance(reader_key, str) or not READER_KEY.fullmatch(reader_key):
            raise TextRequestError("key must be the prompt's key: 32 lowercase hex digits")
        shown = reader_key.encode()
    early = req.get("start")
    if early is not None and keyed:
        raise TextRequestError("start needs the run's text-stream token, not a prompt's key")
    sock.settimeout(SEND_TIMEOUT_S)
    return key, start, shown, early


def _send(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)


def _peer_gone(sock: socket.socket) -> bool:
    """The client closed its end (it sends nothing after its request)."""
    try:
        if not readable_now(sock):
            return False
        return sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True
