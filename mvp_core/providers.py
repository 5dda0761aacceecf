"""What the run needs to know of each provider kind, as data (no provider branches in
the workflows): where a provider's nodes live, how long their starts and stops may take,
and which of the request's provider sections it takes."""

from __future__ import annotations

from dataclasses import dataclass

from mvp_core.models import ModelShare, ProviderKind, RunRequest, VastAiSettings

# A local node (a process, a container) starts within this.
LOCAL_START_S = 60.0
# A rented instance's start: its offers' loading and SSH budgets, plus this.
RENTED_START_EXTRA_S = 600.0
# A node whose host fetches its share of a hub model first (DECISIONS 72): the start may
# take this much longer: the whole model's bytes (the nodes of one host fetch one after
# another) at FETCH_FLOOR_BYTES_S, plus FETCH_EXTRA_S. A bound, not a pace: the start
# activity heartbeats, so a lost worker is found in seconds whatever its timeout.
FETCH_FLOOR_BYTES_S = 5e6
FETCH_EXTRA_S = 300.0


def fetch_allowance_s(share: ModelShare | None) -> float:
    """The extra start time of a node that fetches ``share`` first (0 without one)."""
    if share is None:
        return 0.0
    return FETCH_EXTRA_S + sum(p.size for p in share.pin.parts) / FETCH_FLOOR_BYTES_S


@dataclass(frozen=True)
class ProviderTraits:
    kind: ProviderKind
    # Each node is a rented host of its own: nodes share no cores, all of them start at
    # once (an instance takes minutes to come up), and a start may try several offers.
    rented_hosts: bool
    # A provider stop may take this beyond the stop grace (a rented instance's destroy is
    # retried inside the activity on rate limits).
    stop_allowance_s: float
    # The request's ``docker`` section (gpus, cpus) applies to its nodes.
    takes_gpus: bool
    # Its nodes' stdout and stderr are written apart as they run, on the worker's host
    # (``node.log`` and ``node.err``); otherwise one log arrives when the node stops.
    live_logs: bool

    def host_nodes(self, node_count: int) -> int:
        """How many of the run's nodes share one host (and so its cores)."""
        return 1 if self.rented_hosts else node_count

    def start_timeout_s(self, request: RunRequest) -> float:
        if not self.rented_hosts:
            return LOCAL_START_S
        vast = request.vastai
        return (
            vast.max_offers * (vast.loading_timeout_s + vast.ssh_timeout_s) + RENTED_START_EXTRA_S
        )

    def vastai(self, request: RunRequest) -> VastAiSettings | None:
        """The request's Vast.ai section, for the provider that rents from Vast.ai."""
        return request.vastai if self.kind is ProviderKind.VASTAI else None

    def gpus(self, request: RunRequest) -> str | None:
        return (request.docker.gpus or None) if self.takes_gpus else None

    def cpus(self, request: RunRequest) -> float | None:
        return request.docker.cpus if self.takes_gpus else None

    def memory(self, request: RunRequest) -> int | None:
        """Each node's memory limit where the provider sets one (Docker's --memory)."""
        return request.docker.memory if self.takes_gpus else None

    def stage_memory(self, request: RunRequest, need: int | None) -> int | None:
        """The memory limit of the container of a stage that needs ``need`` bytes: the
        run's one limit, or with docker.memory_per_stage the stage's own need."""
        if self.takes_gpus and request.docker.memory_per_stage and need is not None:
            return need
        return self.memory(request)

    def node_memory(self, request: RunRequest) -> list[int] | None:
        """The memory to plan by: the request's node_memory, else the provider's limit."""
        if request.node_memory is not None:
            return request.node_memory
        limit = self.memory(request)
        return None if limit is None else [limit]


TRAITS: dict[ProviderKind, ProviderTraits] = {
    ProviderKind.PROCESS: ProviderTraits(
        ProviderKind.PROCESS,
        rented_hosts=False,
        stop_allowance_s=30.0,
        takes_gpus=False,
        live_logs=True,
    ),
    ProviderKind.DOCKER: ProviderTraits(
        ProviderKind.DOCKER,
        rented_hosts=False,
        stop_allowance_s=30.0,
        takes_gpus=True,
        live_logs=True,
    ),
    ProviderKind.VASTAI: ProviderTraits(
        ProviderKind.VASTAI,
        rented_hosts=True,
        stop_allowance_s=150.0,
        takes_gpus=False,
        live_logs=False,
    ),
}


def traits(kind: ProviderKind) -> ProviderTraits:
    return TRAITS[kind]
