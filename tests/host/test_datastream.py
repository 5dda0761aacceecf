"""The process host's datastream: record shapes (CONTRACTS "Datastream"), redaction, the
frame archive, live subscribers that never slow the run, the log tailer, the follow client."""

from __future__ import annotations

import io
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from mvp_core import datastream as core
from mvp_core.datastream import (
    CORE_CHANNELS,
    Frame,
    LogStream,
    Redactor,
    decode_payload,
    encode_frame_line,
    frame_line,
)
from mvp_core.models import LifecycleKind, LifecycleReport
from mvp_io.datastream import (
    Datastream,
    FrameArchive,
    LiveSubscribers,
    LogTailer,
    Sink,
    parse_address,
    read_frame_lines,
)
from tests.helpers.waits import wait_until
from workers.host import follow as follow_mod

pytestmark = [pytest.mark.quick, pytest.mark.timeout(120)]

FRAME_KEYS = [
    "arrival_seq",
    "arrival_unix_ms",
    "source",
    "stream",
    "channel",
    "channel_id",
    "position",
    "payload",
]


class Collect(Sink):
    """A sink that keeps every frame offered (synchronously; no thread)."""

    def __init__(self) -> None:
        super().__init__("collect")
        self.frames: list[Frame] = []

    def offer(self, frame: Frame, *, force: bool = False) -> bool:
        self.frames.append(frame)
        return True

    def _wake(self) -> None:
        pass

    def _run(self) -> None:
        pass

    def records(self, channel: str | None = None) -> list[Any]:
        return [
            json.loads(f.payload) for f in self.frames if channel is None or f.channel == channel
        ]


class Reader:
    """A subscriber that reads lines off a live datastream in a thread."""

    def __init__(self, address: str) -> None:
        self.sock = follow_mod.connect(address)
        self.lines: list[dict[str, Any]] = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        f = self.sock.makefile("rb")
        for raw in f:
            self.lines.append(json.loads(raw))

    def close(self) -> None:
        self.sock.close()


# --------------------------------------------------------------------------- shapes


def test_record_shapes_are_the_contracts() -> None:
    b = core.orch_bootstrap("provider_start", "started", 7, 1, {"provider": "process"})
    assert b == {
        "type": "OrchBootstrap",
        "phase": "provider_start",
        "status": "started",
        "run_id": 7,
        "node_id": 1,
        "detail": {"provider": "process"},
    }
    assert list(b) == ["type", "phase", "status", "run_id", "node_id", "detail"]
    assert core.orch_bootstrap("config", "ready", 1, 1)["detail"] == {}
    for status in ("started", "ready", "failed", "sent", "observed"):
        assert core.orch_bootstrap("config", status, 1, 1)["status"] == status
    with pytest.raises(ValueError):
        core.orch_bootstrap("config", "done", 1, 1)
    # The phases are a closed set too (mvp_core.datastream.BootstrapPhase).
    with pytest.raises(ValueError):
        core.orch_bootstrap("x", "ready", 1, 1)

    p = core.orch_prompt_event("prompt_complete", "ready", 7, 1, 42, {"tokens": 3})
    assert list(p) == ["type", "phase", "status", "run_id", "node_id", "request_id", "detail"]
    assert p["type"] == "OrchPromptEvent" and p["request_id"] == 42

    e = core.provision_event(7, 3, "NodeLive", "process", "pid 12")
    assert e == {
        "event": {
            "run_id": 7,
            "node_id": 3,
            "kind": "NodeLive",
            "provider": "process",
            "message": "pid 12",
        }
    }
    for kind in ("ProvisionStart", "NodeLive", "ProvisionFailed", "NodeStopped"):
        assert core.provision_event(1, 1, kind, "docker")["event"]["kind"] == kind
    with pytest.raises(ValueError):
        core.provision_event(1, 1, "NodeDead", "docker")

    line = core.log_line(7, 3, LogStream.STDERR, "boom")
    assert line == {"line": {"run_id": 7, "node_id": 3, "stream": "Stderr", "line": "boom"}}
    assert core.log_line(7, 3, "Provider", "x")["line"]["stream"] == "Provider"
    with pytest.raises(ValueError):
        core.log_line(7, 3, "stdout", "x")


