"""Turn one stage's GGUF tensors into kernel-ready weights.

Only the tensors a stage needs are touched (the file records each one it hands out).
Matrices that are used together are fused (q|k|v, gate|up) so a layer makes fewer
kernel calls. For llama-family files the q/k rows are permuted from the adjacent-pair
rope layout back to the half-split one, so a single rope implementation serves all
architectures (attention scores are unchanged: q and k get the same permutation).
"""

from __future__ import annotations

import ctypes
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from . import native
from .arch_table import traits_of
from .config import ArchConfig
from .gguf_reader import GGUFError, GGUFFile
from .kernels import (
    BlocksLayout,
    DenseLinear,
    Int4Linear,
    LayoutJoiner,
    Linear,
    NativeLayout,
    NativeLinear,
    NativePart,
    QuantLinear,
    QuantPart,
    int4_codes,
    int4_compatible,
    int4_rows,
    native_layout,
    pack_int4,
    row_blocks_pack_independently,
    with_residual_group,
)
from .layout_cache import LayoutCache, layout_key, tensor_digest
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
    SUPPORTED_TYPES,
    KScales,
    affine_groups,
    as_torch_bytes,
    dequantize,
    dequantize_rows,
    k_scales,
    q6_k_groups,
)

# Rows converted per step: bounds the temporary memory of large matrices (the head).
_CHUNK_ROWS = 4096
# A native layout's chunk: this many weights (rows x inputs), in whole 16-row groups, so
# that a matrix of few rows and many inputs (a down projection: 4,096 x 14,336) is built
# in pieces too; its temporaries are several times its codes.
_CHUNK_WEIGHTS = 4096 * 2048


R = TypeVar("R")


def _parallel_chunks(k: int) -> tuple[int, int]:
    """The threads that convert a matrix of ``k`` inputs (the stage's kernel count) and
    the rows of each's chunk: 1/threads of a serial chunk, so that the chunks in
    conversion together hold one serial chunk's temporaries."""
    workers = max(1, native.threads())
    return workers, max(16, native_chunk_rows(k) // workers // 16 * 16)


def _in_order(fn: Callable[..., R], spans: Sequence[tuple[Any, ...]], workers: int) -> Iterator[R]:
    """``fn(*span)`` for each span, results in order: on ``workers`` threads, at most that
    many spans at once (one thread: here, one after another). A failure is raised where
    its result would have come; later spans are not started."""
    if workers <= 1:
        for span in spans:
            yield fn(*span)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="mvp-layout") as pool:
        window: deque[Future[R]] = deque()
        try:
            for span in spans:
                window.append(pool.submit(fn, *span))
                if len(window) >= workers:
                    yield window.popleft().result()
            while window:
                yield window.popleft().result()
        finally:
            for pending in window:
                pending.cancel()


