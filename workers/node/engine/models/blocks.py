"""The blocks every architecture's graph is built of: norms, rope, attention, the gated
feed-forward, the head, and the stage scaffolding (``StageModel``: logits, batched
forward, the native layer plan) that models/llama.py and models/gemma3.py share.

Tensor shapes, per layer (T new tokens, S = position + T cached tokens):
  h          [T, hidden]                      float32 residual stream
  qkv        [T, (n_head + 2 n_kv) head_dim]  one fused matmul (+ qwen2 biases)
  k/v cache  [n_kv, max_seq, head_dim]        per layer, owned by the session
  scores     [n_kv, group T, S]               grouped-query attention without repeating k/v
  gate_up    [T, 2 ffn]                       one fused matmul, then act(gate) * up
Rope is applied in the half-split (NEOX) form; llama-family q/k rows were permuted at load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Generic, Protocol, TypeVar, cast

import numpy as np
import torch
import torch.nn.functional as F

from .. import native
from ..config import ArchConfig
from ..gguf_reader import GGUFError
from ..kernels import Linear, NativeLinear
from ..loader import Part, WeightBuilder

# The torch-kernel head's logits carry its bfloat16 output rounding (2^-9 of a logit: 0.06
# at 16, more than many greedy margins): the best REFINE_TOP are recomputed in float32 from
# their rows, so the greedy choice and the likely candidates are those of the float32 path.
# (The native kernel's products are float32 sums already: no refinement, as llama.cpp.)
REFINE_TOP = 64

# One sequence's rows of a batch: (rows, position, k cache, v cache), the caches the
# session's [layers, nkv, max_seq, hd] of its slot.
Segment = tuple[int, int, torch.Tensor, torch.Tensor]


class RopeTables:
    """cos/sin per position, grown on demand, shaped for ``x * cos + roll(x) * sin``."""

    def __init__(self, cfg: ArchConfig, freq_factors: torch.Tensor | None, device: torch.device):
        half = cfg.rope_dim // 2
        self.freq_factors = freq_factors  # Llama 3's rope_freqs (native.Rope takes them too)
        exponents = torch.arange(half, dtype=torch.float64) * 2.0 / cfg.rope_dim
        inv_freq = cfg.rope_base ** (-exponents)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.to(torch.float64).cpu()[:half]
        self.inv_freq = inv_freq * cfg.rope_linear_scale
        self.device = device
        self.cos = torch.empty(0, 1, cfg.rope_dim, device=device)
        self.sin = torch.empty(0, 1, cfg.rope_dim, device=device)

    def ensure(self, n: int) -> None:
        if self.cos.shape[0] >= n:
            return
        n = max(n, 2 * self.cos.shape[0], 64)
        angles = torch.arange(n, dtype=torch.float64).view(-1, 1) * self.inv_freq.view(1, -1)
        c, s = angles.cos().float(), angles.sin().float()
        self.cos = torch.cat([c, c], dim=-1).unsqueeze(1).to(self.device)
        self.sin = torch.cat([-s, s], dim=-1).unsqueeze(1).to(self.device)

    def matrix(self, pos: int, head_dim: int) -> torch.Tensor:
        """[head_dim, head_dim] R with ``x @ R`` = rope of a single position: one matmul per
        layer instead of four elementwise ops (decode is dispatch-bound)."""
        c = self.cos[pos, 0]
        rot = c.shape[0]
        half = self.sin[pos, 0, rot // 2 :]
        diag = c if rot == head_dim else torch.cat([c, c.new_ones(head_dim - rot)])
        r = torch.diag(diag)
        idx = torch.arange(rot // 2, device=c.device)
        r[idx + rot // 2, idx] = -half
        r[idx, idx + rot // 2] = half
        return r


def float32_inverse_sqrt(n: int) -> float:
    """``1.0f / sqrtf(float(n))`` as llama.cpp's graphs compute an attention scale: in
    float32 (1 / sqrt(n) in double, rounded to float32, is an ulp off for some n: 96)."""
    return float(np.float32(1.0) / np.sqrt(np.float32(n)))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int) -> torch.Tensor:
    """Rotate the first ``rot`` dims of each head (half-split pairs)."""
    if rot == x.shape[-1]:
        return x * cos + torch.roll(x, rot // 2, -1) * sin
    head, tail = x[..., :rot], x[..., rot:]
    return torch.cat([head * cos + torch.roll(head, rot // 2, -1) * sin, tail], dim=-1)


def rms_norm_prescaled(x: torch.Tensor, w_scaled: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """RMS norm with ``w_scaled = w * sqrt(n)`` and ``c = sqrt(n * eps)``:
    ``x / sqrt(mean(x^2) + eps) * w == x * w_scaled / hypot(||x||, c)``, in 4 cheap ops
    (about half the time of ``F.rms_norm`` for one row)."""
    return x * (w_scaled / torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True), c))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def ggml_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
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


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """ggml's CPU gelu: the tanh form looked up in a float16 table (input and output
    rounded to float16) for |x| < 10, x itself above, 0 below. (torch's tanh-gelu rounds
    26 of the 65536 table entries differently; native.geglu has ggml's table.)"""
    y = F.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x >= 10.0, x, torch.where(x <= -10.0, torch.zeros_like(x), y))


