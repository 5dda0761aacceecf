"""OpenTelemetry for every process: traces and metrics, chosen by the standard ``OTEL_*``
variables, off by default (DECISIONS 39).

- Traces: ``OTEL_TRACES_EXPORTER`` = ``otlp`` (OTLP over HTTP/protobuf to
  ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``), ``console``, or ``none``. Unset means none:
  nothing is traced and no interceptor is installed.
- Metrics: ``OTEL_METRICS_EXPORTER`` = ``prometheus`` (a scrape endpoint on
  ``OTEL_EXPORTER_PROMETHEUS_HOST``:``OTEL_EXPORTER_PROMETHEUS_PORT``, default
  localhost:9464; port 0 picks a free one), ``otlp``, ``console``, or ``none`` (unset).
  They carry the Temporal SDK's own runtime metrics (drained from a ``MetricBuffer``) and
  ours (:data:`METRICS`).
- ``OTEL_SDK_DISABLED=true`` turns both off; ``OTEL_SERVICE_NAME`` and
  ``OTEL_RESOURCE_ATTRIBUTES`` name the process as the SDK reads them.

A process calls :func:`setup` once, early; :func:`temporal.connect.connect` then gives its
clients (and the workers built on them) the tracing interceptor and the metrics runtime.
Off, :func:`current` is a :class:`Telemetry` with nothing in it, and the token path checks
one attribute.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mvp_core import metrics, names
from temporal import core_log

log = logging.getLogger(__name__)

# Our own metrics (names in mvp_core.names): the run and prompt workflows record theirs
# through workflow.metric_meter() (nothing while replaying), a stage its forward time here.
METRICS = (
    names.METRIC_PROMPT_READY,
    names.METRIC_QUEUE_DEPTH,
    names.METRIC_NODES,
    names.METRIC_TTFT,
    names.METRIC_TOKENS_PER_S,
    names.METRIC_PROMPTS,
    names.METRIC_STAGE_FORWARD,
)

# A stage records one decode forward in this many (prefill forwards always): the figure
# is a sample, never a per-token export.
FORWARD_SAMPLE_EVERY = 16

TRACES_EXPORTERS = ("otlp", "console", "none")
METRICS_EXPORTERS = ("otlp", "prometheus", "console", "none")


class TelemetryConfigError(ValueError):
    """An OTEL_* variable this process cannot honour (named in the message)."""


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> list[str]:
    raw = env.get(name, "").strip()
    if not raw:
        return []
    chosen = [part.strip().lower() for part in raw.split(",") if part.strip()]
    bad = [c for c in chosen if c not in allowed]
    if bad:
        raise TelemetryConfigError(
            f"{name}={raw!r}: unsupported exporter {bad[0]!r} (use one of {', '.join(allowed)})"
        )
    return [c for c in chosen if c != "none"]


def _otlp_protocol(env: Mapping[str, str], signal: str) -> None:
    name = f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL"
    protocol = env.get(name) or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    if protocol.strip() != "http/protobuf":
        shown = name if env.get(name) else "OTEL_EXPORTER_OTLP_PROTOCOL"
        raise TelemetryConfigError(
            f"{shown}={protocol!r}: this build exports OTLP over http/protobuf only"
        )


@dataclass(frozen=True)
class TelemetryChoice:
    """What the environment asks for (parsed and checked, nothing started)."""

    traces: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    prometheus_host: str = "localhost"
    prometheus_port: int = 9464

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TelemetryChoice:
        env = os.environ if env is None else env
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return cls()
        traces = _choice(env, "OTEL_TRACES_EXPORTER", TRACES_EXPORTERS)
        metrics = _choice(env, "OTEL_METRICS_EXPORTER", METRICS_EXPORTERS)
        if "otlp" in traces:
            _otlp_protocol(env, "TRACES")
        if "otlp" in metrics:
            _otlp_protocol(env, "METRICS")
        port_raw = env.get("OTEL_EXPORTER_PROMETHEUS_PORT", "9464").strip() or "9464"
        try:
            port = int(port_raw)
            if not 0 <= port <= 65535:
                raise ValueError
        except ValueError:
            raise TelemetryConfigError(
                f"OTEL_EXPORTER_PROMETHEUS_PORT={port_raw!r}: not a port number (0-65535)"
            ) from None
        host = env.get("OTEL_EXPORTER_PROMETHEUS_HOST", "").strip() or "localhost"
        return cls(tuple(traces), tuple(metrics), host, port)

    @property
    def enabled(self) -> bool:
        return bool(self.traces or self.metrics)


@dataclass
class Telemetry:
    """One process's telemetry; an empty one (the default) costs nothing."""

    service: str = ""
    tracer_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider
    meter_provider: Any = None  # opentelemetry.sdk.metrics.MeterProvider
    runtime: Any = None  # temporalio.runtime.Runtime with a MetricBuffer
    prometheus_address: tuple[str, int] | None = None
    _buffer: Any = None
    _exporter: Any = None  # temporalio.contrib.opentelemetry.MetricsExporter
    _exporter_task: asyncio.Task[None] | None = None
    _http: Any = None
    _instruments: dict[str, Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    @property
    def metering(self) -> bool:
        return self.meter_provider is not None

    # ------------------------------------------------------------------ Temporal parts
    def client_plugins(self) -> list[Any]:
        """The SDK's OpenTelemetry plugin (client, workflows, activities), or nothing.

        Its spans parent each handler to the caller's context (an update's handler under
        the client's update span), so a prompt is one tree from the request down to the
        node's generate activity; a run started from the temporal CLI has its own
        RunWorkflow root. Workflow spans end when their workflow (or handler) ends."""
        if not self.tracing:
            return []
        from temporalio.contrib.opentelemetry import OpenTelemetryPlugin

        return [OpenTelemetryPlugin(add_temporal_spans=True)]

    async def start_exporter(self) -> None:
        """Drain the SDK's metric buffer into our meter provider (in this event loop)."""
        if self._exporter is None or self._exporter_task is not None:
            return
        self._exporter_task = asyncio.ensure_future(self._exporter.run())

    # ------------------------------------------------------------------ our own parts
    @contextmanager
    def span(self, name: str, **attributes: str | int | float) -> Iterator[Any]:
        """A span of ours (a request, a prompt) that Temporal's spans nest under."""
        if not self.tracing:
            with nullcontext() as nothing:
                yield nothing
            return
        tracer = self.tracer_provider.get_tracer("mvp-orchestrator")
        with tracer.start_as_current_span(name, attributes=attributes) as span:
            yield span

    def histogram(self, name: str, unit: str, description: str) -> Any:
        """An OpenTelemetry histogram of ours, or None when metrics are off."""
        if not self.metering:
            return None
        with self._lock:
            inst = self._instruments.get(name)
            if inst is None:
                meter = self.meter_provider.get_meter("mvp-orchestrator")
                inst = meter.create_histogram(name, unit=unit, description=description)
                self._instruments[name] = inst
            return inst

    def recorder(self) -> Recorder | None:
        """The run and prompt workflows' instruments (replay-safe), or None when off."""
        if not self.metering:
            return None
        with self._lock:
            rec = self._instruments.get("__recorder__")
            if rec is None:
                rec = self._instruments["__recorder__"] = Recorder(self.meter_provider)
            return rec

    def forward_timer(self, stage_index: int) -> ForwardTimer | None:
        """A stage's sampled forward-time recorder, or None (nothing to do per token)."""
        hist = self.histogram(
            names.METRIC_STAGE_FORWARD, "ms", "One stage's forward pass (sampled)"
        )
        return None if hist is None else ForwardTimer(hist, stage_index)

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        for provider in (self.tracer_provider, self.meter_provider):
            if provider is not None:
                try:
                    provider.force_flush(5_000)
                except Exception as err:  # an exporter that is down loses its batch
                    log.warning("telemetry flush failed: %s", err)

    async def aclose(self) -> None:
        if self._exporter_task is not None:
            await self._exporter.shutdown()
            try:
                async with asyncio.timeout(5):
                    await self._exporter_task
            except (TimeoutError, asyncio.CancelledError, Exception):
                pass
            self._exporter_task = None
        self.close()

    def close(self) -> None:
        self.flush()  # the tracer provider is the process's: flushed, never shut down
        if self.meter_provider is not None:
            try:
                self.meter_provider.shutdown()
            except Exception as err:
                log.warning("telemetry shutdown failed: %s", err)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.tracer_provider = self.meter_provider = None


class TracingMiddleware:
    """ASGI: each HTTP request in a server span (the whole response, streamed or not), so
    that the Temporal spans of the prompt it submits nest under it."""

    def __init__(self, app: Any, tel: Telemetry | None = None) -> None:
        self.app = app
        self.tel = tel or current()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or not self.tel.tracing:
            await self.app(scope, receive, send)
            return
        from opentelemetry.trace import SpanKind, Status, StatusCode

        tracer = self.tel.tracer_provider.get_tracer("mvp-orchestrator")
        method, path = scope.get("method", "GET"), scope.get("path", "/")
        status: list[int] = []

        async def sending(message: Any) -> None:
            if message.get("type") == "http.response.start":
                status.append(int(message.get("status", 0)))
            await send(message)

        with tracer.start_as_current_span(
            f"{method} {path}",
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        ) as span:
            await self.app(scope, receive, sending)
            if status:
                span.set_attribute("http.response.status_code", status[0])
                if status[0] >= 500:
                    span.set_status(Status(StatusCode.ERROR))


class Recorder:
    """Our workflow metrics, on OpenTelemetry instruments made once per process through
    the SDK's ReplaySafeMeterProvider (nothing is recorded while a workflow replays its
    history). Workflows call the module functions below, never a meter of their own."""

    def __init__(self, meter_provider: Any) -> None:
        from temporalio.contrib.opentelemetry import ReplaySafeMeterProvider

        meter = ReplaySafeMeterProvider(meter_provider).get_meter("mvp-orchestrator")
        self.prompt_ready = meter.create_histogram(
            names.METRIC_PROMPT_READY, unit="ms", description="Run start to prompt-ready"
        )
        self.queue_depth = meter.create_gauge(
            names.METRIC_QUEUE_DEPTH, unit="{prompt}", description="Prompts admitted, not ended"
        )
        self.nodes = meter.create_gauge(
            names.METRIC_NODES, unit="{node}", description="The run's nodes by state"
        )
        self.ttft = meter.create_histogram(
            names.METRIC_TTFT, unit="ms", description="Prompt admitted to its first text"
        )
        self.tokens_per_s = meter.create_histogram(
            names.METRIC_TOKENS_PER_S, unit="{token}/s", description="One prompt's decode rate"
        )
        self.prompts = meter.create_counter(
            names.METRIC_PROMPTS, unit="{prompt}", description="Prompts ended, by status"
        )
        self.recovery = meter.create_histogram(
            names.METRIC_RECOVERY,
            unit="ms",
            description="A stage recovery: the node's loss to prompt-ready again",
        )

    def record_prompt_ready(self, run_id: int, elapsed_ms: float) -> None:
        self.prompt_ready.record(elapsed_ms, {"run_id": run_id})

    def record_run_gauges(self, run_id: int, queued: int, nodes: Mapping[str, int]) -> None:
        self.queue_depth.set(queued, {"run_id": run_id})
        for state, count in nodes.items():
            self.nodes.set(count, {"run_id": run_id, "state": state})

    def record_recovery(self, run_id: int, stage_index: int, elapsed_ms: float) -> None:
        self.recovery.record(elapsed_ms, {"run_id": run_id, "stage": stage_index})

    def record_prompt(
        self, status: str, ttft_ms: float | None = None, tokens_per_s: float | None = None
    ) -> None:
        self.prompts.add(1, {"status": status})
        if ttft_ms is not None:
            self.ttft.record(ttft_ms)
        if tokens_per_s is not None:
            self.tokens_per_s.record(tokens_per_s)


class ForwardTimer:
    """Records every prefill forward and one decode forward in FORWARD_SAMPLE_EVERY."""

    __slots__ = ("_decode", "_hist", "_n", "_prefill")

    def __init__(self, hist: Any, stage_index: int) -> None:
        self._hist = hist
        self._n = 0
        self._prefill = {"stage": stage_index, "phase": "prefill"}
        self._decode = {"stage": stage_index, "phase": "decode"}

    def wants(self, prefill: bool) -> bool:
        if prefill:
            return True
        self._n += 1
        return self._n % FORWARD_SAMPLE_EVERY == 0

    def record(self, seconds: float, prefill: bool) -> None:
        self._hist.record(seconds * 1000.0, self._prefill if prefill else self._decode)


_current = Telemetry()

# A prompt's end, on its spans (the node's generate activity, mvp-chat's prompt).
ATTR_TOKENS = "mvp.prompt.tokens_generated"
ATTR_STOP_REASON = "mvp.prompt.stop_reason"


def note_prompt_end(tokens_generated: int, stop_reason: str, span: Any = None) -> None:
    """Put a prompt's token count and stop reason on ``span`` (else the current span);
    nothing when tracing is off (a non-recording span)."""
    if not _current.tracing and span is None:
        return
    from opentelemetry import trace

    target = span if span is not None else trace.get_current_span()
    if target is not None and target.is_recording():
        target.set_attribute(ATTR_TOKENS, tokens_generated)
        target.set_attribute(ATTR_STOP_REASON, stop_reason)


def current() -> Telemetry:
    return _current


def setup(
    service: str,
    env: Mapping[str, str] | None = None,
    *,
    span_exporter: Any = None,
    metric_reader: Any = None,
    port_file: Path | None = None,
) -> Telemetry:
    """Set this process's telemetry up from the environment (once; later calls return the
    first). ``span_exporter`` / ``metric_reader`` add an exporter of the caller's (tests:
    the SDK's in-memory ones) whatever the environment says. ``port_file`` gets the bound
    Prometheus port (for port 0)."""
    global _current
    if _current.service:
        return _current
    choice = TelemetryChoice.from_env(env)
    if not choice.enabled and span_exporter is None and metric_reader is None:
        return _current
    env = os.environ if env is None else env
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or service})
    tel = Telemetry(service=service)
    if choice.traces or span_exporter is not None:
        tel.tracer_provider = _tracer_provider(resource, choice, span_exporter)
    if choice.metrics or metric_reader is not None:
        readers = [metric_reader] if metric_reader is not None else []
        readers += _metric_readers(tel, choice, port_file)
        from opentelemetry.sdk.metrics import MeterProvider
        from temporalio.contrib.opentelemetry import MetricsExporter
        from temporalio.runtime import MetricBuffer, Runtime, TelemetryConfig

        tel.meter_provider = MeterProvider(resource=resource, metric_readers=readers)
        tel._buffer = MetricBuffer(100_000)
        tel.runtime = Runtime(
            telemetry=TelemetryConfig(logging=core_log.logging_config(), metrics=tel._buffer)
        )
        tel._exporter = MetricsExporter(tel._buffer, tel.meter_provider)
    _current = tel
    recorder = tel.recorder()
    if recorder is not None:
        metrics.install(recorder)
    return tel


