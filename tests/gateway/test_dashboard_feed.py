"""The dashboard follows the served run's datastream (issue 21 defect 10, DECISIONS 58):
a real ``LiveSubscribers`` server fed by a real ``Datastream``, as the run's datastream
activity makes them, and the dashboard's ``Observer`` over a scripted Temporal source."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection
from typing import Any

import pytest

import workers.dashboard.observer as dashboard
from mvp_core import datastream as ds
from mvp_core.models import DatastreamAddress, LifecycleKind, LifecycleReport, RunPhase
from mvp_core.run_state import RunState
from mvp_io.datastream import Datastream, LiveSubscribers
from tests.gateway.test_dashboard import HOST, SECRET, FakeSource, serving_state
from tests.helpers.waits import eventually
from workers.dashboard.feed import DatastreamFeed, event_text, node_of_log_channel
from workers.dashboard.observer import LocalLogs, LogTail, Observer

RUN = 7
# A secret only the gateway knows, in no shape the stream's own patterns catch: the feed
# redacts with the gateway's secrets too.
GATEWAY_SECRET = "correct horse battery staple"


@pytest.fixture
async def stream() -> AsyncIterator[tuple[Datastream, LiveSubscribers]]:
    live = LiveSubscribers("127.0.0.1:0", replay_frames=1000)
    stream = Datastream(run_id=RUN, node_id=0, sinks=[live], summary_interval_s=None)
    try:
        yield stream, live
    finally:
        await asyncio.to_thread(stream.close, 2.0)


def with_datastream(address: str, host: str = HOST) -> RunState:
    state = serving_state()
    state.datastream = DatastreamAddress(
        run_id=RUN, address=address, archive="/nowhere/frames.jsonl", host=host
    )
    return state


class CountedLogs(LocalLogs):
    """LocalLogs that remember which nodes' files they were asked for."""

    def __init__(self) -> None:
        super().__init__(hostname=HOST)
        self.read: list[int] = []

    def tails(self, state: RunState, skip: Collection[int] = ()) -> dict[int, LogTail]:
        got = super().tails(state, skip)
        self.read += got
        return got


def watched(src: FakeSource) -> Observer:
    feed = DatastreamFeed(HOST, ds.Redactor([SECRET, GATEWAY_SECRET]), reconnect_s=0.05)
    return Observer(src, RUN, logs=CountedLogs(), feed=feed, others=False)  # type: ignore[arg-type]


def publish_start(stream: Datastream) -> None:
    stream.publish(
        ds.CHANNEL_BOOTSTRAP,
        ds.orch_bootstrap(ds.BootstrapPhase.PROVIDER_START, ds.BootstrapStatus.STARTED, RUN, 2),
    )
    stream.publish(
        ds.CHANNEL_PROVISIONING_EVENTS,
        ds.provision_event(RUN, 2, ds.ProvisionEventKind.PROVISION_START, "process"),
    )
    stream.publish(
        ds.node_log_channel(2, ds.LogStream.PROVIDER),
        ds.log_line(RUN, 2, ds.LogStream.PROVIDER, "renting offer 17"),
    )
    stream.publish(
        ds.node_log_channel(2, ds.LogStream.STDOUT),
        ds.log_line(RUN, 2, ds.LogStream.STDOUT, "stage 0 loaded layers [0,15) in 1.50s"),
    )
    stream.publish(
        ds.node_log_channel(2, ds.LogStream.STDERR),
        ds.log_line(RUN, 2, ds.LogStream.STDERR, f"warning: {GATEWAY_SECRET} and {SECRET}"),
    )
    report = LifecycleReport(kind=LifecycleKind.RUN_READY, run_id=RUN, detail="2 stage(s)")
    stream.publish(ds.CHANNEL_LIFECYCLE, ds.lifecycle_record(report, 3))