def causal_mask(pos: int, t: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, S] True where hidden: the future, and for a window what lies beyond it."""
    end = pos + t
    q_pos = torch.arange(pos, end, device=device).view(-1, 1)
    k_pos = torch.arange(end, device=device).view(1, -1)
    hidden = k_pos > q_pos
    if window > 0:
        hidden |= q_pos - k_pos >= window
    return hidden


def attend(
    qk: torch.Tensor,
    v: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    pos: int,
    start: int,
    mask: torch.Tensor | None,
    f16: bool,
    window: int = 0,
    ggml: bool = False,
    kq_scale: float = 1.0,
) -> torch.Tensor:
    """Grouped-query attention of T new positions: their rotated ``qk`` [T, nh + nkv, hd]
    and ``v`` [T, nkv * hd] go into the layer's caches ``kc``/``vc`` [nkv, max_seq, hd]
    at ``pos``; each query head h attends with kv head h // group over cached positions
    ``start..pos+T-1`` (``mask`` [T, S] hides the future at prefill). With ``f16`` keys,
    values, queries and softmax weights are float16 values (StageModel.attention_f16).
    With ``ggml``, where the native kernel is built, it computes the rest as ggml does
    (native.attention; ``window`` > 0: a query sees only the last ``window`` positions,
    which ``start`` and ``mask`` express for the torch path; ``kq_scale`` multiplies the
    scores there, where q does not carry the scale already). Returns [T, nh * hd]."""
    t, heads, hd = qk.shape
    nkv = kc.shape[0]
    nh = heads - nkv
    group, end = nh // nkv, pos + t
    k_new, v_new = qk[:, nh:].transpose(0, 1), v.view(t, nkv, hd).transpose(0, 1)
    if f16:  # float16 values (the cache itself is float16 then: session.kv_dtype)
        k_new, v_new = k_new.half(), v_new.half()
    kc[:, pos:end] = k_new
    vc[:, pos:end] = v_new
    if ggml:
        out = native.attention(qk[:, :nh], kc, vc, pos, window, kq_scale)
        if out is not None:
            return out
    # [T, nh, hd] -> [nkv, group * T, hd]; head h uses kv head h // group.
    if t == 1:
        qg = qk[:, :nh].reshape(nkv, group, hd)
    else:
        qg = qk[:, :nh].reshape(t, nkv, group, hd).permute(1, 2, 0, 3).reshape(nkv, -1, hd)
    if f16:
        qg = qg.half().float()
    scores = torch.bmm(qg, kc[:, start:end].float().transpose(1, 2))
    if kq_scale != 1.0:
        scores = scores * kq_scale
    if mask is not None:
        scores.view(nkv, group, t, end).masked_fill_(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if f16:
        probs = probs.half().float()
    attn = torch.bmm(probs, vc[:, start:end].float())
    if t > 1:
        attn = attn.view(nkv, group, t, hd).permute(2, 0, 1, 3)
    return attn.reshape(t, nh * hd)


class Layer(Protocol):
    """What the scaffolding reads of an architecture's layer weights."""

    attn_norm: torch.Tensor
    qkv: Linear
    wo: Linear
    ffn_norm: torch.Tensor
    gate_up: Linear
    down: Linear
    attn_fused: bool  # qkv applies attn_norm itself (Linear.fuse_norm)
    ffn_fused: bool  # gate_up applies ffn_norm itself


def feed_forward(
    lw: Layer,
    x: torch.Tensor,
    add_to: torch.Tensor | None,
    kinds: torch.Tensor | None,
    ffn: int,
    ggml: bool,
    gelu: bool = False,
) -> torch.Tensor:
    """``down(act(gate) * up)`` of the normed rows ``x`` (+ ``add_to``): SwiGLU, or GeGLU
    with ggml's gelu table (``gelu``); ggml's own kernel where ``ggml`` and it is built.
    ``kinds``: the products' row kinds (StageModel._ffn_rows; None: as a product of T rows)."""
    gu = lw.gate_up(x) if kinds is None else cast(NativeLinear, lw.gate_up)(x, None, kinds)
    act = (native.geglu if gelu else native.swiglu)(gu, ffn) if ggml else None
    if act is None:
        act = (ggml_gelu if gelu else F.silu)(gu[:, :ffn]) * gu[:, ffn:]
    if kinds is None:
        return lw.down(act, add_to)
    return cast(NativeLinear, lw.down)(act, add_to, kinds)