_global_provider: Any = None  # the process's one replay-safe tracer provider

# Spans nobody reads, made many times a second: a stream's polls and publishes (one per
# batch of text), and queries (the gateway and the dashboard poll ``snapshot``).
QUIET_SPANS = ("__temporal_workflow_stream_", "QueryWorkflow:", "HandleQuery:")


def _quiet_sampler() -> Any:
    """Everything, under its parent's decision, but the QUIET_SPANS (dropped at start, so
    they cost a non-recording span)."""
    from opentelemetry.sdk.trace.sampling import (
        ALWAYS_ON,
        Decision,
        ParentBased,
        Sampler,
        SamplingResult,
    )

    class Quiet(Sampler):
        def __init__(self) -> None:
            self._inner = ParentBased(ALWAYS_ON)

        def should_sample(
            self,
            parent_context: Any,
            trace_id: int,
            name: str,
            kind: Any = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            if name.startswith(QUIET_SPANS[1:]) or QUIET_SPANS[0] in name:
                return SamplingResult(Decision.DROP)
            return self._inner.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )

        def get_description(self) -> str:
            return "mvp-quiet"

    return Quiet()


def _tracer_provider(resource: Any, choice: TelemetryChoice, extra: Any) -> Any:
    """The process-wide tracer provider (the SDK's workflow interceptor takes the global
    one; it is replay-safe: span ids are deterministic in workflows), with this setup's
    exporters added."""
    global _global_provider
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from temporalio.contrib.opentelemetry import create_tracer_provider

    if _global_provider is None:
        _global_provider = create_tracer_provider(resource=resource, sampler=_quiet_sampler())
        trace.set_tracer_provider(_global_provider)
    provider = _global_provider
    if extra is not None:
        provider.add_span_processor(SimpleSpanProcessor(extra))
    if "otlp" in choice.traces:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if "console" in choice.traces:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return provider