async def test_the_served_runs_log_lines_and_events_come_from_its_datastream(
    stream: Any, monkeypatch: pytest.MonkeyPatch
):
    ds_stream, live = stream
    monkeypatch.setattr(dashboard, "FOLLOWED_EVERY_S", 60.0)
    publish_start(ds_stream)
    src = FakeSource()
    src.status["mvp-run-7"] = ("running", "e")
    src.states["mvp-run-7"] = with_datastream(live.address)
    obs = watched(src)
    try:
        await obs.observe()  # learns the address and starts following it
        await eventually(
            lambda: obs.feed.frames >= 6,
            timeout=10,
            what="the stream's first frames read",
            interval=0.01,
        )
        logs = obs.logs
        assert isinstance(logs, CountedLogs)
        logs.read.clear()
        view = (await obs.observe()).runs[0]
        # The node the stream has lines of: its log file is not read at all.
        assert logs.read == [3], logs.read
        assert view.datastream == f"following the run's datastream at {live.address}"
        node2 = next(s for s in view.stages if s.node_id == 2)
        assert node2.log is not None and node2.log.source == "datastream"
        assert node2.log.lines == [
            "[provider] renting offer 17",
            "stage 0 loaded layers [0,15) in 1.50s",
            "[stderr] warning: [redacted] and [redacted]",
        ], node2.log.lines
        # Node 3 has no datastream lines: its log file is read as before (none here).
        node3 = next(s for s in view.stages if s.node_id == 3)
        assert node3.log is not None and node3.log.source == "file"
        assert [e.text for e in view.events] == [
            "node 2 provider_start started",
            "node 2 ProvisionStart (process)",
            "RunReady: 2 stage(s)",
        ]
        assert all(e.at_ms > 0 for e in view.events)
        assert SECRET not in view.model_dump_json()
        assert GATEWAY_SECRET not in view.model_dump_json()

        # A new frame is what wakes the poller: pace() returns on it, long before the
        # followed run's idle interval (made a minute here).
        obs.feed.changed.clear()
        pacing = asyncio.ensure_future(obs.pace(0.01))
        await asyncio.sleep(0.05)
        assert not pacing.done()
        ds_stream.publish(
            ds.node_log_channel(2, ds.LogStream.STDOUT),
            ds.log_line(RUN, 2, ds.LogStream.STDOUT, "prompt 11 done"),
        )
        await asyncio.wait_for(pacing, 10)
        view = (await obs.observe()).runs[0]
        assert next(s for s in view.stages if s.node_id == 2).log.lines[-1] == "prompt 11 done"  # type: ignore[union-attr]

        # No page open: the feed stops; a page that opens again gets the stream's replay,
        # not the lines twice.
        obs.idle()
        await eventually(
            lambda: not obs.feed.live, timeout=10, what="the feed paused", interval=0.01
        )
        frames_before = obs.feed.frames
        await obs.observe()
        await eventually(
            lambda: obs.feed.live and obs.feed.frames >= frames_before,
            timeout=10,
            what="resumed",
            interval=0.01,
        )
        lines = (await obs.observe()).runs[0].stages[0].log.lines  # type: ignore[union-attr]
        assert lines.count("prompt 11 done") == 1, lines

        # The stream closes with the run: what was read stays, and the page says it ended.
        await asyncio.to_thread(ds_stream.close, 2.0)
        await eventually(
            lambda: obs.feed.ended, timeout=10, what="the stream's end seen", interval=0.01
        )
        view = (await obs.observe()).runs[0]
        assert view.datastream == f"the run's datastream at {live.address} ended"
        assert view.stages[0].log is not None and view.stages[0].log.source == "datastream"
    finally:
        await obs.aclose()


