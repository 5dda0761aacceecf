"""Typed messages that cross a process boundary, named as in the actor spec.

Every model here travels as JSON through Temporal (workflow and activity inputs and
results, signals, updates, queries). None of them may carry a secret: secrets are read
from the environment of the process that needs them.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from mvp_core.errors import ErrorType
from mvp_core.request_ids import request_id_problem


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


# --------------------------------------------------------------------------- run request


class ProviderKind(StrEnum):
    PROCESS = "process"
    DOCKER = "docker"
    VASTAI = "vastai"


# A Hugging Face model source (docs/models.md): owner/name (the hub's own rule: letters,
# digits, '-', '_', '.', no '--' or '..', at most 96 characters); a file path of segments
# of such characters ending in .gguf; a revision that is a branch, tag or commit.
HUB_REPO_MAX = 96
HUB_FILE_MAX = 255
HUB_REVISION_MAX = 128
_HUB_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_REPO = re.compile(rf"{_HUB_NAME}/{_HUB_NAME}")
_HUB_FILE_SEGMENT = re.compile(r"[A-Za-z0-9_+][A-Za-z0-9_.+-]*")
_HUB_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+/-]*")


def hub_repo_problem(repo: str) -> str | None:
    """Why ``repo`` is not a Hugging Face model repo id (``owner/name``), or None."""
    if not repo or len(repo) > HUB_REPO_MAX:
        return f"must be a Hugging Face repo id, owner/name, of 1 to {HUB_REPO_MAX} characters"
    if not _HUB_REPO.fullmatch(repo):
        return (
            "must be a Hugging Face repo id, owner/name (letters, digits, '-', '_', '.'; "
            "each part starting and ending with a letter, digit or '_')"
        )
    if "--" in repo or ".." in repo or repo.endswith(".git"):
        return "must be a Hugging Face repo id: '--', '..' and a '.git' ending are not allowed"
    return None


def hub_file_problem(file: str) -> str | None:
    """Why ``file`` is not a GGUF file path inside a repo, or None."""
    if not file or len(file) > HUB_FILE_MAX:
        return f"must be the path of a .gguf file in the repo, 1 to {HUB_FILE_MAX} characters"
    if file.startswith("/") or "\\" in file:
        return "must be a relative path inside the repo, with '/' between folders"
    segments = file.split("/")
    if any(s in ("", ".", "..") for s in segments):
        return "must be a relative path inside the repo: no empty, '.' or '..' parts"
    if not all(_HUB_FILE_SEGMENT.fullmatch(s) for s in segments):
        return (
            "must be a path of letters, digits, '-', '_', '.', '+' (no spaces or other characters)"
        )
    if not file.lower().endswith(".gguf"):
        return "must name a GGUF file (ending in .gguf)"
    return None


def hub_revision_problem(revision: str) -> str | None:
    """Why ``revision`` is not a branch, tag or commit name, or None."""
    if not revision or len(revision) > HUB_REVISION_MAX:
        return f"must be a branch, tag or commit of 1 to {HUB_REVISION_MAX} characters"
    if (
        not _HUB_REVISION.fullmatch(revision)
        or ".." in revision
        or "//" in revision
        or revision.endswith(("/", ".", ".lock"))
    ):
        return (
            "must be a branch, tag or commit: letters, digits, '-', '_', '.', '+', '/' "
            "(no '..', '//', or a '/', '.' or '.lock' ending)"
        )
    return None


class HubModel(_Model):
    """A GGUF file of a Hugging Face model repo (process spec [model] gguf_repo, gguf_file,
    gguf_revision). The token, when the repo needs one, is ``HF_TOKEN`` in the environment
    of the orchestrator worker that fetches it, never part of a run."""

    repo: str = Field(
        description="Repo id, owner/name, e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct-GGUF'"
    )
    file: str = Field(
        description="Path of the GGUF in the repo, e.g. 'smollm2-135m-instruct-q8_0.gguf'"
    )
    revision: str = Field(default="main", description="Branch, tag or commit (default main)")

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        return _checked(value, hub_repo_problem(value))

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        return _checked(value, hub_file_problem(value))

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str) -> str:
        return _checked(value, hub_revision_problem(value))

    def describe(self) -> str:
        """``owner/name/file@revision``: how messages name it."""
        return f"{self.repo}/{self.file}@{self.revision}"


def _checked(value: str, problem: str | None) -> str:
    if problem is not None:
        raise ValueError(problem)
    return value


class ModelSource(_Model):
    """Where the GGUF comes from: a bundled default by name, a local path, or a file of a
    Hugging Face repo; exactly one of them (``validate_request``)."""

    bundled: str | None = Field(
        default=None, description="Name of a bundled model, e.g. 'SmolLM2-135M-Instruct.Q4_1'"
    )
    path: str | None = Field(default=None, description="Path of a GGUF file on the provider host")
    hf: HubModel | None = Field(
        default=None,
        description=(
            "A GGUF of a Hugging Face repo, downloaded once into the model cache of the "
            "provider host (HF_ENDPOINT and HF_TOKEN from that worker's environment)"
        ),
    )

    def display_name(self) -> str | None:
        """How summaries name the model before a plan exists: the bundled name, or the
        file name of the path or of the hub file; None when no source is given."""
        if self.bundled:
            return self.bundled
        if self.path:
            return self.path.replace("\\", "/").rsplit("/", 1)[-1]
        if self.hf is not None:
            return self.hf.file.rsplit("/", 1)[-1]
        return None


_DAY_S = 86_400.0
_U32 = 2**32 - 1
_U64 = 2**64 - 1


class RunTimeouts(_Model):
    """Deadlines of the run (DECISIONS 8), all in seconds, finite and at most a day."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    readiness_s: float = Field(default=120.0, gt=0, le=_DAY_S)
    ack_s: float = Field(default=30.0, gt=0, le=_DAY_S)
    ack_resend_s: float = Field(default=1.0, gt=0, le=_DAY_S)
    weight_load_s: float = Field(default=300.0, gt=0, le=_DAY_S)
    stop_grace_s: float = Field(default=5.0, ge=0, le=_DAY_S)
    stage_stopped_wait_s: float = Field(default=10.0, ge=0, le=_DAY_S)
    lease_heartbeat_s: float = Field(default=10.0, gt=0, le=_DAY_S)
    generate_heartbeat_s: float = Field(default=5.0, gt=0, le=_DAY_S)


