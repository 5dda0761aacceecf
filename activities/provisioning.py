"""Provider activities, run on the host-affine provider queue (DECISIONS 17)."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.heartbeat import in_thread
from activities.providers.base import Provider
from activities.providers.process import ProcessProvider
from mvp_core import names
from mvp_core.models import (
    NodeExited,
    NodeHandle,
    NodeProvisionSpec,
    ProviderKind,
    StopNodeInput,
    StopNodeResult,
    WatchNodesInput,
)

WATCH_INTERVAL_S = 0.5


class ProviderActivities:
    """Holds the providers of this host; credentials live only in this worker's env."""

    def __init__(self, providers: dict[ProviderKind, Provider] | None = None) -> None:
        self.providers: dict[ProviderKind, Provider] = providers or {
            ProviderKind.PROCESS: ProcessProvider()
        }

    def _provider(self, kind: ProviderKind) -> Provider:
        provider = self.providers.get(kind)
        if provider is None:
            raise ApplicationError(
                f"unsupported provider {kind.value!r} on this worker",
                type="ProviderUnavailable",
                non_retryable=True,
            )
        return provider

    @activity.defn(name=names.ACT_START_NODE)
    async def start_node(self, spec: NodeProvisionSpec) -> NodeHandle:
        provider = self._provider(ProviderKind.PROCESS)
        return await in_thread(provider.start, spec)

    @activity.defn(name=names.ACT_STOP_NODE)
    async def stop_node(self, inp: StopNodeInput) -> StopNodeResult:
        provider = self._provider(inp.handle.provider)
        return await in_thread(provider.stop, inp.handle, inp.grace_s)

    @activity.defn(name=names.ACT_WATCH_NODES)
    async def watch_nodes(self, inp: WatchNodesInput) -> NodeExited:
        """Return as soon as one node's runtime is gone; heartbeats while all live."""
        by_kind: dict[ProviderKind, list[NodeHandle]] = {}
        for h in inp.handles:
            by_kind.setdefault(h.provider, []).append(h)
        while True:
            for kind, handles in by_kind.items():
                exited = await asyncio.to_thread(self._provider(kind).poll_exited, handles)
                if exited is not None:
                    return exited
            activity.heartbeat()
            await asyncio.sleep(WATCH_INTERVAL_S)
