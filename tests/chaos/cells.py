"""The chaos matrix: one function per cell (a fault in a phase of a run), shared by
``tests/chaos/test_chaos.py`` and ``scripts/chaos.py``.

Every cell runs a real run on a real dev server with real orchestrator and node processes
(no mocks), injects its fault, and judges the run against its documented end state
(docs/reliability.md): how the run ends, one terminal event per admitted prompt, no node
process left, no node started twice. A cell never raises for a failed oracle: it returns
a ``Result`` whose ``problems`` say what went wrong, so the script can print the matrix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
from pydantic import TypeAdapter
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowUpdateFailedError,
)
from temporalio.contrib.workflow_streams import WorkflowStreamClient
from temporalio.service import RPCError

from mvp_core import names
from mvp_core.models import (
    Done,
    Fault,
    LifecycleKind,
    PromptEvent,
    PromptTerminal,
    RequestShutdown,
    RunOutcome,
    RunPhase,
    RunRequest,
    SubmitPrompt,
    TextDelta,
)
from mvp_core.run_records import NodeState
from mvp_core.run_state import RunState
from mvp_io.model_store import DEFAULT_BUNDLED
from temporal.client import RunHandle
from temporal.connect import connect
from temporal.devserver import DevServer, start_dev_server, temporal_binary
from tests.helpers.runs import start_run
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    OrchestratorProcess,
    activity_started,
    harness_env,
    node_processes,
    snapshot,
)

_EVENT: TypeAdapter[TextDelta | Done | Fault] = TypeAdapter(PromptEvent)
_TERMINAL: Any = PromptTerminal
_PHASE_ORDER = [
    RunPhase.ACCEPTED,
    RunPhase.PLANNING,
    RunPhase.PROVISIONING,
    RunPhase.READINESS,
    RunPhase.STAGE_PROVISIONING,
    RunPhase.PROMPT_READY,
    RunPhase.TEARING_DOWN,
    RunPhase.TORN_DOWN,
]
_SERVING = re.compile(r"^node (\d+) stage \d+ serving \S+ as \S+:(\d+)$", re.MULTILINE)
# A text piece held this long on the head node makes a prompt last seconds, so that a
# fault lands while it generates however fast the machine (MVP_FAULT_TEXT_DELAY_MS).
SLOW_TEXT = {"MVP_FAULT_TEXT_DELAY_MS": "20"}
LONG_PROMPT = ("Once upon a time", 160)
RESTART_HEARTBEAT_S = 20.0  # server-restart@generation's generate heartbeat timeout
OUTAGE_HEARTBEAT_S = 5.0  # server-outage-10s@generation's: the outage outlasts it
NEVER_HEARTBEAT_S = 600.0  # node kills at generation: longer than the cell may last
STOP_DELAY_S = 4  # orch-kill@teardown: each node's stop activity waits this long first
# The readiness cells hold every node's LeaseStarted until the cell opens the gate
# (Scope.held_leases), so the run stays in readiness, with its nodes' NodeRuntimeReady in
# its state, however slowly the machine runs. (A 6 s hold from each lease's start was
# missed on a loaded machine: the snapshot polls saw nothing of the ~5 s left of it.)

STOPPED = "completed RunOutcome operator_stopped"
TERMINATED = "terminated; nodes exit by dead-man switch"
REPLACED = "node replaced; the prompt ends Done with the undisturbed text; prompt-ready; " + STOPPED


def faulted(node: str) -> str:
    return f"RunFaulted 'node <{node}> exited'"


class CellError(Exception):
    """The cell could not do what it meant to (a phase missed, a step out of time)."""


# ---------------------------------------------------------------------- results
@dataclass
class Result:
    """What a cell saw; ``ok`` when nothing in ``problems``."""

    cell: str
    fault: str
    phase: str
    expected: str
    outcome: str = "-"
    torn_down_s: float | None = None  # end trigger (stop request, node kill) -> run closed
    recovered_s: float | None = None  # fault -> first prompt Done after it
    leaked: list[int] = field(default_factory=list)
    twice: dict[int, str] = field(default_factory=dict)
    prompts: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    fault_at: float | None = None  # monotonic time of the injected fault

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def report(self) -> str:
        lines = [
            f"{self.cell}: {'ok' if self.ok else 'FAILED'} ({self.seconds:.1f} s)",
            f"  expected: {self.expected}",
            f"  outcome:  {self.outcome}",
            f"  prompts:  {', '.join(self.prompts) or '-'}",
            f"  leaked:   {self.leaked or '-'}; started twice: {self.twice or '-'}",
        ]
        lines += [f"  problem:  {p}" for p in self.problems]
        lines += [f"  note:     {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------- the lab
class Lab:
    """One dev server for the cells that do not restart theirs; a folder per cell."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.server: DevServer | None = None
        self.client: Client | None = None

    async def __aenter__(self) -> Lab:
        self.root.mkdir(parents=True, exist_ok=True)
        self.server = start_dev_server(
            str(self.root / "temporal.db"),
            log_file=str(self.root / "temporal.log"),
            stop_with_parent=True,
        )
        self.client = await connect(self.server.address)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proc in node_processes(self.root):
            _killpg(proc.pid)
        if self.server is not None:
            self.server.stop()


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class Census:
    """Every node process of one run, by its ``--resource=`` mark, sampled every 0.2 s
    while the cell runs: a node started twice shows as two pids for one resource."""

    def __init__(self, run_id: int) -> None:
        self.mark = f"--resource=mvp-{run_id}-"
        self.seen: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="census", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for proc in psutil.process_iter(["cmdline"]):
                try:
                    for arg in proc.info["cmdline"] or []:
                        if arg.startswith(self.mark):
                            self.seen.setdefault(arg.removeprefix("--resource="), set()).add(
                                proc.pid
                            )
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self._stop.wait(0.2)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class Scope:
    """What one cell starts: orchestrator workers, its own dev server if it restarts one,
    runs; all of it stopped or killed when the cell ends, whatever happened."""

    def __init__(self, lab: Lab, name: str) -> None:
        self.lab = lab
        self.dir = lab.root / name
        self.state = self.dir / "state"
        self.faults = self.dir / "faults.json"
        self.own_server: DevServer | None = None
        self._own_db = str(self.dir / "temporal.db")
        self.client: Client = _need(lab.client)
        self.address = _need(lab.server).address
        self.orchestrators: list[OrchestratorProcess] = []
        self.handles: list[WorkflowHandle[Any, Any]] = []
        self.censuses: list[Census] = []
        self.probes: list[Probe] = []

    async def __aenter__(self) -> Scope:
        self.state.mkdir(parents=True, exist_ok=True)
        self.faults.write_text("{}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for probe in self.probes:
            probe.close()
        for h in self.handles:
            with contextlib.suppress(RPCError):
                await h.terminate("chaos clean-up")
        for proc in node_processes(self.dir):
            _killpg(proc.pid)
        for orch in self.orchestrators:
            orch.stop()
        for census in self.censuses:
            census.close()
        if self.own_server is not None:
            self.own_server.stop()

    def held_leases(self) -> dict[str, str]:
        """Faults for a run whose nodes' leases report LeaseStarted only once
        :meth:`open_leases` is called: the run cannot leave readiness before that."""
        return {"MVP_FAULT_LEASE_GATE": str(self.dir / "leases-open")}

    def open_leases(self) -> None:
        (self.dir / "leases-open").touch()

    def live_orchestrators(self) -> list[OrchestratorProcess]:
        return [o for o in self.orchestrators if o.proc is not None and o.proc.poll() is None]

    async def own_dev_server(self) -> None:
        """This cell restarts its server: it gets one of its own (a SQLite file here)."""
        self.own_server = start_dev_server(
            self._own_db, log_file=str(self.dir / "temporal.log"), stop_with_parent=True
        )
        self.address = self.own_server.address
        self.client = await connect(self.address)

    async def restart_server(self, down_s: float = 0.0) -> float:
        """Stop the cell's dev server, wait ``down_s``, start it again on the same SQLite
        file and port; returns how long the frontend was unreachable."""
        srv = _need(self.own_server)
        t0 = time.monotonic()
        srv.stop()
        await asyncio.sleep(down_s)
        self.own_server = start_dev_server(
            self._own_db,
            port=srv.port,
            log_file=str(self.dir / "temporal.log"),
            stop_with_parent=True,
        )
        return time.monotonic() - t0

    async def orchestrator(self, tag: str = "a", **env: str) -> OrchestratorProcess:
        """Start an orchestrator worker of this cell (its log under ``orch-<tag>/``)."""
        logs = self.dir / f"orch-{tag}"
        logs.mkdir(exist_ok=True)
        orch = OrchestratorProcess(
            self.address, self.state, logs, {**harness_env(self.faults), **env}
        )
        await asyncio.to_thread(orch.start)
        self.orchestrators.append(orch)
        return orch

    async def start_run(
        self, run_id: int, stages: int, faults: dict[str, str] | None = None, **request: Any
    ) -> WorkflowHandle[Any, Any]:
        """Start run ``run_id`` as the harness does (5 s workflow task timeout)."""
        if self.faults.is_file():
            table = json.loads(self.faults.read_text())
            table[str(run_id)] = faults or {}
            self.faults.write_text(json.dumps(table))
        req = RunRequest.model_validate(
            {
                "model": {"bundled": DEFAULT_BUNDLED},
                "default_max_tokens": 64,
                "pipeline_stages": stages,
                **request,
            }
        )
        self.censuses.append(Census(run_id))
        handle = await start_run(self.client, run_id, req)
        self.handles.append(handle)
        return handle

    async def prompt(
        self, run_id: int, request_id: int, text: str = "Hello", max_tokens: int = 8
    ) -> Probe:
        probe = await Probe.admit(self.client, run_id, request_id, text, max_tokens)
        self.probes.append(probe)
        return probe


def _need(value: Any) -> Any:
    assert value is not None
    return value


# ---------------------------------------------------------------------- prompts
class Probe:
    """One admitted prompt seen as a client sees it: the text deltas and terminal events
    on its stream, and the Update's result, re-attached after an outage."""

    def __init__(self, client: Client, run_id: int, request_id: int, update_id: str) -> None:
        self.client = client
        self.run_id = run_id
        self.request_id = request_id
        self.update_id = update_id
        self.child_id = names.prompt_workflow_id(run_id, request_id, update_id)
        self.deltas = 0
        self.after_terminal = 0  # deltas after the terminal event (it must be the last)
        self.stream_terminals: list[str] = []
        self.result: Done | Fault | None = None
        self.error: str | None = None
        self.done_at: float | None = None
        self.first_delta = asyncio.Event()
        self._stream = asyncio.ensure_future(self._watch_stream())
        self._result = asyncio.ensure_future(self._await_result())

    @classmethod
    async def admit(
        cls, client: Client, run_id: int, request_id: int, text: str, max_tokens: int
    ) -> Probe:
        prompt = SubmitPrompt(request_id=request_id, prompt_text=text, max_tokens=max_tokens)
        handle = await RunHandle(client, run_id).start_prompt(prompt)
        return cls(client, run_id, request_id, handle.id)

    async def _watch_stream(self) -> None:
        offset = 0
        while True:
            try:
                stream = WorkflowStreamClient.create(self.client, self.child_id)
                async for item in stream.subscribe(
                    [names.PROMPT_STREAM_TOPIC],
                    from_offset=offset,
                    result_type=None,
                    poll_cooldown=timedelta(milliseconds=50),
                ):
                    offset = item.offset + 1
                    event = _EVENT.validate_python(item.data)
                    if isinstance(event, TextDelta):
                        self.deltas += 1
                        self.after_terminal += bool(self.stream_terminals)
                        self.first_delta.set()
                    else:
                        self.stream_terminals.append(event.type)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                # Not started yet, an outage, or closed after its terminal event.
                if self.stream_terminals and self.result is not None:
                    return
                await asyncio.sleep(0.2)

    async def _await_result(self) -> None:
        run = self.client.get_workflow_handle(names.run_workflow_id(self.run_id))
        deadline = time.monotonic() + 600
        while True:
            try:
                update = run.get_update_handle(self.update_id, result_type=_TERMINAL)
                self.result = await update.result()
                self.done_at = time.monotonic()
                return
            except WorkflowUpdateFailedError as err:
                self.error = f"update failed: {err.cause}"
                return
            except RPCError as err:
                if time.monotonic() > deadline:
                    self.error = f"no result: {err.message}"
                    return
                await asyncio.sleep(0.5)

    async def wait(self, timeout: float) -> Done | Fault | None:
        """The terminal event, once the stream has had a moment to show its own."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._result), timeout)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._stream), 3)
        return self.result

    def close(self) -> None:
        self._stream.cancel()
        self._result.cancel()

    def summary(self) -> str:
        kind = self.result.type if self.result is not None else (self.error or "none")
        return f"#{self.request_id} {kind} ({self.deltas} deltas)"


# ---------------------------------------------------------------------- waiting
async def until_phase(
    handle: WorkflowHandle[Any, Any],
    phase: RunPhase,
    timeout: float = 90.0,
    extra: Callable[[RunState], bool] | None = None,
    interval: float = 0.03,
) -> RunState:
    """Poll ``snapshot`` until the run reports ``phase`` (and ``extra`` holds); a run
    that is already past it, or stopping, is a missed phase (CellError)."""
    want = _PHASE_ORDER.index(phase)
    last: RunState | None = None

    async def reached() -> RunState | None:
        nonlocal last
        try:
            last = await snapshot(handle)
        except RPCError:  # an outage: ask again
            return None
        if last.phase == phase and (extra is None or extra(last)):
            return last
        if last.phase in _PHASE_ORDER and _PHASE_ORDER.index(last.phase) > want:
            raise CellError(f"phase {phase.value} missed: the run is already {last.phase.value}")
        if last.stopping and phase not in (RunPhase.TEARING_DOWN, RunPhase.TORN_DOWN):
            raise CellError(f"run stopped before {phase.value}: {last.first_fault}")
        return None

    reached_state: RunState = await cell_wait(
        reached,
        timeout,
        f"phase {phase.value}",
        interval=interval,
        detail=lambda: f"last phase: {last and last.phase}",
    )
    return reached_state


async def cell_wait(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.2,
    detail: Callable[[], str] | None = None,
) -> Any:
    """``eventually``, its timeout a CellError: a step of the cell out of time is the
    cell's problem to report, as any other."""
    try:
        return await eventually(
            predicate, timeout=timeout, what=what, interval=interval, detail=detail
        )
    except AssertionError as err:
        raise CellError(str(err)) from None


def progress(state: RunState) -> str:
    """How far startup got: the facts that gate prompt-ready, counted over the nodes."""
    n = len(state.nodes)
    return (
        f"runtime ready {sum(x.runtime_ready is not None for x in state.nodes)}/{n}, "
        f"acked {sum(x.acked for x in state.nodes)}/{n}, "
        f"weights {sum(x.weights_ready for x in state.nodes)}/{n}, "
        f"stage ready {sum(x.stage_ready for x in state.nodes)}/{n}"
    )


def stage(state: RunState, index: int) -> NodeState:
    return next(n for n in state.nodes if n.stage_index == index)


def pid_of(node: NodeState) -> int:
    assert node.handle is not None and node.handle.pid is not None
    return node.handle.pid


# ---------------------------------------------------------------------- holds
class StartGate:
    """Holds provisioning: the orchestrator gets no MVP_EDGE_SECRET, so the process
    provider reads the host's edge secret from ``<state>/edge-secret`` once per node it
    launches (and nothing else reads it); that file is a FIFO here, and each read blocks
    until the cell lets it through (``allow``), so a start is caught inside its activity."""

    def __init__(self, path: Path, secret: bytes = b"chaos-edge-secret-0123456789abcdef") -> None:
        self.path = path
        os.mkfifo(path)
        self._data = secret
        self._cond = threading.Condition()
        self._allowed = 0
        self._closing = False
        self.waiting = 0  # readers held now
        self.served = 0
        self._thread = threading.Thread(target=self._serve, name="start-gate", daemon=True)
        self._thread.start()

    def allow(self, n: int = 1_000_000) -> None:
        with self._cond:
            self._allowed += n
            self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            fd = os.open(self.path, os.O_WRONLY)  # returns once a reader opened it
            with self._cond:
                if self._closing:
                    os.close(fd)
                    return
                self.waiting += 1
                self._cond.wait_for(lambda: self._allowed > 0 or self._closing)
                self.waiting -= 1
                if self._closing:
                    os.close(fd)
                    return
                try:
                    os.write(fd, self._data)
                    self._allowed -= 1
                    self.served += 1
                except BrokenPipeError:
                    pass  # the reader died (its worker was killed): nothing consumed
            os.close(fd)
            # The reader still has the FIFO open until it has read the end: opening it
            # again at once would hold that same reader. Starts are far apart than this.
            time.sleep(0.3)

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # unblock a waiting open
            time.sleep(0.05)
            os.close(fd)
        self._thread.join(5)


# ---------------------------------------------------------------------- oracle
async def close_of(handle: WorkflowHandle[Any, Any], timeout: float) -> tuple[str, str | None]:
    """How the run closed: ("completed", None), ("RunFaulted", message), ...; waits."""
    try:
        await asyncio.wait_for(handle.result(), timeout)
        return "completed", None
    except TimeoutError:
        raise CellError(f"the run did not close within {timeout:.0f} s") from None
    except WorkflowFailureError as err:
        cause = err.cause
        kind = getattr(cause, "type", None) or type(cause).__name__
        return str(kind), str(getattr(cause, "message", cause))


async def final_state(handle: WorkflowHandle[Any, Any]) -> RunState | None:
    """The run's state, asked for up to 10 s through an outage; None if it never answers."""

    async def asked() -> RunState | None:
        with contextlib.suppress(RPCError):
            return await snapshot(handle)
        return None

    with contextlib.suppress(AssertionError):
        return await eventually(asked, timeout=10, what="the run's state", interval=0.5)
    return None


def started_twice(
    state_dir: Path, run_id: int, census: Census, state: RunState | None, seen: dict[int, list[int]]
) -> dict[int, str]:
    """Node ids with more than one process (pids from the resource marks, pid files,
    node logs and the run's handles) or more than one node folder (execution nonce)."""
    pids: dict[int, set[int]] = {}
    dirs: dict[int, list[str]] = {}
    for folder in sorted((state_dir / "nodes").glob(f"mvp-{run_id}-*")):
        node_id = int(folder.name.split("-")[2])
        dirs.setdefault(node_id, []).append(folder.name)
        found = pids.setdefault(node_id, set())
        with contextlib.suppress(OSError, ValueError, KeyError):
            found.add(int(json.loads((folder / "pid.json").read_text())["pid"]))
        with contextlib.suppress(OSError):
            found.update(int(m[1]) for m in _SERVING.findall((folder / "node.log").read_text()))
    for resource, marks in census.seen.items():
        pids.setdefault(int(resource.split("-")[2]), set()).update(marks)
    for node in state.nodes if state is not None else []:
        if node.handle is not None and node.handle.pid is not None:
            pids.setdefault(node.node_id, set()).add(node.handle.pid)
    twice: dict[int, str] = {}
    seen.update({n: sorted(p) for n, p in pids.items()})
    for node_id in sorted(set(pids) | set(dirs)):
        if len(pids.get(node_id, ())) > 1 or len(dirs.get(node_id, [])) > 1:
            twice[node_id] = f"pids {sorted(pids.get(node_id, ()))}, dirs {dirs.get(node_id)}"
    return twice


async def leaked_nodes(state_dir: Path, grace_s: float) -> tuple[list[int], float]:
    """Node processes still alive after ``grace_s``; and how long the last one lived."""
    t0 = time.monotonic()
    with contextlib.suppress(AssertionError):  # some outlived the grace: reported below
        await eventually(
            lambda: node_processes(state_dir) == [],
            timeout=grace_s,
            what="no node process left",
            interval=0.2,
        )
    return [p.pid for p in node_processes(state_dir)], time.monotonic() - t0


async def judge(
    sc: Scope,
    res: Result,
    handle: WorkflowHandle[Any, Any],
    run_id: int,
    *,
    expect: str,
    trigger: float,
    node_id: int | None = None,
    phase_word: str = "",
    prompts: dict[int, str] | None = None,
    close_timeout: float = 90.0,
) -> None:
    """The oracle of every cell: the run closes in its documented state, every admitted
    prompt has exactly one terminal event, no node survives, none was started twice.

    ``expect``: "stopped", "faulted" (node ``node_id`` exited, message starting with
    ``phase_word``), "terminated", or "closed" (however it ended: the cell judged that).
    ``prompts``: request id -> "done" / "fault"."""
    kind, message = await close_of(handle, close_timeout)
    closed = time.monotonic()
    state = await final_state(handle)
    lifecycle = [r.kind for r in state.lifecycle] if state is not None else []
    torn = lifecycle.count(LifecycleKind.RUN_TORN_DOWN)
    if expect == "stopped":
        outcome = RunOutcome.model_validate(await handle.result()) if kind == "completed" else None
        res.outcome = f"{kind}: {outcome.outcome.value}" if outcome else f"{kind}: {message}"
        if outcome is None or outcome.outcome.value != "operator_stopped":
            res.problem(f"expected an operator-stopped RunOutcome, got {res.outcome}")
        elif outcome.first_fault is not None:
            res.problem(f"operator stop with a fault: {outcome.first_fault}")
        if outcome is not None and outcome.first_stop_error is not None:
            res.notes.append(f"first_stop_error: {outcome.first_stop_error}")
        if outcome is not None and outcome.later_faults:
            res.notes.append(f"later_faults: {outcome.later_faults}")
    elif expect == "faulted":
        res.outcome = f"{kind}: {message}"
        if kind != "RunFaulted":
            res.problem(f"expected RunFaulted, got {kind}")
        elif f"node {node_id} exited" not in (message or ""):
            res.problem(f"the fault does not name node {node_id} as exited: {message}")
        elif not (message or "").startswith(phase_word):
            res.problem(f"the fault does not start with {phase_word!r}: {message}")
    elif expect == "closed":
        res.outcome = f"{kind}: {message}" if message is not None else kind
    else:
        status = (await handle.describe()).status
        res.outcome = "terminated" if status == WorkflowExecutionStatus.TERMINATED else str(status)
        if status != WorkflowExecutionStatus.TERMINATED:
            res.problem(f"expected a terminated run, got {status}")
    if expect != "terminated":
        res.torn_down_s = closed - trigger if expect != "closed" else None
        if torn != 1:
            res.problem(f"RunTornDown {torn} times")
        elif lifecycle[-1] is not LifecycleKind.RUN_TORN_DOWN:
            after = lifecycle[lifecycle.index(LifecycleKind.RUN_TORN_DOWN) + 1 :]
            res.problem(f"reports after RunTornDown: {[k.value for k in after]}")
        if expect == "stopped" and LifecycleKind.RUN_FAULTED in lifecycle:
            res.problem("RunFaulted in the lifecycle of an operator-stopped run")
    elif torn:
        res.problem("a terminated run reports RunTornDown")
    _judge_prompts(sc, res, state, prompts or {})
    grace = 20.0 if expect == "terminated" else 2.0
    res.leaked, lived = await leaked_nodes(sc.state, grace)
    if res.leaked:
        res.problem(f"node processes survived {grace:.0f} s after the run closed: {res.leaked}")
    if expect == "terminated":
        res.torn_down_s = None
        res.notes.append(f"last node exited {closed - trigger + lived:.1f} s after terminate")
    census = next(c for c in sc.censuses if c.mark.endswith(f"-{run_id}-"))
    census.close()
    seen: dict[int, list[int]] = {}
    res.twice = started_twice(sc.state, run_id, census, state, seen)
    res.notes.append(f"node pids (marks, pid files, logs, handles): {seen}")
    if res.twice:
        res.problem(f"nodes started twice: {res.twice}")


def _judge_prompts(sc: Scope, res: Result, state: RunState | None, want: dict[int, str]) -> None:
    reports: dict[int, int] = {}
    for r in state.lifecycle if state is not None else []:
        if r.kind in (
            LifecycleKind.PROMPT_COMPLETED,
            LifecycleKind.PROMPT_FAULTED,
            LifecycleKind.PROMPT_CANCELLED,
        ):
            assert r.request_id is not None
            reports[r.request_id] = reports.get(r.request_id, 0) + 1
    for probe in sc.probes:
        res.prompts.append(probe.summary())
        rid = probe.request_id
        if probe.result is None:
            res.problem(f"prompt {rid}: no terminal event ({probe.error})")
            continue
        if len(probe.stream_terminals) != 1:
            res.problem(
                f"prompt {rid}: {len(probe.stream_terminals)} terminal events on its stream"
            )
        if probe.after_terminal:
            res.problem(
                f"prompt {rid}: {probe.after_terminal} text deltas after its terminal event"
            )
        if reports.get(rid, 0) != 1 and state is not None:
            res.problem(f"prompt {rid}: {reports.get(rid, 0)} terminal lifecycle reports")
        expected = want.get(rid)
        if expected is not None and probe.result.type != expected:
            detail = getattr(probe.result, "error", "")
            res.problem(f"prompt {rid}: expected {expected}, got {probe.result.type} {detail}")
        if (
            res.fault_at is not None
            and probe.result.type == "done"
            and probe.done_at is not None
            and probe.done_at > res.fault_at
            and res.recovered_s is None
        ):
            res.recovered_s = probe.done_at - res.fault_at


async def serve_and_stop(
    sc: Scope,
    res: Result,
    handle: WorkflowHandle[Any, Any],
    run_id: int,
    request_id: int,
    prompts: dict[int, str] | None = None,
) -> None:
    """After a fault the run must ride out: prompt-ready, a prompt served, operator stop."""
    await until_phase(handle, RunPhase.PROMPT_READY, timeout=120)
    probe = await sc.prompt(run_id, request_id)
    await probe.wait(60)
    trigger = time.monotonic()
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    await judge(
        sc,
        res,
        handle,
        run_id,
        expect="stopped",
        trigger=trigger,
        prompts={request_id: "done", **(prompts or {})},
    )


def _same_pids(res: Result, before: RunState, after: RunState) -> None:
    a = {n.node_id: n.handle.pid if n.handle else None for n in before.nodes}
    b = {n.node_id: n.handle.pid if n.handle else None for n in after.nodes}
    if any(pid is not None and b.get(nid) != pid for nid, pid in a.items()):
        res.problem(f"node pids changed across the fault: {a} -> {b}")


# ---------------------------------------------------------------------- cells
CellFn = Callable[[Scope, Result], Awaitable[None]]


@dataclass(frozen=True)
class Cell:
    name: str
    fault: str
    phase: str
    expected: str
    timeout_s: int
    fn: CellFn
    how: str  # how the phase is hit
    known_gap: str = ""  # a product gap this cell shows today (the test is an xfail)
    gap_marker: str = ""  # every problem of the gap says this; any other is a failure
    gap_strict: bool = True  # False where the gap shows only when a race goes one way

    def only_gap(self, res: Result) -> bool:
        """The cell failed, and only in the way of its known gap."""
        return bool(self.known_gap and res.problems) and all(
            self.gap_marker in p for p in res.problems
        )


class KnownGap(AssertionError):
    """A cell failed only through its documented product gap (docs/reliability.md)."""


async def orch_kill_planning(sc: Scope, res: Result) -> None:
    run_id = 1201
    orch = await sc.orchestrator("a")
    handle = await sc.start_run(run_id, 1, {"MVP_FAULT_PLAN_DELAY_S": "4"})
    await until_phase(handle, RunPhase.PLANNING, timeout=30)
    await cell_wait(
        lambda: activity_started(handle, names.ACT_PREPARE_PLAN), 30, "prepare_plan to start"
    )
    await until_phase(handle, RunPhase.PLANNING, timeout=5)
    orch.kill9()
    res.fault_at = time.monotonic()
    res.notes.append("killed while prepare_plan ran (MVP_FAULT_PLAN_DELAY_S=4)")
    await sc.orchestrator("b")
    await serve_and_stop(sc, res, handle, run_id, 1)


async def orch_kill_provisioning(sc: Scope, res: Result) -> None:
    run_id = 1202
    gate = StartGate(sc.state / "edge-secret")
    try:
        # Two reads go through: the run's datastream reads the secret once as it starts
        # (to redact the run's edge token), and one node's start; the other start is held.
        gate.allow(2)
        orch = await sc.orchestrator("a", MVP_EDGE_SECRET="")
        handle = await sc.start_run(run_id, 2)
        await cell_wait(
            lambda: gate.waiting >= 1 and gate.served >= 2,
            60,
            "the edge secret read twice and a third read held",
            detail=lambda: f"read {gate.served} time(s), {gate.waiting} held",
        )
        state = await until_phase(
            handle,
            RunPhase.PROVISIONING,
            timeout=60,
            extra=lambda s: any(n.handle is not None for n in s.nodes),
        )
        launched = [n.node_id for n in state.nodes if n.handle is not None]
        held = [n.node_id for n in state.nodes if n.handle is None]
        if len(launched) != 1:
            raise CellError(f"expected one node launched and one held: launched {launched}")
        orch.kill9()
        res.fault_at = time.monotonic()
        res.notes.append(
            f"killed with node {launched[0]} launched and node {held[0]}'s start held in"
            " its activity"
        )
        gate.allow()
        await sc.orchestrator("b", MVP_EDGE_SECRET="")
        await serve_and_stop(sc, res, handle, run_id, 1)
    finally:
        gate.close()


async def _orch_kill_polled(
    sc: Scope,
    res: Result,
    run_id: int,
    phase: RunPhase,
    when: Callable[[RunState], bool],
    faults: dict[str, str] | None = None,
) -> None:
    orch = await sc.orchestrator("a")
    handle = await sc.start_run(run_id, 3, faults)
    state = await until_phase(handle, phase, timeout=90, extra=when)
    orch.kill9()
    res.fault_at = time.monotonic()
    res.notes.append(f"killed at {phase.value}: {progress(state)}")
    sc.open_leases()  # a run held in readiness (the readiness cell) may go on now
    await sc.orchestrator("b")
    after = await until_phase(handle, RunPhase.PROMPT_READY, timeout=120)
    _same_pids(res, state, after)
    await serve_and_stop(sc, res, handle, run_id, 1)


async def orch_kill_readiness(sc: Scope, res: Result) -> None:
    # Once a node has reported NodeRuntimeReady: the leases are then under way, their
    # LeaseStarted held back until the kill (the barrier waits on the head's membership;
    # its route checks and acks run under the second orchestrator).
    await _orch_kill_polled(
        sc,
        res,
        1203,
        RunPhase.READINESS,
        lambda s: any(n.runtime_ready for n in s.nodes),
        sc.held_leases(),
    )


async def orch_kill_stage_provisioning(sc: Scope, res: Result) -> None:
    # While the middle stage loads: the head's stage is up, its edges connecting.
    await _orch_kill_polled(
        sc, res, 1204, RunPhase.STAGE_PROVISIONING, _victim_ready(1, RunPhase.STAGE_PROVISIONING)
    )


async def orch_kill_prompt_ready(sc: Scope, res: Result) -> None:
    run_id = 1205
    orch = await sc.orchestrator("a")
    handle = await sc.start_run(run_id, 2)
    state = await until_phase(handle, RunPhase.PROMPT_READY)
    orch.kill9()
    res.fault_at = time.monotonic()
    await sc.orchestrator("b")
    _same_pids(res, state, await until_phase(handle, RunPhase.PROMPT_READY, timeout=60))
    await serve_and_stop(sc, res, handle, run_id, 1)


async def orch_kill_generation(sc: Scope, res: Result) -> None:
    run_id = 1206
    orch = await sc.orchestrator("a")
    handle = await sc.start_run(run_id, 2, SLOW_TEXT)
    state = await until_phase(handle, RunPhase.PROMPT_READY)
    probe = await sc.prompt(run_id, 1, *LONG_PROMPT)
    await asyncio.wait_for(probe.first_delta.wait(), 60)
    orch.kill9()
    res.fault_at = time.monotonic()
    res.notes.append(f"killed after {probe.deltas} text deltas")
    await sc.orchestrator("b")
    await probe.wait(90)
    if probe.result is not None and probe.result.type == "done" and probe.deltas < 2:
        res.problem("the prompt streamed fewer than 2 deltas: the kill may have missed it")
    _same_pids(res, state, await until_phase(handle, RunPhase.PROMPT_READY, timeout=60))
    await serve_and_stop(sc, res, handle, run_id, 2, prompts={1: "done"})


async def orch_kill_teardown(sc: Scope, res: Result) -> None:
    run_id = 1207
    orch = await sc.orchestrator("a")
    # Each node's stop waits STOP_DELAY_S in its activity (heartbeating), so the window
    # between every StageStopped and the nodes' stops outlasts the snapshot's polling.
    handle = await sc.start_run(run_id, 3, {"MVP_FAULT_STOP_DELAY_S": str(STOP_DELAY_S)})
    await until_phase(handle, RunPhase.PROMPT_READY)
    probe = await sc.prompt(run_id, 1)
    await probe.wait(60)
    trigger = time.monotonic()
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=run_id))
    # Killed once every stage reported StageStopped: the provider stops, the worker's own
    # activities, are then in flight and die with it.
    state = await until_phase(
        handle,
        RunPhase.TEARING_DOWN,
        timeout=30,
        extra=lambda s: all(n.stage_stopped for n in s.nodes),
    )
    orch.kill9()
    res.fault_at = time.monotonic()
    res.notes.append(
        f"killed while tearing down: StageStopped {sum(n.stage_stopped for n in state.nodes)}/3,"
        f" provider-stopped {sum(n.provider_stopped for n in state.nodes)}/3"
    )
    await sc.orchestrator("b")
    await judge(sc, res, handle, run_id, expect="stopped", trigger=trigger, prompts={1: "done"})


