"""The llama family's graph and weights (arch_table family LLAMA: llama, mistral, qwen2,
qwen3, phi3), as llama.cpp's ``llama`` / ``qwen2`` / ``qwen3`` / ``phi3`` graphs compute it:
pre-norm attention and SwiGLU feed-forward, with each architecture's own tensors where
its file has them (qwen2's q/k/v biases, qwen3's q/k norms, phi3's fused q/k/v and
gate/up). The blocks are models/blocks.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

import torch

from .. import native
from ..arch_table import fused_qkv_architectures, traits_of
from ..config import ArchConfig
from ..gguf_reader import GGUFError
from ..kernels import Linear, NativeLinear
from ..loader import Part, WeightBuilder, rope_permutation
from .blocks import (
    RopeTables,
    StageModel,
    attend,
    causal_mask,
    check_layer_shapes,
    feed_forward,
    float32_inverse_sqrt,
    load_head,
    rms_norm_prescaled,
    rope,
)


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    attn_fused: bool = False  # qkv applies attn_norm itself (Linear.fuse_norm)
    ffn_fused: bool = False  # gate_up applies ffn_norm itself


class LlamaStageModel(StageModel[LayerWeights]):
    """Layers ``[layer_start, layer_end)`` plus, where held, the embedding and the head."""

    def __init__(
        self,
        cfg: ArchConfig,
        layer_start: int,
        layers: list[LayerWeights],
        rope: RopeTables,
        output_norm: torch.Tensor | None,
        head: Linear | None,
        fp16_split_points: tuple[int, ...],
        ggml_order: bool = False,
    ) -> None:
        super().__init__(cfg, layer_start, layers, output_norm, head, fp16_split_points)
        self.rope = rope
        # Norm weights are stored pre-scaled for rms_norm_prescaled.
        root_h, root_d = math.sqrt(cfg.hidden), math.sqrt(cfg.head_dim)
        for lw in layers:
            lw.attn_norm = lw.attn_norm * root_h
            lw.ffn_norm = lw.ffn_norm * root_h
            # ggml_order: qwen3's q/k norms as ggml computes them (native.rms_norm), with
            # the file's weights; else rms_norm_prescaled's pre-scaled ones
            if lw.q_norm is not None and lw.k_norm is not None and not ggml_order:
                lw.q_norm, lw.k_norm = lw.q_norm * root_d, lw.k_norm * root_d
        self.output_norm = None if output_norm is None else output_norm * root_h
        device = rope.device
        self.c_hidden = torch.tensor(math.sqrt(cfg.hidden * cfg.eps), device=device)
        self.c_head = torch.tensor(math.sqrt(cfg.head_dim * cfg.eps), device=device)
        # ggml_order (load_llama_layer: q carries neither the attention scale nor the rope
        # permutation): rope, attention and SwiGLU as ggml computes them.
        lib = native.library() if device.type == "cpu" else None
        self.native_rope: native.Rope | None = None
        # Phi-3 (fused q/k/v rows, the scale not in them) scales q after the rope under
        # ggml_order, as llama.cpp does, else the scores
        traits = traits_of(cfg.architecture)
        fused = traits is not None and traits.fused_qkv
        scale = float32_inverse_sqrt(cfg.head_dim)
        self.q_scale = scale if ggml_order and fused else 0.0
        self.kq_scale = scale if ggml_order != fused else 1.0
        if ggml_order and lib is not None:
            self.native_rope = native.Rope(
                lib, cfg.rope_base, cfg.rope_linear_scale, cfg.head_dim, cfg.rope_neox,
                None if rope.freq_factors is None else rope.freq_factors.cpu(),
            )  # fmt: skip

    def forward(
        self, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int
    ) -> torch.Tensor:
        """Run the stage's layers on ``h`` [T, hidden] at positions ``pos..pos+T-1``.

        This is the hot loop: every op costs microseconds of dispatch, so the attention
        scale lives in the q weights, q and k are rotated together and the residual adds
        ride along with the output matmuls.
        """
        cfg = self.cfg
        t = h.shape[0]
        end = pos + t
        layers = self._native_layers()
        if layers is not None:
            h = h.to(torch.float32, copy=True).contiguous()
            if layers.forward_(h, k_cache, v_cache, pos):
                return h
        self.rope.ensure(end)
        cos, sin = self.rope.cos[pos:end], self.rope.sin[pos:end]
        rot_matrix = self.rope.matrix(pos, cfg.head_dim) if t == 1 else None
        mask = causal_mask(pos, t, 0, h.device) if t > 1 else None  # [T, S] True = hidden
        nh, nkv, hd, rot = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.rope_dim
        qkd = cfg.q_dim + cfg.kv_dim
        ch = self.c_hidden
        f16 = self.attention_f16
        for i, lw in enumerate(self.layers):
            if i in self.round_before:
                h = h.half().float()
            qkv = lw.qkv(h if lw.attn_fused else rms_norm_prescaled(h, lw.attn_norm, ch))
            qk = qkv[:, :qkd].view(t, nh + nkv, hd)
            ggml = self.native_rope is not None
            if lw.q_norm is not None and lw.k_norm is not None:
                qk = torch.cat(
                    [self._qk_norm(qk[:, :nh], lw.q_norm), self._qk_norm(qk[:, nh:], lw.k_norm)],
                    dim=1,
                )  # fmt: skip
            if self.native_rope is not None:
                qk = self.native_rope.apply_(qk.contiguous(), pos)
                if self.q_scale:
                    qk[:, :nh] *= self.q_scale
            elif rot_matrix is not None:
                qk = torch.mm(qk.view(nh + nkv, hd), rot_matrix).view(1, nh + nkv, hd)
            else:
                qk = rope(qk, cos, sin, rot)
            attn = attend(
                qk, qkv[:, qkd:], k_cache[i], v_cache[i], pos, 0, mask, f16, 0, ggml, self.kq_scale
            )  # fmt: skip
            h = lw.wo(attn, h)
            x = h if lw.ffn_fused else rms_norm_prescaled(h, lw.ffn_norm, ch)
            h = feed_forward(lw, x, h, self._ffn_rows(i, t, lw), cfg.ffn, ggml)
        return h

    def ensure_positions(self, n: int) -> None:
        self.rope.ensure(n)

    def _qk_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """qwen3's per-head RMS norm of q or k [T, heads, head_dim]."""
        if self.native_rope is not None:  # ggml's order (the file's weights)
            out = native.rms_norm(x, w, self.cfg.eps)
            if out is not None:
                return out
        return rms_norm_prescaled(x, w, self.c_head)

    def _final_norm(self, x: torch.Tensor, output_norm: torch.Tensor) -> torch.Tensor:
        return rms_norm_prescaled(x, output_norm, self.c_hidden)

    def _native_ready(self) -> bool:
        return self.native_rope is not None

    def _layer_plan(
        self, lw: LayerWeights, products: tuple[Any, Any, Any, Any], rounds: bool, out_last: bool
    ) -> native.LayerPlan:
        assert self.native_rope is not None  # _native_ready
        return native.LayerPlan(
            *products, self.native_rope, lw.q_norm, lw.k_norm,
            kq_scale=self.kq_scale, round_scale=1.0 if rounds else 0.0,
            qkv_bias=cast(NativeLinear, lw.qkv).bias, q_scale=self.q_scale, out_last=out_last,
        )  # fmt: skip


