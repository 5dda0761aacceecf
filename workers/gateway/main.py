"""``mvp-gateway``: an OpenAI-compatible HTTP API over one run or several.

    mvp-gateway --workflow-id mvp-run-7                       # serve a run that exists
    mvp-gateway --workflow-id mvp-run-7 --workflow-id mvp-run-8=smol-b  # several (alias)
    mvp-gateway --run-request docs/examples/run-pipeline.json # start run 1 and serve it

It connects to Temporal at ``$TEMPORAL_ADDRESS`` (default localhost:7233), where an
orchestrator worker must be running. With ``--run-request`` it starts run ``--run-id``
(default 1) and, on SIGINT or SIGTERM, asks it to shut down (``request_shutdown``) and
waits for it to close; with ``--workflow-id`` it leaves the run as it is. The API is at
``http://HOST:PORT/v1`` (docs/gateway.md); until the run is prompt-ready it answers 503.
A request goes to the run its ``model`` names (of replicas, the shortest queue); runs are
added and removed while it serves (``POST``/``DELETE /admin/runs``). Exit status: 0
after a signal, 1 when its last run ends on its own or the gateway cannot start (one
line on stderr), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import NoReturn

import uvicorn
from pydantic import ValidationError
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.models import RunOutcome, RunPhase, RunRequest, ShutdownReason
from mvp_core.validation import describe_invalid, json_kind
from temporal import telemetry
from temporal.client import RunHandle, RunNotOpen
from temporal.client.ends import STOP_COUNT_WAIT_S
from temporal.connect import connect, temporal_address
from workers import stdio
from workers.gateway.app import create_app
from workers.gateway.auth import API_KEYS_ENV, ApiKeyError, load_keys
from workers.gateway.runs import RunSet, RunSpec
from workers.gateway.selection import AliasError, check_alias
from workers.web.server import SignallessServer

PROG = "mvp-gateway"
DEFAULT_LISTEN = "127.0.0.1:8000"
SHUTDOWN_WAIT_S = 60.0  # how long a run we started may take to close after our signal
SERVER_STOP_S = 10.0
GRACEFUL_S = 3  # open HTTP requests get this long; then their prompts are cancelled
WATCH_EVERY_S = 1.0


class GatewayError(Exception):
    """Why the gateway cannot go on, in one line for stderr; it exits 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"{PROG}: {message}", file=sys.stderr)
        sys.exit(2)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help="where the HTTP API listens (default: %(default)s; port 0 picks one)",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--workflow-id",
        action="append",
        metavar="mvp-run-N[=ALIAS]",
        help="serve this existing run (repeat for several; =ALIAS lists its model as ALIAS)",
    )
    which.add_argument(
        "--run-request",
        metavar="FILE",
        type=Path,
        help="start a run from this RunRequest JSON (e.g. docs/examples/run-pipeline.json), "
        "serve it, and shut it down on exit",
    )
    p.add_argument(
        "--run-id",
        type=int,
        default=None,
        help="(with --run-request) the run's id, workflow mvp-run-<id> (default: 1)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help="API keys, one per line: every request to /v1 and the dashboard must carry one "
        f"(also from ${API_KEYS_ENV}, comma-separated; never on the command line)",
    )
    p.add_argument(
        "--no-auth",
        action="store_true",
        help="serve anyone who reaches the port when listening beyond loopback without keys",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's and the gateway's own log level; info includes one access line per "
        "request and how the gateway reads prompts' text (default: info)",
    )
    return p


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise GatewayError(f"invalid --listen {value!r}: use HOST:PORT")
    return host, int(port)


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any address


def api_keys(args: argparse.Namespace, host: str) -> list[str]:
    """The configured API keys. Listening beyond loopback without any is refused unless
    ``--no-auth`` says so: anyone who reaches the port would prompt the run."""
    try:
        keys = load_keys(args.api_key_file)
    except ApiKeyError as err:
        raise GatewayError(str(err)) from None
    if keys and args.no_auth:
        raise GatewayError(
            "--no-auth goes without API keys (--api-key-file, $" + API_KEYS_ENV + ")"
        )
    if not keys and not args.no_auth and not loopback(host):
        raise GatewayError(
            f"listening on {host} needs API keys: --api-key-file FILE or ${API_KEYS_ENV} "
            "(or --no-auth to serve anyone who reaches the port)"
        )
    return keys


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything starts, so a busy port fails first."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as err:
        raise GatewayError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return sock


