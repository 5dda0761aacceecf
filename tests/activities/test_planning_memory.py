"""The planning activity's memory check for providers whose nodes all run on its host
(process, Docker without per-node memory): the stages' needs together against the host's
available memory, a planning error naming the shortfall where they do not fit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

import activities.planning as planning
from mvp_core.memory_plan import host_shortfall
from mvp_core.models import ModelSource, PreparePlanInput, ProviderKind
from mvp_io.model_store import DEFAULT_BUNDLED, fetch_bundled

MIB = 1 << 20


def _input(provider: ProviderKind, node_memory: list[int] | None = None) -> PreparePlanInput:
    return PreparePlanInput(
        run_id=7,
        orchestrator_node_id=0,
        node_id=1,
        model=ModelSource(path=str(fetch_bundled(DEFAULT_BUNDLED))),
        tokenizer=None,
        pipeline_stages=2,
        max_context=None,
        node_memory=node_memory,
        provider=provider,
    )


def test_the_stages_together_must_fit_the_hosts_available_memory() -> None:
    assert host_shortfall([600 * MIB, 600 * MIB], 1300 * MIB, "h") is None
    why = host_shortfall([600 * MIB, 600 * MIB], 1000 * MIB, "h")
    assert why == (
        "the run's 2 stage(s) need about 1.17 GiB together (CONTRACTS 'Planning by "
        "memory'); this host (h) has 1000.0 MiB available: short by 209715200 bytes "
        "(200.0 MiB)"
    )


@pytest.mark.parametrize("provider", [ProviderKind.PROCESS, ProviderKind.DOCKER])
async def test_a_host_without_the_memory_rejects_the_plan(
    monkeypatch: pytest.MonkeyPatch, provider: ProviderKind
) -> None:
    monkeypatch.setattr(
        planning.psutil, "virtual_memory", lambda: SimpleNamespace(available=700 * MIB)
    )
    with pytest.raises(
        ApplicationError, match=r"this host \(.*\) has 700\.0 MiB available"
    ) as info:
        await ActivityEnvironment().run(planning.plan_run, _input(provider))
    assert info.value.non_retryable and info.value.type == "PlanningError"
    # Per-node memory given: each node is planned by it, not the planning host's.
    plan = await ActivityEnvironment().run(planning.plan_run, _input(provider, [1 << 30]))
    assert [s.node_memory for s in plan.stages] == [1 << 30, 1 << 30]
    # A Vast.ai run's nodes are elsewhere: this host's memory says nothing of them.
    assert (await ActivityEnvironment().run(planning.plan_run, _input(ProviderKind.VASTAI))).stages


async def test_a_host_with_the_memory_plans_and_states_each_need() -> None:
    plan = await ActivityEnvironment().run(planning.plan_run, _input(ProviderKind.PROCESS))
    assert all(s.memory_need is not None and s.node_memory is None for s in plan.stages)
