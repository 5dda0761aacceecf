"""Matrix kernels: how a (possibly fused) weight matrix is stored and multiplied.

* ``NativeLinear`` (the default CPU path where the engine's own kernel is built,
  native.py, DECISIONS 43): the file's integer codes and scales times int8 activation
  blocks quantised as llama.cpp quantises them, float32 sums. The rest of this module is
  its fallback (torch's kernels) and the other precisions.
* ``Int4Linear`` keeps 32-wide affine groups as torch's CPU int4 weight-only format
  (``_weight_int4pack_mm_for_cpu``). Q4_0/Q4_1/Q4_K map onto it exactly (only the
  per-group scale and zero are rounded to bfloat16). Wider codes (Q8_0, Q5_K) are split
  into a high and a low nibble, stored side by side along K, and the input is duplicated,
  so one kernel call still computes the exact product. The kernel only has a vectorised
  path for bfloat16 activations; its output is bfloat16 (it accumulates in float32). For
  single rows (decode) two more calls on the same codes undo that output rounding and the
  scales' (``Int4Linear``: ``exact_output``, ``scale_residuals``).
* ``DenseLinear`` holds a plain matrix (float32 for the reference path, bfloat16 or
  float16 where no compact kernel applies, e.g. Q6_K's 16-wide groups, or on CUDA).
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from . import native
from .native import Weights
from .quants import (
    AFFINE_BITS,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    KScales,
    dequantize,
)

GROUP = 32
_BLOCK_N = 64
# Activation (and scale) dtype of the int4 kernel: only bfloat16 has a vectorised CPU path.
INT4_ACT_DTYPE = torch.bfloat16


def _probe_direct_layout() -> bool:
    """True when torch's CPU int4 layout is ``[N/64, K, 32]`` with n and n+32 in one byte.

    That layout lets us pack straight from uint8 codes (fast, little memory); otherwise
    we fall back to torch's converter. Checked once on a small random matrix.
    """
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=gen)
    try:
        ref = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.equal(ref, _pack_direct(q.to(torch.uint8))))


def _pack_direct(q: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    blocks = q.view(n // _BLOCK_N, _BLOCK_N, k).transpose(1, 2)
    packed = blocks[..., : _BLOCK_N // 2] | (blocks[..., _BLOCK_N // 2 :] << 4)
    return packed.contiguous().view(n, k // 2)


def row_blocks_pack_independently(rows: int) -> bool:
    """Whether packed row blocks of this size can be concatenated (direct layout only)."""
    return _DIRECT and rows % _BLOCK_N == 0


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in 0..15 -> torch's CPU int4 packed weight."""
    if row_blocks_pack_independently(q.shape[0]):
        return _pack_direct(q)
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)


def int4_kernel_available() -> bool:
    return hasattr(torch, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch, "_convert_weight_to_int4pack_for_cpu"
    )


# Probed at import: a property of the torch build, and it pages in the converter's code
# here rather than during the first load.
_DIRECT = int4_kernel_available() and _probe_direct_layout()


class Linear:
    """``y = x @ W.T (+ b) (+ add_to)`` with float32 input and output, whatever the storage.

    ``add_to`` lets the residual add ride along with the matmul (one op fewer per call).
    """

    out_features: int
    in_features: int
    # Float32 rows of the matrix by index, where its product is not float32 throughout
    # (set by the loader for plain single-tensor matrices; the head refines its top logits).
    exact_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def fuse_norm(self, weight: torch.Tensor, eps: float) -> bool:
        """Apply RMS norm (``weight``, ``eps``) to every input first, if this kernel can do
        it itself; returns whether it will."""
        return False

    @property
    def nbytes(self) -> int:
        raise NotImplementedError