def test_records_where_the_contract_is_silent() -> None:
    rep = LifecycleReport(kind=LifecycleKind.PROMPT_COMPLETED, run_id=7, detail="ok", request_id=4)
    assert core.lifecycle_record(rep, 5) == {
        "type": "OrchLifecycle",
        "kind": "PromptCompleted",
        "run_id": 7,
        "request_id": 4,
        "detail": "ok",
        "index": 5,
    }
    reps = [LifecycleReport(kind=LifecycleKind.RUN_ACCEPTED, run_id=7), rep]
    assert [r["index"] for r in core.lifecycle_records(reps, 1)] == [1]
    assert [r["kind"] for r in core.lifecycle_records(reps)] == ["RunAccepted", "PromptCompleted"]

    route = core.stage_route_record(7, 3, 1, "mvp-node-7-3-ab", "host-9", True, ["host-9"])
    assert route["type"] == "OrchStageRoute" and route["status"] == "observed"
    assert core.stage_route_record(7, 3, 1, "q", "i", False, [], "no poller")["status"] == "failed"

    m = core.membership_record(7, 3, "Alive", {"lease": "started"})
    assert m == {
        "type": "SwimMembership",
        "run_id": 7,
        "node_id": 3,
        "state": "Alive",
        "detail": {"lease": "started"},
    }
    with pytest.raises(ValueError):
        core.membership_record(7, 3, "Zombie")


def test_channels_and_frame_lines() -> None:
    assert core.node_log_channel(3, LogStream.STDOUT) == "mvp.provisioning.logs.node.3.stdout"
    assert core.node_log_channel(3, "Stderr") == "mvp.provisioning.logs.node.3.stderr"
    assert core.node_log_channel(3, "Provider") == "mvp.provisioning.logs.node.3.provider"
    assert core.stdio_channel("Stdout") == "mvp.orch.stdio.stdout"
    assert core.stdio_channel(LogStream.STDERR) == "mvp.orch.stdio.stderr"
    with pytest.raises(ValueError):
        core.stdio_channel("Provider")
    assert CORE_CHANNELS[0] == "mvp.orch.bootstrap"
    assert set(CORE_CHANNELS) == {
        "mvp.orch.bootstrap",
        "mvp.orch.prompt",
        "mvp.orch.lifecycle",
        "mvp.orch.stage_route",
        "mvp.swim.membership",
        "mvp.provisioning.events",
        "mvp.orch.stdio.stdout",
        "mvp.orch.stdio.stderr",
    }

    text = Frame(0, 1700, "orchestrator", "mvp-orchestrator-7", "c", 2, 9, '{"a":"é"}'.encode())
    line = frame_line(text, 11)
    assert list(line) == FRAME_KEYS
    assert line["arrival_seq"] == 11 and line["channel_id"] == 2 and line["position"] == 9
    assert line["payload"] == {"encoding": "utf8", "value": '{"a":"é"}'}
    raw = Frame(0, 1700, "node_datastream", "s", "c", 0, 0, b"\xff\x00a")
    assert frame_line(raw, 0)["payload"] == {"encoding": "bytes", "value": [255, 0, 97]}
    encoded = encode_frame_line(text, 11)
    assert "\n" not in encoded and json.loads(encoded) == line
    assert decode_payload(line) == {"a": "é"}


