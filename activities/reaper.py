"""The reaper's activities (DECISIONS 30).

Listing and destroying run on the host-affine provider queue, where the providers that
own the resources live; the liveness check of the runs runs on the shared queue, with
the activity's own Temporal client.
"""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.api.enums.v1 import WorkflowExecutionStatus
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.heartbeat import in_thread
from activities.provisioning import ProviderActivities
from mvp_core import names
from mvp_core.models import ProviderKind
from mvp_core.names import QUERY_TIMEOUT
from mvp_core.reaper import (
    DestroyInput,
    DestroyResult,
    Liveness,
    LivenessInput,
    LivenessResult,
    ResourceListing,
    RunLiveness,
)

LIVENESS_CONCURRENCY = 8


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ReaperActivities:
    """The provider side of the reaper: this host's providers, as the run uses them."""

    def __init__(self, providers: ProviderActivities) -> None:
        self.providers = providers
        # Why each provider is not swept here, as last logged: a host without a Docker
        # daemon or a Vast.ai key says so once per worker (and again when the reason
        # changes, or after the provider was back), not on every sweep.
        self.unavailable: dict[ProviderKind, str] = {}

    def _note_unavailable(self, kind: ProviderKind, why: str) -> None:
        if self.unavailable.get(kind) == why:
            activity.logger.debug("reaper: %s still not swept here: %s", kind.value, why)
            return
        self.unavailable[kind] = why
        activity.logger.info(
            "reaper: provider %s is not swept on this host (%s); said once per worker",
            kind.value,
            why,
        )

    def _kinds(self) -> list[ProviderKind]:
        return sorted({*self.providers.providers, *self.providers.factories})

    @activity.defn(name=names.ACT_LIST_RESOURCES)
    async def list_resources(self, host: str) -> ResourceListing:
        """Every labelled resource of every provider this host can reach, as the
        providers report them; a provider that cannot list is named, the rest still are."""
        listing = ResourceListing(host=host)
        for kind in self._kinds():
            try:
                provider = self.providers.provider(kind)
                await in_thread(provider.check, None)
            except Exception as err:  # ProviderUnavailable, or a provider that cannot load
                self._note_unavailable(kind, _clip(str(err)))
                listing.unavailable.append(_clip(f"{kind.value}: {err}"))
                continue
            self.unavailable.pop(kind, None)
            try:
                found = await in_thread(provider.list_resources)
            except Exception as err:
                activity.logger.warning("reaper: %s cannot list its resources: %s", kind, err)
                listing.errors.append(_clip(f"{kind.value}: {err}"))
                continue
            listing.resources.extend(found)
        return listing

    @activity.defn(name=names.ACT_DESTROY_RESOURCE)
    async def destroy_resource(self, inp: DestroyInput) -> DestroyResult:
        """Destroy one resource (idempotent); a failure is reported, not raised: the next
        sweep tries again."""
        res = inp.resource
        try:
            provider = self.providers.provider(res.provider)
            await in_thread(provider.destroy, res)
        except Exception as err:
            activity.logger.warning(
                "reaper: destroying %s %s (%s) failed: %s", res.kind, res.name, res.detail, err
            )
            return DestroyResult(destroyed=False, error=_clip(f"{type(err).__name__}: {err}"))
        activity.logger.info(
            "reaper: destroyed %s %s of %s (%s)",
            res.kind,
            res.name,
            res.run_workflow_id,
            res.detail,
        )
        return DestroyResult(destroyed=True)


async def liveness_of(client: Client, run_workflow_id: str) -> RunLiveness:
    """Whether ``run_workflow_id`` exists, is closed, or runs (and which execution).
    Every failure to tell is UNKNOWN: the reaper never destroys on doubt."""
    handle = client.get_workflow_handle(run_workflow_id)
    try:
        desc = await handle.describe(rpc_timeout=QUERY_TIMEOUT)
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return RunLiveness(state=Liveness.ABSENT)
        return RunLiveness(state=Liveness.UNKNOWN, detail=_clip(f"describe failed: {err}"))
    except Exception as err:
        return RunLiveness(state=Liveness.UNKNOWN, detail=_clip(f"describe failed: {err}"))
    status = desc.raw_description.workflow_execution_info.status
    if status != WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING:
        name = WorkflowExecutionStatus.Name(status).removeprefix("WORKFLOW_EXECUTION_STATUS_")
        return RunLiveness(state=Liveness.CLOSED, detail=name.lower())
    if desc.workflow_type != names.RUN_WORKFLOW:
        return RunLiveness(
            state=Liveness.UNKNOWN, detail=_clip(f"running workflow of type {desc.workflow_type}")
        )
    try:
        # The snapshot carries the execution's nonce cut to its first 8 characters.
        state = await handle.query(names.QUERY_SNAPSHOT, rpc_timeout=QUERY_TIMEOUT)
        nonce = state["nonce"] if isinstance(state, dict) else None
    except Exception as err:
        return RunLiveness(state=Liveness.UNKNOWN, detail=_clip(f"snapshot query failed: {err}"))
    if not isinstance(nonce, str) or not nonce:
        return RunLiveness(state=Liveness.UNKNOWN, detail="the snapshot carries no nonce")
    return RunLiveness(state=Liveness.RUNNING, nonce8=nonce[:8])


@activity.defn(name=names.ACT_RUN_LIVENESS)
async def run_liveness(inp: LivenessInput) -> LivenessResult:
    """The liveness of each run workflow id, a few at a time."""
    client = activity.client()
    gate = asyncio.Semaphore(LIVENESS_CONCURRENCY)

    async def one(run_workflow_id: str) -> RunLiveness:
        async with gate:
            activity.heartbeat()
            return await liveness_of(client, run_workflow_id)

    ids = sorted(set(inp.run_workflow_ids))
    found = await asyncio.gather(*(one(i) for i in ids))
    return LivenessResult(runs=dict(zip(ids, found, strict=True)))