def run_specs(values: list[str]) -> list[RunSpec]:
    """The runs ``--workflow-id`` names: ``mvp-run-N`` or ``mvp-run-N=ALIAS`` each."""
    specs: list[RunSpec] = []
    for value in values:
        wid, sep, alias = value.partition("=")
        run_id = names.run_id_from_workflow_id(wid)
        if run_id is None:
            shape = "mvp-run-N=ALIAS" if sep else "mvp-run-N"
            raise GatewayError(f"invalid --workflow-id {value!r}: use {shape}")
        if sep:
            try:
                check_alias(alias)
            except AliasError as err:
                raise GatewayError(f"invalid alias in --workflow-id {value!r}: {err}") from None
        if any(s.run_id == run_id for s in specs):
            raise GatewayError(f"--workflow-id {wid} is given twice")
        specs.append(RunSpec(run_id, alias if sep else None))
    return specs


def read_run_request(path: Path) -> RunRequest:
    """``--run-request FILE``: a refusal names each bad field with its reason, as the
    run's own rejection does (``pipeline_stage: Extra inputs are not permitted``), at most
    8 of them, each bounded, never a value from the file (it may hold near-secrets)."""
    try:
        text = path.read_text()
    except OSError as err:
        raise GatewayError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        raw = json.loads(text)
    except ValueError as err:  # its position in the file, not the text there
        raise GatewayError(f"invalid run request {path}: not JSON ({err})") from None
    if not isinstance(raw, dict):
        raise GatewayError(
            f"invalid run request {path}: expected a JSON object, got {json_kind(raw)}"
        )
    try:
        return RunRequest.model_validate(raw)
    except ValidationError as err:
        raise GatewayError(f"invalid run request {path}: {describe_invalid(err)}") from None