class PromptHost(StrEnum):
    """Where a run serves its prompts (DECISIONS 66)."""

    # A child PromptWorkflow per prompt: its own history, text stream (Temporal's, for
    # clients that cannot read the head node), search attribute and Web UI row.
    WORKFLOW = "workflow"
    # In the run's own submit_prompt Update: no workflow per prompt, a fifth of the
    # control plane's CPU per prompt; the text only from the head node (else the whole
    # text with the terminal event), a finished prompt kept by the run for re-attach.
    RUN = "run"


class NodeLossPolicy(StrEnum):
    """What a run does when a node is lost while it serves (DECISIONS 68)."""

    FAIL = "fail"  # the specs' fail-stop: the run faults and tears down
    REPLACE = "replace"  # a new node takes the lost one's layers; prompts continue


class RecoverySettings(_Model):
    """The bound on stage recovery (``on_node_loss: "replace"``, DECISIONS 68)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_replacements: int = Field(
        default=3, ge=1, le=16, description="Replacements allowed within window_s"
    )
    window_s: float = Field(
        default=3600.0, gt=0, le=_DAY_S, description="The window max_replacements counts in"
    )
    replacement_timeout_s: float = Field(
        default=300.0,
        gt=0,
        le=_DAY_S,
        description="From a loss to the run prompt-ready again: past it the run faults",
    )


class LayerSplit(StrEnum):
    """How the planner gives a pipeline's stages their layers (DECISIONS 67)."""

    # CONTRACTS "Run planner": stage i of N gets layers floor(L*i/N) .. floor(L*(i+1)/N).
    EVEN = "even"
    # Contiguous ranges that even out the stages' work per token: each layer's weights
    # (multiply-accumulates per token) and the output head's on the last stage.
    BALANCED = "balanced"


