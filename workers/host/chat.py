"""Chat with a run from a terminal.

``mvp-chat [--rpc HOST:PORT]`` talks to a running ``mvp-orchestrator`` over its prompt
RPC (default 127.0.0.1:19777), as the original chat wrapper did: ``prompt:> ``, the
reply's text as it arrives, ``error: <msg>`` on a fault. ``mvp-chat --run-id N`` talks
to run N through Temporal instead. Either way each line goes under the model's chat
template unless ``--raw``, and each reply ends with its token count and stop reason.
``--max-tokens 0`` means until the end (the end token or the planned context), as in
the demo; without ``--max-tokens`` the run's ``default_max_tokens`` applies.

Every line read from standard input is one prompt. The run keeps no conversation: each
line stands on its own. Ctrl-C during a reply cancels that prompt and the session goes
on to the next one (over the RPC: the connection closes, the host cancels its prompt,
and the next prompt opens another); end with EOF (Ctrl-D), ``/quit`` or Ctrl-C at the
prompt. SIGTERM cancels a reply too, then ends the session.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Awaitable
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import Done, Fault, RunPhase, SubmitPrompt, TextDelta
from temporal import telemetry
from temporal.client import PromptRejected, RunHandle, RunNotOpen
from temporal.connect import DEFAULT_ADDRESS, TemporalConnectError, TemporalSettings, connect
from workers import stdio

PROMPT = "prompt:> "
DEFAULT_RPC = "127.0.0.1:19777"
QUIT = "/quit"
# A duplicate id belongs to a prompt another client has in the run's queue (at most 8).
MAX_ID_TRIES = 9
# --max-tokens 0: the largest cap a prompt can carry (u32), which only the end token or
# the planned context reaches. The wire's own 0 means "the run's default" (CONTRACTS).
UNTIL_THE_END = 2**32 - 1


def max_tokens_of(value: int | None) -> int | None:
    """``--max-tokens`` as a prompt carries it: None = the run's default, 0 = no cap."""
    return UNTIL_THE_END if value == 0 else value


def done_line(tokens: int, stop_reason: object, elapsed_ms: object) -> str:
    return f"\n[{tokens} tokens, stopped by {stop_reason}, {elapsed_ms} ms]"


class ChatError(Exception):
    """Why mvp-chat cannot start, in words for stderr; it exits with 1."""


async def open_run(client: Client, run_id: int, address: str) -> RunHandle:
    """The run's handle, once it is known to exist and to be open."""
    handle = RunHandle(client, run_id)
    try:
        await handle.check_open(address)
    except RunNotOpen as err:
        raise ChatError(str(err)) from None
    state = await handle.try_snapshot()
    if state is not None and state.phase is not RunPhase.PROMPT_READY:
        say(
            f"note: run {handle.workflow_id} is {state.phase.value}; it rejects prompts until "
            "it is prompt_ready"
        )
    return handle


