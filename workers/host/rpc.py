"""The prompt RPC of the process host (process spec 2.5, 7.8; CONTRACTS "Prompt RPC").

Newline-delimited JSON over TCP. A client sends ``{"request_id", "prompt_text",
"max_tokens"?}`` and reads ``text_delta`` events, then exactly one ``done`` or ``fault``.
The server is a host adapter: each request becomes the run's ``submit_prompt`` Update
(the run queues, orders and rejects), its text comes from the prompt's stream, a client
that goes away mid-prompt becomes ``cancel_prompt``. It decides nothing the run decides.

Per connection: one request in flight. A malformed line, a line over the size limit, or
a second request while one is in flight is a protocol error for that connection only: it
gets one ``fault`` naming the problem and is closed (its prompt, if any, cancelled);
other connections carry on. ``{"control": "shutdown"}`` asks the host to shut the run
down (answered ``{"type": "shutdown_accepted"}``).

Request ids: clients choose theirs freely, so two connections may both send id 1. The
run sees ids the server allots (unique for the host's lifetime), and each event goes
back with the client's own id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from temporalio.client import Client
from temporalio.service import RPCError

from mvp_core.models import Done, SubmitPrompt, TextDelta
from mvp_core.request_ids import RequestIds
from temporal.client import PromptRejected, RunHandle
from temporal.client.ends import STOP_COUNT_WAIT_S

log = logging.getLogger("mvp.host.rpc")

MAX_LINE_BYTES = 1 << 20  # a request line longer than this is a protocol error
_U64 = 2**64 - 1
_U32 = 2**32 - 1


class RpcRequest(BaseModel):
    """The wire request (untagged, CONTRACTS); ``max_tokens`` absent or 0: no cap of its
    own (the run's ``default_max_tokens`` applies). ``chat`` (ours, default false): the
    prompt is a user message under the model's chat template (docs/host.md)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    request_id: int = Field(ge=0, le=_U64)
    prompt_text: str
    max_tokens: int | None = Field(default=None, ge=0, le=_U32)
    chat: bool = False


class ProtocolError(Exception):
    pass


@dataclass(frozen=True)
class PromptObservation:
    """What the host's datastream records of a prompt (no prompt text, no reply text)."""

    phase: str  # received | admitted | rejected | first_delta | done | fault | cancelled
    request_id: int  # the run's id
    client_request_id: int
    connection: int
    detail: str = ""


def parse_line(line: bytes) -> RpcRequest | str:
    """A request, or ``"shutdown"`` for the control request; ProtocolError otherwise.
    The error names what is wrong, never the line's content."""
    try:
        value = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ProtocolError("malformed request: not a JSON object") from None
    if not isinstance(value, dict):
        raise ProtocolError("malformed request: not a JSON object")
    if "control" in value:
        if value == {"control": "shutdown"}:
            return "shutdown"
        raise ProtocolError('malformed control request: use {"control": "shutdown"}')
    try:
        return RpcRequest.model_validate(value)
    except ValidationError as err:
        fields = sorted({".".join(str(p) for p in e["loc"]) or "request" for e in err.errors()})
        raise ProtocolError(f"malformed request: invalid {', '.join(fields[:8])}") from None


class PromptRpcServer:
    def __init__(
        self,
        client: Client,
        run_id: int,
        *,
        on_shutdown: Callable[[], None],
        observe: Callable[[PromptObservation], None] = lambda _: None,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.run = RunHandle(client, run_id)
        self.on_shutdown = on_shutdown
        self.observe = observe
        self._server: asyncio.Server | None = None
        self._ids = RequestIds()  # the run's ids: unique per host, JavaScript-safe
        self._connections = 0
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve; returns the bound address (port 0 picks one)."""
        self._server = await asyncio.start_server(
            self._accept, host, port, limit=MAX_LINE_BYTES, reuse_address=True
        )
        sock = self._server.sockets[0].getsockname()
        return str(sock[0]), int(sock[1])

    async def close(self) -> None:
        """Stop accepting, end every connection (cancelling their prompts)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2):
                    await self._server.wait_closed()
        # Ends its clients had from the head node's end line are the run's before the
        # stop that follows (DECISIONS 95).
        with contextlib.suppress(Exception):
            await self.run.wait_ends_counted(STOP_COUNT_WAIT_S)

    # ------------------------------------------------------------------ connections
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self._connections += 1
        conn = self._connections
        try:
            await self._connection(conn, reader, writer)
        except asyncio.CancelledError:
            pass
        except Exception:  # one connection's failure never reaches the others
            log.exception("prompt RPC connection %d failed", conn)
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _connection(
        self, conn: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        active: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError as eof:
                    line = eof.partial
                    if not line.strip():
                        return  # the client went away (its prompt is cancelled below)
                except asyncio.LimitOverrunError:
                    await self._refuse(writer, None, f"request line over {MAX_LINE_BYTES} bytes")
                    return
                if not line.strip():
                    continue
                try:
                    request = parse_line(line)
                except ProtocolError as err:
                    await self._refuse(writer, None, str(err))
                    return
                if request == "shutdown":
                    self.on_shutdown()
                    await self._write(writer, {"type": "shutdown_accepted"})
                    continue
                assert isinstance(request, RpcRequest)
                if active is not None and not active.done():
                    await self._refuse(
                        writer,
                        request.request_id,
                        "a request is already in flight on this connection",
                    )
                    return
                active = asyncio.ensure_future(self._serve(conn, request, writer))
        finally:
            if active is not None and not active.done():
                active.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await active

    async def _serve(self, conn: int, request: RpcRequest, writer: asyncio.StreamWriter) -> None:
        run_rid = next(self._ids)
        cid = request.request_id

        def note(phase: str, detail: str = "") -> None:
            self.observe(PromptObservation(phase, run_rid, cid, conn, detail))

        note("received")
        prompt = SubmitPrompt(
            request_id=run_rid,
            prompt_text=request.prompt_text,
            max_tokens=request.max_tokens or None,
            chat=request.chat,
        )
        first = True
        ended = False  # a terminal event reached the client
        try:
            events = self.run.stream(prompt, on_admitted=lambda: note("admitted"))
            async with contextlib.aclosing(events):
                async for event in events:
                    if isinstance(event, TextDelta):
                        if first:
                            first = False
                            note("first_delta")
                        await self._write(
                            writer, {"type": "text_delta", "request_id": cid, "text": event.text}
                        )
                        continue
                    if isinstance(event, Done):
                        note("done", f"{event.tokens_generated} tokens, {event.stop_reason}")
                        terminal: dict[str, Any] = {
                            "type": "done",
                            "request_id": cid,
                            "final_text": event.final_text,
                            "tokens_generated": event.tokens_generated,
                            "elapsed_ms": event.elapsed_ms,
                            "stop_reason": event.stop_reason,
                        }
                    else:
                        note("fault", event.error)
                        terminal = {"type": "fault", "request_id": cid, "error": event.error}
                    ended = True
                    await self._write(writer, terminal)
        except PromptRejected as err:
            ended = True
            note("rejected", err.kind)
            await self._write(
                writer, {"type": "fault", "request_id": cid, "error": f"{err.kind}: {err}"}
            )
        except asyncio.CancelledError:
            note("cancelled", "client disconnected")
            raise
        except (ConnectionError, OSError):
            note("cancelled", "client disconnected")
        except Exception as err:  # the SDK's own (an RPC or update timeout, a lost run)
            log.warning("prompt %d: %s: %s", run_rid, type(err).__name__, err)
            note("fault", type(err).__name__)
            ended = True
            with contextlib.suppress(ConnectionError, OSError):
                await self._write(
                    writer,
                    {"type": "fault", "request_id": cid, "error": f"run unreachable: {err}"},
                )
        finally:
            # Whatever ended this handler before the prompt did (the client went away,
            # the host is closing, an SDK error mid-stream): the run ends the prompt.
            if not ended:
                await asyncio.shield(self._cancel(run_rid))

    async def _cancel(self, run_rid: int) -> None:
        # Once only: the stream, left before its end, has cancelled it already.
        with contextlib.suppress(RPCError, TimeoutError, asyncio.CancelledError):
            await self.run.cancel_prompt(run_rid)

    async def _refuse(self, writer: asyncio.StreamWriter, request_id: int | None, why: str) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await self._write(
                writer,
                {"type": "fault", "request_id": request_id, "error": f"protocol error: {why}"},
            )

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, event: dict[str, Any]) -> None:
        writer.write(json.dumps(event, ensure_ascii=False).encode() + b"\n")
        await writer.drain()