def _victim_ready(stage_index: int, phase: RunPhase) -> Callable[[RunState], bool]:
    """When to kill: in readiness once the victim is up and has reported NodeRuntimeReady
    (not a node that never came up); in stage provisioning while its own stage loads."""

    def ready(s: RunState) -> bool:
        node = stage(s, stage_index)
        if phase is RunPhase.READINESS:
            return node.runtime_ready is not None
        if phase is RunPhase.STAGE_PROVISIONING:
            return node.stage_provisioned and not node.weights_ready
        return True

    return ready


def _node_kill(stage_index: int, phase: RunPhase, run_id: int, replace: bool = False) -> CellFn:
    """Kill stage ``stage_index``'s node in ``phase``; ``replace``: in a run whose policy
    replaces lost nodes (DECISIONS 68), which it does once it serves, not in startup."""

    async def cell(sc: Scope, res: Result) -> None:
        await sc.orchestrator("a")
        # In readiness the leases stay held: the run can only leave it by the kill's fault.
        faults = {
            RunPhase.PROMPT_READY: SLOW_TEXT,
            RunPhase.READINESS: sc.held_leases(),
            # A load from the layout cache takes ~0.05 s: held, so the poll sees the phase.
            RunPhase.STAGE_PROVISIONING: {"MVP_FAULT_PROVISION_DELAY_MS": "3000"},
        }.get(phase)
        policy: dict[str, Any] = {"on_node_loss": "replace"} if replace else {}
        if phase is RunPhase.PROMPT_READY and not replace:
            # Nothing may wait for a generate's heartbeat timeout: the prompt on a dead
            # head ends on the run's news of it, one on a live head on its pushed stop
            # (DECISIONS 101); with this timeout a wait for it would outlast the cell.
            policy["timeouts"] = {"generate_heartbeat_s": NEVER_HEARTBEAT_S}
        handle = await sc.start_run(run_id, 3, faults, **policy)
        probe: Probe | None = None
        if phase is RunPhase.PROMPT_READY:
            await until_phase(handle, RunPhase.PROMPT_READY)
            probe = await sc.prompt(run_id, 1, *LONG_PROMPT)
            await asyncio.wait_for(probe.first_delta.wait(), 60)
        when = _victim_ready(stage_index, phase)
        state = await until_phase(handle, phase, timeout=90, extra=when)
        victim = stage(state, stage_index)
        os.kill(pid_of(victim), signal.SIGKILL)
        trigger = res.fault_at = time.monotonic()
        res.notes.append(
            f"killed node {victim.node_id} (stage {stage_index}, pid {pid_of(victim)}) at "
            f"{state.phase.value}: {progress(state)}; its own: runtime ready "
            f"{victim.runtime_ready is not None}, acked {victim.acked}, stage provisioned "
            f"{victim.stage_provisioned}, weights {victim.weights_ready}"
        )
        if replace and probe is not None:
            await _recovered(sc, res, handle, run_id, probe, victim.node_id)
            return
        word = "prompt serving" if phase is RunPhase.PROMPT_READY else f"startup ({phase.value})"
        await judge(
            sc,
            res,
            handle,
            run_id,
            expect="faulted",
            trigger=trigger,
            node_id=victim.node_id,
            phase_word=word,
            prompts={1: "fault"} if probe is not None else None,
        )
        if probe is not None and stage_index == 0:  # (another's loss: the edge's error)
            error = getattr(probe.result, "error", None) or ""
            if f"node {victim.node_id}" not in error:
                res.problem(f"prompt 1's fault does not name the lost node: {error!r}")

    return cell