class Chat:
    """The conversation loop: lines in, streamed replies out."""

    def __init__(self, run: RunHandle, args: argparse.Namespace) -> None:
        self.run = run
        self.run_id = run.run_id
        self.max_tokens = max_tokens_of(args.max_tokens)
        self.chat = not args.raw
        self.next_id = 1
        self.in_flight: int | None = None

    async def reply(self, text: str) -> None:
        """Submit one prompt and print its reply as it streams, then how it ended."""
        for _ in range(MAX_ID_TRIES):
            request_id, self.next_id = self.next_id, self.next_id + 1
            prompt = SubmitPrompt(
                request_id=request_id,
                prompt_text=text,
                max_tokens=self.max_tokens,
                chat=self.chat,
            )
            self.in_flight = request_id  # kept when cancelled: the prompt to cancel
            try:
                await self._stream(prompt)
                self.in_flight = None
                return
            except PromptRejected as err:
                self.in_flight = None
                if err.kind != ErrorType.DUPLICATE_REQUEST_ID:
                    print(f"rejected ({err.kind}): {err}", flush=True)
                    return
            except RPCError as err:  # e.g. the run has ended, or the server is gone
                raise ChatError(f"lost run {names.run_workflow_id(self.run_id)}: {err}") from None
        print(f"rejected: request ids up to {self.next_id - 1} are all in use", flush=True)

    async def _stream(self, prompt: SubmitPrompt) -> None:
        # One trace per prompt (when tracing is on): the Temporal spans nest under it.
        with telemetry.current().span(
            "mvp-chat prompt", run_id=self.run_id, request_id=prompt.request_id
        ):
            await self._print(prompt)

    async def _print(self, prompt: SubmitPrompt) -> None:
        async with contextlib.aclosing(self.run.stream(prompt)) as events:
            async for event in events:
                self._show(event)

    @staticmethod
    def _show(event: TextDelta | Done | Fault) -> None:
        if isinstance(event, TextDelta):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, Done):
            telemetry.note_prompt_end(event.tokens_generated, event.stop_reason)
            print(
                done_line(event.tokens_generated, event.stop_reason, event.elapsed_ms), flush=True
            )
        else:
            print(f"\nerror: {event.error}", flush=True)

    async def cancel(self, request_id: int) -> None:
        """Tell the run the client is going away: it ends the prompt with a Fault."""
        await self.run.cancel_prompt(request_id)  # nothing twice: the stream may have


class RpcChat:
    """The conversation loop over the prompt RPC (CONTRACTS "Prompt RPC")."""

    def __init__(self, host: str, port: int, max_tokens: int | None, chat: bool) -> None:
        self.host, self.port = host, port
        self.max_tokens = max_tokens_of(max_tokens)
        self.chat = chat
        self.next_id = 1
        self.in_flight: int | None = None
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def connect(self) -> None:
        try:
            self._conn = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        except OSError as err:
            raise ChatError(
                f"cannot reach the prompt RPC at {self.host}:{self.port}: {err.strerror or err} "
                "(is mvp-orchestrator running and prompt-ready?)"
            ) from None

    async def reply(self, text: str) -> None:
        if self._conn is None:
            await self.connect()
        assert self._conn is not None
        reader, writer = self._conn
        request_id, self.next_id = self.next_id, self.next_id + 1
        request: dict[str, Any] = {"request_id": request_id, "prompt_text": text}
        if self.max_tokens is not None:
            request["max_tokens"] = self.max_tokens
        if self.chat:
            request["chat"] = True
        self.in_flight = request_id
        writer.write(json.dumps(request).encode() + b"\n")
        await writer.drain()
        while True:
            line = await reader.readline()
            if not line:
                self._conn = None
                raise ChatError("the prompt RPC closed the connection (the run has stopped?)")
            event = json.loads(line)
            kind = event.get("type")
            if kind == "text_delta":
                sys.stdout.write(str(event.get("text", "")))
                sys.stdout.flush()
            elif kind == "done":
                print(
                    done_line(
                        int(event.get("tokens_generated", 0)),
                        event.get("stop_reason", "?"),
                        event.get("elapsed_ms", "?"),
                    ),
                    flush=True,
                )
                break
            elif kind == "fault":
                print(f"\nerror: {event.get('error')}", flush=True)
                if event.get("request_id") is None:  # a protocol error closes the connection
                    self._conn = None
                break
        self.in_flight = None

    async def cancel(self, request_id: int) -> None:
        """Going away mid-reply: the host cancels the prompt of a closed connection."""
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


def run_turn(loop: asyncio.AbstractEventLoop, chat: Chat | RpcChat, text: str) -> int | None:
    """One prompt on the loop. Ctrl-C cancels it and the session goes on (None); SIGTERM
    cancels it and ends the session (its exit code). None when it ran to its end."""
    turn = loop.create_task(chat.reply(text))
    interrupted: list[int] = []

    def on_signal(sig: int) -> None:
        interrupted.append(sig)
        turn.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(turn)
    except Exception:
        # An interrupt may surface as the SDK's own error (an update RPC "cancelled").
        if not interrupted:
            raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if not interrupted:
        return None
    request_id = chat.in_flight
    chat.in_flight = None
    if request_id is not None:
        # (A second Ctrl-C meanwhile raises KeyboardInterrupt: the session ends.)
        with contextlib.suppress(RPCError, TimeoutError):
            loop.run_until_complete(_within(chat.cancel(request_id), 5))
        print(f"\ncancelled request {request_id}", flush=True)
    return None if interrupted[0] == signal.SIGINT else 128 + interrupted[0]


