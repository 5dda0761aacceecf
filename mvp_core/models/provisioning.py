"""What the run asks of a provider and of its own orchestrator activities: start, stop
and watch nodes, prepare the plan, check a node's route."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from mvp_core.models._base import _Model
from mvp_core.models.engine_settings import ActivationDtype, EnginePrecision
from mvp_core.models.model_share import ModelShare
from mvp_core.models.model_source import ModelSource
from mvp_core.models.provider_settings import ProviderKind, VastAiSettings
from mvp_core.models.run_request import LayerSplit


class NodeProvisionSpec(_Model):
    """What a provider needs to start one node agent (actor spec 6.3)."""

    run_id: int
    node_id: int
    stage_index: int
    nonce: str
    task_queue: str
    readiness_id: str
    authorized_orchestrator: str
    run_workflow_id: str
    image_or_artifact: str | None = None
    environment: dict[str, str] = Field(default_factory=dict)
    mounts: list[str] = Field(
        default_factory=list, description="Host files a node reads (the model): mounted read-only"
    )
    coordinator_endpoint: str
    temporal_namespace: str = "default"
    provider: ProviderKind = ProviderKind.PROCESS
    gpus: str | None = None
    cpus: float | None = None  # docker.cpus: each node container's CPU limit
    memory: int | None = None  # docker.memory: each node container's memory limit (bytes)
    # What the node's stage needs (StagePlan.memory_need): a rented host has at least this
    # much RAM (Vast.ai offers are filtered by it).
    memory_need: int | None = None
    # A hub model (RunPlan.hub): what the node's host fetches before the node starts.
    model_share: ModelShare | None = None
    vastai: VastAiSettings | None = None
    # A replacement (DECISIONS 68): machines to rent elsewhere than, where an offer allows.
    avoid_machines: list[int] = Field(default_factory=list, max_length=64)


class NodeHandle(_Model):
    """A provider's durable record of a started node."""

    run_id: int
    node_id: int
    provider: ProviderKind
    host: str
    pid: int | None = None
    log_path: str | None = None
    resource_name: str
    container_id: str | None = None
    address: str | None = Field(default=None, description="The node's own network address")
    instance_id: int | None = Field(default=None, description="Vast.ai instance (contract) id")
    machine_id: int | None = Field(default=None, description="Vast.ai: the instance's machine")
    share_bytes: int | None = Field(
        default=None, ge=0, description="A hub model: the bytes of the node's share (its stage's)"
    )
    share_fetched: int | None = Field(
        default=None,
        ge=0,
        description="Of those, what its host fetched for this start (the rest was in its cache)",
    )


class ProviderResource(_Model):
    """One thing a provider made for a run, as the provider itself reports it (the
    reaper sweeps by these, not by the run's records)."""

    provider: ProviderKind
    kind: Literal["process", "container", "network", "instance"]
    name: str
    run_workflow_id: str
    nonce8: str = Field(description="The first 8 characters of the execution's nonce")
    host: str
    detail: str = ""


class StopNodeInput(_Model):
    handle: NodeHandle
    grace_s: float


class CompleteBootstrapInput(_Model):
    """The nodes whose runtime-ready acknowledgement succeeded (process spec 7.6)."""

    handles: list[NodeHandle] = Field(max_length=1024)


class CompleteBootstrapResult(_Model):
    """What a provider could not finish of those nodes' bootstrap, one line a node (a
    node's bootstrap that fails to complete still serves: the run records it, no fault)."""

    errors: list[str] = Field(default_factory=list)


class StopNodeResult(_Model):
    node_id: int
    stopped: bool
    error: str | None = None


class WatchNodesInput(_Model):
    handles: list[NodeHandle]


class NodeExited(_Model):
    """Provider report that a node's process is gone (NodeFailed of actor spec 4.3)."""

    run_id: int
    node_id: int
    detail: str


class PreparePlanInput(_Model):
    run_id: int
    orchestrator_node_id: int
    node_id: int
    model: ModelSource
    tokenizer: ModelSource | None
    pipeline_stages: int
    max_context: int | None
    activation_dtype: ActivationDtype = ActivationDtype.FLOAT32
    # The engine's precision sets the KV cache's element size in the memory plan.
    precision: EnginePrecision = EnginePrecision.DEFAULT
    layer_split: LayerSplit = LayerSplit.EVEN
    node_memory: list[int] | None = None
    max_active_prompts: int = 1
    provider: ProviderKind = ProviderKind.PROCESS
    gpus: str | None = None
    vastai: VastAiSettings | None = None


class CheckRouteInput(_Model):
    task_queue: str
    identity: str


class RouteCheck(_Model):
    """What DescribeTaskQueue showed on a node's queue (route ownership, DECISIONS 5)."""

    owned: bool
    pollers: list[str] = Field(default_factory=list, description="Distinct poller identities")
    reason: str = ""