def _metric_readers(tel: Telemetry, choice: TelemetryChoice, port_file: Path | None) -> list[Any]:
    readers: list[Any] = []
    if "prometheus" in choice.metrics:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        readers.append(PrometheusMetricReader(registry=registry))
        try:
            server, _ = start_http_server(
                choice.prometheus_port, addr=choice.prometheus_host, registry=registry
            )
        except OSError as err:
            raise TelemetryConfigError(
                f"Prometheus endpoint {choice.prometheus_host}:{choice.prometheus_port} "
                f"could not be served ({err.strerror or err}); set "
                "OTEL_EXPORTER_PROMETHEUS_PORT to a free port, or 0 for any"
            ) from None
        tel._http = server
        tel.prometheus_address = (choice.prometheus_host, int(server.server_port))
        log.info("metrics: http://%s:%d/metrics", choice.prometheus_host, tel.prometheus_address[1])
        if port_file is not None:
            tmp = port_file.with_suffix(".tmp")
            tmp.write_text(f"{tel.prometheus_address[1]}\n")
            tmp.replace(port_file)
    if "otlp" in choice.metrics:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    if "console" in choice.metrics:
        from opentelemetry.sdk.metrics.export import (
            ConsoleMetricExporter,
            PeriodicExportingMetricReader,
        )

        readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
    return readers


def reset_for_tests() -> None:
    """Forget this process's telemetry (tests that set it up more than once)."""
    global _current
    _current.close()
    _current = Telemetry()
    metrics.install(metrics.OFF)


def node_env(host_env: Mapping[str, str], *, own_port: bool) -> dict[str, str]:
    """The OTEL_* variables a provider passes to its nodes: the provider host's own.
    ``own_port``: nodes sharing the host's address (local processes) take a free
    Prometheus port each, and write it to ``metrics.port`` in their node directory."""
    env = {k: v for k, v in host_env.items() if k.startswith("OTEL_")}
    if own_port and "prometheus" in env.get("OTEL_METRICS_EXPORTER", ""):
        env["OTEL_EXPORTER_PROMETHEUS_PORT"] = "0"
    return env
