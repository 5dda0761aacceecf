"""The main job on the embedded default: ``python -m workers.host.demo``.

Starts a local Temporal dev server (SQLite in the data directory), an orchestrator
worker and a run on the bundled SmolLM2 model with local process nodes, streams a reply
to the terminal as it is generated, then shuts the run down and stops everything it
started. Ctrl-C or SIGTERM does the same at any point, in that order, within seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.models import (
    Done,
    Fault,
    PromptHost,
    ProviderKind,
    RunOutcome,
    ShutdownReason,
    TextDelta,
)
from mvp_core.names import NODE_MODULE
from mvp_core.run_state import RunState
from mvp_io.model_store import BUNDLED, DEFAULT_BUNDLED
from temporal.client import PromptRejected, RunClosed, RunHandle
from temporal.connect import TemporalSettings, connect
from temporal.devserver import DevServer, DevServerError, start_dev_server
from workers import stdio
from workers.host.demo_args import (
    BUNDLED_CHAT,
    DemoError,
    DemoPlan,
    FlagError,
    check_flags,
    check_model,
    fetch_model,
    flag_value,
)
from workers.host.embedded import (
    DirLock,
    DirLockBusy,
    dev_server_ip,
    failure_text,
    prune_node_dirs,
    start_worker,
    stop_process,
)

DEFAULT_PROMPT = "The capital of France is"
# An interrupt stops everything within 10 s: the run's teardown (StopRun, then the
# provider stops each node) and its close get most of it, each process a short SIGTERM
# grace after that.
RUN_STOP_WAIT_S = 6.0
# After the reply, nothing hurries the shutdown: nodes may take a while to exit (e.g. a
# trace exporter with no collector to reach retries its last batch for up to 10 s).
RUN_END_WAIT_S = 30.0
PROCESS_STOP_S = 1.5
LOCK_FILE = "demo.lock"

log = logging.getLogger("mvp.demo")


# --------------------------------------------------------------------------- before the run


class DataDirLock:
    """One demo per data directory: its dev server's SQLite database allows one server.

    The lock file names the demo that holds it and the processes it started; the kernel
    drops the lock when that demo ends, however it ends. A demo killed hard leaves its
    dev server and worker to die of its death (they get SIGTERM) and the next demo waits
    for them, so that two servers never share the database."""

    def __init__(self, root: Path) -> None:
        path = root / LOCK_FILE
        try:
            self._lock = DirLock(path)
        except DirLockBusy as err:
            holder = err.holder.get("pid", "unknown")
            raise DemoError(
                f"the data directory {root} is in use by another demo (pid {holder}, see "
                f"{path}): its Temporal database {root / 'dev.db'} is busy. Wait for that "
                f"demo to end, stop it (kill -INT {holder}), or pass another --data-dir"
            ) from None
        self._left: dict[str, list[float]] = self._lock.previous.get("children", {})
        self._record: dict[str, Any] = {"pid": os.getpid(), "children": {}}
        self._lock.write(self._record)

    def record(self, name: str, pid: int) -> None:
        """Remember a process this demo started, for the next demo if this one is killed."""
        self._record["children"][name] = [pid, psutil.Process(pid).create_time()]
        self._lock.write(self._record)

    def stop_leftovers(self, wait_s: float = 5.0) -> list[str]:
        """The processes an earlier demo here started and that still run: wait for them
        to exit, kill them past ``wait_s``; what had to be killed."""
        procs: dict[str, psutil.Process] = {}
        for name, (pid, created) in self._left.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(int(pid))
                if abs(proc.create_time() - created) < 0.5:  # not a reused pid
                    procs[name] = proc
        _, alive = psutil.wait_procs(list(procs.values()), timeout=wait_s)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=5)
        return [name for name, proc in procs.items() if proc in alive]

    def release(self) -> None:
        self._lock.release()


# --------------------------------------------------------------------------- the session


@dataclass
class Demo:
    """One demo: what it started, so that every exit path stops it in order."""

    args: argparse.Namespace
    root: Path
    plan: DemoPlan
    state_dir: Path
    lock: DataDirLock
    server: DevServer | None = None
    worker: subprocess.Popen[bytes] | None = None
    handle: RunHandle | None = None
    run_id: int = 0
    run_closed: bool = False
    interrupted: signal.Signals | None = None
    # From the reply's end on: the run's own shutdown, which a first signal lets finish.
    stopping_since: float | None = None
    waited_for: signal.Signals | None = None  # the signal that said so
    mid_line: bool = False
    stopped: list[str] = field(default_factory=list)

    async def main(self) -> int:
        loop = asyncio.get_running_loop()
        session = asyncio.ensure_future(self._session())
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig, session)
        code = 1
        try:
            code = await session
        except (asyncio.CancelledError, Exception) as err:
            # An interrupt cancels the session; the SDK may turn that into its own error
            # (e.g. an update RPC "cancelled"). Either way it is the interrupt, not a fault.
            if self.interrupted is None:
                if isinstance(err, asyncio.CancelledError):
                    raise
                self._report(err)
        finally:
            began = time.monotonic()
            await self._stop_everything()
            if self.interrupted is not None:
                self._end_line()
                what = ", ".join(self.stopped) or "nothing was running yet"
                print(
                    f"interrupted by {self.interrupted.name}: stopped {what} "
                    f"({time.monotonic() - began:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                code = 128 + self.interrupted.value
        return code

    def _on_signal(self, sig: signal.Signals, session: asyncio.Future[int]) -> None:
        if self.interrupted is not None:  # it changes nothing: the stop is bounded
            return
        if self.stopping_since is not None:
            # The reply is done and everything is stopping as it should: a first signal
            # lets the run's shutdown finish (bounded by RUN_END_WAIT_S), a second one
            # terminates the run. Past the run, the processes' stop is bounded anyway.
            if self.waited_for is None:
                self.waited_for = sig
                self._say_stopping(sig, session.done())
                return
            if session.done():
                return
        self.interrupted = sig
        session.cancel()

    def _say_stopping(self, sig: signal.Signals, run_closed: bool) -> None:
        self._end_line()
        took = f"{time.monotonic() - (self.stopping_since or time.monotonic()):.1f} s so far"
        if run_closed:
            what = "the run has shut down; the orchestrator worker and the dev server stop next"
        else:
            again = "Ctrl-C" if sig is signal.SIGINT else sig.name
            what = (
                f"the run is shutting down after its reply ({took}, at most "
                f"{RUN_END_WAIT_S:.0f} s); waiting for it to finish ({again} again "
                "terminates it)"
            )
        print(f"{sig.name}: already stopping: {what}", file=sys.stderr, flush=True)

    def _report(self, err: Exception) -> None:
        self._end_line()
        if isinstance(err, DemoError):
            print(f"demo: {err}", file=sys.stderr, flush=True)
            return
        log.error("demo failed", exc_info=err)
        print(
            f"demo: unexpected {type(err).__name__}: {err} (traceback in {self.root / 'demo.log'})",
            file=sys.stderr,
            flush=True,
        )

    def _end_line(self) -> None:
        if self.mid_line:
            print(flush=True)
            self.mid_line = False

    async def _session(self) -> int:
        args, root = self.args, self.root
        print(f"starting Temporal dev server (db {root / 'dev.db'})", flush=True)
        try:
            self.server = start_dev_server(
                str(root / "dev.db"),
                ip=dev_server_ip(ProviderKind(args.provider)),
                headless=False,
                log_file=str(root / "temporal.log"),
                own_process_group=True,
                stop_with_parent=True,
            )
        except DevServerError as err:
            raise DemoError(f"{err}; its log: {root / 'temporal.log'}") from None
        self.lock.record("dev server", self.server.process.pid)
        print(
            f"  gRPC {self.server.address}, Web UI http://127.0.0.1:{self.server.ui_port}",
            flush=True,
        )
        client = await connect(settings=TemporalSettings.local(self.server.address))
        await self._terminate_leftovers(client)
        self.worker = self._start_worker(self.server.address)
        self.lock.record("orchestrator worker", self.worker.pid)
        self.run_id = args.run_id or int(time.time()) % 1_000_000
        t0 = time.perf_counter()
        # Built and validated from the flags before anything started (check_flags).
        self.handle = await RunHandle.start(client, self.run_id, self.plan.request)
        print(f"run {self.handle.workflow_id} started; waiting for prompt-ready", flush=True)
        state = await self._wait_prompt_ready(self.handle)
        print(
            f"prompt-ready after {time.perf_counter() - t0:.2f}s ({len(state.nodes)} node(s))\n",
            flush=True,
        )
        result = await self._prompt(self.handle)
        self.stopping_since = time.monotonic()
        outcome = await self._shut_down_run(ShutdownReason.OPERATOR_REQUESTED, RUN_END_WAIT_S)
        if outcome is not None:
            print(
                f"run {outcome.outcome.value}: "
                + " -> ".join(
                    r.kind.value for r in outcome.lifecycle if not r.kind.value.startswith("Prompt")
                ),
                flush=True,
            )
        return 0 if isinstance(result, Done) else 1

    # ------------------------------------------------------------------ processes

    def _start_worker(self, address: str) -> subprocess.Popen[bytes]:
        worker = start_worker(address, self.state_dir, self.root / "orchestrator.log")
        if worker.ready_fd is not None:  # the demo waits on its run, not on this line
            os.close(worker.ready_fd)
            worker.ready_fd = None
        return worker

    async def _stop_everything(self) -> None:
        """Run, then orchestrator worker, then dev server: the run's teardown needs both."""
        began = time.monotonic()
        if self.handle is not None and not self.run_closed:
            await self._shut_down_run(ShutdownReason.HOST_REQUESTED)
            log.info("run shut down after %.2f s", time.monotonic() - began)
        current = asyncio.current_task()
        rest = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
        for task in rest:  # e.g. a prompt's result, which would fail once the server stops
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        if self.worker is not None:
            await asyncio.to_thread(stop_process, self.worker, PROCESS_STOP_S)
            self.stopped.append("the orchestrator worker")
            log.info("worker stopped after %.2f s", time.monotonic() - began)
        if self.handle is not None:
            # A safety net: the run's teardown stops its nodes, and this finds none.
            left = await asyncio.to_thread(stop_nodes, self.state_dir, [self.run_id])
            if left:
                log.warning(
                    "%s: %d node process(es) outlived the run's teardown",
                    self.handle.workflow_id,
                    left,
                )
                self.stopped.append(f"{left} node process(es) the run's teardown left")
        if self.server is not None:
            await asyncio.to_thread(self.server.stop, PROCESS_STOP_S)
            self.stopped.append("the dev server")
            log.info("dev server stopped after %.2f s", time.monotonic() - began)

    # ------------------------------------------------------------------ the run

    async def _wait_prompt_ready(self, handle: RunHandle) -> RunState:
        def worker_alive() -> None:
            if self.worker is not None and self.worker.poll() is not None:
                raise DemoError(
                    f"the orchestrator worker exited with {self.worker.returncode}; "
                    f"see {self.root / 'orchestrator.log'}"
                )

        try:
            return await handle.wait_prompt_ready(check=worker_alive)
        except RunClosed as err:
            self.run_closed = True
            raise DemoError(_closed_reason(err.error)) from None

    async def _prompt(self, run: RunHandle) -> Done | Fault:
        args = self.args
        if args.chat:
            print(f"user: {args.prompt}", flush=True)
            sys.stdout.write("assistant: ")
        else:
            sys.stdout.write(args.prompt)  # a completion continues the prompt's text
        self.mid_line = True
        t1 = time.perf_counter()
        first: float | None = None
        result: Done | Fault | None = None
        try:
            async with contextlib.aclosing(run.stream(self.plan.prompt)) as events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        first = first or time.perf_counter()
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
                    else:
                        result = event
        except PromptRejected as err:
            raise DemoError(f"prompt rejected ({err.kind}): {err}") from None
        self._end_line()
        if isinstance(result, Fault):
            print(f"error: {result.error}", file=sys.stderr, flush=True)
            return result
        assert result is not None
        total = time.perf_counter() - t1
        first_ms = f"{(first - t1) * 1000:.0f} ms" if first is not None else "never"
        print(
            f"\n[{result.tokens_generated} tokens, stopped by {result.stop_reason}; "
            f"first text after {first_ms}; "
            f"{result.tokens_generated / max(total, 1e-9):.1f} tokens/s seen by the client; "
            f"engine {result.elapsed_ms} ms]",
            flush=True,
        )
        return result

    async def _shut_down_run(
        self, reason: ShutdownReason, wait_s: float = RUN_STOP_WAIT_S
    ) -> RunOutcome | None:
        """Stop the run and wait (``wait_s``) until it is torn down and closed; past the
        bound, or on an interrupt while it waits, terminate it (its nodes are then
        stopped by :func:`stop_nodes`), saying which of the two it was."""
        handle = self.handle
        assert handle is not None
        self.run_closed = True
        began = time.monotonic()
        bound = asyncio.timeout(wait_s)
        try:
            async with bound:
                outcome = await self._teardown(handle, reason)
            self.stopped.append("the run")
            return outcome
        except WorkflowFailureError as err:
            self._end_line()
            print(f"demo: {failure_text(err)}", file=sys.stderr, flush=True)
            return None
        except (
            TimeoutError,
            asyncio.CancelledError,
            WorkflowUpdateRPCTimeoutOrCancelledError,  # the SDK's word for a cancelled wait
            RPCError,
        ) as err:
            task = asyncio.current_task()
            if bound.expired():
                why = f"its teardown took over {wait_s:.0f} s"
            elif self.interrupted is not None and task is not None and task.cancelling():
                # A second signal while the run shut down after its reply (the first
                # one let it go on): said as such, not as a teardown that took too long.
                again = " again" if self.waited_for is not None else ""
                why = (
                    f"{self.interrupted.name}{again} during its teardown, after "
                    f"{time.monotonic() - began:.1f} s"
                )
            else:
                why = f"it did not close: {err!r}"
            await self._force_stop(handle, why)
            if isinstance(err, asyncio.CancelledError):
                raise
            return None

    async def _teardown(self, handle: RunHandle, reason: ShutdownReason) -> RunOutcome | None:
        """The run's shutdown: the waiting Update, then the run's close."""
        outcome: RunOutcome | None = None
        try:
            outcome = await handle.shutdown_and_wait(reason)
            log.info("%s torn down: %s", handle.workflow_id, outcome.outcome.value)
        except (RPCError, WorkflowUpdateFailedError) as err:
            # Closed already (a fault: its result says why), or the Update did not get
            # through: the request_shutdown signal asks the same of a run still open.
            log.info("%s: shutdown update failed (%s); signalling", handle.workflow_id, err)
            with contextlib.suppress(RPCError):
                await handle.request_shutdown(reason)
        await handle.workflow.result()
        return outcome

    async def _force_stop(self, handle: RunHandle, why: str) -> None:
        """Terminate a run whose shutdown did not finish (its nodes: see stop_nodes)."""
        try:
            desc = await handle.describe()
            if desc.status is WorkflowExecutionStatus.RUNNING:
                await handle.terminate(reason=f"demo shutdown: {why}")
                self.stopped.append(f"the run (terminated: {why})")
        except RPCError as err:
            log.warning("could not terminate %s: %s", handle.workflow_id, err)

    # ------------------------------------------------------------------ leftovers

    async def _terminate_leftovers(self, client: Client) -> None:
        """Workflows still Running in this data directory's database belong to a demo
        killed hard (the lock says no demo runs here now): terminate them before a
        worker could resume them, and stop the nodes their teardown never stopped."""
        runs: dict[str, int] = {}
        async for wf in client.list_workflows('ExecutionStatus="Running"'):
            handle = client.get_workflow_handle(wf.id, run_id=wf.run_id)
            await handle.terminate(reason="left running by a demo that was killed")
            run_id = names.run_id_from_workflow_id(wf.id)
            if wf.workflow_type == names.RUN_WORKFLOW and run_id is not None:
                runs[wf.id] = run_id
        if runs:
            nodes = await asyncio.to_thread(stop_nodes, self.state_dir, list(runs.values()))
            print(
                f"terminated {', '.join(runs)} (and stopped {nodes} node process(es)): left "
                "running by an earlier demo that was killed, so not resumed",
                flush=True,
            )