async def _recovered(
    sc: Scope, res: Result, handle: WorkflowHandle[Any, Any], run_id: int, probe: Probe, lost: int
) -> None:
    """The replace column at generation: the prompt completes with the text the same
    prompt gets on the recovered run, the lost node replaced once, then operator stop."""
    await probe.wait(120)
    state = await until_phase(
        handle, RunPhase.PROMPT_READY, timeout=120, extra=lambda s: s.recoveries_done >= 1
    )
    res.recovered_s = None if probe.done_at is None else probe.done_at - _need(res.fault_at)
    if state.recoveries_done != 1 or [r.lost_node_id for r in state.recoveries] != [lost]:
        res.problem(f"recoveries {[(r.lost_node_id, r.new_node_id) for r in state.recoveries]}")
    if any(n.node_id == lost for n in state.nodes):
        res.problem(f"node {lost} is still one of the run's nodes")
    rec = state.recoveries[-1] if state.recoveries else None
    if rec is not None:
        res.notes.append(
            f"node {lost} replaced by node {rec.new_node_id}: joined "
            f"{rec.seconds(rec.lost_at_ms, rec.joined_at_ms)} s, prompt-ready "
            f"{rec.seconds(rec.lost_at_ms, rec.ready_at_ms)} s after the loss"
        )
    again = await sc.prompt(run_id, 3, *LONG_PROMPT)
    await again.wait(120)
    first, second = probe.result, again.result
    if not (isinstance(first, Done) and isinstance(second, Done)):
        res.problem(f"prompts 1 and 3: {first!r:.120} / {second!r:.120}")
    elif (first.final_text, first.recoveries) != (second.final_text, 1):
        res.problem(
            f"prompt 1 ({first.recoveries} recoveries) is not the undisturbed text: "
            f"{first.final_text[:60]!r} / {second.final_text[:60]!r}"
        )
    await serve_and_stop(sc, res, handle, run_id, 2, prompts={1: "done", 3: "done"})


