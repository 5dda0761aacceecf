"""The run's datastream (DECISIONS 58): one background activity per run execution.

``RunWorkflow`` starts ``provider.run_datastream`` on its provider queue once it knows
it (beside the provider activities, in the same orchestrator worker), and cancels it only
after RunTornDown is recorded (and before a continue-as-new; the continued run starts its
own). The activity, for every run however it was started (the process host, the gateway,
the ``temporal`` CLI, the demo):

- serves the live datastream (each follower first gets the frames published so far by
  this attempt, up to ``REPLAY_FRAMES``, then every new one) on ``MVP_DATASTREAM_BIND`` (default ``127.0.0.1:0``, a free
  loopback port; ``unix:<path>`` for a unix socket; ``{run_id}`` in it is replaced by the
  run's id) and tells the run where, by the ``datastream_address`` signal: the run's
  snapshot shows it (``RunState.datastream``), so ``mvp-follow --run-id N``, the host and
  the gateway find it;
- writes the run's frame archive to ``<state dir>/runs/<run_id>/frames.jsonl`` (appended,
  so a finished run's datastream can still be read);
- publishes what the run's ``snapshot`` shows changing (``mvp_core.host_observe``:
  lifecycle, bootstrap phases, provisioning events, membership, stage routes);
- tails each node's log files that this host has (``node.log`` stdout, ``node.err``
  stderr, written live by the process and Docker providers) into ``mvp.provisioning.logs.node.<id>.<stdout|stderr>``;
- drains the in-process bus (``activities/datastream_bus.py``) where the provider
  activities put their progress (provider log lines) and ``ProvisionFailed`` events;
- follows each node's own datastream (DECISIONS 93: load progress, step timings, edge
  throughput, KV slots) on the data-plane address its runtime-ready report names
  (``datastream_publisher``), authenticated with the node-datastream token derived from
  the run's edge token, from its report until it ends its stream or is stopped, a
  replacement node too, and passes its frames on (source ``node_datastream``, the node's
  stream ``mvp-node-<run_id>-<node_id>``, the node's positions).

A retried attempt (or the continued run's activity) resumes from
``<state dir>/runs/<run_id>/observed.json``: the last snapshot it published from and how
far it read each node log and each node channel, so records are not published twice. Everything is redacted
(the worker's secrets, the run's edge token, what looks like a secret).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any

from temporalio import activity

from activities import datastream_bus
from activities.providers.base import NODE_STDERR_FILE, edge_secret, edge_token, state_dir
from mvp_core import names
from mvp_core.datastream import LogStream, Redactor
from mvp_core.edge_auth import node_datastream_token, text_stream_token
from mvp_core.host_observe import observe
from mvp_core.models import DatastreamAddress, RunDatastreamInput, RunPhase
from mvp_core.providers import traits
from mvp_core.run_signals import signal_name
from mvp_core.run_state import RunState
from mvp_io.datastream import Datastream, FrameArchive, LiveSubscribers, LogTailer, NodeFollower

log = logging.getLogger("mvp.datastream")
BIND_ENV = "MVP_DATASTREAM_BIND"
DEFAULT_BIND = "127.0.0.1:0"
# The run's snapshot is read every POLL_S while it changes, and the interval doubles up to
# POLL_IDLE_S while it does not (a prompt-ready run at rest): the reads were two thirds
# of the control plane's CPU at rest (124 ms/s against 43 without them, bench_serve).
# The first change after a quiet spell is published within POLL_IDLE_S.
POLL_S = 0.25
POLL_IDLE_S = 2.0
# While the run serves prompts (prompt-ready before and after a read), what changes is
# prompt traffic: read every SERVING_POLL_S at most. At 0.25 s, 8 streams kept the reads
# going all along: about 20 ms of CPU each (dev server and worker), 0.3 ms per generated
# token at 270 tok/s (bench_serve).
SERVING_POLL_S = 1.0
# A follower attaching late first gets the run's last frames (this attempt's): so the host
# that started the run, or mvp-follow --run-id, sees the run from its start.
REPLAY_FRAMES = 20_000
ARCHIVE_NAME = "frames.jsonl"
OBSERVED_NAME = "observed.json"
STDERR_NAME = NODE_STDERR_FILE  # beside a node's node.log (its stdout): process, Docker


def run_dir(run_id: int) -> Path:
    """Where a run's datastream files are kept on this host."""
    return state_dir() / "runs" / str(int(run_id))


