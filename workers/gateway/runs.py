"""The runs one gateway serves (DECISIONS 90): a :class:`~workers.gateway.service.Gateway`
per run, what ``/v1/models`` lists, which run a request goes to (``selection.py``), and
each run's end.

Each run is watched while the gateway serves it: its model is learned in the background
(``Gateway.start``), and one long poll of its close (``RunHandle.wait_closed``, which
follows a continue-as-new chain: a continued run is the same run) says when it ends,
completed, failed or terminated. A run that ends leaves the set at once; the requests in
flight in it get a ``run_ended`` error (a 503, or the last event of a started stream).
Runs are added (the command line, ``POST /admin/runs``) and removed (``DELETE``) while
the gateway serves; removing one leaves the run running and lets its requests in
flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError

from mvp_core import names
from workers.gateway.selection import RunView, rank, resolve
from workers.gateway.service import Gateway, ServedModel
from workers.gateway.wire import ApiError, model_not_found

log = logging.getLogger("mvp.gateway")

WATCH_RETRY_S = 1.0  # a Temporal that cannot be asked whether a run closed: ask again


class RunAlreadyServed(ValueError):
    """The gateway serves that run already."""


@dataclass(frozen=True)
class RunSpec:
    """A run to serve: its id, and the model id to list it under (None: its file's)."""

    run_id: int
    alias: str | None = None

    @property
    def workflow_id(self) -> str:
        return names.run_workflow_id(self.run_id)


class RunSet:
    """The runs this gateway serves, by workflow id, in the order they were added."""

    def __init__(
        self,
        client: Client,
        *,
        poll_cooldown_ms: int = 20,
        notify: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.poll_cooldown_ms = poll_cooldown_ms
        self._notify = notify
        self._runs: dict[str, Gateway] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._chosen = itertools.count(1)  # when a run was last sent a request
        self._started = False
        self.primary: Gateway | None = None  # the first run: the dashboard's
        # The last run that ended by itself, set when no run is left: the command exits.
        self.emptied: asyncio.Event = asyncio.Event()
        self.last_ended: Gateway | None = None

    def notify(self, message: str) -> None:
        """Tell the operator: through ``notify`` where given (the command's stderr), else
        the log (not both: the command's log is its stderr too)."""
        if self._notify is not None:
            self._notify(message)
        else:
            log.info("%s", message)

    # ------------------------------------------------------------------ the set
    def __len__(self) -> int:
        return len(self._runs)

    def gateways(self) -> list[Gateway]:
        return list(self._runs.values())

    def get(self, run_id: int) -> Gateway | None:
        return self._runs.get(names.run_workflow_id(run_id))

    def add(self, spec: RunSpec) -> Gateway:
        """Serve run ``spec.run_id`` from now on (RunAlreadyServed if it is served)."""
        wid = spec.workflow_id
        if wid in self._runs:
            raise RunAlreadyServed(f"this gateway serves {wid} already")
        gateway = Gateway(
            self.client,
            spec.run_id,
            poll_cooldown_ms=self.poll_cooldown_ms,
            alias=spec.alias,
        )
        self._runs[wid] = gateway
        if self.primary is None:
            self.primary = gateway
        if self._started:
            self._watch(gateway)
        return gateway

    def remove(self, workflow_id: str) -> Gateway | None:
        """Stop serving a run (it goes on running; its requests in flight finish)."""
        gateway = self._runs.pop(workflow_id, None)
        watch = self._watches.pop(workflow_id, None)
        if watch is not None:
            watch.cancel()
        if gateway is not None:
            gateway.retire()
        return gateway

    # ------------------------------------------------------------------ models
    def _view(self, gateway: Gateway, served: ServedModel) -> RunView:
        return RunView(
            key=gateway.workflow_id,
            model=served.id,
            names=served.aliases,
            ready=gateway.ready,
            in_flight=gateway.in_flight,
            max_active=gateway.max_active,
            last_chosen=gateway.last_chosen,
        )

    async def _served(self, *, ask: bool) -> tuple[dict[str, ServedModel], ApiError | None]:
        """Each run's model as known; with ``ask``, the runs not known yet are asked (a
        run without a plan: the first such one's 503 comes back beside)."""
        known: dict[str, ServedModel] = {}
        pending: list[Gateway] = []
        for gateway in self.gateways():
            served = gateway.known()
            if served is not None:
                known[gateway.workflow_id] = served
            else:
                pending.append(gateway)
        first_error: ApiError | None = None
        if ask and pending:
            answers = await asyncio.gather(*(g.served() for g in pending), return_exceptions=True)
            for gateway, answer in zip(pending, answers, strict=True):
                if isinstance(answer, ServedModel):
                    known[gateway.workflow_id] = answer
                elif isinstance(answer, ApiError):
                    first_error = first_error or answer
                elif isinstance(answer, BaseException):
                    raise answer
        return known, first_error

    async def models(self) -> list[ServedModel]:
        """One entry per model id (replicas listed once, with the earliest start); a 503
        while no run's model is known and a run cannot say yet."""
        known, error = await self._served(ask=True)
        if not known and error is not None:
            raise error
        by_id: dict[str, ServedModel] = {}
        for served in known.values():
            seen = by_id.get(served.id)
            if seen is None or served.created < seen.created:
                by_id[served.id] = served
        return [by_id[k] for k in sorted(by_id)]

    async def model(self, name: str) -> ServedModel:
        """The model ``name`` names (``GET /v1/models/{name}``), or a 404."""
        runs = await self._candidates(name)
        served = await runs[0].served()
        return served

    async def select(self, name: str) -> list[Gateway]:
        """The runs a request for model ``name`` may go to, the one to try first first
        (selection.py); a 404 naming the model when none serves it, a 503 while a run
        whose model is not known yet cannot say. The first is taken as chosen now."""
        order = await self._candidates(name)
        order[0].last_chosen = next(self._chosen)
        return order

    async def _candidates(self, name: str) -> list[Gateway]:
        known, _ = await self._served(ask=False)
        chosen = self._pick(name, known)
        if chosen:
            return chosen
        if len(known) < len(self._runs):  # a run not known yet may serve it: ask
            known, error = await self._served(ask=True)
            chosen = self._pick(name, known)
            if chosen:
                return chosen
            if error is not None:
                raise error
        found = resolve(name, (self._view(self._runs[k], s) for k, s in known.items()))
        if found.ambiguous:
            ids = ", ".join(found.ambiguous)
            raise ApiError(
                404,
                f"The model `{name[:200]}` names several models of this gateway ({ids}); "
                "use one of these ids.",
                param="model",
                code="model_not_found",
            )
        raise model_not_found(name)

    def _pick(self, name: str, known: dict[str, ServedModel]) -> list[Gateway]:
        views = [self._view(self._runs[k], s) for k, s in known.items() if k in self._runs]
        return [self._runs[v.key] for v in rank(resolve(name, views).runs)]

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Watch every run (its model, its end) from now on."""
        self._started = True
        for gateway in self.gateways():
            self._watch(gateway)

    def _watch(self, gateway: Gateway) -> None:
        gateway.start()
        self._watches[gateway.workflow_id] = asyncio.ensure_future(self._until_closed(gateway))

    async def _until_closed(self, gateway: Gateway) -> None:
        """When the run closes (however: completed, failed, terminated; not a continue-
        as-new), it leaves the set and its requests in flight get ``run_ended``."""
        while True:
            try:
                await gateway.run.wait_closed()
                break
            except RPCError:  # Temporal unreachable, or no such run (yet): ask again
                await asyncio.sleep(WATCH_RETRY_S)
        how = "closed"
        with contextlib.suppress(Exception):
            status = (await gateway.run.describe()).status
            if status is not None and status is not WorkflowExecutionStatus.RUNNING:
                how = status.name.lower()
        wid = gateway.workflow_id
        if self._runs.get(wid) is not gateway:
            return  # removed meanwhile
        del self._runs[wid]
        self._watches.pop(wid, None)
        gateway.mark_ended(how)
        served = gateway.known()
        model = f" (model {served.id!r})" if served is not None else ""
        self.notify(f"run {wid}{model} ended ({how}): no longer served")
        if not self._runs:
            self.last_ended = gateway
            self.emptied.set()
        await gateway.aclose()

    def close_viewers(self) -> None:
        if self.primary is not None:
            self.primary.close_viewers()

    async def aclose(self) -> None:
        watches = list(self._watches.values())
        self._watches.clear()
        for watch in watches:
            watch.cancel()
        for watch in watches:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch
        await asyncio.gather(*(g.aclose() for g in self.gateways()), return_exceptions=True)
