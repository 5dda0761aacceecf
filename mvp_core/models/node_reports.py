"""What node agents report to their run (readiness, leases, stage faults) and what the
run hands a stage (``StageProvision``, ``StopRun``)."""

from __future__ import annotations

from pydantic import Field

from mvp_core.models._base import _DAY_S, _Model
from mvp_core.models.engine_settings import EngineSettings
from mvp_core.models.plan import EdgePlan, LayerRange, RingSpec


class NodeRuntimeReady(_Model):
    run_id: int
    node_id: int
    stage_index: int
    endpoint: str  # the node's data-plane listener, host:port
    node_actor: str  # the node's task queue
    worker_identity: str
    datastream_publisher: str | None = None
    readiness_id: str


class NodeRuntimeReadyAck(_Model):
    run_id: int
    node_id: int
    stage_index: int
    readiness_id: str


class LeaseStarted(_Model):
    run_id: int
    node_id: int
    readiness_id: str
    worker_identity: str


class LeaseInput(_Model):
    run_id: int
    node_id: int
    readiness_id: str
    run_workflow_id: str
    heartbeat_every_s: float = 1.0


class WeightsReady(_Model):
    run_id: int
    node_id: int
    stage_index: int
    readiness_id: str = ""


# A report about a stage's data plane names the pipeline it was about (``epoch``: 0 the
# first, one more after each stage recovery), so a report of a pipeline the run has
# replaced moves nothing (DECISIONS 68).
_EPOCH = Field(default=0, ge=0, description="The pipeline the report is about (DECISIONS 68)")


class StageReady(_Model):
    run_id: int
    stage_index: int
    readiness_id: str = ""
    epoch: int = _EPOCH


class StageFault(_Model):
    run_id: int
    stage_index: int
    reason: str
    readiness_id: str = ""
    epoch: int = _EPOCH


class TokenEndpointsReady(_Model):
    """The head node's driver has its token-in and token-out edges connected."""

    run_id: int
    node_id: int
    readiness_id: str
    epoch: int = _EPOCH


class StageStopped(_Model):
    run_id: int
    stage_index: int
    readiness_id: str = ""


class EdgeEndpoint(_Model):
    edge_id: int
    host: str
    port: int


class StageProvision(_Model):
    """Everything a stage needs (actor spec 6.6); rejected unless the authority matches."""

    run_id: int
    authorized_orchestrator: str
    node_id: int
    stage_index: int
    stage_count: int
    layers: LayerRange
    inbound_edge: EdgePlan | None
    outbound_edge: EdgePlan | None
    consumer_endpoint: EdgeEndpoint | None  # where the outbound edge connects
    driver_edges: list[EdgePlan] = Field(
        default_factory=list, description="Head only: token-in and token-out of the driver"
    )
    model_name: str
    model_path: str
    tokenizer_path: str
    max_seq_len: int
    max_active_prompts: int = Field(
        default=1, ge=1, description="Sequences the stage holds at once (KV cache slots)"
    )
    rings: list[RingSpec] = Field(default_factory=list)
    readiness_id: str
    engine: EngineSettings = Field(default_factory=EngineSettings)
    run_workflow_id: str
    epoch: int = Field(
        default=0,
        ge=0,
        description="The pipeline this provision wires (DECISIONS 68): a stage that has its "
        "weights and gets a later epoch keeps them and joins the new pipeline's edges",
    )
    recovery_wait_s: float | None = Field(
        default=None,
        gt=0,
        le=_DAY_S,
        description="Head only, a run that replaces lost nodes: how long a prompt whose "
        "pipeline was lost waits for the next one to continue on; None: it faults at once",
    )


class StopRun(_Model):
    run_id: int
    stage_index: int
    readiness_id: str
    authorized_orchestrator: str
    reason: str