def stop_nodes(state_dir: Path, run_ids: list[int]) -> int:
    """Stop the live node processes of these runs; how many there were.

    A node runs in its own session with its node directory,
    ``<state_dir>/nodes/mvp-<run_id>-<node_id>-<nonce8>``, as working directory."""
    nodes_dir = state_dir.resolve() / "nodes"
    prefixes = tuple(f"mvp-{run_id}-" for run_id in run_ids)
    found: list[psutil.Process] = []
    for proc in psutil.process_iter(["cmdline", "cwd", "status"]):
        try:
            cwd = Path(proc.info["cwd"] or "/")
            if (
                cwd.parent == nodes_dir
                and cwd.name.startswith(prefixes)
                and NODE_MODULE in (proc.info["cmdline"] or [])
                and proc.info["status"] != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for sig, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 2.0)):
        for proc in found:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        _, alive = psutil.wait_procs(found, timeout=wait_s)
        if not alive:
            break
    return len(found)


def _closed_reason(err: BaseException | None) -> str:
    if isinstance(err, WorkflowFailureError):
        return failure_text(err)
    if err is not None:
        return f"run ended before it was prompt-ready: {err}"
    return "run was stopped before it was prompt-ready"


# --------------------------------------------------------------------------- entry point


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m workers.host.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt (default: %(default)r)")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=64,
        help="most tokens to generate; 0 = until the end token or the context end "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--stages",
        type=int,
        default=2,
        help="pipeline stages, one local node process each; 1 = direct mode (default: %(default)s)",
    )
    p.add_argument(
        "--max-active-prompts",
        type=int,
        default=1,
        metavar="N",
        help="prompts the run generates at once (its max_active_prompts; mvp-gateway "
        "serves many clients with docs/examples/run-serve.json) (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-host",
        choices=[h.value for h in PromptHost],
        default=PromptHost.WORKFLOW.value,
        help="where the run serves its prompts: a PromptWorkflow each, or in the run's "
        "own Update at a fifth of the control plane's CPU per prompt (default: %(default)s)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template and print the prompt and reply as a dialogue "
        f"(a model without one is refused before anything starts; bundled: {BUNDLED_CHAT})",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_BUNDLED,
        help=f"a bundled model ({', '.join(sorted(BUNDLED))}), the path of a GGUF file, or "
        "hf:OWNER/NAME/FILE.gguf[@REVISION] from the Hugging Face hub (HF_ENDPOINT, HF_TOKEN "
        "from the environment) (default: %(default)s)",
    )
    p.add_argument(
        "--provider",
        choices=["process", "docker"],
        default="process",
        help="local node processes, or containers on a Docker daemon (DOCKER_HOST; the "
        "node image is built offline on first use) (default: %(default)s)",
    )
    p.add_argument(
        "--run-id", type=int, default=0, help="the run's id (default: derived from the clock)"
    )
    p.add_argument(
        "--data-dir",
        default=".temporal/demo",
        help="dev server database, logs and node directories; one demo at a time each "
        "(default: %(default)s)",
    )
    return p