def test_channel_ids_are_stable_and_positions_count_per_channel() -> None:
    sink = Collect()
    ds = Datastream(run_id=7, node_id=1, sinks=[sink], summary_interval_s=None)
    ds.bootstrap("config", "ready")
    ds.node_log(3, "Stdout", "a")
    ds.bootstrap("run_plan", "started")
    ds.provision_event(3, "ProvisionStart", "process")
    ds.node_log(3, "Stdout", "b")
    ds.node_log(4, "Stderr", "c")
    ids = ds.channels()
    assert [ids[c] for c in CORE_CHANNELS] == list(range(len(CORE_CHANNELS)))
    f = sink.frames
    assert [(x.channel_id, x.position) for x in f if x.channel == "mvp.orch.bootstrap"] == [
        (0, 0),
        (0, 1),
    ]
    logs3 = [x for x in f if x.channel == "mvp.provisioning.logs.node.3.stdout"]
    assert [x.position for x in logs3] == [0, 1]
    assert len({x.channel_id for x in logs3}) == 1 and logs3[0].channel_id >= len(CORE_CHANNELS)
    assert [x.seq for x in f] == list(range(6))
    assert {x.stream for x in f} == {"mvp-orchestrator-7"} and {x.source for x in f} == {
        "orchestrator"
    }
    ds.close()


# --------------------------------------------------------------------------- redaction


SECRET = 'sk-"very\\secret"-token-123'
HF = "hf_" + "A1b2C3d4E5" * 4


def test_redactor_replaces_secrets_and_patterns() -> None:
    r = Redactor([SECRET, "", "abc-secret-longer", "abc-secret"])
    assert r.secret_count == 3
    assert r.redact_text(f"x {SECRET} y") == "x [redacted] y"
    assert r.redact_text("abc-secret-longer") == "[redacted]"
    assert r.redact_text(f"token {HF} end") == "token [redacted] end"
    assert r.redact_text("HF_TOKEN=abcdefgh rest") == "HF_TOKEN=[redacted] rest"
    assert r.redact_text('"VASTAI_API_KEY": "k123456"') == '"VASTAI_API_KEY": "[redacted]"'
    assert r.redact_text("Authorization: Bearer abcdefghijk") == "Authorization: Bearer [redacted]"
    assert r.redact_text("max_tokens: 32, tokens_generated 3") == (
        "max_tokens: 32, tokens_generated 3"
    )
    nested = r.redact({SECRET: [SECRET, {"k": f"..{SECRET}.."}], "n": 3, "b": None})
    assert SECRET not in json.dumps(nested) and nested["n"] == 3
    assert r.redact_bytes(SECRET.encode() + b"\xff") == b"[redacted]\xff"
    env = {"HF_TOKEN": "hf_x" * 4, "SOME_KEY_ENABLED": "1", "PATH": "/usr/bin" * 3}
    assert core.secret_values_from_env(env) == ["hf_x" * 4]
    assert Redactor.from_env(env).redact_text("a hf_xhf_xhf_xhf_x b") == "a [redacted] b"


def test_a_secret_never_reaches_the_archive_or_a_subscriber(tmp_path: Path) -> None:
    archive_path = tmp_path / "frames.jsonl"
    live = LiveSubscribers("127.0.0.1:0")
    ds = Datastream(
        run_id=7,
        node_id=1,
        sinks=[FrameArchive(archive_path), live],
        redactor=Redactor([SECRET]),
    )
    reader = Reader(live.address)
    wait_until(lambda: live.subscriber_count == 1, timeout=20, what="subscriber")
    log = tmp_path / "node.log"
    log.write_text(f"starting with {SECRET}\nHF_TOKEN={HF}\n")
    tailer = LogTailer(ds, log, node_id=3)
    tailer.poll()
    ds.bootstrap("provider_start", "failed", {"error": f"auth {SECRET}", SECRET: 1})
    ds.provision_event(3, "ProvisionFailed", "vastai", f"401 for key {SECRET}")
    ds.stdio_line("Stderr", f"error: {SECRET}")
    ds.publish("mvp.worker.raw", SECRET.encode() + b"\xfe")
    ds.publish("mvp.worker.text", f"raw {HF}")
    ds.publish(f"mvp.worker.{SECRET}", {}, source=SECRET, stream=SECRET)
    n = ds.published
    wait_until(lambda: len(reader.lines) >= n, timeout=20, what="subscriber lines")
    tailer.stop()
    ds.close()
    reader.close()
    texts = [archive_path.read_text(), "\n".join(json.dumps(x) for x in reader.lines)]
    for text in texts:
        assert "[redacted]" in text
        for forbidden in (SECRET, json.dumps(SECRET)[1:-1], HF):
            assert forbidden not in text
    for frame in read_frame_lines(archive_path.read_text()):
        value = decode_payload(frame)
        if isinstance(value, bytes):
            assert SECRET.encode() not in value
        else:
            assert SECRET not in json.dumps(value) and HF not in json.dumps(value)


