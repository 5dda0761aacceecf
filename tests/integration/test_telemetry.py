"""OpenTelemetry through the whole system: a run started from the temporal CLI, a prompt
through the gateway, one trace from the gateway's request span down to the generate
activity on the head node; then the Prometheus endpoints of the orchestrator worker and
of a node, scraped for real.

The gateway runs in this process with the SDK's in-memory span exporter; the
orchestrator worker and the nodes export OTLP/HTTP to a local collector
(tests/helpers/otlp_collector.py), configured only by OTEL_* variables.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from temporalio.client import WorkflowExecutionStatus

from mvp_core import names
from mvp_core.models import RequestShutdown, RunPhase
from temporal import telemetry
from temporal.connect import connect
from temporal.devserver import DevServer, start_dev_server, temporal_binary
from tests.helpers.otlp_collector import Collector, Span, start_collector
from tests.helpers.runs import task_failures
from tests.helpers.waits import eventually
from tests.integration.conftest import (
    OrchestratorProcess,
    harness_env,
    node_processes,
    snapshot,
    wait_closed,
    wait_phase,
)
from tests.integration.test_gateway import serve

RUN = 4101
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def samples(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """The samples of ``metric`` in a Prometheus text exposition: (labels, value)."""
    out = []
    for line in text.splitlines():
        if not line.startswith(metric) or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$", line)
        if m is None or m.group(1) != metric:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        out.append((labels, float(m.group(4))))
    return out


class Site:
    def __init__(self, collector: Collector, memory: InMemorySpanExporter, **kw: Any) -> None:
        self.collector = collector
        self.memory = memory
        self.__dict__.update(kw)


@pytest.fixture(scope="module")
async def site(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Site]:
    tmp = tmp_path_factory.mktemp("otel")
    state_dir = tmp / "state"
    state_dir.mkdir()
    faults = tmp / "faults.json"
    faults.write_text("{}")
    collector = start_collector()
    # Its own server and worker: every workflow task of this run goes through a worker
    # whose only configuration of telemetry is the OTEL_* environment.
    server = start_dev_server(str(tmp / "t.db"), log_file=str(tmp / "temporal.log"))
    metrics_port = _free_port()
    otel = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "prometheus",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        "OTEL_EXPORTER_PROMETHEUS_PORT": str(metrics_port),
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    worker = OrchestratorProcess(server.address, state_dir, tmp, {**harness_env(faults), **otel})
    memory = InMemorySpanExporter()
    telemetry.reset_for_tests()
    # This process is the gateway: in-memory spans, no exporter from the environment.
    telemetry.setup("mvp-gateway", env={}, span_exporter=memory)
    try:
        worker.start()
        client = await connect(server.address)
        start_from_cli(server, tmp)
        handle = client.get_workflow_handle(names.run_workflow_id(RUN))
        await wait_phase(handle, RunPhase.PROMPT_READY, timeout=120)
        async with serve(client, RUN) as url:
            yield Site(
                collector,
                memory,
                client=client,
                handle=handle,
                url=url,
                worker=worker,
                metrics_port=metrics_port,
                state_dir=state_dir,
                tmp=tmp,
            )
        assert not task_failures(tmp)
    finally:
        telemetry.reset_for_tests()
        with contextlib.suppress(Exception):
            await client.get_workflow_handle(names.run_workflow_id(RUN)).terminate("clean-up")
        for p in node_processes(state_dir):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        worker.stop()
        server.stop()
        collector.stop()


def start_from_cli(server: DevServer, tmp: Path) -> None:
    request = tmp / "run.json"
    request.write_text(
        json.dumps(
            {
                "run_id": RUN,
                "model": {"bundled": MODEL},
                "pipeline_stages": 2,
                "default_max_tokens": 64,
                "max_context": 512,
            }
        )
    )
    done = subprocess.run(
        [
            *(temporal_binary(), "workflow", "start", "--address", server.address),
            *("--type", "RunWorkflow", "--task-queue", names.ORCHESTRATOR_TASK_QUEUE),
            *("--workflow-id", names.run_workflow_id(RUN), "--input-file", str(request)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


def ancestors(span: Span, by_id: dict[str, Span]) -> list[Span]:
    chain = []
    while span.parent_id and span.parent_id in by_id:
        span = by_id[span.parent_id]
        chain.append(span)
    return chain


async def test_one_trace_from_the_gateway_to_the_generate_activity(site: Site):
    async with httpx.AsyncClient(base_url=site.url, timeout=60) as http:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 12,
            "stream": True,
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            text = "".join([line async for line in resp.aiter_lines()])
        assert "[DONE]" in text
    local = [s for s in site.memory.get_finished_spans() if s.name == "POST /v1/chat/completions"]
    assert len(local) == 1, [s.name for s in site.memory.get_finished_spans()]
    root = local[0]
    trace_id = f"{root.context.trace_id:032x}"
    generate = f"RunActivity:{names.ACT_NODE_GENERATE}"

    # The client's spans (gateway process) and the workers' (collector) are one tree.
    mine = [
        Span(
            name=s.name,
            trace_id=trace_id,
            span_id=f"{s.context.span_id:016x}",
            parent_id=f"{s.parent.span_id:016x}" if s.parent is not None else "",
            service="mvp-gateway",
            attributes=dict(s.attributes or {}),
            kind=0,
        )
        for s in site.memory.get_finished_spans()
        if f"{s.context.trace_id:032x}" == trace_id
    ]

    def chain_of(spans: list[Span]) -> list[str]:
        by_id = {s.span_id: s for s in [*mine, *spans] if s.trace_id == trace_id}
        gens = [s for s in spans if s.name == generate and s.trace_id == trace_id]
        if len(gens) != 1:
            return []
        return [gens[0].name, *(s.name for s in ancestors(gens[0], by_id))]

    # A workflow's handler span goes out when the handler ends: wait for the whole chain.
    spans = site.collector.wait_for(
        lambda spans: chain_of(spans)[-1:] == ["POST /v1/chat/completions"]
    )
    remote = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in [*mine, *remote]}
    chain = chain_of(spans)
    (gen,) = [s for s in remote if s.name == generate]
    chain = [gen.name, *(s.name for s in ancestors(gen, by_id))]
    assert chain[-1] == "POST /v1/chat/completions", chain
    assert f"StartWorkflowUpdate:{names.UPDATE_ADMIT_PROMPT}" in chain, chain
    assert f"HandleUpdate:{names.UPDATE_ADMIT_PROMPT}" in chain, chain
    assert f"RunWorkflow:{names.PROMPT_WORKFLOW}" in chain, chain
    assert f"StartActivity:{names.ACT_NODE_GENERATE}" in chain, chain
    # Each part where it ran: the generate activity on the head node (stage 0).
    state = await snapshot(site.handle)
    head = next(n for n in state.nodes if n.stage_index == 0)
    assert gen.service == f"mvp-node-{head.node_id}", gen
    workflow_side = by_id[gen.parent_id]
    assert workflow_side.service == "mvp-orchestrator", workflow_side
    # How the prompt ended, on the span of the activity that generated it.
    assert gen.attributes[telemetry.ATTR_STOP_REASON] in ("eos", "max_tokens"), gen
    assert 1 <= gen.attributes[telemetry.ATTR_TOKENS] <= 12, gen
    # No prompt text in any span attribute.
    for s in [*remote, *mine]:
        assert "Name a colour" not in json.dumps(s.attributes, default=str)


async def test_the_prometheus_endpoints_after_prompts(site: Site):
    async with httpx.AsyncClient(base_url=site.url, timeout=60) as http:
        for i in range(2):
            r = await http.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": f"Count to {i + 3}:", "max_tokens": 24},
            )
            assert r.status_code == 200, r.text
    state = await snapshot(site.handle)

    def orchestrator_ready(text: str) -> bool:
        return bool(samples(text, "mvp_prompt_time_to_first_token_milliseconds_count"))

    def scraped() -> str:  # the SDK's metric buffer drains every second
        text = scrape(site.metrics_port)
        ttft = samples(text, "mvp_prompt_time_to_first_token_milliseconds_count")
        # The last reply came with its text's end (DECISIONS 95): the run counts that
        # end, and its queue empties, a workflow task later.
        depth = [v for lab, v in samples(text, "mvp_run_prompt_queue_depth") if lab.get("run_id")]
        return text if ttft and sum(v for _, v in ttft) >= 3 and depth == [0.0] else ""

    text = await eventually(
        scraped,
        timeout=30,
        what="the time to first token of 3 prompts, and an empty queue, in the metrics",
        interval=0.2,
        detail=lambda: scrape(site.metrics_port)[:3000],
    )
    assert orchestrator_ready(text), text[:3000]
    ready = samples(text, "mvp_run_time_to_prompt_ready_milliseconds_sum")
    count = samples(text, "mvp_run_time_to_prompt_ready_milliseconds_count")
    assert count and count[0][1] == 1, count
    assert 500 < ready[0][1] < 120_000, ready  # a 2-stage start takes seconds
    ttft_sum = sum(v for _, v in samples(text, "mvp_prompt_time_to_first_token_milliseconds_sum"))
    ttft_n = sum(v for _, v in samples(text, "mvp_prompt_time_to_first_token_milliseconds_count"))
    assert ttft_n >= 3 and 0 < ttft_sum / ttft_n < 30_000, [
        line for line in text.splitlines() if line.startswith("mvp_")
    ]
    rate_sum = sum(v for _, v in samples(text, "mvp_prompt_decode_tokens_per_second_sum"))
    rate_n = sum(v for _, v in samples(text, "mvp_prompt_decode_tokens_per_second_count"))
    assert rate_n >= 3 and 1 < rate_sum / rate_n < 10_000, (rate_sum, rate_n)
    ended = {
        lab["status"]: v for lab, v in samples(text, "mvp_prompt_ended_total") if "status" in lab
    }
    assert ended.get("done", 0) >= 3, ended
    depth = [v for lab, v in samples(text, "mvp_run_prompt_queue_depth") if lab.get("run_id")]
    assert depth == [0.0], depth
    nodes = {
        lab["state"]: v
        for lab, v in samples(text, "mvp_run_nodes")
        if lab.get("run_id") == str(RUN)
    }
    assert nodes.get("ready") == len(state.nodes) == 2, nodes
    # The Temporal SDK's own runtime metrics, through the same endpoint.
    assert samples(text, "temporal_workflow_completed_total") or samples(
        text, "temporal_request_total"
    ), [line for line in text.splitlines() if line.startswith("temporal_")][:20]

    # Every node serves its own sampled stage forward times (a free port each, written
    # to its node directory).
    ports = sorted(site.state_dir.rglob("metrics.port"))
    assert len(ports) == 2, ports
    for port_file in ports:
        node_text = scrape(int(port_file.read_text()))
        fwd = {
            lab["phase"]: v
            for lab, v in samples(node_text, "mvp_stage_forward_time_milliseconds_count")
        }
        assert fwd.get("prefill", 0) >= 3, fwd  # every prefill forward
        # Decode forwards are sampled (1 in 16): 3 prompts of ~12-24 tokens give a few.
        assert 1 <= fwd.get("decode", 0) < 3 * 24, fwd


async def test_a_run_started_from_the_cli_has_its_own_workflow_span(site: Site):
    await site.handle.signal(names.SIGNAL_REQUEST_SHUTDOWN, RequestShutdown(run_id=RUN))
    assert await wait_closed(site.handle) is WorkflowExecutionStatus.COMPLETED
    name = f"RunWorkflow:{names.RUN_WORKFLOW}"
    spans = site.collector.wait_for(lambda spans: any(s.name == name for s in spans))
    found = [s for s in spans if s.name == name]
    assert found, spans
    # No client started it: the workflow span is the root of its own trace. (A first
    # workflow task that timed out on a loaded machine runs the workflow code again,
    # outside replay, and the SDK's interceptor then emits a second such span: each is a
    # root of this run's workflow, and the one whose trace holds the run's work is checked.)
    for run in found:
        assert run.parent_id == "" and run.service == "mvp-orchestrator", run
        assert run.attributes.get("temporalWorkflowID") == names.run_workflow_id(RUN)
    run = max(found, key=lambda r: sum(s.trace_id == r.trace_id for s in spans))
    # Its activities, and the reports nodes send from them, hang under it.
    under = {s.name for s in spans if s.trace_id == run.trace_id}
    assert f"HandleSignal:{names.SIGNAL_WEIGHTS_READY}" in under, sorted(under)
    assert f"StartActivity:{names.ACT_NODE_PROVISION_STAGE}" in under, sorted(under)
