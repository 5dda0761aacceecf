"""The bus from provider activities to their run's datastream (DECISIONS 58): a provider's
log records inside a start become the node's provider log lines, a failed start is a
ProvisionFailed event, and a start in a thread (as every provider start runs) keeps its
run's context."""

from __future__ import annotations

import logging

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities import datastream_bus as bus
from activities.providers.base import NodeStartFailed
from activities.provisioning import ProviderActivities
from mvp_core.models import NodeProvisionSpec, ProviderKind


class FailingProvider:
    def check(self, spec_gpus: str | None) -> None:
        return None

    def start(self, spec: NodeProvisionSpec, progress: object = None) -> None:
        logging.getLogger("mvp.provider.vastai").info("offer 17 tried: rate limited (HTTP 429)")
        raise NodeStartFailed("no offer left; HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123")


def spec(run_id: int) -> NodeProvisionSpec:
    return NodeProvisionSpec(
        run_id=run_id,
        node_id=2,
        stage_index=1,
        nonce="0123456789abcdef",
        task_queue="q",
        readiness_id="r",
        authorized_orchestrator="a",
        run_workflow_id=f"mvp-run-{run_id}",
        image_or_artifact="img",
        environment={},
        coordinator_endpoint="",
        temporal_namespace="default",
        provider=ProviderKind.VASTAI,
    )


async def test_a_failed_start_reaches_its_runs_bus_with_the_providers_progress() -> None:
    bus.install_provider_log_handler()
    run_id = 99101
    acts = ProviderActivities({ProviderKind.VASTAI: FailingProvider()})  # type: ignore[dict-item]
    with bus.attached(run_id), pytest.raises(ApplicationError):
        await ActivityEnvironment().run(acts.start_node, spec(run_id))
    items = bus.drain(run_id)
    channels = [i.channel for i in items]
    assert channels == ["mvp.provisioning.logs.node.2.provider", "mvp.provisioning.events"]
    line = items[0].record["line"]
    assert line["stream"] == "Provider" and "offer 17 tried" in line["line"], line
    event = items[1].record["event"]
    assert event["kind"] == "ProvisionFailed" and event["provider"] == "vastai"
    assert event["node_id"] == 2 and "no offer left" in event["message"]
    assert "hf_abcdefghijklmnopqrstuvwxyz0123" not in event["message"]  # redacted
    assert bus.drain(99102) == []  # another run's queue is its own


def test_the_bus_is_bounded_and_forgets_a_run_when_its_datastream_leaves() -> None:
    run_id = 99103
    for i in range(bus.MAX_ITEMS + 5):
        bus.publish(run_id, "c", i)
    assert bus.dropped(run_id) == 5
    with bus.attached(run_id):
        items = bus.drain(run_id)
    assert [i.record for i in items[:2]] == [5, 6] and len(items) == bus.MAX_ITEMS
    assert bus.dropped(run_id) == 0  # forgotten: nothing left, nobody attached
    bus.publish(run_id, "c", 1)
    logging.getLogger("mvp.provider.vastai").info("outside any run: not on a bus")
    assert [i.record for i in bus.drain(run_id)] == [1]