def run(args: argparse.Namespace) -> int:
    """Every flag is checked first, before anything is created or started (a refusal
    exits with 2, as argparse's own). Everything before the event loop can be
    interrupted plainly (KeyboardInterrupt); from the dev server on, signals go through
    :meth:`Demo.main`."""
    try:
        plan = check_flags(args)
    except FlagError as err:
        return usage_error(err)
    root = Path(args.data_dir)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    lock: DataDirLock | None = None
    try:
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock = DataDirLock(root)
        except OSError as err:
            raise FlagError(
                f"{flag_value('--data-dir', args.data_dir)}: cannot use it as the demo's "
                f"data directory: {err.strerror or err}"
            ) from None
        handler = logging.FileHandler(root / "demo.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        killed = lock.stop_leftovers()
        if killed:
            print(f"killed the {' and '.join(killed)} an earlier demo left running", flush=True)
        path = fetch_model(plan.source)
        check_model(path, args)
        state_dir = Path(os.environ.get("MVP_STATE_DIR") or root / "state").resolve()
        if pruned := prune_node_dirs(state_dir):
            log.info("removed %d node directories of old runs: %s", len(pruned), pruned)
        demo = Demo(args=args, root=root, plan=plan, state_dir=state_dir, lock=lock)
        return asyncio.run(demo.main())
    except FlagError as err:
        return usage_error(err)
    except DemoError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted before the dev server started: nothing to stop", file=sys.stderr)
        return 130
    finally:
        if lock is not None:
            lock.release()


def usage_error(err: FlagError) -> int:
    """A refused flag, said as argparse says its own: the usage line, then the reason."""
    p = parser()
    p.print_usage(sys.stderr)
    print(f"{p.prog}: error: {err}", file=sys.stderr, flush=True)
    return 2


def main() -> None:
    stdio.install()  # a reader gone from our pipe (| tee) never stops the shutdown
    raise SystemExit(run(parser().parse_args()))


if __name__ == "__main__":
    main()