# --------------------------------------------------------------------------- archive


def test_archive_appends_creates_dirs_and_continues_arrival_seq(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "frames.jsonl"
    ds = Datastream(run_id=7, node_id=1, sinks=[FrameArchive(path)], summary_interval_s=None)
    for i in range(5):
        ds.bootstrap("config", "observed", {"i": i})
    # flushed per record: readable before close
    wait_until(
        lambda: path.exists() and path.read_text().count("\n") == 5, timeout=20, what="5 lines"
    )
    ds.close()
    first = read_frame_lines(path.read_text())
    assert len(first) == 6  # 5 + the closing summary
    assert [x["arrival_seq"] for x in first] == list(range(6))
    for line in first:
        assert list(line) == FRAME_KEYS
        assert line["source"] == "orchestrator" and line["stream"] == "mvp-orchestrator-7"
        assert line["payload"]["encoding"] == "utf8"
    assert [decode_payload(x)["detail"]["i"] for x in first[:5]] == list(range(5))
    summary = decode_payload(first[5])
    assert summary["phase"] == "datastream" and summary["detail"]["final"] is True
    assert summary["detail"]["published"] == 5 and summary["detail"]["drops"] == {"archive": 0}

    # reopen: appends, arrival_seq continues from the line count
    archive = FrameArchive(path)
    assert archive.next_arrival_seq == 6
    ds2 = Datastream(run_id=8, node_id=1, sinks=[archive], summary_interval_s=None)
    ds2.bootstrap("config", "ready")
    ds2.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 8 and all(json.loads(x) for x in lines)
    assert [json.loads(x)["arrival_seq"] for x in lines] == list(range(8))
    assert json.loads(lines[6])["position"] == 0  # a new stream's positions start again

    # a torn last line is completed and counted, the next record starts on its own line
    with open(path, "a") as f:
        f.write('{"torn":')
    archive = FrameArchive(path)
    assert archive.next_arrival_seq == 9
    ds3 = Datastream(run_id=9, node_id=1, sinks=[archive], summary_interval_s=None)
    ds3.bootstrap("config", "ready")
    ds3.close()
    lines = path.read_text().splitlines()
    assert lines[8] == '{"torn":' and json.loads(lines[9])["arrival_seq"] == 9


def test_publish_after_close_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "f.jsonl"
    ds = Datastream(run_id=1, node_id=1, sinks=[FrameArchive(path)])
    ds.close()
    ds.bootstrap("config", "ready")
    ds.close()
    assert ds.published_after_close == 1
    assert len(path.read_text().splitlines()) == 1  # the closing summary only


# --------------------------------------------------------------------------- subscribers


def test_a_subscriber_that_never_reads_does_not_block_publish() -> None:
    live = LiveSubscribers("127.0.0.1:0")
    ds = Datastream(run_id=7, node_id=1, sinks=[live], summary_interval_s=None)
    stuck = socket.create_connection(parse_address(live.address)[1])
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    wait_until(lambda: live.subscriber_count == 1, timeout=20, what="subscriber")
    pad = "x" * 1000
    t0 = time.monotonic()
    for i in range(50_000):
        ds.node_log(3, "Stdout", f"{i} {pad}")
    elapsed = time.monotonic() - t0
    assert elapsed < 30, f"publish took {elapsed:.1f}s"
    wait_until(lambda: live.queued == 0, timeout=20, what="the sink's queue to drain")
    assert ds.drops["subscribers"] > 0
    t0 = time.monotonic()
    ds.close(timeout_s=5.0)
    assert time.monotonic() - t0 < 10
    assert live.subscriber_count == 0
    stuck.close()


def test_two_subscribers_each_get_every_frame_in_order(tmp_path: Path) -> None:
    live = LiveSubscribers("127.0.0.1:0")
    ds = Datastream(run_id=7, node_id=1, sinks=[live], summary_interval_s=None)
    early = ds.published
    ds.bootstrap("config", "ready")  # before anyone attached: nobody gets it
    wait_until(lambda: live.queued == 0, timeout=20, what="the sink's queue to drain")
    a, b = Reader(live.address), Reader(live.address)
    wait_until(lambda: live.subscriber_count == 2, timeout=20, what="two subscribers")
    for i in range(2000):
        ds.node_log(3, "Stdout", str(i))
    ds.close()
    wait_until(lambda: len(a.lines) >= 2001 and len(b.lines) >= 2001, timeout=20, what="frames")
    for r in (a, b):
        logs = [x for x in r.lines if x["channel"] == "mvp.provisioning.logs.node.3.stdout"]
        assert [decode_payload(x)["line"]["line"] for x in logs] == [str(i) for i in range(2000)]
        assert [x["position"] for x in logs] == list(range(2000))
        seqs = [x["arrival_seq"] for x in r.lines]
        assert seqs == sorted(seqs) and seqs[0] > early
        assert decode_payload(r.lines[-1])["phase"] == "datastream"
        r.close()
    assert ds.drops == {"subscribers": 0}


def test_unix_socket_subscribers_and_the_follow_client(tmp_path: Path) -> None:
    sock_path = tmp_path / "run" / "ds.sock"
    live = LiveSubscribers(f"unix:{sock_path}")
    assert live.address == f"unix:{sock_path}"
    assert (os.stat(sock_path).st_mode & 0o777) == 0o600
    ds = Datastream(run_id=7, node_id=1, sinks=[live], summary_interval_s=None)
    out = io.StringIO()
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(follow_mod.follow(live.address, out)))
    t.start()
    wait_until(lambda: live.subscriber_count == 1, timeout=20, what="follower")
    ds.bootstrap("config", "ready")
    ds.node_log(3, "Stdout", "hello")
    ds.close()
    t.join(10)
    assert not t.is_alive() and got == [3]  # ends when the host closes the stream
    lines = read_frame_lines(out.getvalue())
    assert [x["channel"] for x in lines] == [
        "mvp.orch.bootstrap",
        "mvp.provisioning.logs.node.3.stdout",
        "mvp.orch.bootstrap",
    ]
    assert follow_mod.render_text(json.dumps(lines[1])).startswith(
        'mvp.provisioning.logs.node.3.stdout {"line":'
    )
    assert not sock_path.exists()  # unlinked at close

    # a leftover socket file of a dead host is replaced; a live one is refused
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()
    live2 = LiveSubscribers(f"unix:{sock_path}")
    with pytest.raises(OSError):
        LiveSubscribers(f"unix:{sock_path}")
    live2.close()


