"""A committed run plan (actor spec 4.2): the model's facts, the stages and their
layers, the edges between them and their rings."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from mvp_core.models._base import _Model
from mvp_core.models.engine_settings import ActivationDtype
from mvp_core.models.model_share import MAX_RANGES, ByteRange, HubPin, ModelShare


class ModelBytes(_Model):
    """What the model's stages hold, from its tensor table: GGUF bytes per layer, the
    token embedding (the first stage's, and the last's where the output head is tied to
    it), the rest outside the layers (output norm and head: the last stage's), and the K
    and V elements each layer caches per position (n_kv_head x (key + value length))."""

    layers: list[int]
    embedding: int
    output: int
    tied_head: bool
    kv_elements: int


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
    # Bytes per stage part, for planning by memory (None where the table does not say).
    sizes: ModelBytes | None = None


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
    # What the stage needs (mvp_core.memory_plan: weights, KV cache, scratch, margin), where
    # the model's sizes are known; the node's memory it was planned against, where given.
    memory_need: int | None = None
    node_memory: int | None = None
    # A hub model (RunPlan.hub): the bytes this stage's node fetches, its files' headers
    # and its tensors (mvp_core.model_share.share_ranges); empty for a model on a path.
    fetch: list[ByteRange] = Field(default_factory=list, max_length=MAX_RANGES)


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
    model_files: list[str] = Field(
        default_factory=list,
        description="Every file of the model in part order, model_path first (a split "
        "GGUF's parts); empty in plans made before split models: model_path alone",
    )

    hub: HubPin | None = Field(
        default=None,
        description="A hub model pinned at planning from its headers: each node's host "
        "fetches its own stage's share (StagePlan.fetch) into model_files' paths",
    )

    def files(self) -> list[str]:
        """The files a node must be able to read to load its stage (and the tokenizer's)."""
        return [*(self.model_files or [self.model_path]), self.tokenizer_path]

    def share_of(self, stage_index: int) -> ModelShare | None:
        """What the node of ``stage_index`` has its host fetch (a hub model), or None."""
        if self.hub is None or not 0 <= stage_index < len(self.stages):
            return None
        return ModelShare(
            pin=self.hub,
            paths=self.model_files or [self.model_path],
            ranges=self.stages[stage_index].fetch,
        )