def head_logits(head: Linear, x: torch.Tensor) -> torch.Tensor:
    """Logits [vocab] of one normed row ``x`` [1, hidden]; where the head's product is not
    float32 throughout (torch's bfloat16 kernels), its best REFINE_TOP are recomputed from
    the file's rows in float32."""
    out = head(x).view(-1).float()
    if head.exact_rows is not None:
        top = torch.topk(out, min(REFINE_TOP, out.shape[0]), sorted=False).indices
        out[top] = torch.mv(head.exact_rows(top), x.view(-1))
    return out


def load_head(
    b: WeightBuilder, cfg: ArchConfig, layer_end: int
) -> tuple[torch.Tensor | None, Linear | None]:
    """The output norm and head (tied to the embedding where the file has no output
    matrix), for the stage that ends the model; (None, None) for any other."""
    if layer_end != cfg.n_layers:
        return None, None
    output_norm = b.vector("output_norm.weight")
    head_name = "output.weight" if "output.weight" in b.f.tensors else "token_embd.weight"
    return output_norm, b.linear([Part(head_name)])


def check_layer_shapes(path: str, prefix: str, cfg: ArchConfig, lw: Any) -> None:
    """Refuse a file whose layer tensors do not fit the model's dimensions (the kernels
    size their buffers from those): a malformed GGUF is a clear error, not a write past a
    buffer. ``lw``: any architecture's layer (gemma3's post-norms are checked too)."""
    want = {
        "qkv": (cfg.q_dim + 2 * cfg.kv_dim, cfg.hidden),
        "wo": (cfg.hidden, cfg.q_dim),
        "gate_up": (2 * cfg.ffn, cfg.hidden),
        "down": (cfg.hidden, cfg.ffn),
    }
    for name, (rows, cols) in want.items():
        lin = getattr(lw, name)
        if (lin.out_features, lin.in_features) != (rows, cols):
            raise GGUFError(
                f"{path}: {prefix}{name} is {lin.out_features} x {lin.in_features}, "
                f"the model's dimensions need {rows} x {cols}"
            )
    bias = getattr(lw.qkv, "bias", None)
    vectors = {"qkv bias": (bias, cfg.q_dim + 2 * cfg.kv_dim)}
    for name in ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm"):
        vectors[name] = (getattr(lw, name, None), cfg.hidden)
    for name in ("q_norm", "k_norm"):
        vectors[name] = (getattr(lw, name, None), cfg.head_dim)
    for name, (v, n) in vectors.items():
        if v is not None and v.numel() != n:
            raise GGUFError(f"{path}: {prefix}{name} has {v.numel()} values, not {n}")


def native_products(lw: Any) -> tuple[Any, Any, Any, Any] | None:
    """A layer's qkv, wo, gate_up and down as the native kernel's weights (for
    native.Layers), or None unless all four are native products without biases (but
    qkv's: native.LayerPlan.qkv_bias) and the kernel applies the attention and FFN norms
    itself."""
    lins = (lw.qkv, lw.wo, lw.gate_up, lw.down)
    if not (lw.attn_fused and lw.ffn_fused):
        return None
    if not all(isinstance(x, NativeLinear) for x in lins):
        return None
    if any(x.bias is not None for x in lins[1:]):
        return None
    qkv, wo, gate_up, down = cast(tuple[NativeLinear, ...], lins)
    return qkv._weights, wo._weights, gate_up._weights, down._weights


L = TypeVar("L", bound=Layer)