async def server_restart_prompt_ready(sc: Scope, res: Result) -> None:
    run_id = 1221
    await sc.own_dev_server()
    await sc.orchestrator("a")
    handle = await sc.start_run(run_id, 2)
    state = await until_phase(handle, RunPhase.PROMPT_READY)
    res.fault_at = time.monotonic()
    down = await sc.restart_server()
    res.notes.append(f"frontend down {down:.1f} s")
    _same_pids(res, state, await until_phase(handle, RunPhase.PROMPT_READY, timeout=60))
    await serve_and_stop(sc, res, handle, run_id, 1)


async def server_restart_generation(sc: Scope, res: Result) -> None:
    run_id = 1222
    await sc.own_dev_server()
    await sc.orchestrator("a")
    # A restart well inside the generate's heartbeat timeout (a loaded machine's restart
    # took 4.7 s, against the 5 s that was the default); server-outage-10s@generation is
    # the outage that outlasts one.
    handle = await sc.start_run(
        run_id, 2, SLOW_TEXT, timeouts={"generate_heartbeat_s": RESTART_HEARTBEAT_S}
    )
    state = await until_phase(handle, RunPhase.PROMPT_READY)
    probe = await sc.prompt(run_id, 1, *LONG_PROMPT)
    await asyncio.wait_for(probe.first_delta.wait(), 60)
    res.fault_at = time.monotonic()
    down = await sc.restart_server()
    if down >= RESTART_HEARTBEAT_S:
        res.problem(f"the restart took {down:.1f} s, not inside the heartbeat timeout")
    res.notes.append(f"restarted after {probe.deltas} deltas; frontend down {down:.1f} s")
    await probe.wait(90)
    _same_pids(res, state, await until_phase(handle, RunPhase.PROMPT_READY, timeout=60))
    await serve_and_stop(sc, res, handle, run_id, 2, prompts={1: "done"})


