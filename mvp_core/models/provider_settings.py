"""Which provider starts a run's nodes, and the settings of the Docker and Vast.ai
providers (process spec [docker], [vastai]; never their secrets)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from mvp_core.models._base import _Model


class ProviderKind(StrEnum):
    PROCESS = "process"
    DOCKER = "docker"
    VASTAI = "vastai"


MAX_DOCKER_CPUS = 1024.0  # docker.cpus: the most one node container may be given


class DockerSettings(_Model):
    """Docker provider settings of a run (process spec [docker])."""

    gpus: str | None = Field(
        default=None,
        max_length=200,
        description=(
            "GPUs for each node container: 'all', a count ('2'), or device ids "
            "('0,1' or 'GPU-uuid,...'); null or '' = none. A host without a GPU driver for "
            "Docker fails the node's start with nothing left behind"
        ),
    )
    cpus: float | None = Field(
        default=None,
        ge=0.01,  # Docker's own least
        le=MAX_DOCKER_CPUS,
        description=(
            "CPUs each node container may use (docker run --cpus: the kernel's CFS quota), "
            "e.g. 1 or 0.5; null = no limit. A node sizes its threads to it"
        ),
    )
    memory: int | None = Field(
        default=None,
        ge=64 << 20,
        le=1 << 50,
        description=(
            "Memory each node container may use, in bytes (docker run --memory, no swap "
            "beyond it); null = no limit. The run is planned by it where node_memory is "
            "not given: each stage must fit its container (docs/contracts.md)"
        ),
    )
    memory_per_stage: bool = Field(
        default=False,
        description=(
            "Limit each node container to its own stage's planned memory need (the plan's "
            "memory_need: weights of its share, KV cache, scratch, margin) instead of one "
            "value for all (memory): a node that holds more than its share is stopped by "
            "the kernel, nothing else on the host is. Not with memory"
        ),
    )


class VastAiSettings(_Model):
    """Vast.ai settings of a run (process spec [vastai], less its secrets: the API key
    and the SSH identity live only in the orchestrator worker's environment)."""

    image: str | None = Field(
        default=None,
        max_length=300,
        description="Image each instance runs; it must hold the node agent (deploy/node.Dockerfile)",
    )
    bootstrap_command: str | None = Field(
        default=None,
        max_length=2000,
        description=(
            "Shell command that starts the node agent on an instance, run over SSH with the "
            "node's environment (e.g. 'python -m workers.node'); required"
        ),
    )
    onstart: str | None = Field(
        default=None, max_length=4000, description="Instance onstart script"
    )
    disk_gb: float = Field(default=16.0, gt=0, le=10_000)
    ssh_user: str = Field(
        default="root", min_length=1, max_length=32, pattern=r"^[a-z_][a-z0-9_-]*$"
    )
    gpu_name: str | None = Field(default=None, max_length=100)
    min_gpu_ram_mb: int | None = Field(default=None, ge=0)
    min_down_mbps: float = Field(default=100.0, ge=0)
    min_up_mbps: float | None = Field(default=None, ge=0)
    min_reliability: float = Field(default=0.95, ge=0, le=1)
    require_verified: bool = True
    max_dph: float | None = Field(default=None, gt=0, description="Price cap, $/hour per instance")
    poll_interval_s: float = Field(default=2.0, gt=0, le=60)
    loading_timeout_s: float = Field(
        default=600.0, gt=0, le=3600, description="How long an instance may take to run"
    )
    ssh_timeout_s: float = Field(default=120.0, gt=0, le=3600)
    max_offers: int = Field(
        default=3, ge=1, le=20, description="Offers tried per node before its start fails"
    )
    dataplane_port: int = Field(
        default=7000, ge=1024, le=65535, description="Container port of the node's data plane"
    )