class ActivationDtype(StrEnum):
    """How the hidden state crosses a pipeline edge (CONTRACTS "Data-plane records",
    DECISIONS 53): float32 as the stage computed it, so N stages compute the 1-stage
    logits bit for bit; float16 at half the bytes, for thin links, at a measured cost
    in fidelity (docs/models.md)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire (the edge's alignment)."""
        return 4 if self is ActivationDtype.FLOAT32 else 2


class EnginePrecision(StrEnum):
    """How a stage computes (docs/models.md "Precision", DECISIONS 42-44)."""

    # The engine's own kernel: llama.cpp's arithmetic in llama.cpp's float order, so its
    # logits are llama.cpp's (torch's int4 kernel where the host cannot build the kernel).
    DEFAULT = "default"
    # torch's int4 kernel with decode products exact in float32: nearer to the float
    # reference than torch's fast path, further from llama.cpp than the default.
    EXACT = "exact"
    # Every weight dequantized to float32: the reference path.
    FLOAT32 = "float32"


class EngineDevice(StrEnum):
    AUTO = "auto"  # CUDA when torch sees a device, else the CPU
    CPU = "cpu"
    CUDA = "cuda"


class EngineSettings(_Model):
    precision: EnginePrecision = Field(
        default=EnginePrecision.DEFAULT,
        description=(
            "default: the engine's kernel, llama.cpp's logits bit for bit on the CPU, "
            "fastest; exact: torch's int4 kernel with decode products exact in float32 "
            "(~0.45x of torch's one-call path, further from llama.cpp's text than default); "
            "float32: everything dequantized (the reference path)"
        ),
    )
    threads: int | None = Field(default=None, ge=1)
    device: EngineDevice = EngineDevice.AUTO
    fp16_split_points: list[int] = Field(
        default_factory=list,
        description="Round activations to float16 after these layers (emulates a pipeline split)",
    )
    compute_cpus: Literal["auto", "off"] | list[Annotated[int, Field(ge=0)]] = Field(
        default="auto",
        description=(
            "Cores for each node's token path: 'auto' = all of the node's cores but the "
            "first (left to the control plane), 'off' = no pinning, or a list of core ids"
        ),
    )
    token_path_nice: int | None = Field(
        default=-5,
        ge=-20,
        le=19,
        description=(
            "Nice value of each node's token-path threads (applied where the node may raise "
            "priority: root or CAP_SYS_NICE); null leaves the default"
        ),
    )
    address_layout: Literal["auto", "fixed", "randomized"] = Field(
        default="auto",
        description=(
            "'fixed': node processes run with address-space randomization off, so nodes that "
            "share a host map the same code at the same addresses and keep the core's front "
            "end (branch predictors) warm across the per-token switch between them. 'auto' = fixed when a "
            "local provider puts two or more nodes on one host, else 'randomized'"
        ),
    )


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


MAX_ACTIVE_PROMPTS = 32  # KV cache slots per stage; each holds max_seq_len positions