async def server_outage_65s(sc: Scope, res: Result) -> None:
    run_id = 1223
    await sc.own_dev_server()
    await sc.orchestrator("a")
    handle = await sc.start_run(run_id, 2)
    state = await until_phase(handle, RunPhase.PROMPT_READY)
    pids = [pid_of(n) for n in state.nodes]
    res.fault_at = time.monotonic()
    down = await sc.restart_server(down_s=65)
    alive = [p for p in pids if psutil.pid_exists(p)]
    res.notes.append(f"frontend down {down:.1f} s; nodes alive after it: {len(alive)}/{len(pids)}")
    if len(alive) != len(pids):
        res.problem(f"nodes died during the outage: {sorted(set(pids) - set(alive))}")
    after = await until_phase(handle, RunPhase.PROMPT_READY, timeout=60)
    if after.stopping:
        res.problem(f"the run is stopping after the outage: {after.first_fault}")
    _same_pids(res, state, after)
    await serve_and_stop(sc, res, handle, run_id, 1)
    res.notes.append(f"leases scheduled again after the outage: {rescheduled_leases(sc)}")


def rescheduled_leases(sc: Scope) -> int:
    """The run's own word (orchestrator log) that a lease lost its heartbeat while its
    node lived and was scheduled again: the control-plane outage path, not a fault."""
    return sum(
        log.read_text(errors="replace").count("scheduling it again")
        for log in sc.dir.glob("orch-*/*.log")
    )


