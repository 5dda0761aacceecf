"""The Gemma 3 graph and weights (GGUF architecture ``gemma3``).

What Gemma 3 adds to the llama-style layer (as llama.cpp's ``gemma3`` graph computes it):

* the token embedding is multiplied by ``sqrt(hidden)`` before the first layer;
* every sub-block has a norm before *and* after it: ``h += norm(attn(norm(h)))`` and
  ``h += norm(ffn(norm(h)))`` (the GGUF converter already added Gemma's ``1 +`` to
  every norm weight);
* q and k are RMS-normed per head (``attn_q_norm`` / ``attn_k_norm``) before the rope;
  the attention scale is ``1 / sqrt(head_dim)`` (``1 / sqrt(hidden / n_head)`` for 27B);
* the feed-forward is GeGLU: ``down(gelu_tanh(gate) * up)``;
* layers alternate sliding-window and global attention: with
  ``gemma3.attention.sliding_window`` set, layer ``i`` is local unless ``i % 6 == 5``; a
  local layer sees the last ``sliding_window`` positions only and rotates with rope base
  10000 (no scaling), a global one sees everything with ``rope.freq_base`` and the file's
  rope scaling;
* the head is tied to the embedding; an optional ``final_logit_softcapping`` caps logits.

Tensor shapes follow models/blocks.py: h [T, hidden] float32, the k/v cache of a layer
[n_kv, max_seq, head_dim], grouped-query attention without repeating k/v.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from gguf.constants import Keys

from .. import native
from ..config import ArchConfig
from ..gguf_reader import GGUFError, GGUFFile
from ..kernels import Linear
from ..loader import Part, WeightBuilder
from .blocks import (
    RopeTables,
    StageModel,
    attend,
    causal_mask,
    check_layer_shapes,
    feed_forward,
    float32_inverse_sqrt,
    ggml_rms_norm,
    load_head,
    rms_norm,
    rope,
)

SWA_PATTERN = 6  # llama.cpp: every 6th layer (i % 6 == 5) is global
LOCAL_ROPE_BASE = 10000.0
# Gemma's residual stream outgrows float16 at its first position (the BOS token: ~1e5 by
# the middle layers of 270M). Stage boundaries carry float32 (DECISIONS 53), which holds it
# as it is; a run that opts into float16 activations hands on hidden * BOUNDARY_SCALE and
# the next stage multiplies it back (boundary.py): a power of two, so the scaling itself
# is exact and only the float16 rounding remains (the same rounding the
# fp16_split_points emulation applies).
BOUNDARY_SCALE = 2.0**-6


@dataclass(frozen=True)
class Gemma3Params:
    """Gemma-specific hyperparameters (the rest is the ArchConfig)."""

    sliding_window: int  # 0: every layer is global
    attention_scale: float
    embedding_scale: float
    final_logit_softcap: float  # 0: none

    def is_local(self, layer: int) -> bool:
        return self.sliding_window > 0 and layer % SWA_PATTERN < SWA_PATTERN - 1


def gemma3_params(f: GGUFFile, cfg: ArchConfig) -> Gemma3Params:
    window_key = Keys.Attention.SLIDING_WINDOW.format(arch=cfg.architecture)
    softcap_key = Keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=cfg.architecture)
    window = int(f.get(window_key, 0) or 0)
    if window < 0:
        raise GGUFError(f"{f.path}: negative {window_key}")
    # llama.cpp scales 27B (62 layers) by hidden / n_head, every other size by head_dim.
    scale_dim = cfg.hidden // cfg.n_head if cfg.n_layers == 62 else cfg.head_dim
    return Gemma3Params(
        sliding_window=window,
        attention_scale=float32_inverse_sqrt(scale_dim),
        embedding_scale=math.sqrt(cfg.hidden),
        final_logit_softcap=float(f.get(softcap_key, 0.0) or 0.0),
    )


@dataclass
class Gemma3Layer:
    local: bool
    attn_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor  # carries the attention scale
    k_norm: torch.Tensor
    wo: Linear
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    post_ffn_norm: torch.Tensor
    attn_fused: bool = False  # qkv applies attn_norm itself (Linear.fuse_norm)
    ffn_fused: bool = False  # gate_up applies ffn_norm itself


class Gemma3Ropes:
    """The global and the local rope tables, grown together."""

    def __init__(self, cfg: ArchConfig, device: torch.device) -> None:
        self.device = device
        self.global_ = RopeTables(cfg, None, device)
        local_cfg = dataclasses.replace(cfg, rope_base=LOCAL_ROPE_BASE, rope_linear_scale=1.0)
        self.local = RopeTables(local_cfg, None, device)
        # ggml's own rope arithmetic, where the native kernel is built and the stage is on
        # the CPU (see Gemma3StageModel.attention_f16)
        self.native: dict[bool, native.Rope] | None = None
        lib = native.library() if device.type == "cpu" else None
        if lib is not None and cfg.rope_dim == cfg.head_dim:
            self.native = {
                False: native.Rope(lib, cfg.rope_base, cfg.rope_linear_scale, cfg.head_dim),
                True: native.Rope(lib, LOCAL_ROPE_BASE, 1.0, cfg.head_dim),
            }

    def ensure(self, n: int) -> None:
        self.global_.ensure(n)
        self.local.ensure(n)


def load_gemma3_layer(
    b: WeightBuilder, cfg: ArchConfig, params: Gemma3Params, i: int
) -> Gemma3Layer:
    p = f"blk.{i}."
    lw = Gemma3Layer(
        local=params.is_local(i),
        attn_norm=b.vector(p + "attn_norm.weight"),
        qkv=b.linear(
            [Part(p + "attn_q.weight"), Part(p + "attn_k.weight"), Part(p + "attn_v.weight")]
        ),
        q_norm=b.vector(p + "attn_q_norm.weight") * params.attention_scale,
        k_norm=b.vector(p + "attn_k_norm.weight"),
        wo=b.linear([Part(p + "attn_output.weight")]),
        post_attn_norm=b.vector(p + "post_attention_norm.weight"),
        ffn_norm=b.vector(p + "ffn_norm.weight"),
        gate_up=b.linear([Part(p + "ffn_gate.weight"), Part(p + "ffn_up.weight")]),
        down=b.linear([Part(p + "ffn_down.weight")]),
        post_ffn_norm=b.vector(p + "post_ffw_norm.weight"),
    )
    check_layer_shapes(b.f.path, p, cfg, lw)
    return lw


class Gemma3StageModel(StageModel[Gemma3Layer]):
    """Layers ``[layer_start, layer_end)`` plus, where held, the output norm and head."""

    float16_scale = BOUNDARY_SCALE  # a float16 hand-over's scale (boundary.py)

    def __init__(
        self,
        cfg: ArchConfig,
        params: Gemma3Params,
        layer_start: int,
        layers: list[Gemma3Layer],
        rope: Gemma3Ropes,
        output_norm: torch.Tensor | None,
        head: Linear | None,
        fp16_split_points: tuple[int, ...],
    ) -> None:
        super().__init__(cfg, layer_start, layers, output_norm, head, fp16_split_points)
        self.params = params
        self.rope = rope

    def forward(
        self, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int
    ) -> torch.Tensor:
        """Run the stage's layers on ``h`` [T, hidden] at positions ``pos..pos+T-1``: the
        first stage gets the raw embedding rows and scales them; a later one gets the
        previous stage's hidden state as it is."""
        cfg, params = self.cfg, self.params
        t = h.shape[0]
        end = pos + t
        if self.layer_start == 0:
            h = h * params.embedding_scale
        self.rope.ensure(end)
        tables = {
            True: (self.rope.local.cos[pos:end], self.rope.local.sin[pos:end]),
            False: (self.rope.global_.cos[pos:end], self.rope.global_.sin[pos:end]),
        }
        window = params.sliding_window
        masks: dict[bool, torch.Tensor | None] = {True: None, False: None}
        if t > 1:
            masks[False] = causal_mask(pos, t, 0, h.device)
            masks[True] = causal_mask(pos, t, window, h.device) if window else masks[False]
        layers = self._native_layers()
        if layers is not None:
            h = h.to(torch.float32, copy=True).contiguous()  # updated in place
            if layers.forward_(h, k_cache, v_cache, pos):
                return h
        nh, nkv, hd, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.eps
        qkd = cfg.q_dim + cfg.kv_dim
        f16 = self.attention_f16
        norm = ggml_rms_norm if f16 else rms_norm
        for i, lw in enumerate(self.layers):
            if i in self.round_before:
                h = (h * BOUNDARY_SCALE).half().float() * (1.0 / BOUNDARY_SCALE)
            qkv = lw.qkv(h if lw.attn_fused else rms_norm(h, lw.attn_norm, eps))
            qk = qkv[:, :qkd].view(t, nh + nkv, hd)
            qk = torch.cat(
                [norm(qk[:, :nh], lw.q_norm, eps), norm(qk[:, nh:], lw.k_norm, eps)],
                dim=1,
            )
            if f16 and self.rope.native is not None:
                qk = self.rope.native[lw.local].apply_(qk, pos)
            else:
                cos, sin = tables[lw.local]
                qk = rope(qk, cos, sin, hd)  # whole heads
            # A local layer at decode reads only its window; at prefill the mask hides the rest.
            start = max(0, end - window) if lw.local and t == 1 else 0
            attn = attend(
                qk, qkv[:, qkd:], k_cache[i], v_cache[i], pos, start, masks[lw.local], f16,
                window if lw.local else 0, f16,
            )  # fmt: skip
            h = h + norm(lw.wo(attn), lw.post_attn_norm, eps)
            x = h if lw.ffn_fused else rms_norm(h, lw.ffn_norm, eps)
            # the model's last layer keeps only the output row, as llama.cpp does
            ffn = feed_forward(lw, x, None, self._ffn_rows(i, t, lw), cfg.ffn, f16, gelu=True)
            h = h + norm(ffn, lw.post_ffn_norm, eps)
        return h

    def ensure_positions(self, n: int) -> None:
        self.rope.ensure(n)

    def _embedding_scale(self) -> float | None:
        return self.params.embedding_scale if self.layer_start == 0 else None

    def _cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.params.final_logit_softcap
        if cap > 0:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _final_norm(self, x: torch.Tensor, output_norm: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, output_norm, self.cfg.eps)

    def _native_ready(self) -> bool:
        return self.rope.native is not None and self.cfg.head_dim % 16 == 0

    def _layer_plan(
        self, lw: Gemma3Layer, products: tuple[Any, Any, Any, Any], rounds: bool, out_last: bool
    ) -> native.LayerPlan:
        ropes = self.rope.native
        assert ropes is not None  # _native_ready
        return native.LayerPlan(
            *products, ropes[lw.local], lw.q_norm, lw.k_norm, lw.post_attn_norm,
            lw.post_ffn_norm, geglu=True,
            window=self.params.sliding_window if lw.local else 0,
            round_scale=BOUNDARY_SCALE if rounds else 0.0, out_last=out_last,
        )  # fmt: skip


def build_gemma3_stage_model(
    b: WeightBuilder, cfg: ArchConfig, span: range, fp16_split_points: tuple[int, ...]
) -> Gemma3StageModel:
    """Gemma 3 weights of the layers in ``span`` (and the head for the model's last)."""
    with torch.inference_mode():
        params = gemma3_params(b.f, cfg)
        layers = [load_gemma3_layer(b, cfg, params, i) for i in span]
        output_norm, head = load_head(b, cfg, span.stop)
        rope = Gemma3Ropes(cfg, b.device)
        return Gemma3StageModel(
            cfg, params, span.start, layers, rope, output_norm, head, fp16_split_points
        )