class RunRequest(_Model):
    """The typed input of a run (actor spec 4.1)."""

    run_id: int | None = Field(default=None, ge=0)
    orchestrator_node_id: int = Field(default=0, ge=0)
    node_id: int = Field(default=1, ge=0, description="First worker node id (CONTRACTS)")
    provider: ProviderKind = ProviderKind.PROCESS
    worker_image: str | None = Field(
        default=None,
        max_length=300,
        description=(
            "Node image (docker); unset = the offline host image the provider builds "
            "from this host's Python and package the first time a run needs it"
        ),
    )
    docker: DockerSettings = Field(default_factory=DockerSettings)
    vastai: VastAiSettings = Field(default_factory=VastAiSettings)
    model: ModelSource = Field(default_factory=ModelSource)
    tokenizer: ModelSource | None = None
    pipeline_stages: int = Field(default=1)
    activation_dtype: ActivationDtype = Field(
        default=ActivationDtype.FLOAT32,
        description=(
            "How activations cross the pipeline's edges: float32 (default) gives the "
            "1-stage run's text bit for bit; float16 halves the bytes per token for thin "
            "links and changes the greedy text (docs/models.md)"
        ),
    )
    layer_split: LayerSplit = Field(
        default=LayerSplit.EVEN,
        description=(
            "How a pipeline's stages get their layers (DECISIONS 67): 'even', the same "
            "number each (CONTRACTS); 'balanced', contiguous ranges with even work per "
            "token, the output head counted on the last stage, so no stage holds the "
            "pipeline back when many prompts keep every stage busy"
        ),
    )
    default_max_tokens: int | None = Field(default=None, ge=0)
    max_context: int | None = Field(default=None, ge=1)
    prompt_queue_capacity: int = Field(default=8)
    max_active_prompts: int = Field(
        default=1,
        ge=1,
        le=MAX_ACTIVE_PROMPTS,
        description=(
            "How many prompts generate at once (DECISIONS 62): 1 is the specs' one active "
            "prompt; more run side by side on the head node, each with its own KV cache "
            "slot, every step one forward over all of them. The queue behind them holds "
            "prompt_queue_capacity - 1 more"
        ),
    )
    prompt_host: PromptHost = Field(
        default=PromptHost.WORKFLOW,
        description=(
            "Where prompts are served (DECISIONS 66): 'workflow', a child PromptWorkflow "
            "per prompt (its own history, Temporal text stream and Web UI row); 'run', in "
            "the run's own Update, at a fifth of the control plane's CPU per prompt, text "
            "only from the head node"
        ),
    )
    stream_batch_ms: int = Field(
        default=100,
        ge=25,
        le=10_000,
        description=(
            "How often the head node flushes text into a prompt's stream (the first delta "
            "goes at once). Each flush is a signal and workflow tasks on the Temporal "
            "server: larger batches cost the host less CPU, smaller ones stream smoother"
        ),
    )
    on_node_loss: NodeLossPolicy = Field(
        default=NodeLossPolicy.FAIL,
        description=(
            "When a node is lost while the run serves (DECISIONS 68): 'fail', the specs' "
            "fail-stop; 'replace', a new node through the same provider takes its layers, "
            "the pipeline is wired anew and the prompts in flight continue with the same "
            "text, within the bound of 'recovery'"
        ),
    )
    recovery: RecoverySettings = Field(default_factory=RecoverySettings)
    timeouts: RunTimeouts = Field(default_factory=RunTimeouts)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    node_env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra non-secret environment for node agents (secrets come from the worker's env)",
    )

    @model_serializer(mode="wrap")
    def _as_sent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """What a client sends (and the Web UI shows as the run's input): no settings of a
        provider the run does not use unless they were given, and no unset optional
        fields (``"run_id": null``). Validating it gives the same request back."""
        data: dict[str, Any] = handler(self)
        for section in (ProviderKind.DOCKER, ProviderKind.VASTAI):
            if self.provider is not section and section.value not in self.model_fields_set:
                data.pop(section.value, None)
        for name in _DROPPED_WHEN_NONE:
            if data.get(name, "") is None:
                del data[name]
        return data


_DROPPED_WHEN_NONE = ("run_id", "worker_image", "tokenizer", "default_max_tokens", "max_context")


# --------------------------------------------------------------------------- plan


class ModelFacts(_Model):
    architecture: str
    name: str
    block_count: int
    embedding_length: int
    context_length: int
    eos_token_id: int | None = None
    # Work per token from the tensor table (multiply-accumulates: weight elements): per
    # layer, and the output head's. None where the facts did not come from a GGUF file, or
    # its tensor table lacks a layer's matrices or the head (or shows no model's shapes).
    layer_work: list[int] | None = None
    output_work: int | None = None


class LayerRange(_Model):
    start: int
    end: int


class EdgeKind(StrEnum):
    TOKEN_IN = "token_in"
    ACTIVATION = "activation"
    TOKEN_OUT = "token_out"


class EdgePlan(_Model):
    edge_id: int
    kind: EdgeKind
    src_stage: int | None  # None = driver
    dst_stage: int | None  # None = driver
    max_extent: int
    alignment: int
    activation_dtype: ActivationDtype | None = Field(
        default=None,
        description="Activation edges: the rows' element type (None on token edges)",
    )


class RingSpec(_Model):
    edge_id: int
    capacity: int
    alignment: int


class StagePlan(_Model):
    stage_index: int
    node_id: int
    layers: LayerRange
    holds_embedding: bool
    holds_output: bool