async def server_outage_generation(sc: Scope, res: Result) -> None:
    run_id = 1224
    await sc.own_dev_server()
    await sc.orchestrator("a")
    # An outage that outlasts the generate's heartbeat timeout (the default, 30 s, would
    # outlast it: the prompt would just go on).
    handle = await sc.start_run(
        run_id, 2, SLOW_TEXT, timeouts={"generate_heartbeat_s": OUTAGE_HEARTBEAT_S}
    )
    state = await until_phase(handle, RunPhase.PROMPT_READY)
    probe = await sc.prompt(run_id, 1, "Once upon a time", 400)
    await asyncio.wait_for(probe.first_delta.wait(), 60)
    res.fault_at = time.monotonic()
    down = await sc.restart_server(down_s=10)
    res.notes.append(f"frontend down {down:.1f} s after {probe.deltas} deltas")
    await probe.wait(90)
    if probe.result is not None and probe.result.type == "fault":
        res.notes.append(f"prompt 1: {probe.result.error}")
    # Past the run's 2 s grace for a suspected fault: a window for a fault that must not
    # come (nothing to wait for).
    await asyncio.sleep(3)
    after = await snapshot(handle)
    if after.stopping:
        res.problem(f"the run faulted with every node alive: {after.first_fault}")
        await judge(sc, res, handle, run_id, expect="closed", trigger=time.monotonic())
        return
    _same_pids(res, state, after)
    await serve_and_stop(sc, res, handle, run_id, 2)


