"""Every run has a datastream (issue 21, DECISIONS 58): a run started without the host
(here straight through the client, as the gateway, the ``temporal`` CLI or the demo do)
is followed live and read from its archive afterwards; its lifecycle, node logs (stderr
apart from stdout, native writes included) and provisioning events are there, secrets
are not."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import threading
from pathlib import Path
from typing import Any

from mvp_core import names
from mvp_core.datastream import decode_payload
from mvp_core.edge_auth import ANSWER, ANSWER_REJECT, NODE_DATASTREAM_EDGE_ID, hello
from mvp_core.models import DatastreamAddress, Done, RequestShutdown, RunPhase, SubmitPrompt
from mvp_core.stage_share import stage_tensors
from mvp_io.gguf_files import open_model
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled
from temporal.client import RunHandle
from tests.helpers.waits import eventually
from tests.integration.conftest import EDGE_SECRET, SECRET, Runs, run_failure, wait_phase
from workers.host import follow as follow_mod

NATIVE = "native-write-7f3a"


class Follower:
    """``mvp-follow``'s loop in a thread, collecting frame lines until the stream ends."""

    def __init__(self, address: str) -> None:
        self.out = io.StringIO()
        self.thread = threading.Thread(
            target=follow_mod.follow, args=(address, self.out), daemon=True
        )
        self.thread.start()

    def frames(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the live datastream did not end with the run"
        return [json.loads(line) for line in self.out.getvalue().splitlines() if line]


def identity(frame: dict[str, Any]) -> tuple[Any, ...]:
    """A frame as its publisher made it (``arrival_seq`` is each sink's own)."""
    return tuple(frame[k] for k in ("source", "stream", "channel", "channel_id", "position"))


def records(frames: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(f["channel"], decode_payload(f)) for f in frames]


def kinds(frames: list[dict[str, Any]]) -> list[str]:
    return [r["kind"] for ch, r in records(frames) if ch == "mvp.orch.lifecycle"]


def lines(frames: list[dict[str, Any]], channel: str) -> list[str]:
    return [r["line"]["line"] for ch, r in records(frames) if ch == channel]


def events(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["event"] for ch, r in records(frames) if ch == "mvp.provisioning.events"]


async def address_of(runs: Runs, run_id: int) -> DatastreamAddress:
    found = await RunHandle(runs.client, run_id).datastream(wait_s=60)
    assert found is not None, "the run's datastream never told its address"
    return found


async def test_a_run_started_without_the_host_has_a_datastream(runs: Runs, state_dir: Path) -> None:
    run_id = 2701
    # The node writes a secret of its environment too (HF_TOKEN): it never shows.
    handle = await runs.start(run_id, faults={"MVP_FAULT_NATIVE_WRITE": f"{NATIVE} {SECRET}"})
    ds = await address_of(runs, run_id)
    assert ds.run_id == run_id and ds.address.startswith("127.0.0.1:")
    assert Path(ds.archive) == state_dir / "runs" / str(run_id) / "frames.jsonl"
    live = Follower(ds.address)
    await wait_phase(handle, RunPhase.PROMPT_READY)
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
    await handle.result()
    frames = live.frames()

    # Live: a follower attaching late gets the run from its start (the activity's replay),
    # through RunTornDown: the very frames of the archive.
    assert kinds(frames)[0] == "RunAccepted" and kinds(frames)[-1] == "RunTornDown"
    archived = follow_mod.read_archive(Path(ds.archive))
    assert [identity(f) for f in frames] == [identity(f) for f in archived]

    # The archive holds it all, for a reader that comes after the run.
    seen = kinds(archived)
    assert seen[0] == "RunAccepted" and seen[-1] == "RunTornDown", seen
    for kind in ("RunPlanningReady", "RunProvisioningStarted", "RunReady", "RunTearingDown"):
        assert kind in seen, seen
    assert all(
        f["stream"] == f"mvp-orchestrator-{run_id}"
        for f in archived
        if f["source"] == "orchestrator"
    )
    # The node's stdout and stderr apart; a native write to fd 1 / fd 2 reaches each.
    out = lines(archived, "mvp.provisioning.logs.node.1.stdout")
    err = lines(archived, "mvp.provisioning.logs.node.1.stderr")
    assert f"{NATIVE} [redacted] stdout" in out, out[:20]
    assert f"{NATIVE} [redacted] stderr" in err, err[:20]
    assert not any("stderr" in line for line in out if NATIVE in line), out[:20]
    assert not any("stdout" in line for line in err if NATIVE in line), err[:20]
    assert any(" INFO " in line for line in err), err[:20]  # the node's logging: stderr
    assert any("serving" in line for line in out), out[:20]
    assert all(f["stream"] == f"mvp-node-{run_id}-1" for f in archived if f["source"] == "node_log")
    kinds_of_events = [e["kind"] for e in events(archived)]
    assert kinds_of_events[:2] == ["ProvisionStart", "NodeLive"], kinds_of_events
    assert "NodeStopped" in kinds_of_events
    # The provider's own progress (its log) is on the node's provider channel.
    provider = lines(archived, "mvp.provisioning.logs.node.1.provider")
    assert any("starting node 1" in line for line in provider), provider
    text = Path(ds.archive).read_text()
    assert SECRET not in text and EDGE_SECRET not in text
    # The fault planted the secret in the node's raw output (a node is never given it):
    # the datastream redacted what the files hold. The planted lines go, so the
    # session's secret scan (test_zz_secret_scan.py) still judges all the product wrote.
    raw = sorted((state_dir / "nodes").glob(f"mvp-{run_id}-1-*/node.*"))
    planted = [p for p in raw if SECRET in p.read_text(errors="replace")]
    assert {p.name for p in planted} == {"node.log", "node.err"}, raw
    for p in planted:
        p.write_text(p.read_text(errors="replace").replace(SECRET, "[planted by the test]"))

    # mvp-follow --run-id of a closed run reads its archive.
    printed = io.StringIO()
    code = await asyncio.to_thread(
        follow_mod.main_with,
        [
            "--run-id",
            str(run_id),
            "--text",
            "--address",
            runs.client.service_client.config.target_host,
        ],
        printed,
    )
    assert code == 0
    assert "mvp.orch.lifecycle" in printed.getvalue() and "RunTornDown" in printed.getvalue()


async def test_a_node_the_provider_cannot_start_is_a_provision_failed_event(
    runs: Runs, state_dir: Path
) -> None:
    run_id = 2702
    handle = await runs.start(run_id, faults={"MVP_FAULT_START_FAIL": "1"})
    ds = await address_of(runs, run_id)
    cause = await run_failure(handle)
    assert "injected start failure" in cause, cause
    frames = follow_mod.read_archive(Path(ds.archive))
    failed = [e for e in events(frames) if e["kind"] == "ProvisionFailed"]
    assert failed and failed[0]["node_id"] == 1 and failed[0]["provider"] == "process"
    assert "injected start failure of node 1" in failed[0]["message"], failed
    # The startup fault is a failure record of the phase that failed (DECISIONS 81).
    boot = [
        r for ch, r in records(frames) if ch == "mvp.orch.bootstrap" and r["status"] == "failed"
    ]
    assert [r["phase"] for r in boot] == ["provider_start"], boot
    assert "injected start failure" in boot[0]["detail"]["error"]
    assert kinds(frames)[-1] == "RunTornDown", kinds(frames)


def node_frames(frames: list[dict[str, Any]], node_id: int, channel: str) -> list[dict[str, Any]]:
    return [
        f
        for f in frames
        if f["source"] == "node_datastream"
        and f["stream"].endswith(f"-{node_id}")
        and f["channel"] == channel
    ]


def stage_total(model: Path, start: int, end: int, layers: int) -> int:
    files = open_model(str(model))
    try:
        wanted = stage_tensors(files.header, start, end, first=start == 0, last=end == layers)
    finally:
        files.close()
    return sum(t.n_bytes for t in wanted)


async def test_every_node_publishes_its_own_channels_into_the_runs_datastream(
    runs: Runs, tmp_path: Path
) -> None:
    """Issue 38 item 2 (DECISIONS 93): each node of a 2-stage run publishes its load in
    bytes, its steps, its edges and its KV slots; the run's datastream passes them on (the
    archive, a live follower), in order per channel, beside the node's log lines; a
    follower of a node's datastream without the run's token is refused."""
    run_id = 2703
    gate = tmp_path / "text-open"  # the prompt holds its KV slots until the test looked
    handle = await runs.start(run_id, pipeline_stages=2, faults={"MVP_FAULT_TEXT_GATE": str(gate)})
    ds = await address_of(runs, run_id)
    live = Follower(ds.address)
    state = await wait_phase(handle, RunPhase.PROMPT_READY)
    nodes = [n.node_id for n in state.nodes]
    assert len(nodes) == 2
    archive = Path(ds.archive)

    # A follower without the run's token is refused by name, and gets nothing.
    ready = state.nodes[0].runtime_ready
    assert ready is not None and ready.datastream_publisher == ready.endpoint
    host, _, port = ready.endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), 10) as sock:
        sock.sendall(hello(NODE_DATASTREAM_EDGE_ID, "guessed-token-0123456789abcdef"))
        status, length = ANSWER.unpack(sock.recv(ANSWER.size, socket.MSG_WAITALL))
        reason = sock.recv(length, socket.MSG_WAITALL).decode()
        assert (status, reason) == (ANSWER_REJECT, "authentication failed: wrong datastream token")
        assert sock.recv(100) == b""

    prompt = "Count slowly: one, two, three"
    sent = asyncio.ensure_future(
        RunHandle(runs.client, run_id).submit(
            SubmitPrompt(request_id=1, prompt_text=prompt, max_tokens=12)
        )
    )
    try:

        def busy() -> bool:  # both stages hold the prompt's KV slot, as the archive says
            frames = follow_mod.read_archive(archive)
            return all(
                any(
                    decode_payload(f)["slots_in_use"] > 0
                    for f in node_frames(frames, n, "mvp.node.kv")
                )
                for n in nodes
            )

        await eventually(busy, timeout=90, what="both nodes' KV slots in use")
        gate.touch()
        done = await sent
    finally:
        sent.cancel()
    assert isinstance(done, Done), done
    await handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown())
    await handle.result()
    frames = follow_mod.read_archive(archive)
    model = fetch_bundled(DEFAULT_BUNDLED)
    plan = state.plan
    assert plan is not None
    layers = plan.stages[-1].layers.end

    for node_state in state.nodes:
        node, stage = node_state.node_id, plan.stages[node_state.stage_index]
        stream = f"mvp-node-{run_id}-{node}"
        own = [f for f in frames if f["source"] == "node_datastream" and f["stream"] == stream]
        assert {f["channel"] for f in own} == {
            "mvp.node.load",
            "mvp.node.steps",
            "mvp.node.edges",
            "mvp.node.kv",
        }, node
        # In order: each channel's positions rise, one channel id each on the node's stream.
        for channel in {f["channel"] for f in own}:
            mine = [f for f in own if f["channel"] == channel]
            positions = [f["position"] for f in mine]
            assert positions == sorted(set(positions)), (channel, positions)
            assert len({f["channel_id"] for f in mine}) == 1
        records = {ch: [decode_payload(f) for f in node_frames(frames, node, ch)] for ch in
                   ("mvp.node.load", "mvp.node.steps", "mvp.node.edges", "mvp.node.kv")}  # fmt: skip
        assert all(
            (r["run_id"], r["node_id"], r["stage_index"]) == (run_id, node, stage.stage_index)
            for rs in records.values()
            for r in rs
        )
        # Load progress, in bytes, up to the stage's share of the model.
        load = records["mvp.node.load"]
        total = stage_total(model, stage.layers.start, stage.layers.end, layers)
        assert load[0]["status"] == "loading" and load[-1]["status"] == "loaded", load
        assert load[-1]["loaded_bytes"] == load[-1]["total_bytes"] == total, load[-1]
        assert load[-1]["layers"] == [stage.layers.start, stage.layers.end]
        loaded = [r["loaded_bytes"] for r in load]
        assert loaded == sorted(loaded), loaded
        # Step timings while the prompt generated (its prefill among them).
        steps = records["mvp.node.steps"]
        assert sum(r["steps"] for r in steps) >= 2 and any(r["prefill_steps"] for r in steps)
        assert all(r["max_ms"] > 0 and r["mean_ms"] > 0 for r in steps), steps
        # KV slots: in use while it generated, free after.
        kv = records["mvp.node.kv"]
        assert any(r["slots_in_use"] >= 1 for r in kv) and kv[-1]["slots_in_use"] == 0, kv
        assert all(r["slots_total"] >= 1 for r in kv)
        # Edge throughput: bytes went both ways through the stage.
        edges = records["mvp.node.edges"]
        assert any(r["in_bytes_per_s"] > 0 for r in edges), edges
        assert any(r["out_bytes_per_s"] > 0 for r in edges), edges
        last = {(e["edge_id"], e["direction"]): e["bytes"] for e in edges[-1]["edges"]}
        assert {d for _, d in last} == {"in", "out"} and all(last.values()), last
        # Its log lines are on the same stream, and the channels start with its load.
        assert any(f["source"] == "node_log" and f["stream"] == stream for f in frames)
        assert own[0]["channel"] == "mvp.node.load"
        # No prompt text, no secret: numbers and fixed words only.
        assert not any("Count" in json.dumps(f["payload"]) for f in own)

    # A live follower of the run got the very frames of the archive (mvp-follow's way).
    followed = [identity(f) for f in live.frames() if f["source"] == "node_datastream"]
    assert followed == [identity(f) for f in frames if f["source"] == "node_datastream"]
    # The run's edge token and the nodes' datastream token: test_zz_secret_scan.py.
    text = archive.read_text()
    assert EDGE_SECRET not in text and SECRET not in text