class RunPlan(_Model):
    """A committed plan (actor spec 4.2): workers never choose their own topology."""

    run_id: int
    orchestrator_node_id: int
    stage_count: int
    stages: list[StagePlan]
    edges: list[EdgePlan]
    rings: list[RingSpec]
    max_seq_len: int
    model_path: str
    tokenizer_path: str
    model_facts: ModelFacts


# --------------------------------------------------------------------------- provisioning


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


class RunDatastreamInput(_Model):
    """The run datastream activity's input (activities/datastream.py): which run."""

    run_id: int
    run_workflow_id: str
    provider: ProviderKind
    # The execution's nonce (already in history with every NodeProvisionSpec): the
    # activity derives the run's edge token from it, to keep it out of the records.
    nonce: str = ""


class DatastreamAddress(_Model):
    """Signal from the run's datastream activity: where its live frames are served
    (``127.0.0.1:<port>`` or ``unix:<path>``) and where its frame archive is written, on
    ``host``. A later one (an activity retry, a continued run) replaces the earlier."""

    run_id: int
    address: str
    archive: str
    host: str = ""
    attempt: int = 1


class PreparePlanInput(_Model):
    run_id: int
    orchestrator_node_id: int
    node_id: int
    model: ModelSource
    tokenizer: ModelSource | None
    pipeline_stages: int
    max_context: int | None
    activation_dtype: ActivationDtype = ActivationDtype.FLOAT32
    layer_split: LayerSplit = LayerSplit.EVEN
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


# --------------------------------------------------------------------------- node reports


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


# --------------------------------------------------------------------------- prompts


class ChatMessage(_Model):
    """One message of a conversation, rendered on the head node with the model's own
    chat template (``SubmitPrompt.messages``)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = Field(max_length=1_000_000)


class SubmitPrompt(_Model):
    """A prompt (actor spec 4.5 plus DECISIONS 10). ``reply_to`` is the prompt stream.

    Bounds are the data plane's: ids and seeds are u64, counts u32, sampling floats
    finite float32 values (the begin record carries them)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    request_id: int = Field(
        description="The client's id of the prompt: 0 to 2^53 - 1, a JavaScript-safe integer"
    )
    prompt_text: str
    max_tokens: int | None = Field(default=None, ge=0, le=_U32)
    chat: bool = False
    messages: list[ChatMessage] | None = Field(
        default=None,
        max_length=1024,
        description=(
            "A whole conversation (with chat): rendered with the model's chat template on "
            "the head node, its control tokens encoded as such; prompt_text is then ignored"
        ),
    )
    temperature: float = Field(default=0.0, ge=0.0, le=1000.0)
    top_k: int = Field(default=0, ge=0, le=_U32)
    top_p: float = Field(default=1.0, ge=1e-6, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=_U64)
    stop: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "The client's stop strings (the gateway's): the run and the nodes do not act on "
            "them; they stay with the prompt so that a client re-attaching to it cuts the "
            "text where the original response was cut"
        ),
    )

    @field_validator("request_id")
    @classmethod
    def _request_id(cls, value: int) -> int:
        problem = request_id_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class TextDelta(_Model):
    type: Literal["text_delta"] = "text_delta"
    request_id: int
    text: str
    tokens: int | None = Field(
        default=None,
        ge=0,
        description="Generated tokens whose text this delta completes (None: a node that "
        "did not count them)",
    )
    prompt_tokens: int | None = Field(
        default=None,
        ge=0,
        description="On a prompt's first delta: its tokens as the head node encoded them",
    )


StopReason = Literal["eos", "max_tokens", "context"]


class Done(_Model):
    type: Literal["done"] = "done"
    request_id: int
    final_text: str
    tokens_generated: int
    elapsed_ms: int
    stop_reason: StopReason = Field(
        description="Why generation stopped: the model's end token, max_tokens, or the "
        "planned context (max_seq_len) filled up"
    )
    prompt_tokens: int | None = Field(
        default=None,
        ge=0,
        description="The prompt's tokens as the head node encoded them (None: a node that "
        "did not report them)",
    )
    recoveries: int = Field(
        default=0,
        ge=0,
        description="Stage recoveries the prompt went through (DECISIONS 68): each a pause, "
        "the text the same as an undisturbed run's",
    )


