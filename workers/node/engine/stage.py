"""Loading a contiguous layer range of a GGUF model as a runnable stage."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from . import native
from .config import ArchConfig, ModelFacts, arch_config, facts_of
from .gemma3 import ARCHITECTURE as GEMMA3
from .gemma3 import Gemma3StageModel, build_gemma3_stage_model
from .gguf_reader import GGUFError, GGUFFile
from .loader import Part, WeightBuilder, rope_permutation, trim_heap
from .model import LayerWeights, RopeTables, StageModel, check_layer_shapes
from .quants import as_torch_bytes, dequantize_rows
from .session import BatchSession, StageSession


@dataclass(frozen=True)
class EngineOptions:
    """How a stage is loaded: device ("auto" | "cpu" | "cuda"), precision ("default" =
    compact weights; "exact" = compact weights, decode products exact in float32, loader.py;
    "float32" = everything dequantized, the reference path), CPU threads
    (None = all cores), and layer boundaries after which a single stage rounds the hidden
    state to float16 (to reproduce a float16 pipeline split in one process, boundary.py)."""

    device: str = "auto"
    precision: str = "default"
    threads: int | None = None
    fp16_split_points: tuple[int, ...] = ()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; use auto, cpu or cuda")
    return torch.device(name)


class Embedding:
    """Token rows dequantized on demand from the mapped file (never the whole table)."""

    def __init__(self, f: GGUFFile, device: torch.device) -> None:
        info = f.tensors["token_embd.weight"]
        self._raw = as_torch_bytes(f.raw("token_embd.weight"))
        self._type = info.ggml_type
        self._shape = info.shape
        self._device = device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._shape[0]):
            raise ValueError(f"token id out of range [0, {self._shape[0]})")
        return dequantize_rows(self._raw, self._type, self._shape, ids).to(self._device)


class Stage:
    """Weights of layers ``[layer_start, layer_end)``; sessions hold the per-request state."""

    def __init__(
        self,
        file: GGUFFile,
        cfg: ArchConfig,
        facts: ModelFacts,
        layer_start: int,
        layer_end: int,
        model: StageModel | Gemma3StageModel,
        embedding: Embedding | None,
        device: torch.device,
        options: EngineOptions,
    ) -> None:
        self.file = file
        self.cfg = cfg
        self.facts = facts
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == cfg.n_layers
        self.model = model
        self.embedding = embedding
        self.device = device.type
        self.torch_device = device
        self.options = options
        self.tensor_names_loaded: frozenset[str] = frozenset(file.materialized)
        self.closed = False

    @property
    def float16_scale(self) -> float:
        """What a float16 hand-over multiplies the hidden state by (boundary.py)."""
        return self.model.float16_scale

    def new_session(self, max_seq_len: int) -> StageSession:
        if self.closed:
            raise RuntimeError("stage is closed")
        return StageSession(self, max_seq_len)

    def new_batch_session(self, slots: int, max_seq_len: int) -> BatchSession:
        """State for up to ``slots`` sequences at once (session.BatchSession)."""
        if self.closed:
            raise RuntimeError("stage is closed")
        return BatchSession(self, slots, max_seq_len)

    def close(self) -> None:
        """Drop the weights and the file mapping."""
        self.closed = True
        self.model.layers = []
        self.model.head = None
        self.embedding = None
        self.file.close()


def _ggml_order(b: WeightBuilder, cfg: ArchConfig) -> bool:
    """Whether the llama-family stage computes attention as ggml does (StageModel's
    ggml_order): products in llama.cpp's order, the native kernel built, whole-head rope
    from the base (and Llama 3's rope_freqs)."""
    return (
        b.llamacpp_order
        and b.device.type == "cpu"  # StageModel's native rope and attention: CPU only
        and native.library() is not None
        and cfg.rope_dim == cfg.head_dim
        and cfg.head_dim % 16 == 0  # native.attention's vectors
    )


def _layer(b: WeightBuilder, cfg: ArchConfig, i: int, ggml: bool) -> LayerWeights:
    p = f"blk.{i}."
    names = b.f.tensors
    # The attention scale 1/sqrt(head_dim) is folded into q (or into q_norm, which follows
    # it), and q/k rows are permuted for a half-split rope; except where attention is
    # computed as ggml does it (``ggml``): there the scale multiplies the scores and the
    # rope rotates adjacent pairs, because both change float16 roundings and the order of
    # q.k's sums.
    # Phi-3's fused q/k/v rows (NEOX: no permutation) keep the scale out of q: it
    # multiplies q after the rope (ggml) or the scores (StageModel.q_scale / kq_scale).
    fused = p + "attn_qkv.weight" in names
    if fused != (cfg.architecture == "phi3"):
        raise GGUFError(
            f"{b.f.path}: {'only phi3 has' if fused else 'phi3 needs'} a fused {p}attn_qkv.weight"
        )
    scale = 1.0 if ggml or fused else 1.0 / math.sqrt(cfg.head_dim)
    has_q_norm = p + "attn_q_norm.weight" in names
    if has_q_norm != (p + "attn_k_norm.weight" in names):
        raise GGUFError(f"{b.f.path}: {p}attn_q_norm and attn_k_norm come together or not at all")
    q_norm = b.vector(p + "attn_q_norm.weight") * scale if has_q_norm else None
    qkv_bias = None
    if p + "attn_q.bias" in names:
        qkv_bias = [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"]
    if fused:
        qkv_parts = [Part(p + "attn_qkv.weight")]
    else:
        qkv_parts = [
            Part(
                p + "attn_q.weight",
                None if ggml else rope_permutation(cfg, cfg.n_head),
                1.0 if has_q_norm else scale,
            ),
            Part(p + "attn_k.weight", None if ggml else rope_permutation(cfg, cfg.n_kv_head)),
            Part(p + "attn_v.weight"),
        ]
    # Phi-3's ffn_up holds the gate rows, then the up rows (ggml's swiglu halves)
    gate_up = [Part(p + "ffn_up.weight")]
    if p + "ffn_gate.weight" in names:
        gate_up = [Part(p + "ffn_gate.weight"), Part(p + "ffn_up.weight")]
    lw = LayerWeights(
        attn_norm=b.vector(p + "attn_norm.weight"),
        qkv=b.linear(qkv_parts, qkv_bias),
        q_norm=q_norm,
        k_norm=b.optional_vector(p + "attn_k_norm.weight"),
        wo=b.linear([Part(p + "attn_output.weight")]),
        ffn_norm=b.vector(p + "ffn_norm.weight"),
        gate_up=b.linear(gate_up),
        down=b.linear([Part(p + "ffn_down.weight")]),
    )
    check_layer_shapes(b.f.path, p, cfg, lw)
    return lw


def weight_formats(path: str) -> frozenset[str]:
    """The formats (GGUF type names) of the model's matrices, from its header alone."""
    f = GGUFFile(path, map_tensors=False)
    try:
        return frozenset(t.type_name for t in f.tensors.values() if len(t.shape) == 2)
    finally:
        f.close()


def uses_native_kernel(path: str, options: EngineOptions) -> bool:
    """Whether ``load_stage(path, ..., options)`` runs the engine's own kernel (the CPU,
    the default precision, and the kernel built and chosen for the model's formats:
    native.library). Decides the process's kernel choice if nothing had yet."""
    if options.precision != "default" or resolve_device(options.device).type != "cpu":
        return False
    native.expect_formats(weight_formats(path))
    return native.library() is not None


def load_stage(
    path: str, layer_start: int, layer_end: int, options: EngineOptions = EngineOptions()
) -> Stage:
    """Map the GGUF and build layers ``[layer_start, layer_end)`` (end exclusive)."""
    device = resolve_device(options.device)
    if device.type == "cpu":
        native.expect_formats(weight_formats(path))
        threads = options.threads or os.cpu_count() or 1
        if options.precision == "default" and native.library() is not None:
            # The native kernel's pool does the matrix products; torch's own threads would
            # only spin beside it (its remaining ops are small), so torch gets one.
            torch.set_num_threads(1)
            native.set_threads(threads)
        else:
            torch.set_num_threads(threads)
    f = GGUFFile(path)
    try:
        cfg = arch_config(f)
        facts = facts_of(f)
        if not 0 <= layer_start < layer_end <= cfg.n_layers:
            raise GGUFError(
                f"layer range [{layer_start}, {layer_end}) is outside the model's "
                f"{cfg.n_layers} layers"
            )
        b = WeightBuilder(f, options.precision, device)
        model: StageModel | Gemma3StageModel
        if cfg.architecture == GEMMA3:
            with torch.inference_mode():
                model = build_gemma3_stage_model(
                    f, cfg, b, layer_start, layer_end, options.fp16_split_points
                )
                embedding = Embedding(f, device) if layer_start == 0 else None
        else:
            model, embedding = _llama_stage_model(f, cfg, b, layer_start, layer_end, options)
    except BaseException:
        f.close()
        raise
    model.attention_f16 = options.precision == "default"
    f.release_pages()
    trim_heap()
    return Stage(f, cfg, facts, layer_start, layer_end, model, embedding, device, options)


def _llama_stage_model(
    f: GGUFFile,
    cfg: ArchConfig,
    b: WeightBuilder,
    layer_start: int,
    layer_end: int,
    options: EngineOptions,
) -> tuple[StageModel, Embedding | None]:
    """The llama-family stage (llama, mistral, qwen2, qwen3, phi3)."""
    device = b.device
    with torch.inference_mode():
        ggml = _ggml_order(b, cfg)
        layers = [_layer(b, cfg, i, ggml) for i in range(layer_start, layer_end)]
        rope = RopeTables(cfg, b.optional_vector("rope_freqs.weight"), device)
        output_norm, head = None, None
        if layer_end == cfg.n_layers:
            output_norm = b.vector("output_norm.weight")
            head_name = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
            head = b.linear([Part(head_name)])
        embedding = Embedding(f, device) if layer_start == 0 else None
    model = StageModel(
        cfg, layer_start, layers, rope, output_norm, head, options.fp16_split_points, ggml
    )  # fmt: skip
    return model, embedding