async def test_a_datastream_elsewhere_or_unreachable_is_a_note_and_files_stay(
    monkeypatch: pytest.MonkeyPatch,
):
    src = FakeSource()
    src.status["mvp-run-7"] = ("running", "e")
    src.states["mvp-run-7"] = with_datastream("127.0.0.1:9", host="another-host")
    obs = watched(src)
    try:
        view = (await obs.observe()).runs[0]
        assert view.datastream == (
            "the run's datastream is on host another-host: not readable from here"
        )
        assert not obs.feed.live and all(
            s.log is None or s.log.source == "file" for s in view.stages
        )
        # On this host but nobody listening (the activity gone): a note, retried later.
        src.states["mvp-run-7"] = with_datastream("127.0.0.1:9")
        await obs.observe()
        await eventually(
            lambda: obs.feed.note is not None and "cannot follow" in obs.feed.note,
            timeout=10,
            what="note",
            interval=0.01,
        )
        view = (await obs.observe()).runs[0]
        assert view.datastream is not None and view.datastream.startswith(
            "cannot follow the run's datastream at 127.0.0.1:9"
        )
        # Without a live feed the poller keeps its own pace (no frame will wake it).
        monkeypatch.setattr(dashboard, "FOLLOWED_EVERY_S", 60.0)
        await asyncio.wait_for(obs.pace(0.01), 5)
    finally:
        await obs.aclose()


async def test_other_runs_are_not_followed():
    src = FakeSource()
    src.running = ["mvp-run-9"]
    src.status["mvp-run-9"] = ("running", "e")
    src.states["mvp-run-9"] = with_datastream("127.0.0.1:9")
    src.states["mvp-run-9"].run_id = 9
    src.status["mvp-run-7"] = ("running", "e")
    src.states["mvp-run-7"] = serving_state()
    feed = DatastreamFeed(HOST, ds.Redactor([SECRET]))
    obs = Observer(src, RUN, logs=LocalLogs(hostname=HOST), feed=feed)  # type: ignore[arg-type]
    observed = await obs.observe()
    assert [r.workflow_id for r in observed.runs] == ["mvp-run-7", "mvp-run-9"]
    assert observed.runs[1].datastream is None and observed.runs[1].events == []
    assert feed.address is None and observed.runs[0].datastream == (
        "the run has told no datastream yet"
    )


def test_event_lines_and_log_channels():
    assert node_of_log_channel("mvp.provisioning.logs.node.12.stderr") == 12
    assert node_of_log_channel("mvp.provisioning.logs.node.x.stderr") is None
    assert node_of_log_channel(ds.CHANNEL_LIFECYCLE) is None
    boot = ds.orch_bootstrap(
        ds.BootstrapPhase.WEIGHTS_LOADED, ds.BootstrapStatus.READY, RUN, 3, {"ms": 12}
    )
    assert event_text(ds.CHANNEL_BOOTSTRAP, boot) == 'node 3 weights_loaded ready: {"ms":12}'
    health = ds.orch_bootstrap(ds.BootstrapPhase.DATASTREAM, ds.BootstrapStatus.OBSERVED, RUN, 0)
    assert event_text(ds.CHANNEL_BOOTSTRAP, health) is None  # the stream's own health
    member = ds.membership_record(RUN, 3, ds.MembershipState.DEAD)
    assert event_text(ds.CHANNEL_MEMBERSHIP, member) == "node 3 Dead"
    failed = ds.provision_event(
        RUN, 3, ds.ProvisionEventKind.PROVISION_FAILED, "vastai", "HTTP 500"
    )
    assert event_text(ds.CHANNEL_PROVISIONING_EVENTS, failed) == (
        "node 3 ProvisionFailed (vastai): HTTP 500"
    )
    assert event_text(ds.CHANNEL_LIFECYCLE, "not a record") is None
    assert event_text("mvp.unknown", {"type": "OrchLifecycle"}) is None


def test_a_frame_that_is_not_json_or_has_no_channel_is_skipped():
    feed = DatastreamFeed(HOST, ds.Redactor([SECRET]))
    for raw in (b"not json\n", b'{"payload": {}}\n', b'{"channel": "x"}\n', b"[1]\n"):
        feed.absorb(raw)
    assert feed.frames == 0 and feed.tails() == {} and feed.events() == []


