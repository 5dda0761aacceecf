"""``mvp-orchestrator``: the process host (process spec; docs/host.md).

One command that a person runs: it resolves its configuration (defaults, TOML,
environment, five arguments), starts a run, waits until it is prompt-ready, serves
prompts on the prompt RPC, stops on ``stop``/``shutdown``/``quit`` on stdin, SIGINT or
SIGTERM, tears everything down and exits 0; any configuration, startup, serving or
provider-stop failure exits 1 with one ``mvp-orchestrator: <error>`` line. Every
observation goes to the datastream (the frame archive, live followers).

It is a host adapter around the run (ARCHITECTURE "host adapters"): it translates into
RunRequest, ``submit_prompt``, ``cancel_prompt`` and ``request_shutdown_and_wait``, and
decides nothing the run decides. With no Temporal address configured (``TEMPORAL_ADDRESS``
or an envconfig profile's, docs/temporal-connection.md) it starts and owns a local dev
server and an orchestrator worker; with one, it connects and starts nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.datastream import BootstrapPhase, BootstrapStatus
from mvp_core.edge_auth import state_dir as provider_state_dir
from mvp_core.host_config import (
    ConfigError,
    HostConfig,
    resolve_config,
    to_run_request,
    vast_worker_env,
)
from mvp_core.host_observe import observe
from mvp_core.models import ProviderKind, RunPhase, ShutdownReason
from mvp_core.run_state import RunState
from mvp_io.datastream import Datastream, LogTailer
from mvp_io.model_store import HubUnreachableError, ModelSourceError
from temporal import telemetry
from temporal.client import RunHandle
from temporal.connect import (
    TemporalConfigError,
    TemporalConnectError,
    TemporalSettings,
    connect,
)
from temporal.devserver import DevServer, DevServerError, start_dev_server
from workers import stdio
from workers.host.dashboard import HostDashboard
from workers.host.embedded import (
    DirLock,
    DirLockBusy,
    WorkerNotReady,
    dev_server_ip,
    process_exit,
    prune_node_dirs,
    start_worker,
    stop_process,
    wait_worker_ready,
)
from workers.host.exits import PROG, HostError, bind_failed, closed_code, say
from workers.host.forward import Forwarder, wait_seen
from workers.host.host_stream import StdioCapture, host_secrets, open_datastream
from workers.host.model_fetch import FetchProgress, fetch_in_thread, model_download
from workers.host.rpc import PromptObservation, PromptRpcServer

log = logging.getLogger("mvp.host")
STOP_WORDS = frozenset({"stop", "shutdown", "quit"})
POLL_S = 0.25
# Past prompt-ready, a host following the run's datastream reads the snapshot only to see
# a new datastream address (its activity restarted): this often (DECISIONS 58).
FOLLOW_POLL_S = 2.0
DATASTREAM_WAIT_S = 30.0  # a run that tells no datastream address by then has none
FORWARD_CATCH_UP_S = 5.0  # how long the host waits for a run record to come through
FORWARD_END_WAIT_S = 10.0  # how long the run's datastream may take to end after the run
SHUTDOWN_WAIT_S = 120.0
WORKER_READY_S = 60.0
PROCESS_STOP_S = 3.0
EMBEDDED_REVIVALS = 3  # how often a session starts its embedded dev server again
FETCH_STOP_WAIT_S = 3.0  # how long a stopped model download may take to clean up
FOLLOW_COMMAND = "mvp-follow"  # the console script of workers/host/follow.py


class PathFiles:
    """The resolver's view of the filesystem (it is pure; this is where I/O happens)."""

    def read_text(self, path: Path) -> str:
        return path.read_text()

    def is_file(self, path: Path) -> bool:
        return path.is_file()

    def read_head(self, path: Path, size: int) -> bytes:
        with path.open("rb") as f:
            return f.read(size)


def host_dir() -> Path:
    """The host's own files: dev-server database, logs, lock, datastream socket."""
    return provider_state_dir() / "host"