class Fault(_Model):
    type: Literal["fault"] = "fault"
    request_id: int
    error: str
    kind: ErrorType | None = Field(
        default=None,
        description="A prompt the head node refused, typed: PromptTooLong, "
        "ChatTemplateRefused or InvalidPrompt; None for any other end (a cancel, a fault)",
    )
    prompt_tokens: int | None = Field(
        default=None, ge=0, description="With PromptTooLong: the prompt's tokens"
    )
    text: str | None = Field(
        default=None,
        description="A run-hosted prompt stopped before its end (DECISIONS 66): the text it "
        "had generated, which no workflow stream holds",
    )
    tokens_generated: int | None = Field(
        default=None, ge=0, description="With text: the tokens the text holds"
    )


PromptTerminal = Annotated[Done | Fault, Field(discriminator="type")]
PromptEvent = Annotated[TextDelta | Done | Fault, Field(discriminator="type")]


class CancelPrompt(_Model):
    request_id: int


class ShutdownReason(StrEnum):
    OPERATOR_REQUESTED = "operator_requested"
    HOST_REQUESTED = "host_requested"
    PROMPT_SESSION_CLOSED = "prompt_session_closed"
    FATAL_DEPENDENCY = "fatal_dependency"


class RequestShutdown(_Model):
    run_id: int | None = None
    reason: ShutdownReason = ShutdownReason.OPERATOR_REQUESTED
    reply_to: str | None = None


class GenerateInput(_Model):
    """The head node's generate activity input (one prompt)."""

    run_id: int
    readiness_id: str
    prompt_workflow_id: str
    prompt: SubmitPrompt
    max_new_tokens: int | None
    stream_batch_ms: int = 100
    # False: a run-hosted prompt (no workflow stream): its text goes to the head node's
    # direct readers only, and to Temporal with its terminal event (DECISIONS 66).
    temporal_text: bool = True
    # Stage recovery (DECISIONS 68): heartbeat the tokens so far (GenerateCheckpoint);
    # go on after ``resume``, the tokens generated on a head that was lost, with the text
    # from token ``text_from`` on (what the prompt's readers lack; None: after resume).
    checkpoint: bool = False
    resume: list[int] = Field(default_factory=list, max_length=1_048_576)
    text_from: int | None = Field(default=None, ge=0)


class StopGenerateInput(_Model):
    """A cancelled prompt's stop, pushed to its head node (DECISIONS 65)."""

    run_id: int
    readiness_id: str
    prompt_workflow_id: str


class PromptStatus(StrEnum):
    """How a prompt ended, as its workflow's result and search attribute show it."""

    DONE = "done"
    CANCELLED = "cancelled"
    FAULTED = "faulted"


class PromptTiming(_Model):
    """Where a prompt's time went on its head node (milliseconds, the node's clock).

    The time to first token is the prompt's wait in the run's queue (the prompt workflow
    measures it) + ``encode_ms`` + ``prefill_ms`` + ``first_delta_ms``."""

    encode_ms: float = Field(ge=0, description="Tokenize the prompt")
    prefill_ms: float = Field(ge=0, description="Encode end to the first token sampled")
    first_delta_ms: float = Field(
        ge=0, description="First token to its text published on the prompt's stream"
    )
    decode_tokens_per_s: float | None = Field(
        default=None, ge=0, description="Tokens after the first over the time they took"
    )


class PromptOutcome(_Model):
    """What a prompt workflow returns: the terminal event, and a run fault if any."""

    terminal: PromptTerminal
    run_fault: str | None = None
    status: PromptStatus = PromptStatus.DONE
    timing: PromptTiming | None = None
    # Set by the prompt workflow: admission (its start) to activation, workflow time.
    queued_ms: float | None = Field(default=None, ge=0)


class ServedPrompt(_Model):
    """A run-hosted prompt that ended (DECISIONS 66): kept by its run, a bounded number of
    them, so that a client can re-attach after its end and the dashboard read its figures."""

    workflow_id: str  # the prompt's key: the id its PromptWorkflow would have had
    outcome: PromptOutcome
    admitted_ms: int  # epoch ms, workflow time: the Update admitted it
    stop: list[str] = Field(default_factory=list)  # its stop strings (a re-attach cuts there)


