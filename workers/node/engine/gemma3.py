"""The Gemma 3 forward pass over a stage's layers (GGUF architecture ``gemma3``).

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

Tensor shapes follow model.py: h [T, hidden] float32, the k/v cache of a layer
[n_kv, max_seq, head_dim], grouped-query attention without repeating k/v.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from gguf.constants import Keys

from . import native
from .config import ArchConfig
from .gguf_reader import GGUFError, GGUFFile
from .kernels import Linear, NativeLinear
from .loader import Part, WeightBuilder
from .model import (
    RopeTables,
    Segment,
    attend,
    batch_forward,
    check_layer_shapes,
    float32_inverse_sqrt,
    head_logits,
    native_products,
)

ARCHITECTURE = "gemma3"
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
    window_key = Keys.Attention.SLIDING_WINDOW.format(arch=ARCHITECTURE)
    softcap_key = Keys.LLM.FINAL_LOGIT_SOFTCAPPING.format(arch=ARCHITECTURE)
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


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _ggml_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """ggml's CPU RMS norm: float32 squares summed in double, ``x * (1 / sqrtf(mean +
    eps)) * w`` in float32 (in C where the native kernel is built; torch's float32 sqrt
    and division are not always correctly rounded, so here they go through float64,
    which rounds them exactly as float32 would)."""
    out = native.rms_norm(x, w, eps)
    if out is not None:
        return out
    mean = ((x * x).double().sum(-1, keepdim=True) / x.shape[-1]).float()
    m = (mean + torch.tensor(eps, dtype=torch.float32)).double()
    scale = (1.0 / torch.sqrt(m).float().double()).float()
    return x * scale * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split (NEOX) rotation of whole heads; tables from RopeTables."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, -1) * sin


def _gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU gelu: the tanh form looked up in a float16 table (input and output
    rounded to float16) for |x| < 10, x itself above, 0 below. (torch's tanh-gelu rounds
    26 of the 65536 table entries differently; native.geglu has ggml's table.)"""
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x >= 10.0, x, torch.where(x <= -10.0, torch.zeros_like(x), y))