def test_follow_cli_and_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_address("127.0.0.1:19778") == (socket.AF_INET, ("127.0.0.1", 19778))
    assert parse_address("19778") == (socket.AF_INET, ("127.0.0.1", 19778))
    assert parse_address("[::1]:5")[1] == ("::1", 5)
    assert parse_address("unix:/tmp/x.sock") == (socket.AF_UNIX, "/tmp/x.sock")
    with pytest.raises(ValueError, match="port"):
        parse_address("127.0.0.1:http")
    with pytest.raises(ValueError, match="loopback"):
        LiveSubscribers("0.0.0.0:0")
    with socket.socket() as s:  # a port with no listener
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert follow_mod.main([f"127.0.0.1:{port}", "--connect-timeout", "0.2"]) == 1
    assert "follow 127.0.0.1:" in capsys.readouterr().err


# --------------------------------------------------------------------------- log tailer


def test_log_tailer_follows_a_growing_file_and_flushes_the_last_line(tmp_path: Path) -> None:
    sink = Collect()
    ds = Datastream(run_id=7, node_id=1, sinks=[sink], summary_interval_s=None)
    log = tmp_path / "node.log"  # does not exist yet
    tailer = LogTailer(ds, log, node_id=3, stream="Stderr", poll_interval_s=0.02).start()
    time.sleep(0.05)
    with open(log, "ab") as f:
        f.write(b"one\r\ntwo\n")
        f.flush()
        wait_until(lambda: len(sink.frames) == 2, timeout=20, what="two lines")
        f.write(b"thr")
        f.flush()
        time.sleep(0.1)
        assert len(sink.frames) == 2  # not a complete line yet
        f.write(b"ee\nfour")
        f.flush()
        wait_until(lambda: len(sink.frames) == 3, timeout=20, what="three lines")
    tailer.stop()
    records = sink.records()
    assert [r["line"]["line"] for r in records] == ["one", "two", "three", "four"]
    assert records[0] == {"line": {"run_id": 7, "node_id": 3, "stream": "Stderr", "line": "one"}}
    assert {f.channel for f in sink.frames} == {"mvp.provisioning.logs.node.3.stderr"}
    assert {(f.source, f.stream) for f in sink.frames} == {("node_log", "mvp-node-7-3")}
    assert [f.position for f in sink.frames] == [0, 1, 2, 3]
    assert tailer.poll() == 0  # stopped
    ds.close()