def archive_path(run_id: int) -> Path:
    return run_dir(run_id) / ARCHIVE_NAME


def stderr_path(log_path: str) -> Path:
    """A node's stderr file, beside its stdout log (``node.log``)."""
    return Path(log_path).with_name(STDERR_NAME)


def bind_address(run_id: int) -> str:
    return os.environ.get(BIND_ENV, "").strip().replace("{run_id}", str(run_id)) or DEFAULT_BIND


class RunStream:
    """One attempt's datastream of a run: sinks, tailers, the observed baseline."""

    def __init__(self, inp: RunDatastreamInput) -> None:
        self.inp = inp
        self.dir = run_dir(inp.run_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        secrets: list[str] = []
        self.node_token: str | None = None  # follows nodes' own datastreams (DECISIONS 93)
        if inp.nonce:
            with contextlib.suppress(Exception):
                secret = edge_secret()
                token = edge_token(secret, inp.run_workflow_id, inp.nonce)
                self.node_token = node_datastream_token(token)
                secrets.append(token)
                secrets.append(text_stream_token(secret, inp.run_workflow_id, inp.nonce))
                secrets.append(self.node_token)
        self.archive = FrameArchive(self.dir / ARCHIVE_NAME)
        try:
            self.live = LiveSubscribers(bind_address(inp.run_id), replay_frames=REPLAY_FRAMES)
        except BaseException:
            self.archive.close()
            raise
        self.stream = Datastream(
            run_id=inp.run_id,
            node_id=0,
            sinks=[self.archive, self.live],
            redactor=Redactor.from_env(os.environ, extra=secrets),
        )
        self.tailers: dict[tuple[int, str], LogTailer] = {}
        self.followers: dict[int, NodeFollower] = {}
        self.prev: RunState | None = None
        self.offsets: dict[str, int] = {}
        self.positions: dict[str, dict[str, int]] = {}  # node id -> channel -> last position
        self._load_observed()

    # -- the baseline an earlier attempt left
    def _load_observed(self) -> None:
        path = self.dir / OBSERVED_NAME
        try:
            saved = json.loads(path.read_text())
            prev = RunState.model_validate(saved["state"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if saved.get("workflow_id") != self.inp.run_workflow_id:
            return
        # Another execution that reused the run id starts from nothing (its nonce differs).
        if self.inp.nonce and prev.nonce != self.inp.nonce[:8]:
            return
        self.prev = prev
        self.offsets = {str(k): int(v) for k, v in dict(saved.get("offsets", {})).items()}
        with contextlib.suppress(TypeError, ValueError, AttributeError):
            self.positions = {
                str(node): {str(ch): int(pos) for ch, pos in dict(channels).items()}
                for node, channels in dict(saved.get("node_positions", {})).items()
            }

    def save_observed(self) -> None:
        if self.prev is None:
            return
        offsets = dict(self.offsets)
        for (node_id, which), tailer in self.tailers.items():
            offsets[f"{node_id}:{which}"] = tailer.offset
        positions = dict(self.positions)
        for node_id, follower in self.followers.items():
            positions[str(node_id)] = follower.last
        body = {
            "workflow_id": self.inp.run_workflow_id,
            "state": self.prev.model_dump(mode="json"),
            "offsets": offsets,
            "node_positions": positions,
        }
        tmp = self.dir / (OBSERVED_NAME + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.dir / OBSERVED_NAME)

    # -- one step
    def publish_snapshot(self, cur: RunState) -> bool:
        records = observe(self.prev, cur, self.inp.provider.value)
        for channel, record in records:
            self.stream.publish(channel, record)
        self._tail(cur)
        self._follow(cur)
        changed = bool(records) or self.prev is None
        self.prev = cur
        return changed

    def _tail(self, cur: RunState) -> None:
        for node in cur.nodes:
            handle = node.handle
            if handle is None or not handle.log_path:
                continue
            files = [(LogStream.STDOUT, Path(handle.log_path))]
            if traits(handle.provider).live_logs:
                files.append((LogStream.STDERR, stderr_path(handle.log_path)))
            for which, path in files:
                key = (node.node_id, which.value)
                if key in self.tailers:
                    continue
                start = self.offsets.get(f"{node.node_id}:{which.value}", 0)
                self.tailers[key] = LogTailer(
                    self.stream, path, node_id=node.node_id, stream=which, start_offset=start
                ).start()

    def _follow(self, cur: RunState) -> None:
        """A follower for each node that named its datastream publisher, from its report
        until the node is gone (its own end of stream ends its follower sooner)."""
        if self.node_token is None:
            return
        current = {n.node_id for n in cur.nodes}
        for node_id, old in self.followers.items():
            if node_id not in current:  # replaced (stage recovery): gone
                old.finish()
        for node in cur.nodes:
            ready = node.runtime_ready
            follower = self.followers.get(node.node_id)
            gone = node.provider_stopped or node.exited or node.lease_lost
            if follower is not None:
                if gone:
                    follower.finish()  # the node is gone: its last frames, then no more
                continue
            if gone or ready is None or not ready.datastream_publisher:
                continue
            self.followers[node.node_id] = NodeFollower(
                self.stream,
                run_id=self.inp.run_id,
                node_id=node.node_id,
                endpoint=ready.datastream_publisher,
                token=self.node_token,
                last=self.positions.get(str(node.node_id)),
            ).start()

    def drain_bus(self) -> int:
        items = datastream_bus.drain(self.inp.run_id)
        for item in items:
            self.stream.publish(item.channel, item.record)
        return len(items)

    def close(self) -> None:
        for follower in self.followers.values():
            follower.stop(timeout_s=0)
        for follower in self.followers.values():
            follower.stop()
        for tailer in self.tailers.values():
            tailer.stop()
        self.save_observed()
        self.stream.close()


@activity.defn(name=names.ACT_RUN_DATASTREAM)
async def run_datastream(inp: RunDatastreamInput) -> None:
    """Until cancelled: the run's datastream (see the module doc). Heartbeats every read
    (the SDK sends at most one per throttle interval)."""
    info = activity.info()
    client = activity.client()
    handle = client.get_workflow_handle(inp.run_workflow_id)
    with datastream_bus.attached(inp.run_id):
        rs = await asyncio.to_thread(RunStream, inp)
        try:
            address = DatastreamAddress(
                run_id=inp.run_id,
                address=rs.live.address,
                archive=str(rs.archive.path),
                host=socket.gethostname(),
                attempt=info.attempt,
            )
            with contextlib.suppress(Exception):  # a closed run: nothing to tell
                await handle.signal(signal_name(address), address)
            log.info("datastream of %s on %s", inp.run_workflow_id, rs.live.address)
            interval = POLL_S
            while True:
                activity.heartbeat()
                serving = _serving(rs.prev)
                changed = await _step(rs, handle)
                if not changed:
                    interval = min(interval * 2, POLL_IDLE_S)
                elif serving and _serving(rs.prev):
                    interval = SERVING_POLL_S
                else:
                    interval = POLL_S
                await asyncio.sleep(interval)
        finally:
            # Cancelled (the run recorded RunTornDown) or failing: the last of it first.
            with contextlib.suppress(BaseException):
                async with asyncio.timeout(5.0):
                    await asyncio.shield(_step(rs, handle))
            await asyncio.to_thread(rs.close)


def _serving(state: RunState | None) -> bool:
    return state is not None and state.phase is RunPhase.PROMPT_READY and not state.stopping


async def _step(rs: RunStream, handle: Any) -> bool:
    """One read of the run: whether anything was published (or the read failed, so the
    next comes soon)."""
    drained = rs.drain_bus()
    try:
        cur = await handle.query(names.QUERY_SNAPSHOT, result_type=RunState)
    except asyncio.CancelledError:
        raise
    except Exception:  # not picked up yet, or its worker is restarting: next poll
        return True
    if not isinstance(cur, RunState) or cur.run_id != rs.inp.run_id:
        return True
    changed = rs.publish_snapshot(cur)
    if changed:
        await asyncio.to_thread(rs.save_observed)
    return changed or bool(drained + rs.drain_bus())