async def terminate_prompt_ready(sc: Scope, res: Result) -> None:
    run_id = 1231
    await sc.orchestrator("a")
    handle = await sc.start_run(run_id, 2)
    await until_phase(handle, RunPhase.PROMPT_READY)
    trigger = res.fault_at = time.monotonic()
    cmd = [
        temporal_binary(),
        "workflow",
        "terminate",
        "--address",
        sc.address,
        "--workflow-id",
        names.run_workflow_id(run_id),
        "--reason",
        "chaos: terminate",
    ]
    done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise CellError(f"temporal workflow terminate failed: {done.stderr.strip()[-300:]}")
    await judge(sc, res, handle, run_id, expect="terminated", trigger=trigger)


async def two_workers_one_killed(sc: Scope, res: Result) -> None:
    run_id = 1241
    workers = {"a": await sc.orchestrator("a"), "b": await sc.orchestrator("b")}
    handle = await sc.start_run(run_id, 2, SLOW_TEXT)
    state = await until_phase(handle, RunPhase.PROMPT_READY)
    probe = await sc.prompt(run_id, 1, *LONG_PROMPT)
    await asyncio.wait_for(probe.first_delta.wait(), 60)
    # The worker that ran the run's latest workflow task holds it in its cache: kill that one.
    identity = ""
    async for event in handle.fetch_history_events():
        if event.HasField("workflow_task_started_event_attributes"):
            identity = event.workflow_task_started_event_attributes.identity
    pid = int(identity.split("@")[0]) if identity[:1].isdigit() else -1
    tag, victim = next(
        ((t, w) for t, w in workers.items() if w.proc is not None and w.proc.pid == pid),
        ("a", workers["a"]),
    )
    victim.kill9()
    res.fault_at = time.monotonic()
    res.notes.append(
        f"killed worker {tag} (pid {pid}, the latest workflow task's identity {identity!r})"
        f" after {probe.deltas} deltas"
    )
    await probe.wait(90)
    _same_pids(res, state, await until_phase(handle, RunPhase.PROMPT_READY, timeout=60))
    await serve_and_stop(sc, res, handle, run_id, 2, prompts={1: "done"})