class HostLock:
    """One host per state directory: its dev server's SQLite database allows one server."""

    def __init__(self, root: Path) -> None:
        self.path = root / "host.lock"
        try:
            self._lock = DirLock(self.path, 0o600)
        except DirLockBusy:
            raise HostError(
                f"another {PROG} uses {root} (lock {self.path}); stop it, or give this one "
                "its own MVP_STATE_DIR"
            ) from None

    def release(self) -> None:
        self._lock.release()


class Host:
    def __init__(self, cfg: HostConfig, stream: Datastream, follow_address: str) -> None:
        self.cfg = cfg
        self.stream = stream
        self.follow_address = follow_address
        self.run_id = cfg.run_id
        self.stop = asyncio.Event()
        self.stop_reason = ShutdownReason.OPERATOR_REQUESTED
        self.server: DevServer | None = None
        self.revivals = 0  # how often the embedded dev server was started again
        self.worker: subprocess.Popen[bytes] | None = None
        self.rpc: PromptRpcServer | None = None
        self.tailers: dict[int, LogTailer] = {}
        self.state: RunState | None = None
        self.published_state: RunState | None = None  # what the host published itself
        self.self_publish = False  # the run has no datastream this host can follow
        self.forwarder: Forwarder | None = None  # the run's datastream, followed
        self.forwarders: list[Forwarder] = []
        self.temporal_address = ""  # where the run's Temporal is, once known
        self.bind_error: str | None = None  # the RPC could not bind: exit 1 after shutdown
        self.dashboard: HostDashboard | None = None  # --dashboard (DECISIONS 92)

    # ------------------------------------------------------------------ the whole session
    async def main(self) -> int:
        self.stream.bootstrap(BootstrapPhase.CONFIG, BootstrapStatus.READY, self._config_detail())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, self._on_signal, sig)
        threading.Thread(target=self._stop_listener, args=(loop,), daemon=True).start()
        code = 1
        try:
            code = await self._session()
        except HostError as err:
            self.stream.bootstrap(
                BootstrapPhase.ORCH_EXIT, BootstrapStatus.FAILED, {"error": str(err)}
            )
            say(str(err))
        finally:
            await self._close()
        if code == 0:
            self.stream.bootstrap(BootstrapPhase.ORCH_EXIT, BootstrapStatus.READY, {"status": 0})
        return code

    async def _session(self) -> int:
        if self.cfg.dashboard is not None:
            try:  # bound first: a port in use starts nothing
                self.dashboard = HostDashboard(self.cfg.dashboard)
            except OSError as err:
                raise HostError(
                    f"dashboard cannot bind {self.cfg.dashboard}: {err.strerror or err}"
                ) from None
        client = await self._connect()
        if self.stop.is_set():
            return 0  # stopped before a run was started: nothing to tear down
        if not await self._fetch_model():
            return 0  # stopped while the model downloaded: no run was started
        handle = await self._start_run(client)
        if self.dashboard is not None:
            self.dashboard.start(client, self.run_id)
            say(f"run {handle.workflow_id} dashboard on {self.dashboard.url}")
        closed = asyncio.ensure_future(self._closed(handle))
        watch = asyncio.ensure_future(self._watch(handle))
        try:
            ready = await self._until_prompt_ready(handle, closed)
            if ready:
                await self._serve(client, closed)
            if closed.done():
                return closed_code(closed, self.stream, self.bind_error)
            return await self._shutdown(handle, closed)
        finally:
            if not closed.done():
                closed.cancel()
            await self._final_watch(handle, watch)

    # ------------------------------------------------------------------ Temporal
    async def _connect(self) -> Client:
        """A client of the run's Temporal. An embedded dev server that has exited by then
        (it picks some of its ports itself, and another process can take one first) is
        started again on its port and database (:meth:`_revive_server`)."""
        settings = await self._temporal()
        while True:
            try:
                client = await connect(settings=settings)
            except (TemporalConnectError, RuntimeError) as err:
                if self.server is not None and self.server.exited() is not None:
                    await self._revive_server()
                    continue
                if isinstance(err, TemporalConnectError):
                    raise HostError(str(err)) from None
                raise HostError(f"cannot reach Temporal at {settings.address}: {err}") from None
            self.stream.bootstrap(
                BootstrapPhase.LOCAL_RUNTIME, BootstrapStatus.READY, {"temporal": settings.address}
            )
            return client

    async def _revive_server(self) -> None:
        """Start the embedded dev server again after it exited: on the same port and the
        same database, so the run's history, the worker and the nodes (whose clients
        reconnect by themselves) carry on where they were. At most EMBEDDED_REVIVALS
        times a session; its cause is logged each time, and a server that will not come
        back ends the host with it."""
        assert self.server is not None
        died = self.server.exited()
        log_path = host_dir() / "temporal.log"
        if self.revivals >= EMBEDDED_REVIVALS:
            raise HostError(
                f"{died} (restarted {self.revivals} times already); its log: {log_path}"
            )
        self.revivals += 1
        say(f"{died}; starting it again on the same port and database")
        try:
            self.server = await asyncio.to_thread(
                start_dev_server,
                str(host_dir() / "temporal.db"),
                port=self.server.port,
                ip=dev_server_ip(self.cfg.provider),
                log_file=str(log_path),
                own_process_group=True,
                stop_with_parent=True,
            )
        except DevServerError as err:
            raise HostError(
                f"{died}, and it did not start again: {err}; its log: {log_path}"
            ) from None

    async def _close_embedded(self) -> None:
        if self.worker is not None:
            await asyncio.to_thread(stop_process, self.worker, PROCESS_STOP_S)
            self.worker = None
        if self.server is not None:
            await asyncio.to_thread(self.server.stop, PROCESS_STOP_S)
            self.server = None

    async def _temporal(self) -> TemporalSettings:
        try:
            configured = TemporalSettings.load()
        except TemporalConfigError as err:
            raise HostError(str(err)) from None
        if configured.address_configured:
            self.temporal_address = configured.address
            return configured
        root = host_dir()
        self.stream.bootstrap(
            BootstrapPhase.LOCAL_RUNTIME, BootstrapStatus.STARTED, {"embedded": True}
        )
        try:
            self.server = await asyncio.to_thread(
                start_dev_server,
                str(root / "temporal.db"),
                ip=dev_server_ip(self.cfg.provider),
                log_file=str(root / "temporal.log"),
                own_process_group=True,
                stop_with_parent=True,
            )
        except DevServerError as err:
            raise HostError(f"{err}; its log: {root / 'temporal.log'}") from None
        log = root / "orchestrator.log"
        worker = start_worker(
            self.server.address, provider_state_dir(), log, vast_worker_env(self.cfg)
        )
        self.worker = worker
        try:
            # A stop ends the wait: _session sees it before it starts a run. The worker
            # says it polls on a pipe of its own, not in its log (issue 38 item 6).
            await wait_worker_ready(worker, timeout_s=WORKER_READY_S, stop=self.stop.is_set)
        except WorkerNotReady:
            raise HostError(f"the orchestrator worker did not start; see {log}") from None
        self.temporal_address = self.server.address
        return TemporalSettings.local(self.server.address)

    async def _fetch_model(self) -> bool:
        """With the embedded worker this host runs the nodes: a bundled or hub model is
        fetched here first, so that its download shows (stderr, ``model_fetch`` records);
        the run's planning then finds it in the same model cache. With a Temporal of its
        own choosing the host cannot know which worker's host plans the run: that worker
        fetches it (and logs its progress). False when a stop came during the download."""
        if self.server is None:
            return True
        try:
            request = to_run_request(self.cfg)
        except ConfigError as err:
            raise HostError(str(err)) from None
        download = model_download(request.model)
        if download is None:
            return True
        if request.model.hf is not None and request.provider is ProviderKind.VASTAI:
            # Rented nodes fetch their own shares from the hub (DECISIONS 72): a download
            # here would only be uploaded to them whole.
            return True
        what, origin, fetch = download
        progress = FetchProgress(self.stream, what, origin, self.stop)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # A thread of its own (daemon): a download the host stops must not hold its exit.
        threading.Thread(target=fetch_in_thread, args=(fetch, progress, done), daemon=True).start()
        stopping: asyncio.Future[Any] = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait([done, stopping], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not done.done():
            # The download sees the stop at its next progress report and removes what it
            # wrote; a stalled one is left to the host's exit (the next fetch clears it).
            await asyncio.wait([done], timeout=FETCH_STOP_WAIT_S)
        if self.stop.is_set():
            if done.done():
                done.exception()  # whatever it was, the stop decides
            progress.finish("cancelled: the host is stopping")
            return False
        try:
            done.result()
        except (ModelSourceError, HubUnreachableError) as err:
            progress.finish(str(err))
            raise HostError(str(err)) from None
        progress.finish()
        return True

    async def _start_run(self, client: Client) -> RunHandle:
        wid = names.run_workflow_id(self.run_id)
        try:
            request = to_run_request(self.cfg)
        except ConfigError as err:
            raise HostError(str(err)) from None
        existing = RunHandle(client, self.run_id)
        with contextlib.suppress(RPCError):
            desc = await existing.describe()
            if desc.status == WorkflowExecutionStatus.RUNNING:
                if self.server is None:
                    raise HostError(
                        f"run {wid} is already running on {self.temporal_address}; "
                        "stop it, or choose another [runtime].run_id"
                    )
                # Our own embedded server: a run a killed host left behind.
                await existing.terminate(f"left behind by an earlier {PROG}; replaced")
                say(f"terminated run {wid}, left behind by an earlier {PROG}")
        try:
            handle = await RunHandle.start(client, self.run_id, request)
        except RPCError as err:
            raise HostError(f"cannot start run {wid}: {err.message}") from None
        say(
            f"run {wid} started ({request.pipeline_stages} stage(s), provider "
            f"{request.provider.value}); datastream: {FOLLOW_COMMAND} {self.follow_address}"
        )
        return handle

    async def _closed(self, handle: RunHandle) -> Any:
        """The run's result; a Temporal outage on the way is waited out (the run goes on
        without the host's connection), not taken for the run's end."""
        while True:
            try:
                return await handle.workflow.result()
            except RPCError as err:
                log.warning("waiting for run %s: %s; retrying", handle.workflow_id, err.message)
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ watching the run
    # The run's datastream activity publishes the run's records (DECISIONS 58): the host
    # follows it and forwards its frames. Only a run without one (a worker of an older
    # release, an address this host cannot reach) is observed and published by the host
    # itself, as before: polling the snapshot and tailing the node logs.
    async def _watch(self, handle: RunHandle) -> None:
        started = time.monotonic()
        ready = False
        while True:
            cur = await self._poll(handle)
            if not self.self_publish and cur is not None:
                self._follow_datastream(cur, started)
            ready = ready or (cur is not None and cur.phase is RunPhase.PROMPT_READY)
            await asyncio.sleep(watch_interval(ready, self.self_publish, self.forwarder))

    def _follow_datastream(self, cur: RunState, started: float) -> None:
        fwd = self.forwarder
        if fwd is not None and fwd.failed is not None:
            log.warning("cannot follow the run's datastream at %s: %s", fwd.address, fwd.failed)
            self._publish_self()
            return
        ds = cur.datastream
        if ds is None:
            if fwd is None and time.monotonic() - started > DATASTREAM_WAIT_S:
                log.warning("run %s tells no datastream: the host publishes its own", self.run_id)
                self._publish_self()
            return
        if fwd is not None and (not fwd.done or fwd.address == ds.address):
            return  # following it (or it ended: the run's end, or a new address comes)
        self.forwarder = Forwarder(self.stream, ds.address).start()
        self.forwarders.append(self.forwarder)

    def _publish_self(self) -> None:
        """From now on the host publishes what it observes (records from the start)."""
        self.self_publish = True
        self.published_state = None

    async def _poll(self, handle: RunHandle) -> RunState | None:
        try:
            cur = await handle.snapshot()
        except Exception:  # not picked up yet, or the worker is restarting: next poll
            return None
        self.state = cur
        if self.self_publish:
            self._publish_observed(cur)
        return cur

    def _publish_observed(self, cur: RunState) -> None:
        for channel, record in observe(self.published_state, cur, self.cfg.provider.value):
            self.stream.publish(channel, record)
        for node in cur.nodes:
            if (
                node.handle is not None
                and node.handle.log_path
                and node.node_id not in self.tailers
            ):
                self.tailers[node.node_id] = LogTailer(
                    self.stream, node.handle.log_path, node_id=node.node_id
                ).start()
        self.published_state = cur

    async def _final_watch(self, handle: RunHandle, watch: asyncio.Task[None]) -> None:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watch
        fwd = self.forwarder
        if fwd is not None:
            # The run's datastream ends after RunTornDown; what is left of it comes first.
            if not await asyncio.to_thread(fwd.join, FORWARD_END_WAIT_S):
                fwd.stop()
                await asyncio.to_thread(fwd.join, 1.0)
        if fwd is None or fwd.forwarded == 0:
            self._publish_self()  # nothing came from the run's datastream: say it ourselves
        if self.self_publish:
            await self._poll(handle)  # the lifecycle through RunTornDown
        for tailer in self.tailers.values():
            await asyncio.to_thread(tailer.stop)

    async def _until_prompt_ready(self, handle: RunHandle, closed: asyncio.Future[Any]) -> bool:
        """True once prompt-ready; False when a stop came first. A run that closes on
        its way there is a startup failure."""
        while not self.stop.is_set():
            if closed.done():
                return False
            if self.worker is not None and self.worker.poll() is not None:
                raise HostError(f"the orchestrator worker exited with {self.worker.returncode}")
            if self.server is not None and self.server.exited() is not None:
                await self._revive_server()
            state = self.state
            if state is not None and state.phase is RunPhase.PROMPT_READY:
                return True
            await asyncio.sleep(0.05)
        return False

    # ------------------------------------------------------------------ serving
    async def _serve(self, client: Client, closed: asyncio.Future[Any]) -> None:
        addr = self.cfg.rpc_bind
        self.rpc = PromptRpcServer(
            client, self.run_id, on_shutdown=self._rpc_shutdown, observe=self._prompt_observed
        )
        try:
            host, port = await self.rpc.start(addr.host, addr.port)
        except OSError as err:
            self.stream.bootstrap(
                BootstrapPhase.PROMPT_RPC, BootstrapStatus.FAILED, {"error": str(err)}
            )
            self.rpc = None
            self.stop_reason = ShutdownReason.HOST_REQUESTED
            self.bind_error = f"prompt RPC cannot bind {addr}: {err.strerror or err}"
            return
        # The run's RunReady first (it comes through the forwarder): the archive keeps the
        # session's order.
        await asyncio.to_thread(wait_seen, self.forwarder, "RunReady", FORWARD_CATCH_UP_S)
        self.stream.bootstrap(
            BootstrapPhase.PROMPT_RPC, BootstrapStatus.READY, {"addr": f"{host}:{port}"}
        )
        self.stream.bootstrap(BootstrapPhase.PROMPT_LOOP, BootstrapStatus.READY)
        say(f"run {names.run_workflow_id(self.run_id)} prompt-ready; prompt RPC on {host}:{port}")
        stopping = asyncio.ensure_future(self.stop.wait())
        lost = asyncio.ensure_future(self._worker_lost())
        await asyncio.wait([stopping, closed, lost], return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        lost.cancel()
        if lost.done() and not lost.cancelled():
            raise HostError(lost.result())

    async def _worker_lost(self) -> str:
        """Resolves (with why) if the embedded worker dies (nothing would serve the run)
        or its dev server dies and cannot be started again."""
        if self.worker is None or self.server is None:
            await asyncio.Event().wait()  # a Temporal of the configuration's: none of ours
        while True:
            assert self.worker is not None and self.server is not None
            worker = asyncio.ensure_future(process_exit(self.worker))
            server = asyncio.ensure_future(process_exit(self.server.process))
            try:
                await asyncio.wait([worker, server], return_when=asyncio.FIRST_COMPLETED)
            finally:
                worker.cancel()
                server.cancel()
            if worker.done() and not worker.cancelled():
                return f"the orchestrator worker exited with {worker.result()}"
            try:
                await self._revive_server()
            except HostError as err:
                return str(err)

    def _prompt_observed(self, obs: PromptObservation) -> None:
        self.stream.prompt_event(
            obs.phase,
            "observed",
            obs.request_id,
            {"client_request_id": obs.client_request_id, "connection": obs.connection}
            | ({"detail": obs.detail} if obs.detail else {}),
        )

    def _rpc_shutdown(self) -> None:
        self.stream.bootstrap(
            BootstrapPhase.SHUTDOWN, BootstrapStatus.OBSERVED, {"from": "prompt_rpc"}
        )
        self.stop.set()

    # ------------------------------------------------------------------ stopping
    def _on_signal(self, sig: int) -> None:
        # SIGHUP (the terminal went away) too: a controlled shutdown, nothing left behind.
        self.stream.bootstrap(
            BootstrapPhase.SHUTDOWN, BootstrapStatus.OBSERVED, {"signal": signal.Signals(sig).name}
        )
        self.stop.set()

    def _stop_listener(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stdin, line by line: ``stop``, ``shutdown`` or ``quit`` (any case) stops."""
        try:
            for line in sys.stdin:
                if line.strip().lower() in STOP_WORDS:
                    loop.call_soon_threadsafe(self._stdin_stop, line.strip().lower())
                    return
        except (OSError, ValueError, RuntimeError):
            return

    def _stdin_stop(self, word: str) -> None:
        self.stream.bootstrap(BootstrapPhase.SHUTDOWN, BootstrapStatus.OBSERVED, {"stdin": word})
        say(f"{word!r} on stdin: shutting down run {names.run_workflow_id(self.run_id)}")
        self.stop.set()

    async def _shutdown(self, handle: RunHandle, closed: asyncio.Future[Any]) -> int:
        """Controlled shutdown through ``request_shutdown_and_wait``: 0 when the run tore
        everything down, 1 when a node may still run (or the RPC could not bind)."""
        if self.rpc is not None:
            await self.rpc.close()
            self.rpc = None
        self.stream.bootstrap(BootstrapPhase.SHUTDOWN, BootstrapStatus.STARTED)
        try:
            async with asyncio.timeout(SHUTDOWN_WAIT_S):
                outcome = await handle.shutdown_and_wait(self.stop_reason)
        except (
            WorkflowUpdateFailedError,
            WorkflowUpdateRPCTimeoutOrCancelledError,
            RPCError,
            TimeoutError,
        ) as err:
            if closed.done() or not isinstance(
                err, TimeoutError | WorkflowUpdateRPCTimeoutOrCancelledError
            ):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    async with asyncio.timeout(10):
                        await asyncio.shield(closed)
                if closed.done():
                    return closed_code(closed, self.stream, self.bind_error)
            raise HostError(f"the run did not shut down: {err}") from None
        # The run is closing; its result says whether the provider stopped every node.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            async with asyncio.timeout(30):
                await asyncio.shield(closed)
        if closed.done():
            return closed_code(closed, self.stream, self.bind_error)
        self.stream.bootstrap(
            BootstrapPhase.SHUTDOWN, BootstrapStatus.READY, {"outcome": outcome.outcome.value}
        )
        return bind_failed(self.bind_error) or 0

    async def _close(self) -> None:
        if self.rpc is not None:
            await self.rpc.close()
        if self.dashboard is not None:
            await self.dashboard.close()  # the run's end on its pages, then it stops
        await self._close_embedded()

    def _config_detail(self) -> dict[str, Any]:
        cfg = self.cfg
        return {
            "profile": cfg.config_profile.value,
            "provider": cfg.provider.value,
            "pipeline_stages": cfg.pipeline_stages,
            "rpc_addr": str(cfg.rpc_bind),
            "config_path": str(cfg.config_path) if cfg.config_path else None,
            "frame_log": str(cfg.datastream_frame_log) if cfg.datastream_frame_log else None,
        }


def watch_interval(ready: bool, self_publish: bool, forwarder: Forwarder | None) -> float:
    """How soon the host reads the run's snapshot again: often on the way to prompt-ready
    (the prompt RPC waits for it) and while the host publishes what it observes itself;
    past prompt-ready, while it follows the run's own datastream, only often enough to see
    a new datastream address."""
    following = not self_publish and forwarder is not None and not forwarder.done
    return FOLLOW_POLL_S if ready and following else POLL_S


USAGE = f"""usage: {PROG} [--runtime-config PATH] [--provider process|docker|vastai]
                        [--pipeline-stages N] [--vastai-ssh-identity PATH]
                        [--dashboard [127.0.0.1:]PORT]

Start a run of a GGUF model on worker nodes, serve prompts on the prompt RPC (default
127.0.0.1:19777) once it is prompt-ready, and stop on stop/shutdown/quit on stdin,
Ctrl-C or SIGTERM. Everything else is configured in TOML (--runtime-config, else
.config/config.toml): see docs/host.md. --dashboard serves the run's live dashboard
at http://127.0.0.1:PORT/dashboard (loopback only; docs/dashboard.md).
"""


def run(argv: list[str]) -> int:
    if argv in (["--help"], ["-h"]):  # the one argument beyond the spec's five
        print(USAGE, end="")
        return 0
    try:
        cfg = resolve_config(argv, os.environ, Path.cwd(), PathFiles())
    except ConfigError as err:
        say(str(err))
        return 1
    secrets = host_secrets(cfg)
    try:
        tel = telemetry.setup("mvp-orchestrator-host")
    except telemetry.TelemetryConfigError as err:
        say(str(err))
        return 1
    root = host_dir()
    try:
        lock = HostLock(root)
    except HostError as err:
        say(str(err))
        return 1
    if pruned := prune_node_dirs(provider_state_dir()):
        log.info("removed %d node directories of old runs: %s", len(pruned), pruned)
    try:
        stream, live = open_datastream(cfg, root, secrets)
    except HostError as err:
        say(str(err))
        lock.release()
        return 1
    capture = StdioCapture(stream)
    capture.install()
    _native_write_for_tests()
    try:
        host = Host(cfg, stream, live.address)
        return asyncio.run(host.main())
    finally:
        tel.close()
        capture.remove()
        stream.close()
        lock.release()


def _native_write_for_tests() -> None:
    """Test harness only: ``MVP_TEST_HOST_NATIVE_WRITE``'s text written by libc's write(2)
    to fds 1 and 2, past Python's streams, so that a test sees native output reach the
    datastream (the host's environment allows ``MVP_TEST_`` variables only as the test
    harness's)."""
    text = os.environ.get("MVP_TEST_HOST_NATIVE_WRITE")
    if not text:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for fd, where in ((1, "stdout"), (2, "stderr")):
        data = f"{text} on {where}\n".encode()
        libc.write(fd, data, len(data))


def main() -> None:
    stdio.install()  # a reader gone from our pipe (| tee) never stops the shutdown
    code = run(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # As mvp-chat: no interpreter finalisation under the SDK's native threads.
    os._exit(code)


if __name__ == "__main__":
    main()
