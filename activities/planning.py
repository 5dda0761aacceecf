"""Planning activities: resolve the model, read its GGUF metadata, commit a plan."""

from __future__ import annotations

import functools
import os
import socket

import psutil
from pydantic import ValidationError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.gguf_facts import read_model
from activities.heartbeat import heartbeat_for, in_thread
from activities.providers.base import ProviderUnavailable, harness_faults
from activities.provisioning import ProviderActivities
from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.gguf_header import GGUFHeader
from mvp_core.memory_plan import host_shortfall, kv_bytes_for
from mvp_core.models import HubPin, PreparePlanInput, ProviderKind, RunPlan
from mvp_core.planner import PlanningError, build_plan
from mvp_core.stage_share import share_ranges
from mvp_io.model_store import (
    HubUnreachableError,
    ModelSourceError,
    pin_hub_model,
    resolve_model,
    whole_hub_files,
)


def provider_host() -> str:
    return os.environ.get("MVP_PROVIDER_HOST") or socket.gethostname()


@activity.defn(name=names.ACT_PROVIDER_QUEUE)
async def provider_queue() -> str:
    """The host-affine provider queue of the worker that runs this (DECISIONS 17)."""
    return names.provider_task_queue(provider_host())


class PlanningActivities:
    """Planning runs on the provider's host: the model is resolved where nodes read it,
    and the run's provider is checked there before any node starts (process spec 9.2)."""

    def __init__(self, providers: ProviderActivities) -> None:
        self.providers = providers

    @activity.defn(name=names.ACT_PREPARE_PLAN)
    async def prepare_plan(self, inp: PreparePlanInput) -> RunPlan:
        """Check the provider, resolve the model, plan the run from its GGUF metadata."""
        await _test_delay(inp.run_id)
        try:
            provider = self.providers.provider(inp.provider)
            await in_thread(provider.check, inp.gpus)
            prepare = getattr(provider, "prepare", None)
            if inp.vastai is not None and prepare is not None:
                # Vast.ai runtime preparation (process spec 7.3): identity, key, bootstrap.
                await in_thread(prepare, inp.vastai)
        except ProviderUnavailable as err:
            raise ApplicationError(
                f"provider {inp.provider.value!r} unavailable: {err}",
                type=ErrorType.PLANNING_ERROR,
                non_retryable=True,
            ) from None
        return await plan_run(inp)


async def plan_run(inp: PreparePlanInput) -> RunPlan:
    """Resolve the model on this host and plan the run from its GGUF metadata: a hub
    model from its headers alone (DECISIONS 72), each node's host fetching its share."""
    try:
        pin: HubPin | None = None
        if inp.model.hf is not None:
            try:
                paths, pin = await in_thread(pin_hub_model, inp.model.hf)
            except HubUnreachableError:
                # The hub is down: a model this host holds whole for the revision (its
                # last commit) is still planned and served, as before shares; else the
                # planning retries.
                model_path, pin = await in_thread(resolve_model, inp.model), None
            else:
                whole = await in_thread(whole_hub_files, pin)
                # Files this host holds whole already (the host fetched them before the
                # run): nodes read those, as they read a model on a path.
                model_path, pin = (whole[0], None) if whole else (paths[0], pin)
        else:
            model_path = await in_thread(resolve_model, inp.model)
        tokenizer_path = (
            await in_thread(resolve_model, inp.tokenizer) if inp.tokenizer else model_path
        )
        facts, files, header = await in_thread(read_model, model_path)
        plan = functools.partial(
            build_plan,
            run_id=inp.run_id,
            orchestrator_node_id=inp.orchestrator_node_id,
            base_node_id=inp.node_id,
            stage_count=inp.pipeline_stages,
            max_context=inp.max_context,
            facts=facts,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            activation_dtype=inp.activation_dtype,
            layer_split=inp.layer_split,
            node_memory=inp.node_memory,
            slots=inp.max_active_prompts,
            kv_bytes=kv_bytes_for(inp.precision.value),
        )
        committed = await in_thread(plan)  # a balanced split's search: up to about a second
        if inp.node_memory is None and inp.provider in _ONE_HOST:
            _check_host_memory(committed)
        # A split model's parts (checked as one model by read_model): each node's provider
        # mounts or uploads them all (a hub model's: each node's host fetches its share).
        if len(files) > 1:
            committed = committed.model_copy(update={"model_files": files})
        return committed if pin is None else with_shares(committed, header, pin)
    except (PlanningError, ModelSourceError) as err:
        raise ApplicationError(
            str(err), type=ErrorType.PLANNING_ERROR, non_retryable=True
        ) from None


def with_shares(plan: RunPlan, header: GGUFHeader, pin: HubPin) -> RunPlan:
    """``plan`` with the hub pin and each stage's share of its files (headers, tensors),
    each share checked as a node's spec will carry it."""
    header_bytes = [p.header_bytes for p in pin.parts]
    last = plan.stage_count - 1
    try:
        stages = [
            s.model_copy(
                update={
                    "fetch": share_ranges(
                        header,
                        header_bytes,
                        s.layers.start,
                        s.layers.end,
                        first=s.stage_index == 0,
                        last=s.stage_index == last,
                    )
                }
            )
            for s in plan.stages
        ]
    except ValueError as err:
        raise PlanningError(f"{pin.describe()}: {err}") from None
    shared = plan.model_copy(update={"stages": stages, "hub": pin})
    for stage in shared.stages:
        try:  # what each node's spec will carry: checked here, a planning error if wrong
            shared.share_of(stage.stage_index)
        except ValidationError as err:
            why = "; ".join(e["msg"] for e in err.errors())
            raise PlanningError(f"{pin.describe()}: stage {stage.stage_index}: {why}") from None
    return shared


# Providers whose nodes all run on the planning activity's host.
_ONE_HOST = {ProviderKind.PROCESS, ProviderKind.DOCKER}


def _check_host_memory(plan: RunPlan) -> None:
    """Every stage on this host: their needs together must fit what it has available now
    (MemAvailable: free memory and what the kernel can reclaim)."""
    needs = [s.memory_need for s in plan.stages]
    if any(n is None for n in needs):
        return  # no sizes in the header: nothing to check against
    available = psutil.virtual_memory().available
    why = host_shortfall([n for n in needs if n is not None], available, socket.gethostname())
    if why is not None:
        raise PlanningError(why)


async def _test_delay(run_id: int) -> None:
    """Test harness only (MVP_FAULT_PLAN_DELAY_S): a slow planning, heartbeating."""
    await heartbeat_for(
        float(harness_faults(run_id).get("MVP_FAULT_PLAN_DELAY_S", "0")), "test delay"
    )
