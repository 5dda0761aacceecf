"""Provider activities, run on the host-affine provider queue (DECISIONS 17)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import datastream_bus
from activities.heartbeat import heartbeat_for, in_thread
from activities.model_share import ShareProgress, fetch_node_share
from activities.providers.base import (
    NodeStartFailed,
    Provider,
    ProviderUnavailable,
    harness_faults,
    node_text,
)
from activities.providers.process import ProcessProvider
from mvp_core import names
from mvp_core.datastream import CHANNEL_PROVISIONING_EVENTS, ProvisionEventKind, provision_event
from mvp_core.errors import ErrorType
from mvp_core.models import (
    CompleteBootstrapInput,
    CompleteBootstrapResult,
    NodeExited,
    NodeHandle,
    NodeProvisionSpec,
    ProviderKind,
    StopNodeInput,
    StopNodeResult,
    WatchNodesInput,
)
from mvp_io.share_fetch import ShareFetchError

WATCH_INTERVAL_S = 0.5
# A provider's records are its nodes' provider log lines (datastream_bus.PROVIDER_LOGGERS).
log = logging.getLogger("mvp.provider")
# Providers whose nodes run on this host: their share of a hub model is fetched here.
_FETCH_HERE = frozenset({ProviderKind.PROCESS, ProviderKind.DOCKER})


def _docker() -> Provider:
    from activities.providers.docker import DockerProvider  # the docker SDK only when used

    return DockerProvider()


def _vastai() -> Provider:
    from activities.providers.vastai import VastAiProvider

    return VastAiProvider()


# How each provider of this host is made, on first use: a host without a Docker daemon
# still serves process runs, and a docker run there is rejected naming what is missing.
DEFAULT_FACTORIES: dict[ProviderKind, Callable[[], Provider]] = {
    ProviderKind.PROCESS: ProcessProvider,
    ProviderKind.DOCKER: _docker,
    ProviderKind.VASTAI: _vastai,
}


class ProviderActivities:
    """Holds the providers of this host; credentials live only in this worker's env."""

    def __init__(self, providers: dict[ProviderKind, Provider] | None = None) -> None:
        self.providers: dict[ProviderKind, Provider] = dict(providers or {})
        self.factories = {} if providers else dict(DEFAULT_FACTORIES)

    def provider(self, kind: ProviderKind) -> Provider:
        """This host's provider of ``kind``; ProviderUnavailable when it has none."""
        provider = self.providers.get(kind)
        if provider is None:
            factory = self.factories.get(kind)
            if factory is None:
                raise ProviderUnavailable(f"provider {kind.value!r} is not available on this host")
            provider = self.providers[kind] = factory()
        return provider

    def available(self) -> list[Provider]:
        """The providers this host can reach now (the reaper sweeps these)."""
        found = []
        for kind in {*self.providers, *self.factories}:
            try:
                provider = self.provider(kind)
                provider.check(None)
            except ProviderUnavailable:
                continue
            found.append(provider)
        return found

    def _provider(self, kind: ProviderKind) -> Provider:
        try:
            return self.provider(kind)
        except ProviderUnavailable as err:
            raise ApplicationError(
                str(err), type=ErrorType.PROVIDER_UNAVAILABLE, non_retryable=True
            ) from None

    @activity.defn(name=names.ACT_START_NODE)
    async def start_node(self, spec: NodeProvisionSpec) -> NodeHandle:
        # The provider's log records of this start are the run's provider log lines, and
        # a start that fails is a ProvisionFailed event (the run's datastream, DECISIONS 58).
        with datastream_bus.run_context(spec.run_id, spec.node_id, spec.provider.value):
            try:
                provider = self._provider(spec.provider)
                fetched: int | None = None
                progress = None
                if spec.model_share is not None:
                    progress = ShareProgress(spec, spec.model_share)
                    if spec.provider in _FETCH_HERE:
                        fetched = await in_thread(
                            fetch_node_share, spec, progress, details=progress.details
                        )
                # A node that fetches its share on its own host (Vast.ai) tells the same
                # progress, as this start's heartbeat details, while the provider starts it.
                details = progress.details if progress is not None and fetched is None else None
                handle = await in_thread(provider.start, spec, progress, details=details)
                if spec.model_share is not None:
                    handle = handle.model_copy(
                        update={
                            "share_bytes": spec.model_share.size,
                            # fetched here, or by the node's own host (Vast.ai)
                            "share_fetched": handle.share_fetched if fetched is None else fetched,
                        }
                    )
                # Test harness only (MVP_FAULT_START_DELAY_S): the node launched, its start
                # still in flight this long (heartbeating).
                delay = harness_faults(spec.run_id).get("MVP_FAULT_START_DELAY_S")
                if delay:
                    await heartbeat_for(float(delay), "test delay")
                return handle
            except (NodeStartFailed, ProviderUnavailable, ShareFetchError) as err:
                # A start's error may quote a node's host (an SSH error, a bootstrap's output).
                _start_failed(spec, node_text(str(err)))
                raise ApplicationError(
                    node_text(str(err)), type=type(err).__name__, non_retryable=True
                ) from None
            except ApplicationError as err:
                _start_failed(spec, node_text(str(err)))
                raise
            except Exception as err:
                _start_failed(spec, node_text(f"{type(err).__name__}: {err}"))
                raise

    @activity.defn(name=names.ACT_STOP_NODE)
    async def stop_node(self, inp: StopNodeInput) -> StopNodeResult:
        h = inp.handle
        with datastream_bus.run_context(h.run_id, h.node_id, h.provider.value):
            provider = self._provider(h.provider)
            # Test harness only (MVP_FAULT_STOP_DELAY_S): a slow stop, heartbeating.
            delay = harness_faults(h.run_id).get("MVP_FAULT_STOP_DELAY_S")
            if delay:
                await heartbeat_for(float(delay), "test delay")
            return await in_thread(provider.stop, h, inp.grace_s)

    @activity.defn(name=names.ACT_COMPLETE_BOOTSTRAP)
    async def complete_bootstrap(self, inp: CompleteBootstrapInput) -> CompleteBootstrapResult:
        """Each node's provider completes its bootstrap (process spec 7.6); a node's
        failure is a line of the result (redacted: it may quote the node's host), the
        other nodes still done."""
        errors: list[str] = []
        for h in inp.handles:
            with datastream_bus.run_context(h.run_id, h.node_id, h.provider.value):
                try:
                    await in_thread(self._provider(h.provider).complete_bootstrap, h)
                except Exception as err:
                    text = node_text(f"node {h.node_id}: {type(err).__name__}: {err}")[:500]
                    log.warning("complete_bootstrap of %s", text)
                    errors.append(text)
        return CompleteBootstrapResult(errors=errors)

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
                    # What a node left behind goes into the run's history: redacted.
                    return exited.model_copy(update={"detail": node_text(exited.detail)})
            activity.heartbeat()
            await asyncio.sleep(WATCH_INTERVAL_S)


def _start_failed(spec: NodeProvisionSpec, message: str) -> None:
    """A ProvisionFailed event for the run's datastream (one per failed attempt)."""
    attempt = activity.info().attempt if activity.in_activity() else 1
    datastream_bus.publish(
        spec.run_id,
        CHANNEL_PROVISIONING_EVENTS,
        provision_event(
            spec.run_id,
            spec.node_id,
            ProvisionEventKind.PROVISION_FAILED,
            spec.provider.value,
            f"start attempt {attempt}: {message}",
        ),
    )