class DenseLinear(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self._dtype = weight.dtype
        self._wt = weight.t()

    def __call__(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        if self._dtype == x.dtype:
            base = self.bias if add_to is None else add_to
            if base is None:
                return torch.mm(x, self._wt)
            y = torch.addmm(base, x, self._wt)
            return y if add_to is None or self.bias is None else y.add_(self.bias)
        y = torch.mm(x.to(self._dtype), self._wt).float()
        if self.bias is not None:
            y = y.add_(self.bias)
        return y if add_to is None else y.add_(add_to)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.nbytes
        return self.weight.nbytes + b


@dataclass(frozen=True)
class QuantPart:
    """One GGUF matrix of a QuantLinear as the file holds it: ``raw`` its bytes on the
    device, ``rows`` x the linear's inputs; ``perm`` reorders its rows (on the device) and
    ``row_scale`` multiplies them, as a loader ``Part`` asks."""

    raw: torch.Tensor
    ggml_type: int
    rows: int
    perm: torch.Tensor | None = None
    row_scale: float = 1.0


class QuantLinear(Linear):
    """Weights kept in their GGUF bytes on the device, dequantised ``chunk_rows`` rows at a
    time into a bounded scratch for each product (issue 35: a stage's device memory is
    about its GGUF bytes, not a float16 copy of every matrix). The products run in
    ``dtype`` (float16 on CUDA, whose tensor cores take it; float32 elsewhere) and come
    out float32. Slower than a resident float16 matrix: each call dequantises again."""

    def __init__(
        self,
        parts: list[QuantPart],
        in_features: int,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        chunk_rows: int,
    ) -> None:
        self.parts = parts
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.bias = bias
        self.dtype = dtype
        self.chunk_rows = max(1, chunk_rows)

    def __call__(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        k = self.in_features
        xd = x.to(self.dtype)
        y = torch.empty(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        row0 = 0
        for part in self.parts:
            row_bytes = part.raw.numel() // part.rows
            out = (
                y[:, row0 : row0 + part.rows]
                if part.perm is None
                else torch.empty_like(y[:, row0 : row0 + part.rows])
            )
            for r in range(0, part.rows, self.chunk_rows):
                n = min(self.chunk_rows, part.rows - r)
                raw = part.raw[r * row_bytes : (r + n) * row_bytes]
                w = dequantize(raw, part.ggml_type, (n, k))
                if part.row_scale != 1.0:
                    w = w * part.row_scale
                out[:, r : r + n] = torch.mm(xd, w.to(self.dtype).t()).float()
            if part.perm is not None:
                y[:, row0 : row0 + part.rows] = out[:, part.perm]
            row0 += part.rows
        if self.bias is not None:
            y.add_(self.bias)
        return y if add_to is None else y.add_(add_to)

    @property
    def nbytes(self) -> int:
        b = 0 if self.bias is None else self.bias.nbytes
        return sum(p.raw.nbytes for p in self.parts) + b


class Int4Linear(Linear):
    """int4 weights through torch's bfloat16 CPU kernel.

    ``extra_groups`` > 0: the weight carries zero-correction columns after its K inputs
    (see ``int4_rows``); the input is extended by its 32-wide group sums to match.

    ``exact_output``: the weight ends with one more group (see ``with_residual_group``)
    through which a single-row product is made exact in its output. The kernel accumulates
    in float32 but rounds its result to bfloat16 (2^-9 relative), the largest error of this
    path. So a second call, with that group's scales set to the rounded result ``y1`` and
    its first input to 1, returns ``round(x @ W.T - y1)``: the residual, whose own rounding
    is ~2^-18 of ``y``; ``y1 + residual`` is the float32 product of the kernel's inputs.
    Batched rows (prefill) keep the single call: one group holds one row's ``y1``.

    ``scale_residuals`` (with ``exact_output``): the weights' own bfloat16 rounding, undone
    for single rows by a third call (see ``__init__``). Measured on SmolLM2 (16 prompts x 32
    tokens, scripts/reference/fidelity.py): output rounding alone fixed keeps 345 of
    llama.cpp's 512 tokens, with the scales too 372 (the float32 path: 341).
    """

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        out_features: int,
        in_features: int,
        duplicate_input: bool,
        extra_groups: int,
        bias: torch.Tensor | None,
        exact_output: bool = False,
        scale_residuals: torch.Tensor | None = None,
    ) -> None:
        self.packed = packed
        self.scales_zeros = scales_zeros
        self.out_features = out_features
        self.in_features = in_features
        self.duplicate_input = duplicate_input
        self.extra_groups = extra_groups
        self.bias = bias
        self.exact_output = exact_output
        self._groups = in_features * (2 if duplicate_input else 1) // GROUP
        pad = extra_groups * GROUP - self._groups
        self._pad = torch.zeros(1, max(pad, 0), device=packed.device)
        width = (self._groups + extra_groups) * GROUP  # inputs before the residual group
        self._width = width
        if exact_output:
            # One row of kernel input: [x | residual group], the group's inputs 0 or e_1.
            self._row = torch.zeros(1, width + GROUP, dtype=INT4_ACT_DTYPE, device=packed.device)
            self._residual_scale = scales_zeros[-1, :, 0]  # the residual group's scales
            self._lock = threading.Lock()  # the row and the scales are per call state
            self._pad_rows = torch.zeros(1, GROUP, device=packed.device)
        # Per group, (scale, zero) minus their bfloat16 values (the kernel's rounding of the
        # weights, the second largest error): a third call on the same codes adds their part.
        self.scale_residuals = scale_residuals

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        if self.duplicate_input:
            x = torch.cat([x, x], dim=-1)
        if self.extra_groups:
            t = x.shape[0]
            sums = x.view(t, self._groups, GROUP).sum(-1)
            x = torch.cat([x, sums, self._pad.expand(t, -1)], dim=-1)
        return x

    def __call__(self, x: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        x = self._inputs(x)
        if self.exact_output and x.shape[0] == 1:
            y = self._exact_row(x)
        else:
            if self.exact_output:  # batched rows: the residual group's inputs are 0
                x = torch.cat([x, self._pad_rows.expand(x.shape[0], -1)], dim=-1)
            y = torch._weight_int4pack_mm_for_cpu(
                x.to(self.scales_zeros.dtype), self.packed, GROUP, self.scales_zeros
            )
        base = add_to
        if self.bias is not None:
            base = self.bias if base is None else base + self.bias
        return y.float() if base is None else base + y

    def _exact_row(self, x: torch.Tensor) -> torch.Tensor:
        mm, sz, row, w = (
            torch._weight_int4pack_mm_for_cpu,
            self.scales_zeros,
            self._row,
            self._width,
        )
        with self._lock:
            row[:, :w].copy_(x)
            y1 = mm(row, self.packed, GROUP, sz)  # residual group inputs 0
            self._residual_scale.copy_(y1.view(-1))  # its weights: -y1 (codes 7, zeros 0)
            row[0, w] = 1.0
            residual = mm(row, self.packed, GROUP, sz)
            row[0, w] = 0.0
            y = y1.float().add_(residual)
            if self.scale_residuals is not None:  # its residual group has scales 0
                y.add_(mm(row, self.packed, GROUP, self.scale_residuals))
        return y

    @property
    def nbytes(self) -> int:
        n = self.packed.nbytes + self.scales_zeros.nbytes
        return n + (0 if self.bias is None else self.bias.nbytes)


def int4_rows(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, correct_zeros: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rows for the kernel: (codes [n, K'], scales_zeros [K'/32, n, 2], extra groups).

    The kernel rounds scales and zeros to bfloat16. For formats with their own per-group
    minimum (Q4_1, Q4_K, Q5_K) the rounded zero costs the most accuracy: its error
    multiplies the sum of the group's inputs. With ``correct_zeros`` the residual
    ``zero - bf16(zero)`` of each of the G groups is itself stored as int4 weights of
    ``ceil(G/32)`` extra groups, whose inputs are the group sums of ``x``; so the kernel
    applies the correction (to ~1/14 of the residual) for ~5% more work.
    """
    dt = INT4_ACT_DTYPE
    n = codes.shape[0]
    zero_b = zero.to(dt)
    extra = 0
    if correct_zeros and dt != torch.float32:
        resid = zero - zero_b.float()
        g = resid.shape[1]
        extra = (g + GROUP - 1) // GROUP
        resid = F.pad(resid, (0, extra * GROUP - g)).view(n, extra, GROUP)
        step = (resid.abs().amax(-1) / 7.0).to(dt).float()
        step = torch.where(step > 0, step, torch.ones_like(step))
        extra_codes = (torch.round(resid / step[..., None]) + 8).clamp_(0, 15)
        codes = torch.cat([codes, extra_codes.to(torch.uint8).view(n, -1)], dim=1)
        scale = torch.cat([scale, step], dim=1)
        zero_b = torch.cat([zero_b, torch.zeros(n, extra, dtype=dt)], dim=1)
    sz = torch.stack([scale.t().to(dt), zero_b.t()], dim=-1)
    return codes, sz, extra


def with_residual_group(
    codes: torch.Tensor, scales_zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append the residual group of ``Int4Linear(exact_output=True)``: codes 7 and zero 0,
    so its weights are ``-scale``, the scale written per call."""
    n = codes.shape[0]
    codes = torch.cat([codes, torch.full((n, GROUP), 7, dtype=codes.dtype)], dim=1)
    tail = torch.zeros(1, n, 2, dtype=scales_zeros.dtype)
    return codes, torch.cat([scales_zeros, tail])


def int4_codes(
    q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, split: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kernel codes, scales and zeros for ``w = q * scale + offset`` (the kernel computes
    ``(code - 8) * scale + zero``).

    With ``split``, codes wider than 4 bits become ``[hi | lo]`` along K,
    ``w = 16 s hi + s lo + o``. Hi codes of formats up to 7 bits are stored as ``8 + hi``
    (so ``code - 8`` is small and the bf16 rounding of scale and zero is not amplified).
    Zeros that are power-of-two multiples of the scale (Q4_0, Q8_0, every lo part) stay
    consistent with the scale after rounding.
    """
    if not split:
        return q, scale, offset + 8.0 * scale
    shift = 8 if bits < 8 else 0  # hi codes of <= 7-bit formats fit in 8..15
    hi = (q >> 4) + shift
    codes = torch.cat([hi, q & 15], dim=1)
    zero = torch.cat([16.0 * (8 - shift) * scale + offset, 8.0 * scale], dim=1)
    return codes, torch.cat([16.0 * scale, scale], dim=1), zero


def int4_compatible(types: list[int], shapes: list[tuple[int, ...]]) -> bool:
    """Whether these fused parts can share one int4 kernel."""
    if not int4_kernel_available():
        return False
    if any(t not in AFFINE_BITS for t in types):
        return False
    return all(len(s) == 2 and s[1] % GROUP == 0 for s in shapes)


class NativeLinear(Linear):
    """Affine integer codes through the engine's own kernel (native.py, csrc/qmm.c).

    ``codes`` [N, kp] or nibble-packed [N, kp / 2] (uint8); ``scale`` and ``offset``
    float16 [N, kp / sub] with ``w = code * scale + offset`` (``offset`` None:
    ``-zero * scale``), K padded to ``kp`` with zero codes and scales. Activations are
    quantised to int8 blocks of 32, products summed in int32 per group and in float32
    across groups (llama.cpp's scheme): no bfloat16 rounding of inputs or outputs.
    """

    def __init__(
        self,
        lib: object,
        layout: NativeLayout | list[NativeLayout],
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        rows: list[int] | None = None,
    ) -> None:
        """``layout``: one, or several (``rows`` each, in order) whose formats sum in
        different orders (qmm.c mvk_weights.next: one product, each part in its own)."""
        self.lib = lib
        self.layouts = layout if isinstance(layout, list) else [layout]
        self.layout = self.layouts[0]
        self.out_features = out_features
        self.in_features = in_features
        self.kp = self.layout.kp
        self.bias = bias
        counts = rows if rows is not None else [out_features]
        if len(counts) != len(self.layouts) or sum(counts) != out_features:
            raise ValueError("native product: the parts' rows do not add up")
        self._chain = [_weights(lay, n) for lay, n in zip(self.layouts, counts, strict=True)]
        for a, b in zip(self._chain, self._chain[1:], strict=False):
            a.next = ctypes.addressof(b)
        self._weights = self._chain[0]
        self._ref = ctypes.byref(self._weights)
        self._call = cast(Any, lib).mvk_linear
        self._call_rows = cast(Any, lib).mvk_linear_rows
        self._norm: torch.Tensor | None = None

    def fuse_norm(self, weight: torch.Tensor, eps: float) -> bool:
        # In C, as ggml computes it (mean of squares in double); one foreign call instead
        # of four torch ops per norm, the decode loop being dispatch-bound.
        self._norm = weight.float().contiguous()
        for w in self._chain:
            w.norm = self._norm.data_ptr()
            w.eps = eps
        return True

    def __call__(
        self,
        x: torch.Tensor,
        add_to: torch.Tensor | None = None,
        row_kinds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``row_kinds`` (uint8 [T], native.segment_kinds): which of llama.cpp's
        row-count-dependent sums each row gets, as its own sequence's product would give
        it; None: as llama.cpp's product of these T rows (qmm.c row_kind)."""
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.float().contiguous()
        t = x.shape[0]
        base = add_to
        if self.bias is not None:
            base = self.bias.view(1, -1) if base is None else base + self.bias
        ld_base = 0
        if base is not None:
            if base.dtype != torch.float32 or base.stride(-1) != 1:
                base = base.float().contiguous()
            ld_base = 0 if base.shape[0] == 1 else base.stride(0)
        y = torch.empty(t, self.out_features)
        args = (
            self._ref,
            x.data_ptr(),
            t,
            self.in_features,
            x.stride(0),
            y.data_ptr(),
            None if base is None else base.data_ptr(),
            ld_base,
        )
        if row_kinds is not None:
            if row_kinds.dtype != torch.uint8 or row_kinds.shape != (t,):
                raise ValueError(f"row_kinds must be uint8 [{t}]")
            kinds = row_kinds.contiguous()  # alive through the call
            rc = self._call_rows(*args, kinds.data_ptr())
        else:
            rc = self._call(*args)
        if rc != 0:
            raise MemoryError("native kernel: no memory for the activation buffer")
        return y

    @property
    def nbytes(self) -> int:
        n = 0
        for lay in self.layouts:
            for name in ("codes", "scale", "offset", "zrow", "ksc", "kmin", "kd", "kdmin", "zg"):
                t = getattr(lay, name)
                n += 0 if t is None else t.nbytes
        return n + (0 if self.bias is None else self.bias.nbytes)


def _weights(layout: NativeLayout, n: int) -> Weights:
    """qmm.c's mvk_weights of one layout of ``n`` rows (the tensors stay the layout's)."""
    w = Weights(
        layout.codes.data_ptr(),
        layout.scale.data_ptr(),
        None if layout.offset is None else layout.offset.data_ptr(),
        n,
        layout.kp,
        int(layout.nibble),
        layout.sub,
        layout.zero,
        layout.mode,
        int(layout.scale.dtype == torch.float32),
        5 if layout.bits5 else 0,  # pad: qmm.c reads 5 as codes in 5 bits
    )
    w.arith = layout.arith
    for name in ("zrow", "ksc", "kmin", "kd", "kdmin", "zg"):
        t = getattr(layout, name)
        if t is not None:
            setattr(w, name, t.data_ptr())
    for i, z in enumerate(layout.zlist):
        w.zlist[i] = z
    w.nz = len(layout.zlist)
    return w


@dataclass(frozen=True)
class NativePart:
    """One matrix as affine groups: ``w = q * scale + offset`` per ``width`` columns;
    ``zero`` is the format's fixed zero code (offset = -zero * scale) or None."""

    q: torch.Tensor  # uint8 [n, K]
    scale: torch.Tensor  # float32 [n, K / width]
    offset: torch.Tensor
    width: int
    zero: int | None
    mode: int  # how activations are quantised for it (native.Q8_*_ACT)
    f16_exact: bool  # its scales and offsets are float16 values (not K-format products)
    kscales: KScales | None = None  # Q4_K / Q6_K: the format's own scales
    repacked: bool = False  # Q4_0 that llama.cpp repacks (8x8) and sums block by block


@dataclass(frozen=True)
class NativeLayout:
    codes: torch.Tensor
    scale: torch.Tensor  # float16, or float32 where a part's scales are not float16 values
    offset: torch.Tensor | None  # as scale; None when every part has the same zero code
    nibble: bool
    sub: int
    zero: int
    mode: int
    kp: int  # K padded (the kernel's row length)
    # native.ARITH_Q0 / ARITH_Q0R: llama.cpp's own float order for Q4_0/Q4_1/Q5_0/Q8_0
    # (qmm.c; Q0R: its repacked Q4_0), with each row's zero code (None: Q4_1's mins);
    # else native.ARITH_GROUPS.
    arith: int = 0
    zrow: torch.Tensor | None = None
    # native.ARITH_Q4K / ARITH_Q6K: the parts' KScales stacked (sc, mins, d, dmin)
    ksc: torch.Tensor | None = None
    kmin: torch.Tensor | None = None
    kd: torch.Tensor | None = None
    kdmin: torch.Tensor | None = None
    # native.ARITH_Q0 with zero codes: each group of 16 rows' index into zlist (its one
    # zero code), or -1 where its rows' zero codes differ
    zg: torch.Tensor | None = None
    zlist: tuple[int, ...] = ()
    # interleaved codes of at most 5 bits kept in 5 bits (qmm.c unpack5)
    bits5: bool = False


# A scale this large would not survive float16 (the kernel's compact scale type).
_F16_MAX = 65504.0


def _interleave16_rows(x: torch.Tensor) -> torch.Tensor:
    """[n, g] per-row values (scales, mins) as qmm.c rows_q0 reads them: [n / 16][g][16],
    n padded with zeros to a multiple of 16."""
    n, g = x.shape
    if n % 16:
        x = F.pad(x, (0, 0, 0, -n % 16))
    return x.view(-1, 16, g).transpose(1, 2).contiguous()


def _interleave16_codes(q: torch.Tensor, nibble: bool) -> torch.Tensor:
    """Codes [n, kp] (uint8, kp a multiple of 32) in qmm.c rows_q0's layout: per group of
    16 rows and block of 32, lane l (4 codes) of the 16 rows as 64 bytes (row r at 4r),
    nibble codes two lanes per 64 bytes (2c low, 2c + 1 high)."""
    n, kp = q.shape
    if n % 16:
        q = F.pad(q, (0, 0, 0, -n % 16))
    # a lane's 4 codes as one int32 (4x fewer elements to move than bytes)
    quads = q.contiguous().view(torch.int32).view(-1, 16, kp // 32, 8)  # [G, r, b, l]
    lanes = quads.permute(0, 2, 3, 1)  # [G, b, l, r]
    if not nibble:
        return lanes.contiguous().view(torch.uint8).view(-1)
    pairs = lanes.reshape(lanes.shape[0], kp // 32, 4, 2, 16)
    # codes below 16: a byte-wise shift by 4 within each int32 carries nothing over
    return (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).contiguous().view(torch.uint8).view(-1)


def _interleaved(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [n, kp] in qmm.c's 16-row interleaved layout, stored in ``bits`` bits (4, 5,
    6 or 8) a code."""
    if bits == 6:
        return _interleave16_codes6(q)
    if bits == 5:
        return _interleave16_codes5(q)
    return _interleave16_codes(q, bits == 4)


def _interleave16_codes5(q: torch.Tensor) -> torch.Tensor:
    """Codes [n, kp] of at most 5 bits as qmm.c unpack5 reads them: per group of 16 rows
    and block of 32, the low nibbles in the nibble layout (256 bytes), then 64 bytes
    whose bit l is lane l's fifth bit."""
    kp = q.shape[1]
    low = _interleave16_codes(q & 15, True).view(-1, kp // 32, 256)
    high = _interleave16_codes(q >> 4, False).view(-1, kp // 32, 8, 64)
    plane = torch.zeros_like(high[:, :, 0])
    for lane in range(8):
        plane |= high[:, :, lane] << lane
    return torch.cat([low, plane], dim=2).reshape(-1)


def _interleave16_codes6(q: torch.Tensor) -> torch.Tensor:
    """Q6_K's codes [n, kp] (0..63) in 6 bits as qmm.c unpack6 reads them: per group of 16
    rows and block of 32, the low nibbles in the nibble layout (256 bytes), then the high
    2 bits of lanes 4h..4h+3 in bits 2i, 2i+1 of vector h's bytes (128 bytes)."""
    kp = q.shape[1]
    low = _interleave16_codes(q & 15, True).view(-1, kp // 32, 256)
    high = _interleave16_codes(q >> 4, False).view(-1, kp // 32, 2, 4, 64)
    packed = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4)
    packed = packed | (high[:, :, :, 3] << 6)
    return torch.cat([low, packed.reshape(-1, kp // 32, 128)], dim=2).reshape(-1)


def native_layout(
    parts: list[NativePart], bits: int, llamacpp_order: bool = False
) -> NativeLayout | None:
    """Stack parts into the native kernel's layout, or None where it cannot hold them
    exactly enough (scales outside float16's range). Groups are 16 wide if any part's
    are (Q6_K), else 32; codes go two per byte if the widest (``bits``) fits in 4 bits."""
    sub = min(p.width for p in parts)
    nibble = bits <= 4
    zeros = {p.zero for p in parts}
    zero = next(iter(zeros)) if len(zeros) == 1 else None
    dtype = torch.float16 if all(p.f16_exact for p in parts) else torch.float32
    k = parts[0].q.shape[1]
    # One activation quantisation per product: a fusion of formats with different ones
    # takes the first part's (Q8_K's 256-blocks only where K allows).
    mode = parts[0].mode
    if mode == 2 and k % 256:
        mode = 0
    # llamacpp_order: sum in llama.cpp's own float order where the formats allow it
    # (native.ARITH_*; see qmm.c), else group by group. Q4_0/Q4_1/Q5_0/Q8_0 then go into
    # qmm.c rows_q0's 16-row interleaved layout, K padded only to whole blocks.
    q0_modes = {native.Q8_0_ACT, native.Q8_1_ACT}
    q0 = (
        llamacpp_order
        and {p.mode for p in parts} <= q0_modes
        and len({p.mode for p in parts}) == 1
        and all(p.width == 32 and p.f16_exact for p in parts)
        and len({p.zero is None for p in parts}) == 1
    )
    # Q4_K likewise (qmm.c q4k_tile): its codes and own scales interleaved by 16 rows.
    ks = [p.kscales for p in parts]
    q4k = (
        llamacpp_order
        and k % 256 == 0
        and nibble
        and sub == 32
        and all(x is not None and x.mins is not None for x in ks)
    )
    q6k = (
        llamacpp_order
        and k % 256 == 0
        and not nibble
        and sub == 16
        and all(x is not None and x.mins is None for x in ks)
    )
    # Q5_K (qmm.c q5k_tile): byte codes interleaved as Q8_0's, its own scales as Q4_K's
    q5k = (
        llamacpp_order
        and k % 256 == 0
        and not nibble
        and sub == 32
        and all(x is not None and x.mins is not None for x in ks)
    )
    interleaved = q0 or q4k or q5k or q6k
    k_own = q4k or q5k or q6k
    align = 32 if interleaved else 128 if nibble else 64
    kp = (k + align - 1) // align * align
    codes, scales, offsets = [], [], []
    for p in parts:
        q, s, o = p.q, p.scale, p.offset
        big = max(float(s.abs().max()), float(o.abs().max())) if s.numel() else 0.0
        if dtype == torch.float16 and big > _F16_MAX:
            return None
        if p.width != sub:
            rep = p.width // sub
            s, o = s.repeat_interleave(rep, dim=1), o.repeat_interleave(rep, dim=1)
        if kp != k:
            q = F.pad(q, (0, kp - k))
            s = F.pad(s, (0, (kp - k) // sub))
            o = F.pad(o, (0, (kp - k) // sub))
        if nibble and not interleaved:
            c = q.reshape(q.shape[0], kp // 128, 2, 64)
            q = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(q.shape[0], kp // 2)
        codes.append(q.contiguous())
        if not k_own:
            scales.append(s.to(dtype))
            offsets.append(o.to(dtype))
    if k_own:
        # the K formats' own integer arithmetic reads their own scales (ksc, kd, ...)
        # only: no per-group float scales are kept (Gemma's Q6_K head: 40 MiB less)
        scales = offsets = [torch.empty(0, dtype=dtype)]
    arith, zrow, zg, zlist = native.ARITH_GROUPS, None, None, []
    if q0:
        # llama.cpp's repacked Q4_0 sums per block (qmm.c MVK_ARITH_Q0R)
        arith = native.ARITH_Q0R if all(p.repacked for p in parts) else native.ARITH_Q0
        if parts[0].zero is not None:
            zrow = torch.cat(
                [torch.full((p.q.shape[0],), int(p.zero or 0), dtype=torch.uint8) for p in parts]
            )
            zrow = F.pad(zrow, (0, -zrow.shape[0] % 16))
            # groups of one zero code start from its term (qmm.c mvk_job.corr)
            groups = zrow.view(-1, 16).to(torch.int16)
            uniform = (groups == groups[:, :1]).all(dim=1)
            zlist = sorted({int(z) for z in groups[uniform, 0].tolist()})[:4]
            zg = torch.full((groups.shape[0],), -1, dtype=torch.int8)
            for i, z in enumerate(zlist):
                zg[uniform & (groups[:, 0] == z)] = i
        scales = [_interleave16_rows(torch.cat(scales))]
        offsets = [_interleave16_rows(torch.cat(offsets))]
    # codes of at most 5 bits (Q5_0, Q5_1, Q5_K) in 5 bits: 5/8 of the bytes
    bits5 = interleaved and bits == 5 and not nibble and not q6k
    if interleaved:
        codes = [_interleaved(torch.cat(codes), 6 if q6k else 5 if bits5 else 4 if nibble else 8)]
    kfields: dict[str, torch.Tensor | None] = {}
    kss = [x for x in ks if x is not None]
    if q4k or q5k:
        arith = native.ARITH_Q4K if q4k else native.ARITH_Q5K
        kfields["ksc"] = _interleave16_rows(torch.cat([x.sc for x in kss]))
        kfields["kmin"] = _interleave16_rows(torch.cat([x.mins for x in kss if x.mins is not None]))
        kfields["kd"] = _interleave16_rows(torch.cat([x.d for x in kss]).float())
        kfields["kdmin"] = _interleave16_rows(
            torch.cat([x.dmin for x in kss if x.dmin is not None]).float()
        )
    elif q6k:
        arith = native.ARITH_Q6K
        kfields["ksc"] = _interleave16_rows(torch.cat([x.sc for x in kss]))
        kfields["kd"] = _interleave16_rows(torch.cat([x.d for x in kss]).float())
    return NativeLayout(
        **kfields,
        codes=torch.cat(codes),
        scale=torch.cat(scales).contiguous(),
        offset=None if zero is not None else torch.cat(offsets).contiguous(),
        nibble=nibble,
        sub=sub,
        zero=zero or 0,
        mode=mode,
        kp=kp,
        arith=arith,
        zrow=zrow,
        zg=zg,
        zlist=tuple(zlist),
        bits5=bits5,
    )


class BlocksLayout:
    """The layout ``native_layout`` builds in llama.cpp's order for Q4_K, Q5_K, Q6_K,
    Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 matrices (``ggml_type``; a Q4_0 ``repacked`` or not)
    of ``rows`` rows in all (a multiple of 16) and ``k`` inputs (a multiple of 256 for the
    K formats, of 32 for the others), field for field the same, filled straight from their
    GGUF blocks in C (qmm.c mvk_build_q4k / _q5k / _q6k / _q0): each ``fill`` writes its
    rows' place in tensors allocated once, so a load holds no chunk beside the matrix, and
    fills of different rows may run on different threads at once (ctypes lets go of the
    interpreter). ``types``: a fused run's formats where they are several of one vec_dot
    family (Q5_0 with Q8_0, Q4_1 with Q5_1: ``joins``), each fill naming its own; the
    codes are then in the widest one's bits and, where their zero codes differ, each
    row's zero code and offsets are kept as native_layout keeps them."""

    BLOCK_BYTES = {
        Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210), Q4_0: (32, 18),
        Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    }  # fmt: skip
    # the vec_dot formats: (mvk_build_q0's src, code bits, zero code or None for a min,
    # activation quantisation)
    _Q0 = {
        Q4_0: (0, 4, 8, native.Q8_0_ACT), Q8_0: (1, 8, 128, native.Q8_0_ACT),
        Q5_0: (2, 5, 16, native.Q8_0_ACT), Q4_1: (3, 4, None, native.Q8_1_ACT),
        Q5_1: (4, 5, None, native.Q8_1_ACT),
    }  # fmt: skip
    _PIECE = {4: 256, 5: 320, 8: 512}

    @classmethod
    def joins(cls, types: Sequence[int]) -> bool:
        """Whether matrices of these formats make one layout here: one format, or vec_dot
        formats of one activation quantisation (as native_layout's q0 layout)."""
        kinds = set(types)
        if len(kinds) == 1:
            return next(iter(kinds)) in cls.BLOCK_BYTES
        return kinds <= cls._Q0.keys() and len({cls._Q0[t][3] for t in kinds}) == 1

    def __init__(
        self,
        lib: ctypes.CDLL,
        ggml_type: int,
        rows: int,
        k: int,
        repacked: bool = False,
        types: Sequence[int] = (),
    ) -> None:
        types = tuple(types) or (ggml_type,)
        if ggml_type not in types or not self.joins(types):
            raise ValueError(f"formats {sorted(set(types))} do not make one layout")
        per = max(self.BLOCK_BYTES[t][0] for t in types)
        if rows % 16 or k % per or rows <= 0 or k <= 0:
            raise ValueError(f"a {rows} x {k} layout of type {ggml_type} needs 16-row groups")
        self.lib, self.type, self.rows, self.k, self.repacked = lib, ggml_type, rows, k, repacked
        self.types = types
        self.q6k = ggml_type == Q6_K
        g, nb, ns = rows // 16, k // 256, k // 32
        self.refused = False  # vec_dot formats: a scale or offset beyond float16's range
        if ggml_type in self._Q0:
            zeros = {self._Q0[t][2] for t in types}
            self.bits = max(self._Q0[t][1] for t in types)
            self.zero = next(iter(zeros)) if len(zeros) == 1 else None
            self.codes = torch.empty(g * ns * self._PIECE[self.bits], dtype=torch.uint8)
            self.scale = torch.empty(g, ns, 16, dtype=torch.float16)
            # offsets: Q4_1/Q5_1's mins, or -zero x scale where the zero codes differ
            self.offset = None if self.zero is not None else torch.empty_like(self.scale)
            # each row's zero code (Q4_1, Q5_1: none)
            self.zrow = None if None in zeros else torch.empty(rows, dtype=torch.uint8)
            return
        self.kd = torch.empty(g, nb, 16, dtype=torch.float32)
        if self.q6k:
            self.codes = torch.empty(g * ns * 384, dtype=torch.uint8)
            self.ksc = torch.empty(g, k // 16, 16, dtype=torch.int8)
        else:
            self.codes = torch.empty(
                g * ns * (256 if ggml_type == Q4_K else 320), dtype=torch.uint8
            )
            self.ksc = torch.empty(g, ns, 16, dtype=torch.uint8)
            self.kmin = torch.empty(g, ns, 16, dtype=torch.uint8)
            self.kdmin = torch.empty(g, nb, 16, dtype=torch.float32)

    def fill(
        self,
        raw: torch.Tensor,
        row0: int,
        n: int,
        d_scale: float = 1.0,
        ggml_type: int | None = None,
    ) -> None:
        """Rows ``[row0, row0 + n)`` (whole 16-row groups) from their blocks ``raw`` (of
        ``ggml_type``, one of the layout's ``types``; default the layout's own);
        ``d_scale`` (a power of two) multiplies each block's scales as native_layout does
        (K formats: d and dmin in float32; the vec_dot formats: d and m, then rounded to
        float16)."""
        t = self.type if ggml_type is None else ggml_type
        if t not in self.types:
            raise ValueError(f"type {t} is not one of this layout's {list(self.types)}")
        per, size = self.BLOCK_BYTES[t]
        k = self.k
        if row0 % 16 or n % 16 or n <= 0 or row0 + n > self.rows:
            raise ValueError(f"rows [{row0}, {row0 + n}) of {self.rows} are not whole groups")
        if raw.numel() != n * (k // per) * size or raw.dtype != torch.uint8:
            raise ValueError(f"{n} x {k} blocks of type {t} do not fit {raw.numel()} bytes")
        # A load runs under inference mode, which is per thread: a fill on a pool thread
        # updates the tensors made under it in that mode too.
        with torch.inference_mode():
            self._fill(raw.contiguous(), row0, n, d_scale, t)

    def _fill(self, raw: torch.Tensor, row0: int, n: int, d_scale: float, t: int) -> None:
        k = self.k
        g0, g1 = row0 // 16, (row0 + n) // 16
        codes = self.codes.view(self.rows // 16, -1)[g0:g1]
        if t in self._Q0:
            self._fill_q0(raw, codes, row0, n, d_scale, t)
            return
        if self.q6k:
            self.lib.mvk_build_q6k(
                raw.data_ptr(), n, k, codes.data_ptr(), self.ksc[g0:g1].data_ptr(),
                self.kd[g0:g1].data_ptr(),
            )  # fmt: skip
        else:
            build = self.lib.mvk_build_q4k if t == Q4_K else self.lib.mvk_build_q5k
            build(
                raw.data_ptr(), n, k, codes.data_ptr(), self.ksc[g0:g1].data_ptr(),
                self.kmin[g0:g1].data_ptr(), self.kd[g0:g1].data_ptr(),
                self.kdmin[g0:g1].data_ptr(),
            )  # fmt: skip
        if d_scale != 1.0:
            self.kd[g0:g1] *= d_scale
            if not self.q6k:
                self.kdmin[g0:g1] *= d_scale

    def _fill_q0(
        self, raw: torch.Tensor, codes: torch.Tensor, row0: int, n: int, d_scale: float, t: int
    ) -> None:
        g0, g1 = row0 // 16, (row0 + n) // 16
        src, _, zero, _ = self._Q0[t]
        scale = self.scale[g0:g1]
        offset = None if self.offset is None else self.offset[g0:g1]
        mins = offset if zero is None else None
        self.lib.mvk_build_q0(
            raw.data_ptr(), n, self.k, src, self.bits, codes.data_ptr(), scale.data_ptr(),
            None if mins is None else mins.data_ptr(),
        )  # fmt: skip
        if self.zrow is not None:
            self.zrow[row0 : row0 + n] = zero or 0
        # native_layout's float32 scale and offset (a min, or -zero x scale), then float16
        d = scale.float()
        s = d * d_scale
        o = (mins.float() if mins is not None else d * -float(zero or 0)) * d_scale
        scale.copy_(s.to(torch.float16))
        if offset is not None:
            offset.copy_(o.to(torch.float16))
        # native_layout refuses a chunk whose scales or offsets pass float16's range (as
        # it computes it: a NaN max is not refused)
        big = max(float(s.abs().max()), float(o.abs().max()))
        self.refused = self.refused or big > _F16_MAX

    def layout(self) -> NativeLayout | None:
        """The filled layout; None where native_layout refuses it (a vec_dot format's
        scale or offset beyond float16's range)."""
        empty = torch.empty(0, dtype=torch.float32)
        if self.type in self._Q0:
            if self.refused:
                return None
            zrow, zg = self.zrow, None
            zlist: tuple[int, ...] = ()
            if zrow is not None:
                # as native_layout: groups of one zero code start from its term
                groups = zrow.view(-1, 16).to(torch.int16)
                uniform = (groups == groups[:, :1]).all(dim=1)
                zlist = tuple(sorted({int(z) for z in groups[uniform, 0].tolist()})[:4])
                zg = torch.full((groups.shape[0],), -1, dtype=torch.int8)
                for i, z in enumerate(zlist):
                    zg[uniform & (groups[:, 0] == z)] = i
            return NativeLayout(
                codes=self.codes, scale=self.scale, offset=self.offset, nibble=self.bits == 4,
                sub=32, zero=self.zero or 0, mode=self._Q0[self.type][3], kp=self.k,
                arith=native.ARITH_Q0R if self.repacked else native.ARITH_Q0,
                zrow=zrow, zg=zg, zlist=zlist, bits5=self.bits == 5,
            )  # fmt: skip
        if self.q6k:
            return NativeLayout(
                codes=self.codes, scale=empty, offset=None, nibble=False, sub=16, zero=32,
                mode=native.Q8_K_ACT, kp=self.k, arith=native.ARITH_Q6K, ksc=self.ksc,
                kd=self.kd,
            )  # fmt: skip
        q4k = self.type == Q4_K
        return NativeLayout(
            codes=self.codes, scale=empty, offset=empty.clone(), nibble=q4k, sub=32, zero=0,
            mode=native.Q8_K_ACT, kp=self.k, arith=native.ARITH_Q4K if q4k else native.ARITH_Q5K,
            ksc=self.ksc, kmin=self.kmin, kd=self.kd, kdmin=self.kdmin, bits5=not q4k,
        )  # fmt: skip


def layout_from_blocks(
    lib: ctypes.CDLL, raw: torch.Tensor, ggml_type: int, n: int, k: int, d_scale: float = 1.0
) -> NativeLayout | None:
    """One matrix's BlocksLayout, filled whole."""
    built = BlocksLayout(lib, ggml_type, n, k)
    built.fill(raw, 0, n, d_scale)
    return built.layout()


# NativeLayout's tensor fields, all of them: one row (or 16-row group) of each per row.
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(NativeLayout) if "Tensor" in str(f.type))


def _same_kind(a: NativeLayout, b: NativeLayout) -> bool:
    """Whether two layouts of row chunks can be one layout's pieces."""
    if (a.nibble, a.sub, a.zero, a.mode, a.kp, a.arith, a.zlist, a.bits5) != (
        b.nibble,
        b.sub,
        b.zero,
        b.mode,
        b.kp,
        b.arith,
        b.zlist,
        b.bits5,
    ):
        return False
    for name in _ROW_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        if (x is None) != (y is None):
            return False
        if x is not None and (x.dtype != y.dtype or x.shape[1:] != y.shape[1:]):
            return False
    return True


class LayoutJoiner:
    """Layouts of consecutive row chunks (each a whole number of 16-row groups, ``rows``
    in all) joined into one as they come: each row field's final tensor is allocated from
    the first chunk and each chunk copied into its place, so a load holds the matrix's
    layout and one chunk's, never every chunk beside the whole."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.done = 0
        self.first: NativeLayout | None = None
        self.out: dict[str, torch.Tensor | None] = {}
        self.ok = True

    def add(self, chunk: NativeLayout, rows: int) -> None:
        if not self.ok:
            return
        if self.first is None:
            self.first = chunk
            for name in _ROW_FIELDS:
                t = getattr(chunk, name)
                if t is None or t.numel() == 0:
                    self.out[name] = t
                    continue
                if (t.shape[0] * self.rows) % rows:
                    self.ok = False
                    return
                size = (t.shape[0] * self.rows // rows, *t.shape[1:])
                self.out[name] = torch.empty(size, dtype=t.dtype)
        elif not _same_kind(self.first, chunk):
            self.ok = False
            return
        for name in _ROW_FIELDS:
            t, dst = getattr(chunk, name), self.out[name]
            if t is None or dst is None or t.numel() == 0:
                continue
            n = t.shape[0]
            at = dst.shape[0] * self.done // self.rows
            if at + n > dst.shape[0]:
                self.ok = False
                return
            dst[at : at + n] = t
        self.done += rows

    def layout(self) -> NativeLayout | None:
        """The joined layout; None where the chunks were not one layout's pieces."""
        first = self.first
        if not self.ok or first is None or self.done != self.rows:
            return None
        return dataclasses.replace(first, **self.out)  # type: ignore[arg-type]