def test_log_tailer_bounds_its_work(tmp_path: Path) -> None:
    sink = Collect()
    ds = Datastream(run_id=7, node_id=1, sinks=[sink], summary_interval_s=None)
    log = tmp_path / "node.log"
    log.write_bytes(b"a" * 25 + b"\n" + b"b\n" * 100 + "é\xff\n".encode("latin-1"))
    tailer = LogTailer(ds, log, node_id=3, max_bytes_per_poll=64, max_line_bytes=10)
    assert tailer.poll() == 3 + 19  # 64 bytes: 25 a (cut 10 + 10 + 5) and 19 "b" lines
    while tailer.poll():
        pass
    lines = [r["line"]["line"] for r in sink.records()]
    assert lines[:3] == ["a" * 10, "a" * 10, "a" * 5]
    assert lines[3:103] == ["b"] * 100
    assert lines[103] == "\ufffd\ufffd"  # not UTF-8: replaced, still a line
    # truncated and rewritten: read again from the start
    log.write_bytes(b"new\n")
    assert tailer.poll() == 1 and sink.records()[-1]["line"]["line"] == "new"
    tailer.stop()
    ds.close()


class Stalled(Sink):
    """A sink whose consumer is stuck (a hung disk, say) until released."""

    def __init__(self, capacity: int) -> None:
        super().__init__("stalled", capacity)
        self.release = threading.Event()
        self._start("stalled")

    def _wake(self) -> None:
        pass

    def _run(self) -> None:
        self.release.wait(30)


def test_a_stuck_sink_drops_and_reports_and_close_is_bounded() -> None:
    stalled, collect = Stalled(capacity=10), Collect()
    ds = Datastream(run_id=7, node_id=1, sinks=[stalled, collect], summary_interval_s=0.0)
    t0 = time.monotonic()
    for i in range(5_000):
        ds.prompt_event("prompt_work", "observed", i)
    assert time.monotonic() - t0 < 30
    assert ds.drops["stalled"] == 5_000 - 10 and ds.drops["collect"] == 0
    summaries = [r for r in collect.records("mvp.orch.bootstrap") if r["phase"] == "datastream"]
    assert summaries and summaries[0]["detail"]["drops"] == {"collect": 0, "stalled": 1}
    assert summaries[0]["detail"]["final"] is False
    t0 = time.monotonic()
    ds.close(timeout_s=0.3)
    assert time.monotonic() - t0 < 15  # bounded, not the stalled sink's 30 s
    final = collect.records("mvp.orch.bootstrap")[-1]
    assert final["detail"]["final"] is True and final["detail"]["drops"]["stalled"] == 4_990
    assert ds.drops["stalled"] > 4_990  # what was still queued at close is lost too
    stalled.release.set()