class StageModel(ABC, Generic[L]):
    """Layers ``[layer_start, layer_end)`` plus, where held, the output norm and head:
    what every architecture's stage shares (the graph itself is ``forward``)."""

    # Attention as llama.cpp computes it with its default float16 KV cache: keys, values,
    # queries and the softmax weights rounded to float16, products summed in float32.
    # On SmolLM2 a float32 cache moves llama.cpp's own first logits by 0.13 on average
    # (0.35 at most), more than many greedy margins; the default path matches it.
    attention_f16 = False
    float16_scale = 1.0  # a float16 hand-over's scale (boundary.py)

    def __init__(
        self,
        cfg: ArchConfig,
        layer_start: int,
        layers: list[L],
        output_norm: torch.Tensor | None,
        head: Linear | None,
        fp16_split_points: tuple[int, ...],
    ) -> None:
        self.cfg = cfg
        self.layer_start = layer_start
        self.layers = layers
        self.head = head
        # Where the kernel applies a norm itself, its input is the residual stream.
        for lw in layers:
            lw.attn_fused = lw.qkv.fuse_norm(lw.attn_norm, cfg.eps)
            lw.ffn_fused = lw.gate_up.fuse_norm(lw.ffn_norm, cfg.eps)
        # The native head applies the output norm itself, as ggml computes it (which keeps
        # llama.cpp's int8 activation codes: a 1-ulp change of an input can move one).
        self.head_fused = (
            head is not None
            and output_norm is not None
            and head.exact_rows is None
            and head.fuse_norm(output_norm, cfg.eps)
        )
        self.output_norm = output_norm
        end = layer_start + len(layers)
        self.round_before = frozenset(
            k - layer_start for k in fp16_split_points if layer_start < k < end
        )
        self._layers: native.Layers | None = None
        self._layers_tried = False

    @abstractmethod
    def forward(
        self, h: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int
    ) -> torch.Tensor:
        """Run the stage's layers on ``h`` [T, hidden] at positions ``pos..pos+T-1``."""

    @abstractmethod
    def _native_ready(self) -> bool:
        """Whether the architecture's ops beyond the products have their native kernels
        (its rope above all) for native.Layers."""

    @abstractmethod
    def _layer_plan(
        self, lw: L, products: tuple[Any, Any, Any, Any], rounds: bool, out_last: bool
    ) -> native.LayerPlan:
        """Layer ``lw``'s plan for native.Layers (``rounds``: the hidden state is rounded to
        float16 before it; ``out_last``: the model's last layer)."""

    @abstractmethod
    def _final_norm(self, x: torch.Tensor, output_norm: torch.Tensor) -> torch.Tensor:
        """The output norm of rows ``x`` as the torch path computes it."""

    @abstractmethod
    def ensure_positions(self, n: int) -> None:
        """Grow the rope tables to ``n`` positions (a session does, once, for its length)."""

    def _embedding_scale(self) -> float | None:
        """What the stage multiplies its embedding rows by before the layers (None: 1)."""
        return None

    def _cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The architecture's last step on the head's logits (none here)."""
        return logits

    def _ffn_rows(self, i: int, t: int, lw: L) -> torch.Tensor | None:
        """Row kinds for layer i's feed-forward products (None: as a product of t rows):
        the model's last layer keeps only the last row, as llama.cpp does."""
        last = self.layer_start + i == self.cfg.n_layers - 1
        native_ffn = isinstance(lw.gate_up, NativeLinear) and isinstance(lw.down, NativeLinear)
        return native.feed_forward_rows(t) if last and t > 1 and native_ffn else None

    def forward_batch(self, h: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """The stage's layers over several sequences' rows ``h`` [T, hidden] (``segments``
        in row order): each sequence's rows as ``forward`` computes them for it alone, bit
        for bit. With the native layers every product runs once over all the rows (qmm.c
        mvk_layers_batch: a row's sums never depend on the rows beside it); without them
        (torch's kernels, whose sums for a row may change with the number of rows) each
        sequence runs on its own."""
        scale = self._embedding_scale()
        layers = self._native_layers()
        if layers is not None:
            x = h * scale if scale is not None else h
            x = x.to(torch.float32, copy=True).contiguous()  # updated in place
            if layers.forward_batch_(x, segments):
                return x
        outs, row = [], 0
        for t, pos, kc, vc in segments:
            outs.append(self.forward(h[row : row + t], kc, vc, pos))
            row += t
        return torch.cat(outs)

    def _native_layers(self) -> native.Layers | None:
        """The layers as one foreign call (native.Layers, the same ops as forward()'s
        loop) where everything they compute has a native kernel: ggml's order, float16
        caches, every product native without biases, norms fused; built on first use
        (attention_f16 is set after __init__)."""
        if self._layers_tried:
            return self._layers
        self._layers_tried = True
        cfg, lib = self.cfg, native.library()
        if lib is None or not self._native_ready() or not self.attention_f16 or cfg.ffn % 16:
            return None
        plans = []
        for i, lw in enumerate(self.layers):
            products = native_products(lw)
            if products is None:
                return None
            out_last = self.layer_start + i == cfg.n_layers - 1
            plans.append(self._layer_plan(lw, products, i in self.round_before, out_last))
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
            out = head_logits(self.head, self._final_norm(h_last.view(1, -1), self.output_norm))
        return self._cap_logits(out)

    def logits_rows(self, h_rows: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] of n sequences' last hidden states [n, hidden], each as
        ``logits`` computes it for that row alone (the native head in one product)."""
        if self.head_fused and isinstance(self.head, NativeLinear):
            kinds = native.segment_kinds([1] * h_rows.shape[0])
            return self._cap_logits(self.head(h_rows, row_kinds=kinds))
        return torch.stack([self.logits(r) for r in h_rows])
