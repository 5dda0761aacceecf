"""The dashboard without Temporal: a run's observations shaped into what the page shows,
the event stream's framing and bounds, and that the page only ever reads. The real run
in a real browser is tests/integration/test_dashboard.py."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

import workers.dashboard.hub as hub_module
import workers.dashboard.observer as observer_module
import workers.gateway.dashboard as dashboard
from mvp_core.datastream import Redactor
from mvp_core.models import (
    Done,
    Fault,
    LifecycleKind,
    ModelFacts,
    NodeHandle,
    NodeRuntimeReady,
    PromptHost,
    PromptOutcome,
    PromptStatus,
    ProviderKind,
    RunPhase,
    ServedPrompt,
    ShutdownReason,
)
from mvp_core.planner import build_plan
from mvp_core.run_records import NodeState
from mvp_core.run_state import RunState
from workers.dashboard.hub import Hub, Refused, frames, sse_frame
from workers.dashboard.observer import LocalLogs, Observer
from workers.dashboard.sources import STREAM_PUBLISH_SIGNAL, SourceError, history_times
from workers.dashboard.view import (
    LogTail,
    Observation,
    PromptFigures,
    RunView,
    StageState,
    figures,
    finished_prompts,
    run_view,
    served_figures,
    stage_state,
)
from workers.gateway.app import create_app

HOST = "gw-host"
BIG_ID = 2**56 + 1  # past what a JavaScript number holds exactly
SECRET = "hf_dashboardTestSecret0123456789abcdef"

FACTS = ModelFacts(
    architecture="llama",
    name="SmolLM2 135M",
    block_count=30,
    embedding_length=576,
    context_length=8192,
    eos_token_id=2,
)


def handle(node_id: int, log_path: str | None = None, host: str = HOST) -> NodeHandle:
    return NodeHandle(
        run_id=7,
        node_id=node_id,
        provider=ProviderKind.PROCESS,
        host=host,
        pid=1000 + node_id,
        log_path=log_path,
        resource_name=f"mvp-7-{node_id}-abcdef12",
    )


def node(node_id: int, stage: int, **flags: Any) -> NodeState:
    return NodeState(
        node_id=node_id,
        stage_index=stage,
        task_queue=f"mvp-node-7-{node_id}-abcdef12",
        readiness_id=f"r-{node_id}",
        **flags,
    )


def serving_state() -> RunState:
    """Run 7: 2 stages prompt-ready, one prompt generating, two queued, three finished."""
    plan = build_plan(
        run_id=7,
        orchestrator_node_id=0,
        base_node_id=1,
        stage_count=2,
        max_context=512,
        facts=FACTS,
        model_path="/models/SmolLM2-135M-Instruct.Q4_1.gguf",
        tokenizer_path="/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    ready = {
        "start_attempted": True,
        "lease_started": True,
        "route_owned": True,
        "acked": True,
        "stage_provisioned": True,
        "weights_ready": True,
        "stage_ready": True,
    }
    state = RunState(
        run_id=7,
        nonce="0123456789abcdef-secret-nonce",
        authorized_orchestrator="orch-identity",
        phase=RunPhase.PROMPT_READY,
        plan=plan,
        nodes=[
            node(s.node_id, s.stage_index, handle=handle(s.node_id), **ready) for s in plan.stages
        ],
    )
    state.admit(11, "mvp-run-7-prompt-11-a")
    state.finish_prompt("mvp-run-7-prompt-11-a", True, "", 11)
    state.admit(12, "mvp-run-7-prompt-12-b")
    state.finish_prompt("mvp-run-7-prompt-12-b", False, "cancelled", 12, cancelled=True)
    state.admit(11, "mvp-run-7-prompt-11-c")  # a request id used again after it ended
    state.finish_prompt("mvp-run-7-prompt-11-c", True, "", 11)
    state.admit(BIG_ID, "mvp-run-7-prompt-big")
    state.admit(21, "mvp-run-7-prompt-21-d")
    state.admit(22, "mvp-run-7-prompt-22-e")
    state.activate_next()
    return state


# --------------------------------------------------------------------------- shaping


def test_a_stage_state_follows_the_nodes_facts_and_a_loss_wins():
    progression: list[tuple[dict[str, Any], StageState]] = [
        ({}, StageState.PLANNED),
        ({"start_attempted": True}, StageState.STARTING),
        ({"handle": handle(2)}, StageState.LAUNCHED),
        (
            {
                "runtime_ready": NodeRuntimeReady(
                    run_id=7,
                    node_id=2,
                    stage_index=0,
                    endpoint="127.0.0.1:1",
                    node_actor="q",
                    worker_identity="w",
                    readiness_id="r-2",
                )
            },
            StageState.RUNTIME_READY,
        ),
        ({"acked": True}, StageState.JOINED),
        ({"stage_provisioned": True}, StageState.LOADING),
        ({"weights_ready": True}, StageState.LOADING),  # the stage is not ready yet
        ({"stage_ready": True}, StageState.READY),
        ({"stage_stopped": True}, StageState.STAGE_STOPPED),
        ({"provider_stopped": True}, StageState.STOPPED),
    ]
    flags: dict[str, Any] = {}
    for more, expected in progression:
        flags.update(more)
        assert stage_state(node(2, 0, **flags)) is expected, flags
    assert stage_state(node(2, 0, stage_ready=True, weights_ready=True, exited=True)) is (
        StageState.EXITED
    )
    assert stage_state(node(2, 0, stage_ready=True, lease_lost=True)) is StageState.LOST
    # A node that ends on its own once its stage stopped (a normal stop) is stopped.
    assert stage_state(node(2, 0, stage_stopped=True, exited=True)) is StageState.STOPPED
    assert stage_state(node(2, 0, stage_stopped=True, lease_lost=True)) is (
        StageState.STAGE_STOPPED
    )
    assert stage_state(None) is StageState.PLANNED


def test_a_serving_run_shows_stages_queue_and_recent_prompts():
    state = serving_state()
    figs = {
        "mvp-run-7-prompt-11-a": PromptFigures(
            status=PromptStatus.DONE, tokens=32, elapsed_ms=800, ttft_ms=150, queued_ms=3
        ),
        "mvp-run-7-prompt-12-b": PromptFigures(status=PromptStatus.CANCELLED, ttft_ms=90),
    }
    logs = {2: LogTail(lines=["stage 0 loaded layers [0,15)"])}
    view = run_view("mvp-run-7", 7, "running", state, served=True, figures_of=figs, logs=logs)

    assert (view.phase, view.model, view.stage_count, view.max_seq_len) == (
        "prompt_ready",
        "SmolLM2-135M-Instruct.Q4_1",
        2,
        512,
    )
    rows = [
        (s.stage_index, s.node_id, s.layer_start, s.layer_end, s.host, s.state) for s in view.stages
    ]
    assert rows == [
        (0, 2, 0, 15, HOST, StageState.READY),
        (1, 3, 15, 30, HOST, StageState.READY),
    ]
    assert view.stages[0].pid == 1002 and view.stages[0].log == logs[2]
    assert view.stages[1].log is None
    # FIFO: the first admitted is active, the rest wait in order; ids exact as text.
    assert view.queue.active == str(BIG_ID) and view.queue.pending == ["21", "22"]
    recent = [(p.request_id, p.status, p.tokens, p.tokens_per_s, p.ttft_ms) for p in view.recent]
    assert recent == [
        ("11", "done", 32, 40.0, 150),
        ("12", "cancelled", None, None, 90),
        ("11", "done", None, None, None),  # its figures are not known (yet)
    ]
    assert view.recent[1].error == "cancelled"
    text = view.model_dump_json()
    assert str(BIG_ID) in text and "secret-nonce" not in text and "orch-identity" not in text


def test_recent_prompts_pair_each_end_with_its_admission_and_keep_the_latest():
    state = serving_state()
    done = finished_prompts(state)
    assert [(p.request_id, p.workflow_id, p.ok) for p in done] == [
        (11, "mvp-run-7-prompt-11-a", True),
        (12, "mvp-run-7-prompt-12-b", False),
        (11, "mvp-run-7-prompt-11-c", True),
    ]
    assert [p.workflow_id for p in finished_prompts(state, limit=2)] == [
        "mvp-run-7-prompt-12-b",
        "mvp-run-7-prompt-11-c",
    ]
    assert [p.cancelled for p in done] == [False, True, False]  # PromptCancelled
    # An end whose admission report was trimmed away still shows, without figures.
    state.lifecycle = [r for r in state.lifecycle if r.kind is not LifecycleKind.PROMPT_ACCEPTED]
    assert {p.workflow_id for p in finished_prompts(state)} == {None}


def test_a_stopping_run_and_a_run_without_a_plan():
    state = serving_state()
    state.request_shutdown(ShutdownReason.OPERATOR_REQUESTED)
    state.fault("ignored after the stop")  # kept as a later fact, not the run's fault
    state.phase = RunPhase.TEARING_DOWN
    view = run_view("mvp-run-7", 7, "running", state, served=True, figures_of={}, logs={})
    assert view.stopping and view.shutdown == "operator_requested" and view.fault is None

    early = RunState(run_id=8, nonce="n", authorized_orchestrator="o")
    view = run_view("mvp-run-8", 8, "running", early, served=False, figures_of={}, logs={})
    assert (view.phase, view.stages, view.model, view.queue.active) == ("accepted", [], None, None)
    gone = run_view("mvp-run-9", 9, "not_found", None, served=True, figures_of={}, logs={})
    assert (gone.status, gone.phase) == ("not_found", None)


def test_figures_come_from_the_outcome_and_the_histories_times():
    done = PromptOutcome(
        terminal=Done(
            request_id=1, final_text="x", tokens_generated=10, elapsed_ms=500, stop_reason="eos"
        )
    )
    f = figures(done, started_ms=1000, scheduled_ms=1040, first_text_ms=1210)
    assert (f.status, f.tokens, f.elapsed_ms, f.ttft_ms, f.queued_ms, f.stop_reason) == (
        PromptStatus.DONE,
        10,
        500,
        210,
        40,
        "eos",
    )
    fault = PromptOutcome(
        terminal=Fault(request_id=1, error="cancelled"), status=PromptStatus.CANCELLED
    )
    f = figures(fault, started_ms=1000, scheduled_ms=None, first_text_ms=None)
    assert (f.status, f.tokens, f.ttft_ms, f.queued_ms) == (
        PromptStatus.CANCELLED,
        None,
        None,
        None,
    )


def _event(kind: EventType.ValueType, ms: int, signal: str | None = None) -> HistoryEvent:
    stamp = Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 10**6)
    ev = HistoryEvent(event_type=kind, event_time=stamp)
    if signal is not None:
        ev.workflow_execution_signaled_event_attributes.signal_name = signal
    return ev


def test_history_times_take_the_first_publish_signal_and_the_result():
    events = [
        _event(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED, 5_000),
        _event(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED, 5_010, "activate"),
        _event(EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED, 5_020),
        _event(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED, 5_180, STREAM_PUBLISH_SIGNAL),
        _event(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED, 5_300, STREAM_PUBLISH_SIGNAL),
        _event(EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED, 5_400),
    ]
    times = history_times(events)
    assert (times.started_ms, times.scheduled_ms, times.first_text_ms) == (5_000, 5_020, 5_180)
    assert times.result == []
    assert history_times(events[:3]).result is None  # still running


def test_the_publish_signal_is_the_one_workflow_streams_sends():
    from temporalio.contrib.workflow_streams import _stream

    assert getattr(_stream, "_PUBLISH_SIGNAL", STREAM_PUBLISH_SIGNAL) == STREAM_PUBLISH_SIGNAL


# --------------------------------------------------------------------------- node logs


def test_a_log_tail_is_the_last_lines_redacted_and_other_hosts_are_named(tmp_path: Path):
    log = tmp_path / "node.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)) + f"token in use: {SECRET}\n\n")
    logs = LocalLogs(hostname=HOST, redactor=Redactor([SECRET]))
    tail = logs.tail(handle(2, str(log)))
    assert (
        tail.lines[-1] == "token in use: [redacted]"
        and len(tail.lines) == observer_module.LOG_LINES
    )
    assert tail.lines[0] == f"line {40 - observer_module.LOG_LINES + 1}"
    assert SECRET not in json.dumps(tail.model_dump())
    assert "not readable" in (logs.tail(handle(2, str(log), host="elsewhere")).note or "")
    assert logs.tail(handle(2, str(tmp_path / "none.log"))).note == "no log written yet"
    assert logs.tail(handle(2, None)).note
    # A long log: only its end is read, and the cut first line is dropped.
    log.write_text("x" * (observer_module.LOG_READ_BYTES * 2) + "\nlast\n")
    assert logs.tail(handle(2, str(log))).lines == ["last"]


# --------------------------------------------------------------------------- observer


class FakeSource:
    """Temporal's answers as a script: each run's status and snapshot, counted."""

    def __init__(self) -> None:
        self.status: dict[str, tuple[str, str | None]] = {}
        self.states: dict[str, RunState | Exception] = {}
        self.running: list[str] = []
        self.figs: dict[str, PromptFigures] = {}
        self.fetching: dict[int, tuple[int, int]] = {}
        self.calls: list[tuple[str, str]] = []

    async def describe(self, workflow_id: str) -> tuple[str, str | None]:
        self.calls.append(("describe", workflow_id))
        return self.status.get(workflow_id, ("not_found", None))

    async def snapshot(self, workflow_id: str) -> RunState:
        self.calls.append(("snapshot", workflow_id))
        got = self.states[workflow_id]
        if isinstance(got, Exception):
            raise got
        return got.model_copy(deep=True)

    async def running_runs(self, limit: int) -> list[str]:
        return self.running[:limit]

    async def fetches(self, workflow_id: str) -> dict[int, tuple[int, int]]:
        self.calls.append(("fetches", workflow_id))
        return dict(self.fetching)

    async def prompt_figures(self, workflow_id: str) -> PromptFigures:
        self.calls.append(("figures", workflow_id))
        if workflow_id not in self.figs:
            raise SourceError("no history")
        return self.figs[workflow_id]

    async def served_figures(
        self, run_workflow_id: str, request_id: int, key: str
    ) -> PromptFigures:
        self.calls.append(("served", key))
        if key not in self.figs:
            raise SourceError("no longer kept by its run")
        return self.figs[key]

    def count(self, what: str, workflow_id: str | None = None) -> int:
        return sum(1 for c in self.calls if c[0] == what and workflow_id in (None, c[1]))


def observer(source: FakeSource, **kw: Any) -> Observer:
    return Observer(source, 7, logs=LocalLogs(hostname=HOST), **kw)  # type: ignore[arg-type]


async def test_the_observer_follows_a_run_from_absent_to_closed():
    src = FakeSource()
    obs = observer(src, others=False)
    first = await obs.observe()
    assert [(r.workflow_id, r.status, r.phase) for r in first.runs] == [
        ("mvp-run-7", "not_found", None)
    ]
    src.status["mvp-run-7"] = ("running", "exec-1")
    src.states["mvp-run-7"] = serving_state()
    src.figs["mvp-run-7-prompt-11-a"] = PromptFigures(
        status=PromptStatus.DONE, tokens=8, elapsed_ms=100
    )
    serving = (await obs.observe()).runs[0]
    assert (serving.status, serving.phase, len(serving.stages)) == ("running", "prompt_ready", 2)
    assert serving.recent[0].tokens_per_s == 80.0
    await obs.observe()
    # A prompt's figures are read once; one without a readable history is tried a few
    # times, then shown without.
    assert src.count("figures", "mvp-run-7-prompt-11-a") == 1
    for _ in range(5):
        await obs.observe()
    assert src.count("figures", "mvp-run-7-prompt-12-b") == observer_module.FIGURE_TRIES

    # The snapshot query stops answering: the last state stays, with a note.
    src.states["mvp-run-7"] = SourceError("snapshot query failed: no worker")
    stale = (await obs.observe()).runs[0]
    assert stale.phase == "prompt_ready" and stale.note == "snapshot query failed: no worker"

    closed = serving_state()
    closed.phase = RunPhase.TORN_DOWN
    src.status["mvp-run-7"] = ("completed", "exec-1")
    src.states["mvp-run-7"] = closed
    before = src.count("snapshot")
    for _ in range(3):
        view = (await obs.observe()).runs[0]
        assert (view.status, view.phase) == ("completed", "torn_down")
    assert src.count("snapshot") == before + 1  # a closed execution is read once
    # The same workflow id started again: a new execution is read again.
    src.status["mvp-run-7"] = ("running", "exec-2")
    src.states["mvp-run-7"] = RunState(run_id=7, nonce="n", authorized_orchestrator="o")
    assert (await obs.observe()).runs[0].phase == "accepted"


async def test_a_run_hosted_prompts_figures_come_from_its_run_not_a_history():
    """DECISIONS 66: a run that serves its prompts itself has no prompt workflows: their
    figures come from what the run kept (served_figures), each read once."""
    src = FakeSource()
    state = serving_state()
    state.prompt_host = PromptHost.RUN
    src.status["mvp-run-7"] = ("running", "exec-1")
    src.states["mvp-run-7"] = state
    src.figs["mvp-run-7-prompt-11-a"] = PromptFigures(
        status=PromptStatus.DONE, tokens=8, elapsed_ms=100
    )
    obs = observer(src, others=False)
    for _ in range(3):
        view = (await obs.observe()).runs[0]
    assert view.recent[0].tokens_per_s == 80.0
    assert src.count("served", "mvp-run-7-prompt-11-a") == 1 and src.count("figures") == 0


def test_a_run_hosted_prompts_figures_are_its_queue_wait_and_the_head_nodes_timing():
    from mvp_core.models import PromptTiming

    done = Done(request_id=6, final_text="x", tokens_generated=8, elapsed_ms=400, stop_reason="eos")
    timing = PromptTiming(encode_ms=3, prefill_ms=120, first_delta_ms=1, decode_tokens_per_s=20)
    served = ServedPrompt(
        workflow_id="k",
        outcome=PromptOutcome(terminal=done, timing=timing, queued_ms=50),
        admitted_ms=1_000,
    )
    f = served_figures(served)
    assert (f.ttft_ms, f.queued_ms, f.tokens, f.decode_tokens_per_s) == (174, 50, 8, 20)


async def test_other_open_runs_come_from_visibility_without_the_served_one():
    src = FakeSource()
    src.running = ["mvp-run-9", "mvp-run-7", "mvp-run-8"]
    for wid, n in (("mvp-run-7", 7), ("mvp-run-8", 8), ("mvp-run-9", 9)):
        src.status[wid] = ("running", "e")
        src.states[wid] = RunState(run_id=n, nonce="n", authorized_orchestrator="o")
    got = await observer(src).observe()
    assert [(r.workflow_id, r.served) for r in got.runs] == [
        ("mvp-run-7", True),
        ("mvp-run-9", False),
        ("mvp-run-8", False),
    ]


# --------------------------------------------------------------------------- stream


def test_sse_frames_put_each_line_of_data_on_its_own_line():
    assert sse_frame('{"a": 1}', 4) == b'id: 4\ndata: {"a": 1}\n\n'
    assert sse_frame("x\ny") == b"data: x\ndata: y\n\n"


class ScriptedObserver:
    def __init__(self) -> None:
        self.phase = "accepted"
        self.calls = 0
        self.idled = 0

    async def observe(self) -> Observation:
        self.calls += 1
        run = RunView(workflow_id="mvp-run-7", run_id=7, served=True, status="running")
        run.phase = self.phase
        return Observation(served="mvp-run-7", runs=[run])

    async def pace(self, interval_s: float) -> None:
        await asyncio.sleep(interval_s)

    def idle(self) -> None:
        self.idled += 1

    async def aclose(self) -> None:
        pass


async def _next_data(gen: Any) -> dict[str, Any]:
    while True:
        chunk = await asyncio.wait_for(gen.__anext__(), 5)
        if b"data: " in chunk:
            data = chunk.decode().split("data: ", 1)[1]
            parsed: dict[str, Any] = json.loads(data)
            return parsed


async def test_a_stream_sends_a_frame_only_when_the_observation_changed():
    scripted = ScriptedObserver()
    hub = Hub(scripted, interval_s=0.01)  # type: ignore[arg-type]
    sub = hub.subscribe()
    gen = frames(hub, sub, keepalive_s=0.05, lifetime_s=30)
    assert await gen.__anext__() == f"retry: {hub_module.RETRY_MS}\n\n".encode()
    assert (await _next_data(gen))["runs"][0]["phase"] == "accepted"
    calls = scripted.calls
    # Unchanged observations: only keepalive comments, though the poller goes on.
    for _ in range(3):
        assert await asyncio.wait_for(gen.__anext__(), 5) == b": keepalive\n\n"
    assert scripted.calls > calls and hub.version == 1
    scripted.phase = "planning"
    assert (await _next_data(gen))["runs"][0]["phase"] == "planning"
    assert hub.version == 2
    await gen.aclose()
    assert hub.streams == 0 and not hub.polling and hub.latest is None
    assert scripted.idled == 1  # no page open: the datastream is not followed


async def test_a_stream_ends_after_its_lifetime_and_streams_are_bounded():
    hub = Hub(ScriptedObserver(), interval_s=0.01, max_streams=2)  # type: ignore[arg-type]
    sub = hub.subscribe()
    chunks = [c async for c in frames(hub, sub, lifetime_s=0.3, keepalive_s=0.1)]
    assert chunks[0].startswith(b"retry: ") and any(b"data: " in c for c in chunks)
    assert hub.streams == 0 and not hub.polling
    a, b = hub.subscribe(), hub.subscribe()
    with pytest.raises(Refused) as err:
        hub.subscribe()
    assert err.value.status == 503
    a.close()
    a.close()  # closing twice releases once
    assert hub.streams == 1
    b.close()
    assert not hub.polling


# --------------------------------------------------------------------------- the app


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Any:
    src = FakeSource()
    src.status["mvp-run-7"] = ("running", "e")
    src.states["mvp-run-7"] = serving_state()
    monkeypatch.setattr(dashboard, "TemporalSource", lambda client: src)
    return create_app(client=None, run_id=7)  # type: ignore[arg-type]


async def test_the_page_is_self_contained_and_only_reads(app: Any):
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as h:
        page = await h.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        html = page.text
        # No other origin (no CDN), and the only request the script makes is its stream.
        assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", html)
        assert 'new EventSource("dashboard/events")' in html
        for call in ("fetch(", "XMLHttpRequest", "sendBeacon", "WebSocket", "<form", "POST"):
            assert call not in html, call
        assert (await h.post("/dashboard/events")).status_code == 405
        assert (await h.post("/dashboard")).status_code == 405
    routes = [r for r in app.routes if getattr(r, "path", "").startswith("/dashboard")]
    assert {r.path for r in routes} == {"/dashboard", "/dashboard/events"}
    assert all(r.methods <= {"GET", "HEAD"} for r in routes)


async def test_a_stream_ends_cleanly_when_the_client_goes_away(app: Any):
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []
    first_frame = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if b"data: " in message.get("body", b""):
            first_frame.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/dashboard/events",
        "raw_path": b"/dashboard/events",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"gw")],
        "client": ("127.0.0.1", 1),
        "server": ("gw", 80),
        "state": {},
    }
    call = asyncio.ensure_future(app(scope, receive, send))
    await asyncio.wait_for(first_frame.wait(), 10)
    start = sent[0]
    assert start["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    body = b"".join(m.get("body", b"") for m in sent)
    frame = json.loads(body.split(b"data: ", 1)[1].split(b"\n", 1)[0])
    assert frame["served"] == "mvp-run-7" and frame["runs"][0]["phase"] == "prompt_ready"
    gone.set()
    await asyncio.wait_for(call, 5)
    hub = _hub(app)
    assert hub.streams == 0 and not hub.polling


def _hub(app: Any) -> Hub:
    for route in app.routes:
        if getattr(route, "path", "") == "/dashboard/events":
            owner = route.endpoint.__self__
            assert isinstance(owner, dashboard.Dashboard)
            return owner.hub
    raise AssertionError("no dashboard route")


def test_the_decode_rate_is_the_head_nodes_own_when_it_reports_its_timing():
    from mvp_core.models import PromptTiming
    from workers.dashboard.view import FinishedPrompt, prompt_view

    done = Done(
        request_id=5, final_text="x", tokens_generated=33, elapsed_ms=1000, stop_reason="eos"
    )
    timed = PromptOutcome(
        terminal=done,
        timing=PromptTiming(encode_ms=1, prefill_ms=200, first_delta_ms=2, decode_tokens_per_s=40),
    )
    finished = FinishedPrompt(request_id=5, workflow_id="w", ok=True, detail="")
    view = prompt_view(finished, figures(timed, started_ms=0, scheduled_ms=10, first_text_ms=250))
    assert view.tokens_per_s == 40.0  # decode alone, not 33 tokens / 1 s with the prefill
    untimed = figures(
        PromptOutcome(terminal=done), started_ms=0, scheduled_ms=10, first_text_ms=250
    )
    assert prompt_view(finished, untimed).tokens_per_s == 33.0


def test_a_prompt_whose_text_went_direct_takes_its_ttft_from_the_head_nodes_timing():
    """No stream signal in its history (DECISIONS 63): its time to first token is the
    workflow's queue wait plus the head node's encode, prefill and first delta."""
    from mvp_core.models import PromptTiming

    done = Done(request_id=6, final_text="x", tokens_generated=8, elapsed_ms=400, stop_reason="eos")
    timing = PromptTiming(encode_ms=3, prefill_ms=120, first_delta_ms=1, decode_tokens_per_s=20)
    direct = PromptOutcome(terminal=done, timing=timing, queued_ms=50)
    f = figures(direct, started_ms=0, scheduled_ms=10, first_text_ms=None)
    assert (f.ttft_ms, f.queued_ms) == (174, 10)
    # the published text's time wins where there is one
    f = figures(direct, started_ms=0, scheduled_ms=10, first_text_ms=300)
    assert f.ttft_ms == 300
    # and nothing is made up for a prompt without timing
    f = figures(PromptOutcome(terminal=done), started_ms=0, scheduled_ms=10, first_text_ms=None)
    assert f.ttft_ms is None


async def test_closing_the_viewers_ends_open_streams_at_once_and_refuses_new_ones():
    hub = Hub(ScriptedObserver(), interval_s=0.01)  # type: ignore[arg-type]
    sub = hub.subscribe()
    gen = frames(hub, sub, keepalive_s=30, lifetime_s=300)
    assert (await gen.__anext__()).startswith(b"retry: ")
    await _next_data(gen)
    rest = asyncio.ensure_future(_drain_frames(gen))
    await asyncio.sleep(0.05)
    assert not rest.done()  # waiting for a change (keepalive in 30 s)
    hub.close()
    await asyncio.wait_for(rest, 2)  # ended now, not after its keepalive or lifetime
    assert hub.streams == 0 and not hub.polling
    with pytest.raises(Refused) as err:
        hub.subscribe()
    assert err.value.status == 503


async def _drain_frames(gen: Any) -> None:
    async for _ in gen:
        pass


# --------------------------------------------------------------------------- layout

# Every table of a card and how far it reaches: its box, its content width, its card's
# inner right edge (less the padding).
MEASURE = """() => [...document.querySelectorAll("section.run")].flatMap(card => {
  const style = getComputedStyle(card);
  const inner = card.getBoundingClientRect().right - parseFloat(style.paddingRight)
                - parseFloat(style.borderRightWidth);
  return [...card.querySelectorAll("table")].map(t => ({
    name: t.className || t.parentElement.className,
    right: t.getBoundingClientRect().right, scroll: t.scrollWidth,
    parent: t.parentElement.getBoundingClientRect().width, inner }));
})"""


def crowded_observation() -> dict[str, Any]:
    """A serving run whose prompt table holds the widest cells it gets: 16-digit request
    ids, 4-digit token counts, times in seconds, long errors."""
    state = serving_state()
    figs: dict[str, PromptFigures] = {}
    for i in range(6):
        rid = 2**53 - 1 - i
        wf = f"mvp-run-7-prompt-{rid}-x"
        state.admit(rid, wf)
        error = "prompt serving fault: generate on mvp-node-7-2-abcdef12 failed: lost"
        state.finish_prompt(wf, i % 2 == 0, "" if i % 2 == 0 else error, rid)
        figs[wf] = PromptFigures(
            status=PromptStatus.DONE,
            tokens=4096,
            elapsed_ms=123_456,
            ttft_ms=12_345,
            queued_ms=65_432,
        )
    view = run_view("mvp-run-7", 7, "running", state, served=True, figures_of=figs, logs={})
    return Observation(served="mvp-run-7", runs=[view]).model_dump(mode="json")


async def test_the_prompt_table_fits_its_card_at_1400_px():
    from tests.helpers.browser import chromium

    html = (Path(hub_module.__file__).parent / "page.html").read_text()
    async with chromium(width=1400) as page:
        await page.set_content(html)
        await page.evaluate("obs => render(obs)", crowded_observation())
        tables = await page.evaluate(MEASURE)
        badges = await page.evaluate(
            "() => [...document.querySelectorAll('.recent .badge')].map(b => b.getClientRects().length)"
        )
    assert len(tables) == 2, tables  # the stages and the recent prompts
    for t in tables:
        assert t["right"] <= t["inner"] + 0.5, t  # inside the card's padding
        assert t["scroll"] <= t["parent"] + 0.5, t  # nothing cut off inside its column
    assert badges and set(badges) == {1}  # a status badge keeps to one line


def test_a_stage_recovery_shows_while_it_runs_and_after():
    """DECISIONS 68: the stage being replaced and how far, then each recovery's times;
    the stage row shows the replacement node."""
    from mvp_core.models import NodeLossPolicy

    state = serving_state()
    state.node_loss = NodeLossPolicy.REPLACE
    state.on_node_exited(2, "exit code -9", at_ms=10_000)
    view = run_view("mvp-run-7", 7, "running", state, served=True, figures_of={}, logs={})
    assert view.phase == "recovering" and view.recovering is not None
    assert "node 2 lost" in view.recovering
    _, new = state.begin_replacement(10_500)
    view = run_view("mvp-run-7", 7, "running", state, served=True, figures_of={}, logs={})
    assert view.recovering is not None and f"node {new.node_id} replacing node 2" in view.recovering
    row = view.stages[new.stage_index]
    assert row.node_id == new.node_id and row.state == "planned"
    state.replacement_joined(14_000)
    state.next_epoch()
    state.recovered(17_250)
    view = run_view("mvp-run-7", 7, "running", state, served=True, figures_of={}, logs={})
    assert view.recovering is None and view.recoveries_done == 1 and view.phase == "prompt_ready"
    (rec,) = view.recoveries
    assert (rec.stage_index, rec.lost_node_id, rec.new_node_id) == (new.stage_index, 2, new.node_id)
    assert (rec.joined_s, rec.ready_s) == (4.0, 7.25)


async def test_a_share_being_fetched_shows_how_far_it_is_then_what_was_fetched():
    """A hub run whose second node is still fetching its share (its start activity's
    heartbeat): the stage shows the bytes held of its share; once started, the handle's
    figures. A run without a hub model, or with every node started, is not asked."""
    from mvp_core.models import HubPart, HubPin

    src = FakeSource()
    obs = observer(src, others=False)
    state = serving_state()
    assert state.plan is not None
    state.plan.hub = HubPin(
        endpoint="https://huggingface.co",
        repo="acme/m-GGUF",
        commit="a" * 40,
        parts=[
            HubPart(file="m.gguf", size=10**8, etag="e", header_bytes=100, header_sha256="0" * 64)
        ],
    )
    state.phase = RunPhase.PROVISIONING
    state.nodes[1].handle = None
    second = state.nodes[1].node_id
    src.status["mvp-run-7"] = ("running", "exec-1")
    src.states["mvp-run-7"] = state
    src.fetching = {second: (12_500_000, 50_000_000)}
    row = (await obs.observe()).runs[0].stages[1]
    assert (row.fetching_mb, row.share_mb, row.fetched_mb) == (12.5, 50.0, None)
    assert src.count("fetches") == 1
    state.nodes[1].handle = handle(second)
    src.states["mvp-run-7"] = state
    row = (await obs.observe()).runs[0].stages[1]
    assert row.fetching_mb is None
    assert src.count("fetches") == 1  # every node started: not asked again


def test_only_a_start_activitys_fetch_details_count_as_progress():
    from temporal.client.fetches import fetch_progress as _fetch_progress

    good = {"fetch": {"node_id": 3, "bytes_held": 5, "bytes_total": 9, "seconds": 1.0}}
    assert _fetch_progress(good) == (3, 5, 9)
    for bad in (
        "test delay",
        None,
        {"fetch": "x"},
        {"fetch": {"node_id": 3, "bytes_held": 10, "bytes_total": 9}},
        {"fetch": {"node_id": True, "bytes_held": 1, "bytes_total": 9}},
        {"fetch": {"node_id": 3, "bytes_held": "1", "bytes_total": 9}},
    ):
        assert _fetch_progress(bad) is None, bad


# Each request id shown (the recent prompts' first cell, the queue's chips): its lines,
# and how far right it reaches against its card's inner edge.
REQUEST_IDS = """() => [...document.querySelectorAll('.recent tr.prompt td:first-child, .queue .rid')].map(e => {
  const range = document.createRange();
  range.selectNodeContents(e);
  let lines = 0, bottom = -Infinity;
  for (const r of range.getClientRects()) if (r.top >= bottom - 1) { lines++; bottom = r.bottom; }
  const card = e.closest("section.run"), style = getComputedStyle(card);
  const inner = card.getBoundingClientRect().right - parseFloat(style.paddingRight)
                - parseFloat(style.borderRightWidth);
  return { text: e.textContent, lines, right: e.getBoundingClientRect().right, inner };
})"""


def long_ids_observation() -> dict[str, Any]:
    """The longest request ids there are (20 digits, u64), finished, generating and queued."""
    state = serving_state()
    top = 2**64 - 1
    figs: dict[str, PromptFigures] = {}
    for i in range(4):
        wf = f"mvp-run-7-prompt-{top - i}-x"
        state.admit(top - i, wf)
        state.finish_prompt(
            wf, i % 2 == 0, "" if i % 2 == 0 else "cancelled", top - i, cancelled=i % 2 == 1
        )
        figs[wf] = PromptFigures(
            status=PromptStatus.DONE, tokens=4096, elapsed_ms=123_456, ttft_ms=12_345
        )
    for i in range(4, 10):
        state.admit(top - i, f"mvp-run-7-prompt-{top - i}-x")
    state.activate_next(2)
    view = run_view("mvp-run-7", 7, "running", state, served=True, figures_of=figs, logs={})
    return Observation(served="mvp-run-7", runs=[view]).model_dump(mode="json")


async def test_long_request_ids_keep_to_one_line_inside_their_card():
    from tests.helpers.browser import chromium

    html = (Path(hub_module.__file__).parent / "page.html").read_text()
    obs = long_ids_observation()
    async with chromium(width=1400) as page:
        await page.set_content(html)
        for width in (1400, 1024):  # side by side, then stacked
            await page.set_viewport_size({"width": width, "height": 900})
            await page.evaluate("obs => render(obs)", obs)
            ids = await page.evaluate(REQUEST_IDS)
            tables = await page.evaluate(MEASURE)
            assert sum(str(2**64 - 1) in i["text"] for i in ids) == 1, ids
            assert sum(len(i["text"]) >= 20 for i in ids) >= 9, ids  # queued and finished
            for i in ids:
                assert i["lines"] == 1, (width, i)
                assert i["right"] <= i["inner"] + 0.5, (width, i)
            for t in tables:
                assert t["right"] <= t["inner"] + 0.5 and t["scroll"] <= t["parent"] + 0.5, t
