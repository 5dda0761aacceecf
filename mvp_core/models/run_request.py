"""The typed input of a run (actor spec 4.1), with its deadlines, recovery bound and
how it places prompts and layers."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from mvp_core.models._base import _DAY_S, _Model
from mvp_core.models.engine_settings import ActivationDtype, EngineSettings
from mvp_core.models.model_source import ModelSource
from mvp_core.models.policies import NodeLossPolicy as NodeLossPolicy
from mvp_core.models.prompts import SubmitPrompt
from mvp_core.models.provider_settings import DockerSettings, ProviderKind, VastAiSettings


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
    generate_heartbeat_s: float = Field(default=30.0, gt=0, le=_DAY_S)


class PromptHost(StrEnum):
    """Where a run serves its prompts (DECISIONS 66)."""

    # A child PromptWorkflow per prompt: its own history, text stream (Temporal's, for
    # clients that cannot read the head node), search attribute and Web UI row.
    WORKFLOW = "workflow"
    # In the run's own submit_prompt Update: no workflow per prompt, a fifth of the
    # control plane's CPU per prompt; the text only from the head node (else the whole
    # text with the terminal event), a finished prompt kept by the run for re-attach.
    RUN = "run"


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


MAX_ACTIVE_PROMPTS = 64  # KV cache slots per stage; each holds max_seq_len positions


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
    node_memory: list[Annotated[int, Field(ge=64 << 20, le=1 << 50)]] | None = Field(
        default=None,
        max_length=256,
        description=(
            "Each node's memory for its stage, in bytes: one value (every node's) or one "
            "per stage. The planner then gives each stage a contiguous range that fits its "
            "node (weights + KV cache for max_context x max_active_prompts + scratch + a "
            "margin: docs/contracts.md), the most even work among those, and rejects a "
            "fleet that cannot hold the model, naming each node's shortfall"
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
    one_shot: SubmitPrompt | None = Field(
        default=None,
        description=(
            "A one-shot run (actor spec 8: the terminal prompt-serving policy): the run "
            "serves this prompt once it is prompt-ready, then shuts itself down (reason "
            "one_shot_done); its terminal event is the outcome's one_shot, so that "
            "`temporal workflow execute` of such a run returns the text"
        ),
    )
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


_DROPPED_WHEN_NONE = (
    "run_id",
    "worker_image",
    "tokenizer",
    "default_max_tokens",
    "max_context",
    "one_shot",
)