def native_chunk_rows(k: int) -> int:
    """Rows of one chunk of a native layout's build, for ``k`` inputs (a multiple of 16)."""
    return min(_CHUNK_ROWS, max(16, _CHUNK_WEIGHTS // max(k, 1) // 16 * 16))


# Native layouts built from their blocks in C (_blocks_direct: every format _NATIVE
# holds); False: through their decoded codes in torch (the tests compare the two).
BLOCKS_DIRECT = True
# Native layouts built chunk by chunk and joined (WeightBuilder._run_layout); False: a
# matrix's layout built whole (the tests compare the two).
CHUNKED_LAYOUTS = True
# Formats with a separate minimum per group: their zeros get the bf16 residual correction.
_WITH_MINS = frozenset({Q4_1, Q5_1, Q4_K, Q5_K})
# Zero correction for those formats (kernels.int4_rows). Off by default: on SmolLM2 Q4_1 it
# did not change the logit error measurably (mean max|diff| vs float32 0.280 -> 0.276) and
# costs ~9% decode speed; it lowers a single matmul's error by ~15-25% for Q4_K/Q5_K.
CORRECT_ZEROS = False
# precision "exact": single-row products (decode) of the layers' int4 matrices come out
# exact in float32 instead of rounded to bfloat16 (kernels.Int4Linear: exact_output,
# scale_residuals). The kernel's output and scale rounding were the compact path's losses
# against llama.cpp's greedy text (tests/node/engine/test_hf_reference.py: 372 of llama.cpp's
# 512 reference tokens kept, HF float32 341). Cost: three kernel calls per decode product
# instead of one, ~0.45x decode tok/s (paired runs, 1 thread 52 -> 25, 2 threads 83 -> 33);
# prefill unchanged. Hence opt-in (DECISIONS 42). "default" runs the native kernel where it
# is built (_native, DECISIONS 43: 400 of the 512 tokens), else the single bfloat16 call
# and the head's float32 refinement of its best logits (model.REFINE_TOP) only (334).
CORRECT_SCALES = True
PRECISIONS = ("default", "exact", "float32")
# On CUDA the default precision keeps quantised matrices in their GGUF bytes on the device
# and dequantises QUANT_CHUNK_ROWS rows at a time for each product (kernels.QuantLinear):
# device memory about the file's bytes instead of a float16 copy (3x a Q4_K_M's). The
# chunk bounds the scratch: 1024 rows of 14336 inputs are 59 MB of float32. Off: float16
# copies (DenseLinear), faster per token and 3-4x the memory. DEVICE_QUANT_ON_CPU runs the
# same path on the CPU (the tests: no GPU here).
DEVICE_QUANT = True
DEVICE_QUANT_ON_CPU = False
QUANT_CHUNK_ROWS = 1024
# Formats the native kernel runs: (code bits, fixed zero code or None for a min per group,
# llama.cpp's activation quantisation for it, whether its scales are float16 values).
_NATIVE: dict[int, tuple[int, int | None, int, bool]] = {
    Q4_0: (4, 8, native.Q8_0_ACT, True),
    Q5_0: (5, 16, native.Q8_0_ACT, True),
    Q8_0: (8, 128, native.Q8_0_ACT, True),
    Q4_1: (4, None, native.Q8_1_ACT, True),
    Q5_1: (5, None, native.Q8_1_ACT, True),
    Q4_K: (4, None, native.Q8_K_ACT, False),
    Q5_K: (5, None, native.Q8_K_ACT, False),
    Q6_K: (6, 32, native.Q8_K_ACT, False),
}
_HEAD_TENSORS = frozenset({"output.weight", "token_embd.weight"})


@dataclass(frozen=True)
class Part:
    """One GGUF matrix inside a fused weight, with an optional row permutation and a
    factor folded into its rows (the attention scale goes into q this way)."""

    name: str
    perm: torch.Tensor | None = None
    row_scale: float = 1.0


class WeightBuilder:
    """Builds linears and vectors for one precision mode and device."""

    def __init__(
        self,
        f: GGUFFile,
        precision: str,
        device: torch.device,
        cache: LayoutCache | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; use {', '.join(PRECISIONS)}")
        self.f = f
        self.precision = precision
        # Products summed in llama.cpp's own float order (kernels.native_layout): Gemma 3's
        # default path, measured to hold llama.cpp's greedy text better that way (365 of
        # 512 reference tokens against 286 group by group, docs/models.md). SmolLM2's
        # keeps the group order, which measured better for it (400 against 314-369): its
        # remaining differences from ggml (silu, rope) are not all matched yet.
        traits = traits_of(f.architecture)
        self.llamacpp_order = (
            precision == "default" and traits is not None and traits.llamacpp_order
        )
        self.device = device
        # The native layouts cached on this host's disk (layout_cache.py), keyed in part
        # by the model files' identity, read once.
        self.cache = cache
        self._files = list(f.identities)

    def _info(self, name: str) -> tuple[int, tuple[int, ...]]:
        if name not in self.f.tensors:
            raise GGUFError(f"{self.f.path}: missing tensor {name}")
        info = self.f.tensors[name]
        if self.f.on_tensor is not None:  # a layout from the cache never reads raw()
            self.f.on_tensor(name)
        if info.ggml_type not in SUPPORTED_TYPES:
            raise GGUFError(f"{self.f.path}: tensor {name} has unsupported type {info.type_name}")
        return info.ggml_type, info.shape

    def raw(self, name: str) -> torch.Tensor:
        return as_torch_bytes(self.f.raw(name))

    def vector(self, name: str) -> torch.Tensor:
        """A float32 vector (norm weights, biases)."""
        t, shape = self._info(name)
        return dequantize(self.raw(name), t, shape).clone().to(self.device)

    def optional_vector(self, name: str) -> torch.Tensor | None:
        return self.vector(name) if name in self.f.tensors else None

    def linear(self, parts: list[Part], biases: list[str] | None = None) -> Linear:
        types, shapes = zip(*(self._info(p.name) for p in parts), strict=True)
        k = shapes[0][1]
        if any(len(s) != 2 or s[1] != k for s in shapes):
            raise GGUFError(
                f"{self.f.path}: cannot fuse {[p.name for p in parts]}: shapes {shapes}"
            )
        bias = None
        if biases is not None:
            vecs = [self.vector(b) for b in biases]
            bias = torch.cat(
                [
                    (v if p.perm is None else v[p.perm]) * p.row_scale
                    for v, p in zip(vecs, parts, strict=True)
                ]
            )
        native_lin = self._native(parts, list(types), list(shapes), bias)
        if native_lin is not None:
            return native_lin
        use_int4 = (
            self.precision in ("default", "exact")
            and self.device.type == "cpu"
            and int4_compatible(list(types), list(shapes))
        )
        if use_int4:
            lin: Linear = self._int4(parts, list(shapes), max(_bits(t) for t in types), bias)
        elif self._keeps_quantised(list(types)):
            lin = self._quant(parts, list(shapes), bias)
        else:
            lin = self._dense(parts, list(shapes), bias)
        plain = (
            len(parts) == 1 and parts[0].perm is None and parts[0].row_scale == 1.0 and not biases
        )
        if plain and not (isinstance(lin, DenseLinear) and lin.weight.dtype == torch.float32):
            raw, shape, device = self.raw(parts[0].name), shapes[0], self.device
            lin.exact_rows = lambda ids: dequantize_rows(raw, types[0], shape, ids.cpu()).to(device)
        return lin

    def _native(
        self,
        parts: list[Part],
        types: list[int],
        shapes: list[tuple[int, ...]],
        bias: torch.Tensor | None,
    ) -> NativeLinear | None:
        """The default path on CPU: the engine's own kernel (native.py), where it is built
        and holds these formats; None otherwise (torch's kernels then)."""
        if self.precision != "default" or self.device.type != "cpu":
            return None
        if any(t not in _NATIVE for t in types) or any(len(s) != 2 for s in shapes):
            return None
        lib = native.library()
        if lib is None:
            return None
        k = shapes[0][1]
        n_total = sum(s[0] for s in shapes)
        key = None
        if self.cache is not None:
            key = layout_key(self._files, self._layout_what(parts, types))
            cached = self.cache.get(key)
            if cached is not None:
                self.f.materialized.update(p.name for p in parts)
                return NativeLinear(lib, cached[0], n_total, k, bias, cached[1])
        # Parts whose formats llama.cpp sums in different orders (a Q4_K_M q/k/v: Q4_K q
        # and k, Q6_K v) become consecutive parts of one product, each its own layout.
        runs: list[tuple[tuple[object, ...], list[tuple[Part, tuple[int, ...], int, bool]]]] = []
        for part, shape, t in zip(parts, shapes, types, strict=True):
            repacked = t == Q4_0 and self.llamacpp_order and shape[0] % 8 == 0
            family = _family(t, repacked) if self.llamacpp_order else ()
            if not runs or runs[-1][0] != family:
                runs.append((family, []))
            runs[-1][1].append((part, shape, t, repacked))
        layouts = []
        for _, members in runs:
            layout = self._run_layout(members, k)
            if layout is None:
                return None
            layouts.append(layout)
        rows = [sum(shape[0] for _, shape, _, _ in members) for _, members in runs]
        if self.cache is not None and key is not None:
            # Stored, then used from the file: the built copies are freed, and the pages
            # are the page cache's, shared with the host's other nodes of these layers.
            self.cache.put(key, layouts, rows)
            mapped = self.cache.reopen(key)
            if mapped is not None:
                layouts, rows = mapped
        return NativeLinear(lib, layouts, n_total, k, bias, rows)

    def _run_layout(
        self, members: list[tuple[Part, tuple[int, ...], int, bool]], k: int
    ) -> NativeLayout | None:
        """One layout of consecutive parts (one summation order), or None where the kernel
        cannot hold them exactly. Built a row chunk at a time and the chunks joined, where
        the layout's rows are independent (whole 16-row groups, one zero code, one kind
        of scale): the conversion's temporaries are then a chunk's, not the matrix's
        several times over (a 128k-row head's were over a gigabyte)."""
        bits = max(_NATIVE[t][0] for _, _, t, _ in members)

        def pieces() -> Iterator[NativePart]:
            for part, shape, t, repacked in members:
                yield from self._native_pieces(part, shape, t, k, repacked)

        by_chunks = (
            CHUNKED_LAYOUTS
            and native_chunk_rows(k) % 16 == 0
            and all(shape[0] % 16 == 0 for _, shape, _, _ in members)
            and len({_NATIVE[t][1:] for _, _, t, _ in members}) == 1
            and len({_pow2(p.row_scale) for p, _, _, _ in members}) == 1
        )
        direct = self._direct_layout(members, k)
        if direct is not None:
            return direct
        if not by_chunks:
            return native_layout(list(pieces()), bits, self.llamacpp_order)
        joiner = LayoutJoiner(sum(shape[0] for _, shape, _, _ in members))
        for layout, rows in self._chunk_layouts(members, k, bits):
            if layout is None:
                return None
            joiner.add(layout, rows)
        joined = joiner.layout()
        if joined is None:  # chunks that do not join (cannot happen for the above)
            return native_layout(list(pieces()), bits, self.llamacpp_order)
        return joined

    def _chunk_layouts(
        self, members: list[tuple[Part, tuple[int, ...], int, bool]], k: int, bits: int
    ) -> Iterator[tuple[NativeLayout | None, int]]:
        """Each row chunk's layout and rows, in order, built by as many threads as the
        stage's kernel runs (its pool idles while loading; torch's ops let go of the
        interpreter): that many chunks, each 1/threads of a serial one, in conversion at
        once; each chunk's file pages released once it is converted."""
        workers, step = _parallel_chunks(k)

        def convert(
            part: Part, t: int, repacked: bool, r: int, n: int, raw: torch.Tensor
        ) -> tuple[NativeLayout | None, int]:
            try:
                piece = native_piece(part, t, k, repacked, n, raw)
                return native_layout([piece], bits, self.llamacpp_order), n
            finally:
                self.f.release_range(part.name, r * (raw.numel() // n), raw.numel())

        spans = [
            (part, t, repacked, r, n, raw)
            for part, shape, t, repacked in members
            for r, n, raw in self._chunk_spans(part, shape, step)
        ]
        yield from _in_order(convert, spans, workers)

    def _direct_layout(
        self, members: list[tuple[Part, tuple[int, ...], int, bool]], k: int
    ) -> NativeLayout | None:
        """A run of matrices' layout filled straight from their blocks in C
        (kernels.BlocksLayout), chunk by chunk by the stage's threads: one format of those
        the native kernel holds, or vec_dot formats of one family (a Gemma q/k/v of Q5_0
        and Q8_0); None where the run is not one for it (WeightBuilder._blocks_direct) or
        native_layout would refuse it."""
        types = [t for _, _, t, _ in members]
        if not BlocksLayout.joins(types) or not all(
            self._blocks_direct(part, t, k, shape[0]) for part, shape, t, _ in members
        ):
            return None
        lib = native.library()
        assert lib is not None  # _native checked it
        repacked = members[0][3]
        rows = sum(shape[0] for _, shape, _, _ in members)
        out = BlocksLayout(lib, types[0], rows, k, repacked, types)
        workers, step = _parallel_chunks(k)

        def fill(part: Part, t: int, row0: int, r: int, n: int, raw: torch.Tensor) -> None:
            try:
                out.fill(raw, row0 + r, n, part.row_scale, t)
            finally:
                self.f.release_range(part.name, r * (raw.numel() // n), raw.numel())

        spans, row0 = [], 0
        for part, shape, t, _ in members:
            spans += [
                (part, t, row0, r, n, raw) for r, n, raw in self._chunk_spans(part, shape, step)
            ]
            row0 += shape[0]
        for _ in _in_order(fill, spans, workers):
            pass
        # None: refused as native_layout would (its path then says so again)
        return out.layout()

    def _blocks_direct(self, part: Part, t: int, k: int, n: int) -> bool:
        """Whether a matrix's layout comes straight from its GGUF blocks (qmm.c
        mvk_build_*): a format the native kernel holds (kernels.BlocksLayout) in llama.cpp's
        order, rows in file order, a power-of-two row scale."""
        return (
            BLOCKS_DIRECT
            and self.llamacpp_order
            and t in BlocksLayout.BLOCK_BYTES
            and part.perm is None
            and _pow2(part.row_scale)
            and k % BlocksLayout.BLOCK_BYTES[t][0] == 0
            and n % 16 == 0
        )

    def _layout_what(self, parts: list[Part], types: list[int]) -> dict[str, object]:
        """What a product's layouts are made of, for their cache key (layout_cache.py)."""
        return {
            "parts": [
                [
                    p.name,
                    t,
                    list(self.f.tensors[p.name].shape),
                    self.f.tensors[p.name].part,
                    self.f.tensors[p.name].offset,
                    tensor_digest(p.perm),
                    p.row_scale.hex(),
                ]
                for p, t in zip(parts, types, strict=True)
            ],
            "llamacpp_order": self.llamacpp_order,
        }

    def _native_pieces(
        self, part: Part, shape: tuple[int, ...], t: int, k: int, repacked: bool
    ) -> Iterator[NativePart]:
        """One matrix's rows as the native kernel's pieces (row chunks)."""
        for _, n, raw in self._chunks(part, shape, native_chunk_rows(k)):
            yield native_piece(part, t, k, repacked, n, raw)

    def _chunk_spans(
        self, part: Part, shape: tuple[int, ...], step: int
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(row offset, rows, raw bytes) of chunks of ``step`` rows, nothing released (a
        permuted part comes whole)."""
        raw = self.raw(part.name)
        rows = shape[0]
        if rows <= 0:
            raise GGUFError(f"{part.name} has no rows")
        step = rows if part.perm is not None else step
        row_bytes = raw.numel() // rows
        for r in range(0, rows, step):
            n = min(step, rows - r)
            yield r, n, raw[r * row_bytes : (r + n) * row_bytes]

    def _chunks(
        self, part: Part, shape: tuple[int, ...], step: int = _CHUNK_ROWS
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(row offset, rows, raw bytes) of chunks of ``step`` rows; a permuted part comes
        whole. Each chunk's file pages leave this process once the consumer takes the
        next (the page cache keeps them)."""
        for r, n, raw in self._chunk_spans(part, shape, step):
            yield r, n, raw
            self.f.release_range(part.name, r * (raw.numel() // n), raw.numel())

    def _int4(
        self, parts: list[Part], shapes: list[tuple[int, ...]], bits: int, bias: torch.Tensor | None
    ) -> Int4Linear:
        n_total = sum(s[0] for s in shapes)
        k = shapes[0][1]
        split = bits > 4
        # The head refines its best logits from exact rows instead (model.REFINE_TOP).
        exact = self.precision == "exact" and not (
            len(parts) == 1 and parts[0].name in _HEAD_TENSORS
        )
        correct = CORRECT_ZEROS and any(
            self.f.tensors[p.name].ggml_type in _WITH_MINS for p in parts
        )
        # Pack chunk by chunk (little temporary memory) when packed blocks concatenate.
        by_chunk = all(row_blocks_pack_independently(s[0]) for s in shapes)
        packed_rows: list[torch.Tensor] = []
        sz_rows: list[torch.Tensor] = []
        res_rows: list[torch.Tensor] = []
        extra = 0
        for part, shape in zip(parts, shapes, strict=True):
            t = self.f.tensors[part.name].ggml_type
            for _, n, raw in self._chunks(part, shape):
                # 4-bit codes fused with wider ones split fine: their high nibble is 0.
                g = affine_groups(raw, t, (n, k))
                q, scale, offset = g.q, g.scale * part.row_scale, g.offset * part.row_scale
                if part.perm is not None:
                    q, scale, offset = q[part.perm], scale[part.perm], offset[part.perm]
                kc, ks, kz = int4_codes(q, scale, offset, bits, split)
                codes, sz, extra = int4_rows(kc, ks, kz, correct)
                if exact:
                    codes, sz = with_residual_group(codes, sz)
                    if CORRECT_SCALES and extra == 0:
                        dt = sz.dtype
                        res = torch.stack([ks - ks.to(dt).float(), kz - kz.to(dt).float()], -1)
                        res = torch.cat([res.transpose(0, 1).to(dt), torch.zeros_like(sz[:1])])
                        res_rows.append(res)
                packed_rows.append(pack_int4(codes) if by_chunk else codes)
                sz_rows.append(sz)
        packed = packed_rows[0] if len(packed_rows) == 1 else torch.cat(packed_rows)
        if not by_chunk:
            packed = pack_int4(packed)
        sz = sz_rows[0] if len(sz_rows) == 1 else torch.cat(sz_rows, dim=1)
        res_sz = torch.cat(res_rows, dim=1).contiguous() if res_rows else None
        return Int4Linear(packed, sz.contiguous(), n_total, k, split, extra, bias, exact, res_sz)

    def _keeps_quantised(self, types: list[int]) -> bool:
        """Whether the weights stay in their GGUF bytes (QuantLinear): on CUDA at the
        default precision (DEVICE_QUANT), for quantised formats; float formats stay dense."""
        quantised = all(t in AFFINE_BITS or t == Q6_K for t in types)
        on = self.device.type == "cuda" or DEVICE_QUANT_ON_CPU
        return DEVICE_QUANT and on and self.precision == "default" and quantised

    def _quant(
        self, parts: list[Part], shapes: list[tuple[int, ...]], bias: torch.Tensor | None
    ) -> QuantLinear:
        pieces = []
        for part, shape in zip(parts, shapes, strict=True):
            raw = self.raw(part.name).to(self.device)  # the file's bytes, copied once
            perm = None if part.perm is None else part.perm.to(self.device)
            t = self.f.tensors[part.name].ggml_type
            pieces.append(QuantPart(raw, t, shape[0], perm, part.row_scale))
        dtype = torch.float16 if self.device.type == "cuda" else torch.float32
        return QuantLinear(pieces, shapes[0][1], bias, dtype, QUANT_CHUNK_ROWS)

    def _dense(
        self, parts: list[Part], shapes: list[tuple[int, ...]], bias: torch.Tensor | None
    ) -> DenseLinear:
        n_total = sum(s[0] for s in shapes)
        k = shapes[0][1]
        if self.precision == "float32":
            dtype = torch.float32
        else:
            dtype = torch.float16 if self.device.type == "cuda" else torch.bfloat16
        w = torch.empty(n_total, k, dtype=dtype, device=self.device)
        row0 = 0
        for part, shape in zip(parts, shapes, strict=True):
            t = self.f.tensors[part.name].ggml_type
            for r, n, raw in self._chunks(part, shape):
                m = dequantize(raw, t, (n, k))
                if part.row_scale != 1.0:
                    m = m * part.row_scale
                if part.perm is not None:
                    m = m[part.perm]
                w[row0 + r : row0 + r + n] = m.to(self.device)
            row0 += shape[0]
        return DenseLinear(w, bias)


def native_piece(
    part: Part, t: int, k: int, repacked: bool, n: int, raw: torch.Tensor
) -> NativePart:
    """``n`` rows of a matrix (its GGUF blocks ``raw``) as one native kernel piece, its
    codes decoded in torch (kernels.native_layout's input)."""
    g = q6_k_groups(raw, (n, k)) if t == Q6_K else affine_groups(raw, t, (n, k))
    width = 16 if t == Q6_K else 32
    q, scale, offset = g.q, g.scale * part.row_scale, g.offset * part.row_scale
    if part.perm is not None:
        q, scale, offset = q[part.perm], scale[part.perm], offset[part.perm]
    _, zero, mode, f16_scales = _NATIVE[t]
    # a power-of-two row scale keeps float16 scales float16 values
    pow2 = _pow2(part.row_scale)
    exact16 = f16_scales and pow2
    ks = None
    if t in (Q4_K, Q5_K, Q6_K) and pow2:  # their own integer arithmetic (qmm.c)
        ks = k_scales(raw, t, (n, k))
        dmin = None if ks.dmin is None else ks.dmin * part.row_scale
        ks = KScales(ks.sc, ks.mins, ks.d * part.row_scale, dmin)
        if part.perm is not None:
            p = part.perm
            ks = KScales(
                ks.sc[p],
                None if ks.mins is None else ks.mins[p],
                ks.d[p],
                None if ks.dmin is None else ks.dmin[p],
            )
    return NativePart(q, scale, offset, width, zero, mode, exact16, ks, repacked)


def _pow2(x: float) -> bool:
    return math.frexp(x)[0] == 0.5


def _family(ggml_type: int, repacked: bool) -> tuple[object, ...]:
    """Formats that one native layout sums in llama.cpp's order together: the vec_dot
    formats of one activation quantisation (Q5_0 and Q8_0; Q4_1 and Q5_1), llama.cpp's
    repacked Q4_0, and each K format on its own."""
    if ggml_type == Q4_0 and repacked:
        return ("q4_0 repacked",)
    if ggml_type in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        return ("vec_dot", _NATIVE[ggml_type][2])
    return ("k", ggml_type)


def _bits(ggml_type: int) -> int:
    return AFFINE_BITS[ggml_type]


def rope_permutation(cfg: ArchConfig, n_heads: int) -> torch.Tensor | None:
    """Row order that turns adjacent-pair rope rows into half-split ones (None for NEOX)."""
    if cfg.rope_neox:
        return None
    rot = cfg.rope_dim
    within = torch.cat(
        [torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, cfg.head_dim)]
    )
    heads = torch.arange(n_heads).view(-1, 1) * cfg.head_dim
    return (heads + within.view(1, -1)).reshape(-1)


# glibc's mallopt parameter: allocations from this size up are mapped on their own and
# given back when freed. Fixed, not glibc's default that rises with each large free (to
# 32 MiB): a load's freed conversion buffers would otherwise stay in the heap, on top of
# the weights, until trim_heap.
_M_MMAP_THRESHOLD = -3
_LOAD_MMAP_THRESHOLD = 16 << 20


def fix_mmap_threshold() -> None:
    """Large allocations mapped on their own from now on (see above); where the C
    library has no mallopt (not glibc), nothing."""
    try:
        ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _LOAD_MMAP_THRESHOLD)
    except (OSError, AttributeError):
        pass


def trim_heap() -> None:
    """Give freed conversion buffers back to the OS so RSS reflects the weights only.

    The process's own symbols (glibc's malloc_trim among them), not
    ``ctypes.util.find_library``, which runs ``ldconfig``: a node must fork nothing (a
    child before its exec carries the node's command line, and looks like a second node
    to anyone who lists processes by it)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