def _cells() -> list[Cell]:
    cells = [
        Cell(
            "orch-kill@planning",
            "kill -9 orchestrator",
            "planning",
            STOPPED,
            120,
            orch_kill_planning,
            "MVP_FAULT_PLAN_DELAY_S=4: prepare_plan heartbeats 4 s before it plans",
        ),
        Cell(
            "orch-kill@provisioning",
            "kill -9 orchestrator",
            "provisioning",
            STOPPED,
            120,
            orch_kill_provisioning,
            "<state>/edge-secret as a FIFO: the 2nd node's start blocks reading it",
        ),
        Cell(
            "orch-kill@readiness",
            "kill -9 orchestrator",
            "readiness",
            STOPPED,
            150,
            orch_kill_readiness,
            "3-stage run, snapshot polled every 30 ms, killed once a node reported"
            " NodeRuntimeReady",
        ),
        Cell(
            "orch-kill@stage_provisioning",
            "kill -9 orchestrator",
            "stage_provisioning",
            STOPPED,
            150,
            orch_kill_stage_provisioning,
            "3-stage run, snapshot polled every 30 ms, killed while the middle stage loads",
        ),
        Cell(
            "orch-kill@prompt_ready",
            "kill -9 orchestrator",
            "prompt_ready",
            STOPPED,
            120,
            orch_kill_prompt_ready,
            "2-stage run at prompt-ready",
        ),
        Cell(
            "orch-kill@generation",
            "kill -9 orchestrator",
            "generation",
            STOPPED,
            150,
            orch_kill_generation,
            "MVP_FAULT_TEXT_DELAY_MS=20, 160 tokens, killed after the first text delta",
        ),
        Cell(
            "orch-kill@teardown",
            "kill -9 orchestrator",
            "teardown",
            STOPPED,
            120,
            orch_kill_teardown,
            "3-stage run, operator stop, killed in tearing_down once all StageStopped are in",
        ),
    ]
    run_ids = {False: 1211, True: 1251}  # the replace column's runs: 1251 on
    for phase, word in (
        (RunPhase.READINESS, "readiness"),
        (RunPhase.STAGE_PROVISIONING, "stage_provisioning"),
        (RunPhase.PROMPT_READY, "generation"),
    ):
        for replace in (False, True):
            for index, who in enumerate(("head", "middle", "last")):
                how = (
                    "3-stage run, killed after the first text delta (MVP_FAULT_TEXT_DELAY_MS=20)"
                    if phase is RunPhase.PROMPT_READY
                    else "3-stage run, snapshot polled every 30 ms; readiness: once the victim"
                    " reported NodeRuntimeReady; stage provisioning: while its stage loads (held 3 s by"
                    " MVP_FAULT_PROVISION_DELAY_MS: a load from the layout cache takes ~0.05 s)"
                )
                expected = faulted(who)
                if replace:
                    how += '; on_node_loss "replace"'
                    if phase is RunPhase.PROMPT_READY:
                        expected = REPLACED
                cells.append(
                    Cell(
                        f"node-kill:{who}@{word}" + ("+replace" if replace else ""),
                        f"kill -9 {who} node",
                        word,
                        expected,
                        120 if not replace else 180,
                        _node_kill(index, phase, run_ids[replace], replace),
                        how,
                    )
                )
                run_ids[replace] += 1
    cells += [
        Cell(
            "server-restart@prompt_ready",
            "dev server restart",
            "prompt_ready",
            STOPPED,
            120,
            server_restart_prompt_ready,
            "own dev server stopped and started on the same SQLite file and port",
        ),
        Cell(
            "server-restart@generation",
            "dev server restart",
            "generation",
            STOPPED,
            150,
            server_restart_generation,
            "as above, after the first text delta of a slowed prompt",
        ),
        Cell(
            "server-outage-65s@prompt_ready",
            "dev server down 65 s",
            "prompt_ready",
            STOPPED,
            240,
            server_outage_65s,
            "own dev server stopped, 65 s later started on the same file and port",
        ),
        Cell(
            "server-outage-10s@generation",
            "dev server down 10 s",
            "generation",
            STOPPED + " (the prompt may fault)",
            180,
            server_outage_generation,
            "own dev server down 10 s after the first text delta of a slowed prompt",
        ),
        Cell(
            "terminate@prompt_ready",
            "temporal workflow terminate",
            "prompt_ready",
            TERMINATED,
            90,
            terminate_prompt_ready,
            "2-stage run at prompt-ready, `temporal workflow terminate`",
        ),
        Cell(
            "two-workers:one-killed@generation",
            "kill -9 one of 2 orchestrators",
            "generation",
            STOPPED,
            150,
            two_workers_one_killed,
            "2 workers; the one that ran the latest workflow task is killed mid-prompt",
        ),
    ]
    return cells


CELLS: list[Cell] = _cells()
BY_NAME: dict[str, Cell] = {c.name: c for c in CELLS}


async def run_cell(lab: Lab, cell: Cell) -> Result:
    """Run one cell within its time bound; everything it started is gone afterwards."""
    res = Result(cell.name, cell.fault, cell.phase, cell.expected)
    t0 = time.monotonic()
    try:
        async with Scope(lab, _folder(cell.name)) as sc:
            try:
                await asyncio.wait_for(cell.fn(sc, res), cell.timeout_s)
            except TimeoutError:
                res.problem(f"the cell ran past its bound of {cell.timeout_s} s")
            except CellError as err:
                res.problem(str(err))
            finally:
                if not res.prompts:
                    res.prompts = [p.summary() for p in sc.probes]
    except Exception as err:
        res.problem(f"{type(err).__name__}: {err}")
    res.seconds = time.monotonic() - t0
    return res


def _folder(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)
