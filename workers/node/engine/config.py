"""Model facts and architecture hyperparameters, read only from GGUF metadata (the keys are
gguf.constants.Keys, the names llama.cpp's converter writes)."""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import Keys

from mvp_core.engine_support import unsupported_rope
from mvp_core.models import ModelFacts

from .arch_table import ARCHITECTURES
from .gguf_reader import GGUFError, GGUFFile, LazyArray


class EngineModelFacts(ModelFacts):
    """The planner's facts of a model (mvp_core.models.ModelFacts, without the work
    figures), cheap to read, plus its vocabulary size."""

    vocab_size: int


@dataclass(frozen=True)
class ArchConfig:
    """Hyperparameters of the forward pass."""

    architecture: str
    n_layers: int
    hidden: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn: int
    eps: float
    rope_base: float
    rope_dim: int
    rope_neox: bool
    rope_linear_scale: float  # positions are multiplied by this (1 / scaling factor)
    vocab_size: int
    context_length: int

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim


def _vocab_size(f: GGUFFile) -> int:
    v = f.arch_key(Keys.LLM.VOCAB_SIZE)
    if v is not None:
        return int(v)
    if "token_embd.weight" in f.tensors:
        return f.tensors["token_embd.weight"].shape[0]
    tokens = f.get(Keys.Tokenizer.LIST)
    if isinstance(tokens, LazyArray):
        return tokens.count
    if isinstance(tokens, list):
        return len(tokens)
    raise GGUFError(f"{f.path}: cannot tell the vocabulary size")


def facts_of(f: GGUFFile) -> EngineModelFacts:
    arch = f.architecture
    if not arch:
        raise GGUFError(f"{f.path}: missing general.architecture")
    eos = f.get(Keys.Tokenizer.EOS_ID)
    return EngineModelFacts(
        architecture=arch,
        name=str(f.get(Keys.General.NAME, "")),
        block_count=int(f.arch_key(Keys.LLM.BLOCK_COUNT, 0)),
        embedding_length=int(f.arch_key(Keys.LLM.EMBEDDING_LENGTH, 0)),
        context_length=int(f.arch_key(Keys.LLM.CONTEXT_LENGTH, 0)),
        vocab_size=_vocab_size(f),
        eos_token_id=None if eos is None else int(eos),
    )


def read_model_facts(path: str) -> EngineModelFacts:
    """Metadata only: the tensor data is neither mapped nor read."""
    return facts_of(GGUFFile(path, map_tensors=False))


def arch_config(f: GGUFFile) -> ArchConfig:
    arch = f.architecture
    traits = ARCHITECTURES.get(arch)
    if traits is None:
        raise GGUFError(
            f"{f.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )

    def need(key: str) -> int:
        v = f.arch_key(key)
        if v is None:
            raise GGUFError(f"{f.path}: missing metadata {key.format(arch=arch)}")
        return int(v)

    hidden = need(Keys.LLM.EMBEDDING_LENGTH)
    n_head = need(Keys.Attention.HEAD_COUNT)
    n_kv = int(f.arch_key(Keys.Attention.HEAD_COUNT_KV, n_head))
    head_dim = int(f.arch_key(Keys.Attention.KEY_LENGTH, hidden // n_head))
    value_dim = int(f.arch_key(Keys.Attention.VALUE_LENGTH, head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"{f.path}: key_length {head_dim} != value_length {value_dim}")
    scaling_type = str(f.arch_key(Keys.Rope.SCALING_TYPE, "none"))
    why = unsupported_rope(arch, {f"{arch}.rope.scaling.type": scaling_type}, f.tensors)
    if why is not None:
        raise GGUFError(f"{f.path}: {why}")
    scale = 1.0
    if scaling_type == "linear":
        scale = 1.0 / float(f.arch_key(Keys.Rope.SCALING_FACTOR, 1.0))
    return ArchConfig(
        architecture=arch,
        n_layers=need(Keys.LLM.BLOCK_COUNT),
        hidden=hidden,
        n_head=n_head,
        n_kv_head=n_kv,
        head_dim=head_dim,
        ffn=need(Keys.LLM.FEED_FORWARD_LENGTH),
        eps=float(f.arch_key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        rope_base=float(f.arch_key(Keys.Rope.FREQ_BASE, 10000.0)),
        rope_dim=int(f.arch_key(Keys.Rope.DIMENSION_COUNT, head_dim)),
        rope_neox=traits.rope_neox,
        rope_linear_scale=scale,
        vocab_size=_vocab_size(f),
        context_length=int(f.arch_key(Keys.LLM.CONTEXT_LENGTH, 0)),
    )