def provisioning_state(address: str) -> RunState:
    """Run 7 planned, its nodes not yet asked to start: what the snapshot said last."""
    state = with_datastream(address)
    state.phase = RunPhase.PROVISIONING
    state.lifecycle = state.lifecycle[:3]
    state.lifecycle_recorded = 3
    state.prompts_completed = state.prompts_faulted = state.prompts_cancelled = 0
    state.active, state.pending, state.also_active = None, [], []
    for n in state.nodes:
        for flag in ("start_attempted", "lease_started", "route_owned", "acked"):
            setattr(n, flag, False)
        n.stage_provisioned = n.weights_ready = n.stage_ready = False
        n.handle = None
    return state


async def test_the_served_runs_state_is_fed_by_its_datastream_before_any_snapshot(
    stream: Any, monkeypatch: pytest.MonkeyPatch
):
    """A node's steps and the run's lifecycle reach the page as the frames arrive; the
    snapshot is read again only for what the stream does not carry (issue 38 item 5)."""
    ds_stream, live = stream
    monkeypatch.setattr(dashboard, "SNAPSHOT_EVERY_S", 3600.0)
    monkeypatch.setattr(dashboard, "SNAPSHOT_ASKED_S", 3600.0)
    src = FakeSource()
    src.status["mvp-run-7"] = ("running", "e")
    src.states["mvp-run-7"] = provisioning_state(live.address)
    obs = watched(src)
    try:
        first = (await obs.observe()).runs[0]
        assert first.phase == "provisioning" and {s.state for s in first.stages} == {"planned"}
        await eventually(lambda: obs.feed.live, timeout=10, what="following", interval=0.01)
        reads = obs.snapshots
        ds_stream.publish(
            ds.CHANNEL_PROVISIONING_EVENTS,
            ds.provision_event(RUN, 2, ds.ProvisionEventKind.PROVISION_START, "process"),
        )
        ds_stream.publish(
            ds.CHANNEL_PROVISIONING_EVENTS,
            ds.provision_event(RUN, 2, ds.ProvisionEventKind.NODE_LIVE, "process", "mvp-7-2"),
        )
        ds_stream.publish(
            ds.CHANNEL_PROVISIONING_EVENTS,
            ds.provision_event(RUN, 3, ds.ProvisionEventKind.PROVISION_START, "process"),
        )
        for phase, status in (
            (ds.BootstrapPhase.NODE_RUNTIME_READY, ds.BootstrapStatus.OBSERVED),
            (ds.BootstrapPhase.RUNTIME_READY_ACK, ds.BootstrapStatus.SENT),
            (ds.BootstrapPhase.STAGE_PROVISION, ds.BootstrapStatus.SENT),
        ):
            ds_stream.publish(ds.CHANNEL_BOOTSTRAP, ds.orch_bootstrap(phase, status, RUN, 2))
        ready = LifecycleReport(kind=LifecycleKind.RUN_READINESS_STARTED, run_id=RUN)
        ds_stream.publish(ds.CHANNEL_LIFECYCLE, ds.lifecycle_record(ready, 3))
        await eventually(lambda: obs.feed.frames >= 7, timeout=10, what="frames", interval=0.01)
        view = (await obs.observe()).runs[0]
        assert obs.snapshots == reads  # no snapshot read: the stream said it
        assert view.phase == "readiness"
        assert [s.state for s in view.stages] == ["loading", "starting"]

        # The stream's end of the run, before the snapshot shows it.
        for index, kind in enumerate(
            (LifecycleKind.RUN_TEARING_DOWN, LifecycleKind.RUN_TORN_DOWN), start=4
        ):
            report = LifecycleReport(kind=kind, run_id=RUN)
            ds_stream.publish(ds.CHANNEL_LIFECYCLE, ds.lifecycle_record(report, index))
        ds_stream.publish(
            ds.CHANNEL_PROVISIONING_EVENTS,
            ds.provision_event(RUN, 2, ds.ProvisionEventKind.NODE_STOPPED, "process"),
        )
        await eventually(lambda: obs.feed.frames >= 10, timeout=10, what="frames", interval=0.01)
        view = (await obs.observe()).runs[0]
        assert obs.snapshots == reads
        assert view.phase == "torn_down" and view.stopping
        assert view.stages[0].state == "stopped"
        # A snapshot older than the stream never takes a step back; one past it wins.
        assert obs.feed.facts.wants_snapshot  # RunTornDown asks for the run's last read
        view = (await obs.observe(final=True)).runs[0]
        assert obs.snapshots == reads + 1 and view.phase == "torn_down"
    finally:
        await obs.aclose()


