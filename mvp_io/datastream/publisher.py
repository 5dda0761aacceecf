"""The publisher of a run's datastream: redacts each record, makes it a frame of its
stream and offers it to every sink, and reports what the sinks lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

from mvp_core.datastream import (
    CHANNEL_BOOTSTRAP,
    CHANNEL_LIFECYCLE,
    CHANNEL_MEMBERSHIP,
    CHANNEL_PROMPT,
    CHANNEL_PROVISIONING_EVENTS,
    CORE_CHANNELS,
    SOURCE_NODE_DATASTREAM,
    SOURCE_ORCHESTRATOR,
    BootstrapPhase,
    BootstrapStatus,
    ChannelRegistry,
    Frame,
    LogStream,
    MembershipState,
    ProvisionEventKind,
    Redactor,
    drops_record,
    encode_record,
    lifecycle_record,
    log_line,
    membership_record,
    node_log_channel,
    orch_bootstrap,
    orch_prompt_event,
    orchestrator_stream_id,
    provision_event,
    stdio_channel,
)
from mvp_core.models import LifecycleReport
from mvp_io.datastream.sinks import DEFAULT_CLOSE_TIMEOUT_S, Sink

DEFAULT_SUMMARY_INTERVAL_S = 30.0


class Datastream:
    """The host's datastream (process spec 7.12): one per orchestrator process and run.

    ``publish`` is safe from any thread and never blocks on a sink. Records are redacted
    before anything leaves the process. Every ``summary_interval_s`` (checked on publish)
    and at close, if any sink lost frames since the last summary, a drops record is
    published on ``mvp.orch.bootstrap`` (phase ``datastream``); close always publishes a
    final one (``"final": true``) with the count of frames published."""

    def __init__(
        self,
        *,
        run_id: int,
        node_id: int,
        sinks: Iterable[Sink] = (),
        redactor: Redactor | None = None,
        summary_interval_s: float | None = DEFAULT_SUMMARY_INTERVAL_S,
        stream: str | None = None,
    ) -> None:
        self.run_id = int(run_id)
        self.node_id = int(node_id)
        # The stream of its own records: the run's (``mvp-orchestrator-<run_id>``) unless
        # told otherwise (the process host's own, beside the run's frames it forwards).
        self.stream = stream or orchestrator_stream_id(self.run_id)
        self.redactor = redactor if redactor is not None else Redactor()
        self._sinks: list[Sink] = []
        names: set[str] = set()
        for sink in sinks:
            if sink.name in names:
                raise ValueError(f"two datastream sinks are named {sink.name!r}")
            names.add(sink.name)
            self._sinks.append(sink)
        self._lock = threading.Lock()
        self._registry = ChannelRegistry()
        self._registry.register(self.stream, CORE_CHANNELS)
        self._seq = 0
        self._closed = False
        self._after_close = 0
        self._summary_interval_s = summary_interval_s
        self._next_summary = time.monotonic() + (summary_interval_s or 0.0)
        self._summary_lock = threading.Lock()
        self._reported_drops: dict[str, int] = {s.name: 0 for s in self._sinks}

    # -- publishing

    def publish(
        self,
        channel: str,
        record: Any,
        *,
        source: str = SOURCE_ORCHESTRATOR,
        stream: str | None = None,
    ) -> None:
        """Publish a record (JSON-like; or ``str``/``bytes`` as a raw payload) on
        ``channel`` of ``stream`` (the orchestrator's by default)."""
        self._publish(channel, record, source=source, stream=stream, force=False)
        if self._summary_interval_s is not None and time.monotonic() >= self._next_summary:
            self._maybe_summary(final=False)

    def _publish(
        self, channel: str, record: Any, *, source: str, stream: str | None, force: bool
    ) -> None:
        redact = self.redactor.redact_text  # names too: providers may name channels
        payload = encode_record(self.redactor.redact(record))
        now_ms = time.time_ns() // 1_000_000
        stream_id = redact(stream) if stream else self.stream
        channel, source = redact(channel), redact(source)
        with self._lock:
            if self._closed and not force:
                self._after_close += 1
                return
            channel_id, position = self._registry.next(stream_id, channel)
            frame = Frame(
                seq=self._seq,
                arrival_unix_ms=now_ms,
                source=source,
                stream=stream_id,
                channel=channel,
                channel_id=channel_id,
                position=position,
                payload=payload,
            )
            self._seq += 1
            for sink in self._sinks:
                sink.offer(frame, force=force)

    def forward(self, line: dict[str, Any]) -> bool:
        """Pass on a frame of another datastream (a frame line, as a subscriber or an
        archive has it) keeping its identity: source, stream, channel, channel id,
        position, arrival time and payload (process spec 9.18); only the publish
        sequence (``arrival_seq``) is this datastream's. The payload is redacted again
        with this datastream's secrets. False for a line that is no frame."""
        try:
            payload = line["payload"]
            raw = (
                str(payload["value"]).encode("utf-8")
                if payload["encoding"] == "utf8"
                else bytes(payload["value"])
            )
            frame_args = (
                int(line["arrival_unix_ms"]),
                str(line["source"]),
                str(line["stream"]),
                str(line["channel"]),
                int(line["channel_id"]),
                int(line["position"]),
            )
        except (KeyError, TypeError, ValueError):
            return False
        raw = self.redactor.redact_bytes(raw)
        with self._lock:
            if self._closed:
                self._after_close += 1
                return False
            frame = Frame(self._seq, *frame_args, payload=raw)
            self._seq += 1
            for sink in self._sinks:
                sink.offer(frame)
        return True

    def relay(
        self,
        stream: str,
        channel: str,
        position: int,
        payload: bytes,
        *,
        source: str = SOURCE_NODE_DATASTREAM,
    ) -> None:
        """Pass on a frame another publisher made (a node's own, DECISIONS 93) on
        ``stream``: its channel id is this datastream's for (``stream``, ``channel``),
        its position the publisher's own (a gap: frames it dropped), the arrival time
        now. The payload is redacted with this datastream's secrets."""
        raw = self.redactor.redact_bytes(payload)
        now_ms = time.time_ns() // 1_000_000
        with self._lock:
            if self._closed:
                self._after_close += 1
                return
            channel_id = self._registry.channel_id(stream, channel)
            frame = Frame(self._seq, now_ms, source, stream, channel, channel_id, position, raw)
            self._seq += 1
            for sink in self._sinks:
                sink.offer(frame)

    def bootstrap(
        self,
        phase: BootstrapPhase,
        status: BootstrapStatus | str,
        detail: Any = None,
        *,
        node_id: int | None = None,
    ) -> None:
        self.publish(
            CHANNEL_BOOTSTRAP,
            orch_bootstrap(phase, status, self.run_id, self._node(node_id), detail),
        )

    def prompt_event(
        self,
        phase: str,
        status: str,
        request_id: int | None,
        detail: Any = None,
        *,
        node_id: int | None = None,
    ) -> None:
        self.publish(
            CHANNEL_PROMPT,
            orch_prompt_event(phase, status, self.run_id, self._node(node_id), request_id, detail),
        )

    def provision_event(
        self, node_id: int, kind: ProvisionEventKind | str, provider: str, message: str = ""
    ) -> None:
        self.publish(
            CHANNEL_PROVISIONING_EVENTS,
            provision_event(self.run_id, node_id, kind, provider, message),
        )

    def node_log(
        self,
        node_id: int,
        stream: LogStream | str,
        line: str,
        *,
        source: str = SOURCE_ORCHESTRATOR,
        stream_id: str | None = None,
    ) -> None:
        """A node's log line on ``mvp.provisioning.logs.node.<id>.<stream>``."""
        self.publish(
            node_log_channel(node_id, stream),
            log_line(self.run_id, node_id, stream, line),
            source=source,
            stream=stream_id,
        )

    def stdio_line(self, stream: LogStream | str, line: str) -> None:
        """A captured line of the host's own stdout/stderr (``mvp.orch.stdio.*``)."""
        self.publish(stdio_channel(stream), log_line(self.run_id, self.node_id, stream, line))

    def lifecycle(self, report: LifecycleReport, index: int | None = None) -> None:
        self.publish(CHANNEL_LIFECYCLE, lifecycle_record(report, index))

    def membership(self, node_id: int, state: MembershipState | str, detail: Any = None) -> None:
        self.publish(CHANNEL_MEMBERSHIP, membership_record(self.run_id, node_id, state, detail))

    def _node(self, node_id: int | None) -> int:
        return self.node_id if node_id is None else int(node_id)

    # -- health

    @property
    def published(self) -> int:
        with self._lock:
            return self._seq

    @property
    def published_after_close(self) -> int:
        with self._lock:
            return self._after_close

    @property
    def drops(self) -> dict[str, int]:
        """Frames lost so far, per sink name."""
        return {s.name: s.dropped for s in self._sinks}

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return tuple(self._sinks)

    def channels(self, stream: str | None = None) -> dict[str, int]:
        """Channel name -> channel id of a stream (the orchestrator's by default)."""
        with self._lock:
            return self._registry.channels(stream or self.stream)

    def _maybe_summary(self, *, final: bool) -> None:
        with self._lock:
            if self._summary_interval_s is not None:
                self._next_summary = time.monotonic() + self._summary_interval_s
            published = self._seq
        with self._summary_lock:
            drops = self.drops
            if drops == self._reported_drops and not final:
                return
            self._reported_drops = drops
        self._publish(
            CHANNEL_BOOTSTRAP,
            drops_record(self.run_id, self.node_id, published, drops, final),
            source=SOURCE_ORCHESTRATOR,
            stream=None,
            force=True,
        )

    # -- closing

    def close(self, timeout_s: float = DEFAULT_CLOSE_TIMEOUT_S) -> None:
        """Publish the final summary (published count, drops per sink), then flush and close
        every sink, all within ``timeout_s``. Later publishes are ignored (counted)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._maybe_summary(final=True)
        deadline = time.monotonic() + max(0.0, timeout_s)
        for sink in self._sinks:
            sink.close(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> Datastream:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