def read_line(tty: bool) -> str | None:
    """The next line, None at EOF. Read here, off the loop, so that a terminal gets line
    editing; Ctrl-C raises KeyboardInterrupt as usual."""
    try:
        return input(PROMPT if tty else "")
    except EOFError:
        if tty:
            print(flush=True)
        return None


def converse(loop: asyncio.AbstractEventLoop, chat: Chat | RpcChat) -> int:
    tty = sys.stdin.isatty()
    if tty:
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
    try:
        while (line := read_line(tty)) is not None:
            text = line.strip()
            if text == QUIT:
                break
            if text and (code := run_turn(loop, chat, text)) is not None:
                return code
    except KeyboardInterrupt:
        print(flush=True)
        return 130
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mvp-chat",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--rpc",
        default=DEFAULT_RPC,
        metavar="HOST:PORT",
        help="the prompt RPC of a running mvp-orchestrator (default: %(default)s)",
    )
    p.add_argument(
        "--run-id",
        type=int,
        default=None,
        help="talk to run mvp-run-<id> through Temporal instead of the prompt RPC",
    )
    p.add_argument(
        "--address",
        default=None,
        help="Temporal frontend HOST:PORT (default: $TEMPORAL_ADDRESS or the envconfig "
        f"profile's, else {DEFAULT_ADDRESS}; TLS, API key and namespace from the same "
        "settings: docs/temporal-connection.md)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most tokens per reply; 0 = until the end token or the context end "
        "(default: the run's default_max_tokens)",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send lines as plain completions, without the model's chat template",
    )
    return p


def say(message: str) -> None:
    print(message, flush=True)


def main() -> None:
    stdio.install()  # a reader gone from a pipe of ours never stops mvp-chat's exit
    args = parser().parse_args()
    address = args.address or "the configured address"
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    code = 1
    try:
        if args.run_id is None:
            host, _, port = args.rpc.rpartition(":")
            if not host or not port.isdigit():
                raise ChatError(f"invalid --rpc {args.rpc!r}: use HOST:PORT")
            rpc = RpcChat(host.strip("[]"), int(port), args.max_tokens, chat=not args.raw)
            loop.run_until_complete(rpc.connect())
            code = converse(loop, rpc)
        else:
            telemetry.setup("mvp-chat")
            settings = TemporalSettings.load().override(args.address)
            address = settings.address
            client = loop.run_until_complete(connect(settings=settings))
            run = loop.run_until_complete(open_run(client, args.run_id, address))
            code = converse(loop, Chat(run, args))
    except (ChatError, TemporalConnectError, telemetry.TelemetryConfigError) as err:
        print(f"mvp-chat: {err}", file=sys.stderr)
    except RuntimeError as err:  # the SDK's connection failure
        print(f"mvp-chat: cannot reach Temporal at {address}: {err}", file=sys.stderr)
    except KeyboardInterrupt:  # while connecting
        code = 130
    finally:
        telemetry.current().close()
        loop.run_until_complete(_cancel_rest())
        loop.close()
    # Exit without interpreter finalisation: an RPC cancelled by Ctrl-C can leave a
    # callback of the SDK's native runtime in flight, and finalising under it aborts the
    # process (SIGABRT in PyGILState_Release) instead of exiting 130.
    sys.stdout.flush()  # (SafeStreams: they never raise)
    sys.stderr.flush()
    os._exit(code)


async def _within(work: Awaitable[None], seconds: float) -> None:
    async with asyncio.timeout(seconds):
        await work


async def _cancel_rest() -> None:
    """Tasks left behind by an interrupted prompt (e.g. its pending result)."""
    rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


if __name__ == "__main__":
    main()