class PromptInput(_Model):
    run_id: int
    readiness_id: str
    prompt: SubmitPrompt
    max_new_tokens: int | None
    head_task_queue: str
    head_node_id: int | None = None  # for the Web UI's activity summary only
    generate_heartbeat_s: float = 5.0
    stream_batch_ms: int = 100
    # Next in line at admission: generate at once, without waiting for activation.
    start_active: bool = False
    # Stage recovery (DECISIONS 68): a prompt whose head node is lost goes on, on the
    # replacement head, from its last checkpoint, for at most recovery_wait_s.
    on_node_loss: NodeLossPolicy = NodeLossPolicy.FAIL
    recovery_wait_s: float = Field(default=300.0, gt=0, le=_DAY_S)


class PromptHead(_Model):
    """The run to its prompts, in a stage recovery of the head (DECISIONS 68): the head
    node is lost (``ready`` False), or its replacement serves (``ready`` True)."""

    node_id: int
    task_queue: str
    readiness_id: str
    ready: bool


class GenerateCheckpoint(_Model):
    """A generate's heartbeat details where the run replaces lost nodes (DECISIONS 68):
    the tokens the prompt has generated so far, to go on from should its head be lost."""

    tokens: list[int] = Field(default_factory=list, max_length=1_048_576)


# --------------------------------------------------------------------------- lifecycle


class LifecycleKind(StrEnum):
    RUN_ACCEPTED = "RunAccepted"
    RUN_REJECTED = "RunRejected"
    RUN_PLANNING_STARTED = "RunPlanningStarted"
    RUN_PLANNING_READY = "RunPlanningReady"
    RUN_PROVISIONING_STARTED = "RunProvisioningStarted"
    RUN_READINESS_STARTED = "RunReadinessStarted"
    RUN_READY = "RunReady"
    PROMPT_ACCEPTED = "PromptAccepted"
    PROMPT_COMPLETED = "PromptCompleted"
    PROMPT_FAULTED = "PromptFaulted"
    RUN_OPERATOR_STOPPED = "RunOperatorStopped"
    # Stage recovery (DECISIONS 68): a node lost, its replacement starting, the run
    # prompt-ready again on the new pipeline.
    STAGE_LOST = "StageLost"
    STAGE_REPLACING = "StageReplacing"
    STAGE_RECOVERED = "StageRecovered"
    RUN_FAULTED = "RunFaulted"
    RUN_TEARING_DOWN = "RunTearingDown"
    RUN_TORN_DOWN = "RunTornDown"


class LifecycleReport(_Model):
    kind: LifecycleKind
    run_id: int
    detail: str = ""
    request_id: int | None = None


class RunPhase(StrEnum):
    ACCEPTED = "accepted"
    PLANNING = "planning"
    PROVISIONING = "provisioning"
    READINESS = "readiness"
    STAGE_PROVISIONING = "stage_provisioning"
    PROMPT_READY = "prompt_ready"
    RECOVERING = "recovering"  # a lost node is being replaced (DECISIONS 68)
    ROLLING_OVER = "rolling_over"
    TEARING_DOWN = "tearing_down"
    TORN_DOWN = "torn_down"
    REJECTED = "rejected"


class RunOutcomeKind(StrEnum):
    OPERATOR_STOPPED = "operator_stopped"
    FAULTED = "faulted"
    REJECTED = "rejected"


class IgnoredInput(_Model):
    """A signal, report or update payload the run ignored: what it was and why, never its
    content (which may carry secrets or user text)."""

    kind: str
    reason: str


class RunOutcome(_Model):
    run_id: int
    outcome: RunOutcomeKind
    lifecycle: list[LifecycleReport]
    first_fault: str | None = None
    first_stop_error: str | None = None
    later_faults: list[str] = Field(
        default_factory=list,
        description="Faults seen after the run's terminal cause (an operator stop): facts, "
        "not a new outcome",
    )
    prompts_completed: int = 0
    prompts_faulted: int = 0