def ggml_order(b: WeightBuilder, cfg: ArchConfig) -> bool:
    """Whether the llama-family stage computes attention as ggml does (LlamaStageModel's
    ggml_order): products in llama.cpp's order, the native kernel built, whole-head rope
    from the base (and Llama 3's rope_freqs)."""
    return (
        b.llamacpp_order
        and b.device.type == "cpu"  # LlamaStageModel's native rope and attention: CPU only
        and native.library() is not None
        and cfg.rope_dim == cfg.head_dim
        and cfg.head_dim % 16 == 0  # native.attention's vectors
    )


def load_llama_layer(b: WeightBuilder, cfg: ArchConfig, i: int, ggml: bool) -> LayerWeights:
    p = f"blk.{i}."
    names = b.f.tensors
    # The attention scale 1/sqrt(head_dim) is folded into q (or into q_norm, which follows
    # it), and q/k rows are permuted for a half-split rope; except where attention is
    # computed as ggml does it (``ggml``): there the scale multiplies the scores and the
    # rope rotates adjacent pairs, because both change float16 roundings and the order of
    # q.k's sums.
    # Phi-3's fused q/k/v rows (NEOX: no permutation) keep the scale out of q: it
    # multiplies q after the rope (ggml) or the scores (LlamaStageModel.q_scale / kq_scale).
    fused = p + "attn_qkv.weight" in names
    traits = traits_of(cfg.architecture)
    if fused != (traits is not None and traits.fused_qkv):
        who = f"only {fused_qkv_architectures()} has" if fused else f"{cfg.architecture} needs"
        raise GGUFError(f"{b.f.path}: {who} a fused {p}attn_qkv.weight")
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


def build_llama_stage_model(
    b: WeightBuilder, cfg: ArchConfig, span: range, fp16_split_points: tuple[int, ...]
) -> LlamaStageModel:
    """The llama family's weights of the layers in ``span`` (the head too for the last)."""
    with torch.inference_mode():
        ggml = ggml_order(b, cfg)
        layers = [load_llama_layer(b, cfg, i, ggml) for i in span]
        rope = RopeTables(cfg, b.optional_vector("rope_freqs.weight"), b.device)
        output_norm, head = load_head(b, cfg, span.stop)
    return LlamaStageModel(
        cfg, span.start, layers, rope, output_norm, head, fp16_split_points, ggml
    )  # fmt: skip