async def test_each_nodes_own_channels_show_in_its_stage_row(stream: Any):
    """DECISIONS 93: the latest of a node's load, steps, KV slots and edge rates, by the
    node of the frame's stream (never the record's own word)."""
    ds_stream, live = stream

    def own(node: int, channel: str, record: dict[str, Any], position: int = 0) -> None:
        payload = ds.encode_record(record)
        ds_stream.relay(ds.node_stream_id(RUN, node), channel, position, payload)

    own(
        2,
        ds.CHANNEL_NODE_LOAD,
        ds.node_load_record(RUN, 2, 0, (0, 15), 10**6, 63 * 10**6, "loading", 5),
    )
    own(
        2,
        ds.CHANNEL_NODE_LOAD,
        ds.node_load_record(RUN, 2, 0, (0, 15), 63 * 10**6, 63 * 10**6, "loaded", 9),
        1,
    )
    own(2, ds.CHANNEL_NODE_STEPS, ds.node_steps_record(RUN, 2, 0, interval_ms=500, steps=10, prefill_steps=1,
                                                       busy_ms=24.0, max_ms=9.0, largest_batch=1, steps_total=10))  # fmt: skip
    own(2, ds.CHANNEL_NODE_KV, ds.node_kv_record(RUN, 2, 0, 1, 8))
    own(2, ds.CHANNEL_NODE_EDGES, ds.node_edges_record(RUN, 2, 0, interval_ms=500, in_bytes_per_s=1500,
                                                       out_bytes_per_s=42000, edges=[(1, "out", 9)]))  # fmt: skip
    # Node 3 speaks of node 2 in its record: it is node 3's row that shows it.
    own(3, ds.CHANNEL_NODE_KV, ds.node_kv_record(RUN, 2, 1, 5, 8))
    # A node channel on a stream that is no node's is not a node's figure.
    ds_stream.publish(ds.CHANNEL_NODE_KV, ds.node_kv_record(RUN, 2, 0, 7, 8))
    src = FakeSource()
    src.status["mvp-run-7"] = ("running", "e")
    src.states["mvp-run-7"] = with_datastream(live.address)
    obs = watched(src)
    try:
        await obs.observe()
        await eventually(
            lambda: obs.feed.frames >= 7, timeout=10, what="the frames read", interval=0.01
        )
        view = (await obs.observe()).runs[0]
        node2 = next(s for s in view.stages if s.node_id == 2)
        node3 = next(s for s in view.stages if s.node_id == 3)
        assert node2.own is not None and node3.own is not None
        assert (node2.own.load_status, node2.own.loaded_mb, node2.own.load_total_mb) == (
            "loaded",
            63.0,
            63.0,
        )
        assert (node2.own.step_ms, node2.own.steps_per_s) == (2.4, 20.0)
        assert (node2.own.kv_in_use, node2.own.kv_total) == (1, 8)
        assert (node2.own.in_kb_s, node2.own.out_kb_s) == (1.5, 42.0)
        assert (node3.own.kv_in_use, node3.own.load_status) == (5, None)
    finally:
        await obs.aclose()
