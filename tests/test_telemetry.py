"""temporal.telemetry: what the OTEL_* variables choose, what it costs when off, the
sampled forward timer, the request span of the gateway, and the Prometheus endpoint."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mvp_core import metrics, names
from temporal import telemetry
from temporal.telemetry import TelemetryChoice, TelemetryConfigError

pytestmark = pytest.mark.quick


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    telemetry.reset_for_tests()
    yield
    telemetry.reset_for_tests()


def test_unset_means_off_and_costs_nothing():
    assert not TelemetryChoice.from_env({}).enabled
    tel = telemetry.setup("t", env={})
    assert tel is telemetry.current()
    assert not tel.tracing and not tel.metering
    assert tel.client_plugins() == [] and tel.runtime is None
    assert tel.forward_timer(0) is None and tel.recorder() is None
    with tel.span("nothing") as span:
        assert span is None
    # The workflows' calls are no-ops.
    metrics.sink().record_prompt("done", 1.0, 2.0)
    metrics.sink().record_run_gauges(1, 0, {"ready": 1})
    metrics.sink().record_prompt_ready(1, 10.0)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, ["OTEL_TRACES_EXPORTER", "zipkin", "otlp"]),
        ({"OTEL_METRICS_EXPORTER": "otlp,statsd"}, ["OTEL_METRICS_EXPORTER", "statsd"]),
        (
            {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "http"},
            ["OTEL_EXPORTER_PROMETHEUS_PORT", "'http'"],
        ),
        ({"OTEL_EXPORTER_PROMETHEUS_PORT": "70000"}, ["OTEL_EXPORTER_PROMETHEUS_PORT"]),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            ["OTEL_EXPORTER_OTLP_PROTOCOL", "grpc", "http/protobuf"],
        ),
        (
            {"OTEL_METRICS_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"},
            ["OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"],
        ),
    ],
)
def test_a_bad_variable_is_named(env: dict[str, str], words: list[str]):
    with pytest.raises(TelemetryConfigError) as err:
        TelemetryChoice.from_env(env)
    for word in words:
        assert word in str(err.value)


def test_choices_and_the_kill_switch():
    choice = TelemetryChoice.from_env(
        {
            "OTEL_TRACES_EXPORTER": "otlp, console",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_PROMETHEUS_HOST": "0.0.0.0",
        }
    )
    assert choice.traces == ("otlp", "console") and choice.metrics == ()
    assert choice.prometheus_host == "0.0.0.0" and choice.prometheus_port == 9464
    off = TelemetryChoice.from_env({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "x"})
    assert not off.enabled


def test_nodes_get_the_hosts_otel_variables_and_a_port_of_their_own():
    host = {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_PORT": "9464",
        "OTEL_SERVICE_NAME": "x",
        "PATH": "/bin",
    }
    shared = telemetry.node_env(host, own_port=True)
    assert shared == {
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_PROMETHEUS_PORT": "0",
        "OTEL_SERVICE_NAME": "x",
    }
    assert telemetry.node_env(host, own_port=False)["OTEL_EXPORTER_PROMETHEUS_PORT"] == "9464"


def test_forward_timer_samples_decode_and_keeps_every_prefill():
    reader = InMemoryMetricReader()
    tel = telemetry.setup("t", env={}, metric_reader=reader)
    timer = tel.forward_timer(1)
    assert timer is not None
    recorded = 0
    for i in range(160):
        prefill = i % 40 == 0
        if timer.wants(prefill):
            timer.record(0.002, prefill)
            recorded += 1
    data = reader.get_metrics_data()
    points = {
        dict(p.attributes)["phase"]: p
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == names.METRIC_STAGE_FORWARD
        for p in m.data.data_points
    }
    assert points["prefill"].count == 4
    assert points["decode"].count == 156 // telemetry.FORWARD_SAMPLE_EVERY
    assert dict(points["decode"].attributes)["stage"] == 1
    assert points["decode"].sum == pytest.approx(2.0 * points["decode"].count)


def test_workflow_records_land_on_the_meter():
    reader = InMemoryMetricReader()
    telemetry.setup("t", env={}, metric_reader=reader)
    metrics.sink().record_prompt_ready(7, 1500.0)
    metrics.sink().record_prompt("done", ttft_ms=120.0, tokens_per_s=40.0)
    metrics.sink().record_prompt("cancelled")
    metrics.sink().record_run_gauges(7, 2, {"ready": 2, "lost": 0})
    got: dict[str, list[tuple[dict[str, object], object]]] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    value = getattr(p, "value", None)
                    if value is None:
                        value = (p.count, p.sum)
                    got.setdefault(m.name, []).append((dict(p.attributes), value))
    assert got[names.METRIC_PROMPT_READY] == [({"run_id": 7}, (1, 1500.0))]
    assert got[names.METRIC_TTFT] == [({}, (1, 120.0))]
    assert sorted(got[names.METRIC_PROMPTS], key=str) == sorted(
        [({"status": "done"}, 1), ({"status": "cancelled"}, 1)], key=str
    )
    assert ({"run_id": 7}, 2) in got[names.METRIC_QUEUE_DEPTH]
    assert ({"run_id": 7, "state": "ready"}, 2) in got[names.METRIC_NODES]


def test_the_request_span_wraps_the_whole_response():
    memory = InMemorySpanExporter()
    tel = telemetry.setup("t", env={}, span_exporter=memory)
    inner: list[bool] = []

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        from opentelemetry import trace

        inner.append(trace.get_current_span().get_span_context().is_valid)
        await send({"type": "http.response.start", "status": 503, "headers": []})
        await send({"type": "http.response.body", "body": b"x"})

    async def go() -> int:
        transport = httpx.ASGITransport(app=telemetry.TracingMiddleware(app, tel))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return (await http.post("/v1/completions")).status_code

    assert asyncio.run(go()) == 503
    (span,) = memory.get_finished_spans()
    assert span.name == "POST /v1/completions" and inner == [True]
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 503
    assert not span.status.is_ok


def test_a_prompt_span_carries_its_token_count_and_stop_reason():
    telemetry.note_prompt_end(3, "eos")  # tracing off: nothing to do, no error
    memory = InMemorySpanExporter()
    tel = telemetry.setup("t", env={}, span_exporter=memory)
    with tel.span("mvp-chat prompt", request_id=1):
        telemetry.note_prompt_end(12, "max_tokens")
    (span,) = memory.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes[telemetry.ATTR_TOKENS] == 12
    assert span.attributes[telemetry.ATTR_STOP_REASON] == "max_tokens"


def test_prometheus_endpoint_serves_and_a_taken_port_is_a_clear_error(tmp_path):
    port_file = tmp_path / "metrics.port"
    tel = telemetry.setup(
        "t",
        env={
            "OTEL_METRICS_EXPORTER": "prometheus",
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
            "OTEL_EXPORTER_PROMETHEUS_PORT": "0",
        },
        port_file=port_file,
    )
    assert tel.prometheus_address is not None
    port = tel.prometheus_address[1]
    assert int(port_file.read_text()) == port
    metrics.sink().record_prompt("done", ttft_ms=50.0, tokens_per_s=30.0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    ended = [line for line in text.splitlines() if line.startswith("mvp_prompt_ended_total{")]
    assert len(ended) == 1 and 'status="done"' in ended[0] and ended[0].endswith(" 1.0"), ended
    assert "mvp_prompt_time_to_first_token_milliseconds_count" in text
    telemetry.reset_for_tests()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        with pytest.raises(TelemetryConfigError) as err:
            telemetry.setup(
                "t",
                env={
                    "OTEL_METRICS_EXPORTER": "prometheus",
                    "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
                    "OTEL_EXPORTER_PROMETHEUS_PORT": str(busy),
                },
            )
    assert f"127.0.0.1:{busy}" in str(err.value) and "OTEL_EXPORTER_PROMETHEUS_PORT" in str(
        err.value
    )


def test_stream_polls_and_queries_are_not_traced():
    memory = InMemorySpanExporter()
    tel = telemetry.setup("t", env={}, span_exporter=memory)
    tracer = tel.tracer_provider.get_tracer("x")
    with tracer.start_as_current_span("POST /v1/completions"):
        for name in (
            "StartWorkflowUpdate:__temporal_workflow_stream_poll",
            "QueryWorkflow:snapshot",
            "StartWorkflowUpdate:admit_prompt",
        ):
            with tracer.start_as_current_span(name):
                pass
    assert sorted(s.name for s in memory.get_finished_spans()) == [
        "POST /v1/completions",
        "StartWorkflowUpdate:admit_prompt",
    ]