class Gemma3StageModel:
    """Layers ``[layer_start, layer_end)`` plus, where held, the output norm and head."""

    attention_f16 = False  # as StageModel.attention_f16
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
        self.cfg = cfg
        self.params = params
        self.layer_start = layer_start
        self.layers = layers
        self.rope = rope
        self.output_norm = output_norm
        self.head = head
        # Where the kernel applies a norm itself, its input is the residual stream.
        for lw in layers:
            lw.attn_fused = lw.qkv.fuse_norm(lw.attn_norm, cfg.eps)
            lw.ffn_fused = lw.gate_up.fuse_norm(lw.ffn_norm, cfg.eps)
        self.head_fused = (
            head is not None
            and output_norm is not None
            and head.exact_rows is None
            and head.fuse_norm(output_norm, cfg.eps)
        )
        end = layer_start + len(layers)
        self.round_before = frozenset(
            k - layer_start for k in fp16_split_points if layer_start < k < end
        )
        self._layers: native.Layers | None = None
        self._layers_tried = False

    def _mask(self, pos: int, t: int, window: int, device: torch.device) -> torch.Tensor:
        """[T, S] True where hidden: the future, and for a window what lies beyond it."""
        end = pos + t
        q_pos = torch.arange(pos, end, device=device).view(-1, 1)
        k_pos = torch.arange(end, device=device).view(1, -1)
        hidden = k_pos > q_pos
        if window > 0:
            hidden |= q_pos - k_pos >= window
        return hidden

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
            masks[False] = self._mask(pos, t, 0, h.device)
            masks[True] = self._mask(pos, t, window, h.device) if window else masks[False]
        layers = self._native_layers()
        if layers is not None:
            h = h.to(torch.float32, copy=True).contiguous()  # updated in place
            if layers.forward_(h, k_cache, v_cache, pos):
                return h
        nh, nkv, hd, eps = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.eps
        qkd = cfg.q_dim + cfg.kv_dim
        f16 = self.attention_f16
        norm = _ggml_rms_norm if f16 else _rms_norm
        for i, lw in enumerate(self.layers):
            if i in self.round_before:
                h = (h * BOUNDARY_SCALE).half().float() * (1.0 / BOUNDARY_SCALE)
            qkv = lw.qkv(h if lw.attn_fused else _rms_norm(h, lw.attn_norm, eps))
            qk = qkv[:, :qkd].view(t, nh + nkv, hd)
            qk = torch.cat(
                [norm(qk[:, :nh], lw.q_norm, eps), norm(qk[:, nh:], lw.k_norm, eps)],
                dim=1,
            )
            if f16 and self.rope.native is not None:
                qk = self.rope.native[lw.local].apply_(qk, pos)
            else:
                cos, sin = tables[lw.local]
                qk = _rope(qk, cos, sin)
            # A local layer at decode reads only its window; at prefill the mask hides the rest.
            start = max(0, end - window) if lw.local and t == 1 else 0
            attn = attend(
                qk, qkv[:, qkd:], k_cache[i], v_cache[i], pos, start, masks[lw.local], f16,
                window if lw.local else 0, f16,
            )  # fmt: skip
            h = h + norm(lw.wo(attn), lw.post_attn_norm, eps)
            x = h if lw.ffn_fused else _rms_norm(h, lw.ffn_norm, eps)
            # the model's last layer keeps only the output row, as llama.cpp does
            kinds = None
            native_ffn = isinstance(lw.gate_up, NativeLinear) and isinstance(lw.down, NativeLinear)
            if self.layer_start + i == cfg.n_layers - 1 and t > 1 and native_ffn:
                kinds = native.feed_forward_rows(t)
            gu = lw.gate_up(x) if kinds is None else cast(NativeLinear, lw.gate_up)(x, None, kinds)
            act = native.geglu(gu, cfg.ffn) if f16 else None
            if act is None:
                act = _gelu(gu[:, : cfg.ffn]) * gu[:, cfg.ffn :]
            ffn = lw.down(act) if kinds is None else cast(NativeLinear, lw.down)(act, None, kinds)
            h = h + norm(ffn, lw.post_ffn_norm, eps)
        return h

    def forward_batch(self, h: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """Several sequences' rows at once (model.batch_forward)."""
        scale = self.params.embedding_scale if self.layer_start == 0 else None
        return batch_forward(self, h, segments, scale)

    def logits_rows(self, h_rows: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of n last hidden states, each as ``logits`` computes it."""
        if not (self.head_fused and isinstance(self.head, NativeLinear)):
            return torch.stack([self.logits(r) for r in h_rows])
        out = self.head(h_rows, row_kinds=native.segment_kinds([1] * h_rows.shape[0]))
        cap = self.params.final_logit_softcap
        if cap > 0:
            out = torch.tanh(out / cap) * cap
        return out

    def _native_layers(self) -> native.Layers | None:
        """The layers as one foreign call (native.Layers, the same ops as forward()'s
        loop) where every op has its native kernel; built on first use."""
        if self._layers_tried:
            return self._layers
        self._layers_tried = True
        cfg, lib, ropes = self.cfg, native.library(), self.rope.native
        if lib is None or ropes is None or not self.attention_f16 or cfg.ffn % 16:
            return None
        if cfg.head_dim % 16:
            return None
        plans = []
        for i, lw in enumerate(self.layers):
            products = native_products(lw)
            if products is None:
                return None
            plans.append(
                native.LayerPlan(
                    *products, ropes[lw.local], lw.q_norm, lw.k_norm, lw.post_attn_norm,
                    lw.post_ffn_norm, geglu=True,
                    window=self.params.sliding_window if lw.local else 0,
                    round_scale=BOUNDARY_SCALE if i in self.round_before else 0.0,
                    out_last=self.layer_start + i == cfg.n_layers - 1,
                )
            )  # fmt: skip
        self._layers = native.Layers(
            lib, cfg.hidden, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.ffn, cfg.eps, plans
        )
        return self._layers

    def logits(self, h_last: torch.Tensor) -> torch.Tensor:
        """Logits [vocab] float32 of one hidden state [hidden]."""
        if self.output_norm is None or self.head is None:
            raise RuntimeError("this stage does not hold the output head")
        if self.head_fused:
            out = self.head(h_last.view(1, -1)).view(-1)
        else:
            x = _rms_norm(h_last.view(1, -1), self.output_norm, self.cfg.eps)
            out = head_logits(self.head, x)
        cap = self.params.final_logit_softcap
        if cap > 0:
            out = torch.tanh(out / cap) * cap
        return out


def build_gemma3_stage_model(
    f: GGUFFile,
    cfg: ArchConfig,
    b: WeightBuilder,
    layer_start: int,
    layer_end: int,
    fp16_split_points: tuple[int, ...],
) -> Gemma3StageModel:
    """Weights of layers ``[layer_start, layer_end)`` (the head too for the last stage)."""
    params = gemma3_params(f, cfg)
    layers = [load_gemma3_layer(b, cfg, params, i) for i in range(layer_start, layer_end)]
    output_norm, head = None, None
    if layer_end == cfg.n_layers:
        output_norm = b.vector("output_norm.weight")
        head_name = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
        head = b.linear([Part(head_name)])
    rope = Gemma3Ropes(cfg, b.device)
    return Gemma3StageModel(
        cfg, params, layer_start, layers, rope, output_norm, head, fp16_split_points
    )