class GatewayCommand:
    """One ``mvp-gateway`` process: its run (started or attached), its HTTP server, its
    signals, and the run's shutdown when it started the run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stop = asyncio.Event()
        self.signals = 0
        self._signalled = asyncio.Event()  # set by each signal, cleared by who waits

    def on_signal(self) -> None:
        self.signals += 1
        self.stop.set()
        self._signalled.set()

    async def main(self) -> int:
        args = self.args
        if args.run_id is not None and args.run_request is None:
            raise GatewayError("--run-id goes with --run-request")
        host, port = parse_listen(args.listen)
        keys = api_keys(args, host)
        request = read_run_request(args.run_request) if args.run_request else None
        if request is None:
            specs = run_specs(args.workflow_id)
        else:
            run_id = 1 if args.run_id is None else args.run_id
            if run_id < 0:
                raise GatewayError("--run-id must be 0 or more")
            specs = [RunSpec(run_id)]
        sock = bind(host, port)
        try:
            address = temporal_address()
            client = await connect()
        except RuntimeError as err:  # the connection error says where and why
            text = str(err)
            if not text.startswith("cannot "):
                text = f"cannot connect to Temporal: {text}"
            raise GatewayError(text) from None
        if request is None:
            for spec in specs:
                await self._check_running(RunHandle(client, spec.run_id), address)
            handle = None
        else:
            handle = await self._start(client, specs[0].run_id, request)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal)
        bound = sock.getsockname()
        url = f"http://{_url_host(str(bound[0]))}:{bound[1]}/v1"
        app = create_app(client, specs, api_keys=keys, notify=say)
        runs: RunSet = app.state.runs
        config = uvicorn.Config(
            app,
            log_level=args.log_level,
            timeout_graceful_shutdown=GRACEFUL_S,
            lifespan="on",
        )
        server = SignallessServer(config)
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        closed = asyncio.ensure_future(runs.emptied.wait())  # its last run ended by itself
        ready = [
            asyncio.ensure_future(self._announce(RunHandle(client, s.run_id), url, s.alias))
            for s in specs
        ]
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({serving, closed, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for announce in ready:
                announce.cancel()
            runs.close_viewers()  # an open dashboard holds no shutdown up
            server.should_exit = True
            if self.signals > 1:
                server.force_exit = True
            with contextlib.suppress(Exception):
                async with asyncio.timeout(SERVER_STOP_S):
                    await serving
            stopping.cancel()
        if closed.done() and runs.last_ended is not None:
            raise GatewayError(await self._ended(runs.last_ended.run))
        closed.cancel()
        if serving.done() and not self.stop.is_set():
            why = serving.exception() if not serving.cancelled() else None
            raise GatewayError(f"the HTTP server stopped: {why or 'without a reason'}")
        if handle is not None:
            serving_run = runs.get(handle.run_id)
            if serving_run is not None:
                # The ends its requests had from the head node's end line are the run's
                # before the stop (DECISIONS 95).
                with contextlib.suppress(Exception):
                    await serving_run.run.wait_ends_counted(STOP_COUNT_WAIT_S)
            await self._shutdown(handle)
        return 0

    async def _check_running(self, handle: RunHandle, address: str) -> None:
        try:
            await handle.check_open(address)
        except RunNotOpen as err:
            raise GatewayError(str(err)) from None

    async def _start(self, client: Client, run_id: int, request: RunRequest) -> RunHandle:
        wid = names.run_workflow_id(run_id)
        try:
            handle = await RunHandle.start(client, run_id, request)
        except WorkflowAlreadyStartedError:
            raise GatewayError(
                f"run {wid} exists already: serve it with --workflow-id {wid}, or choose "
                "another --run-id"
            ) from None
        except RPCError as err:
            raise GatewayError(f"cannot start run {wid}: {err.message}") from None
        say(
            f"started run {wid} ({request.pipeline_stages} stage(s), provider "
            f"{request.provider.value})"
        )
        return handle

    async def _announce(self, handle: RunHandle, url: str, alias: str | None) -> None:
        wid = handle.workflow_id
        say(f"serving run {wid} at {url} (503 until it is prompt-ready)")
        while True:
            state = await handle.try_snapshot()
            if state is not None and state.phase is RunPhase.PROMPT_READY and state.plan:
                model = alias or os.path.basename(state.plan.model_path).removesuffix(".gguf")
                say(f"run {wid} is prompt-ready: model {model!r} at {url}")
                return
            await asyncio.sleep(WATCH_EVERY_S)

    async def _ended(self, handle: RunHandle) -> str:
        wid = handle.workflow_id
        try:
            async with asyncio.timeout(10):
                result = await handle.workflow.result()
        except WorkflowFailureError as err:
            return f"run {wid} ended: {_cause(err)}"
        except Exception as err:
            return f"run {wid} ended ({type(err).__name__}: {err})"
        with contextlib.suppress(ValidationError):
            outcome = RunOutcome.model_validate(result)
            return f"run {wid} ended: {outcome.outcome.value}"
        return f"run {wid} ended"

    async def _shutdown(self, handle: RunHandle) -> None:
        """The run we started: ask it to shut down, then say so (a say that cannot be
        written must not keep the run running), and wait (bounded) for it to close."""
        wid = handle.workflow_id
        try:
            await handle.request_shutdown(ShutdownReason.OPERATOR_REQUESTED)  # False: closed
        except RPCError as err:
            raise GatewayError(f"cannot ask run {wid} to shut down: {err.message}") from None
        say(f"shutting down run {wid}")
        wait = asyncio.ensure_future(handle.workflow.result())
        stop_waiting = asyncio.ensure_future(self._second_signal())
        await asyncio.wait(
            {wait, stop_waiting}, timeout=SHUTDOWN_WAIT_S, return_when=asyncio.FIRST_COMPLETED
        )
        stop_waiting.cancel()
        if not wait.done():
            wait.cancel()
            raise GatewayError(
                f"run {wid} did not close within {SHUTDOWN_WAIT_S:.0f} s of the shutdown "
                "request (it goes on shutting down without the gateway)"
            )
        failure = wait.exception()
        if isinstance(failure, WorkflowFailureError):
            raise GatewayError(f"run {wid} ended: {_cause(failure)}")
        if failure is not None:
            raise GatewayError(f"run {wid}: {type(failure).__name__}: {failure}")
        outcome = RunOutcome.model_validate(wait.result())
        say(f"run {wid} closed: {outcome.outcome.value}")

    async def _second_signal(self) -> None:
        self._signalled.clear()
        await self._signalled.wait()


def _cause(err: WorkflowFailureError) -> str:
    """Why a run failed, in its own words."""
    return getattr(err.cause, "message", None) or str(err.cause or err)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


say = stdio.sayer(PROG)


def main() -> None:
    args = parser().parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The gateway's own lines at the level asked for (at info: how it reads prompts'
    # text, docs/gateway.md); the client library's stay at warnings (its "cannot read the
    # head node here" is one; per-prompt notes are not the operator's).
    logging.getLogger("mvp.gateway").setLevel(args.log_level.upper())
    code = 1
    try:
        tel = telemetry.setup(PROG)
    except telemetry.TelemetryConfigError as err:
        say(str(err))
        os._exit(2)
    try:
        code = asyncio.run(GatewayCommand(args).main())
        tel.close()  # the last spans and metrics go out
    except GatewayError as err:
        say(str(err))
    except KeyboardInterrupt:
        code = 130
    except Exception as err:  # whatever it was, the exit below still happens at once
        say(f"unexpected {type(err).__name__}: {err}")
    # As mvp-chat: exit without interpreter finalisation, which an RPC cancelled at exit
    # can turn into an abort of the SDK's native runtime.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