def test_every_phase_the_host_reports_is_a_bootstrap_phase():
    """The host's model download is a phase of its own (a string the enum did not know
    made every download end the host with a ValueError)."""
    for phase in ("config", "local_runtime", "model_fetch", "prompt_rpc", "shutdown", "orch_exit"):
        assert core.orch_bootstrap(phase, "started", 1, 0)["phase"] == phase


def test_a_late_subscriber_gets_the_replay_then_every_new_frame_once() -> None:
    live = LiveSubscribers("127.0.0.1:0", replay_frames=3)
    ds = Datastream(run_id=8, node_id=0, sinks=[live], summary_interval_s=None)
    for i in range(5):
        ds.node_log(1, "Stdout", f"early {i}")
    wait_until(lambda: live.queued == 0, timeout=20, what="the sink's queue to drain")
    late = Reader(live.address)
    wait_until(lambda: live.subscriber_count == 1, timeout=20, what="a subscriber")
    for i in range(3):
        ds.node_log(1, "Stderr", f"later {i}")
    ds.close()
    wait_until(
        lambda: any(x["channel"] == "mvp.orch.bootstrap" for x in late.lines),
        timeout=20,
        what="end",
    )
    got = [decode_payload(x)["line"]["line"] for x in late.lines if "logs" in x["channel"]]
    # the last 3 frames before it attached (the bound), then each later one, none twice
    assert got == ["early 2", "early 3", "early 4", "later 0", "later 1", "later 2"], got


def test_a_forwarded_frame_keeps_its_identity_and_is_redacted_again() -> None:
    source = Collect()
    run = Datastream(run_id=9, node_id=0, sinks=[source], summary_interval_s=None)
    run.node_log(
        2, "Stderr", "token sk-live-please-hide", source="node_log", stream_id="mvp-node-9-2"
    )
    original = frame_line(source.frames[0], 41)
    sink = Collect()
    host = Datastream(
        run_id=9,
        node_id=0,
        sinks=[sink],
        summary_interval_s=None,
        redactor=Redactor(["sk-live-please-hide"]),
        stream="mvp-host-9",
    )
    host.bootstrap("config", "ready")  # the host's own record, on its own stream
    assert host.forward(json.loads(json.dumps(original)))
    assert not host.forward({"channel": "x"})  # no frame: ignored
    own, passed = sink.frames
    assert own.stream == "mvp-host-9" and own.position == 0
    for field in ("arrival_unix_ms", "source", "stream", "channel", "channel_id", "position"):
        assert getattr(passed, field) == original[field], field
    assert passed.seq == 1  # only the publish sequence is the host's
    assert b"sk-live-please-hide" not in passed.payload and b"[redacted]" in passed.payload


def test_the_host_reads_the_snapshot_rarely_once_it_follows_a_ready_runs_datastream():
    """Past prompt-ready, a host that follows the run's datastream needs the snapshot only
    to see a new datastream address; before, or publishing for itself, it reads it often."""
    from types import SimpleNamespace

    from workers.host.main import FOLLOW_POLL_S, POLL_S, watch_interval

    live, ended = SimpleNamespace(done=False), SimpleNamespace(done=True)
    assert watch_interval(True, False, live) == FOLLOW_POLL_S > POLL_S
    assert watch_interval(False, False, live) == POLL_S
    assert watch_interval(True, True, live) == POLL_S
    assert watch_interval(True, False, ended) == POLL_S
    assert watch_interval(True, False, None) == POLL_S
