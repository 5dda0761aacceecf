"""Vectorised dequantisation of ggml block formats, in torch.

Two views of a quantised tensor are offered:

* ``dequantize``: float32 values (the reference path, and fallback for formats no
  compact kernel can run).
* ``affine_groups``: integer codes ``q`` (unsigned) plus per-32-element ``scale`` and
  ``offset`` with ``w = q * scale + offset`` exactly (in float32). The int4 kernels are
  built from this, so formats whose groups are 32 wide run without requantisation.

Block layouts follow ggml-quants.c; tensors arrive as raw uint8 bytes from the mapping.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType

from .gguf_reader import GGML_TYPES, GGUFError

_T = GGMLQuantizationType
F32, F16, BF16 = int(_T.F32), int(_T.F16), int(_T.BF16)
Q4_0, Q4_1, Q5_0, Q8_0 = int(_T.Q4_0), int(_T.Q4_1), int(_T.Q5_0), int(_T.Q8_0)
Q5_1 = int(_T.Q5_1)
Q4_K, Q5_K, Q6_K = int(_T.Q4_K), int(_T.Q5_K), int(_T.Q6_K)

SUPPORTED_TYPES = frozenset({F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K})
# Formats expressible as 32-wide affine groups, with the bit width of their codes.
AFFINE_BITS: dict[int, int] = {Q4_0: 4, Q4_1: 4, Q4_K: 4, Q8_0: 8, Q5_K: 5, Q5_0: 5, Q5_1: 5}


@dataclass(frozen=True)
class AffineGroups:
    """``w[n, k] = q[n, k] * scale[n, k // 32] + offset[n, k // 32]``."""

    q: torch.Tensor  # uint8 [N, K], values in [0, 2**bits)
    scale: torch.Tensor  # float32 [N, K // 32]
    offset: torch.Tensor  # float32 [N, K // 32]
    bits: int


def as_torch_bytes(raw: np.ndarray[Any, Any]) -> torch.Tensor:
    """Wrap read-only mapped bytes without copying (we never write to them)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)


def _blocks(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    _, _, size = GGML_TYPES[ggml_type]
    return raw.view(-1, size)


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    """Column of float16 values at byte ``start`` of each block, as float32 [nb, 1]."""
    return b[:, start : start + 2].contiguous().view(torch.float16).float()


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales/mins of Q4_K and Q5_K into [nb, 8] each."""
    s = s.to(torch.int32)
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], dim=1)
    mn = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=1)
    return sc.float(), mn.float()


def _nibbles_q4(qs: torch.Tensor) -> torch.Tensor:
    """Q4_0/Q4_1: byte j holds element j (low nibble) and j + 16 (high nibble)."""
    return torch.cat([qs & 15, qs >> 4], dim=1)


def _q5_codes(b: torch.Tensor, at: int) -> torch.Tensor:
    """Q5_0 (d f16, qh u32, qs[16]; ``at`` 2) and Q5_1 (d, m f16, qh, qs; ``at`` 4):
    element j has the low nibble of qs[j] and bit j of qh, element j + 16 the high nibble
    and bit j + 16."""
    qh = b[:, at : at + 4].contiguous().view(torch.int32)  # little-endian, as ggml reads it
    bits = ((qh >> torch.arange(32, dtype=torch.int32, device=b.device)) & 1).to(torch.uint8) << 4
    return _nibbles_q4(b[:, at + 4 : at + 20]) | bits


def _affine_blocks(
    b: torch.Tensor, ggml_type: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block codes [nb, E] (uint8), scale and offset [nb, E // 32]."""
    nb = b.shape[0]
    if ggml_type == Q4_0:
        d = _f16(b, 0)
        return _nibbles_q4(b[:, 2:18]), d, -8.0 * d
    if ggml_type == Q4_1:
        return _nibbles_q4(b[:, 4:20]), _f16(b, 0), _f16(b, 2)
    if ggml_type == Q5_0:
        d = _f16(b, 0)
        return _q5_codes(b, 2), d, -16.0 * d
    if ggml_type == Q5_1:
        return _q5_codes(b, 4), _f16(b, 0), _f16(b, 2)
    if ggml_type == Q8_0:
        d = _f16(b, 0)
        q = (b[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return q, d, -128.0 * d
    if ggml_type in (Q4_K, Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scales(b[:, 4:16])
        if ggml_type == Q4_K:
            ql = b[:, 16:144].view(nb, 4, 1, 32)
            q = torch.cat([ql & 15, ql >> 4], dim=2).reshape(nb, 256)
        else:
            qh = b[:, 16:48].view(nb, 1, 32)
            ql = b[:, 48:176].view(nb, 4, 1, 32)
            low = torch.cat([ql & 15, ql >> 4], dim=2).reshape(nb, 8, 32)
            shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
            q = (low | (((qh >> shifts) & 1) << 4)).reshape(nb, 256)
        return q, d * sc, -(dmin * mn)
    raise GGUFError(f"ggml type {ggml_type} has no 32-wide affine form")


def affine_groups(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> AffineGroups:
    """Codes, scales and offsets of a 2-D quantised matrix (see module docstring)."""
    rows, cols = shape[0], int(np.prod(shape[1:]))
    q, scale, offset = _affine_blocks(_blocks(raw, ggml_type), ggml_type)
    groups = cols // 32
    return AffineGroups(
        q=q.reshape(rows, cols),
        scale=scale.reshape(rows, groups),
        offset=offset.reshape(rows, groups),
        bits=AFFINE_BITS[ggml_type],
    )


def _q6_k_blocks(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K blocks: codes [nb, 256] (uint8, 0..63) and the scale ``d * sc`` of each
    16-wide group [nb, 16] (float32, as ggml computes it); ``w = scale * (q - 32)``."""
    nb = b.shape[0]
    ql = b[:, 0:128].reshape(nb, 2, 2, 32)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32)
    sc = b[:, 192:208].view(torch.int8).float()
    d = _f16(b, 208)
    nib = torch.cat([ql & 15, ql >> 4], dim=2)  # [nb, half, quarter, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    q = nib | (((qh >> shifts) & 3) << 4)
    return q.reshape(nb, 256), d * sc


@dataclass(frozen=True)
class KScales:
    """A K-format matrix's own scales, for arithmetic that keeps them integer (qmm.c):
    ``sc`` per group (Q4_K: 8 x uint8 per 256, Q6_K: 16 x int8), ``mins`` (Q4_K: uint8
    per group; Q6_K: None), ``d`` and ``dmin`` float32 per 256-block (rows x blocks)."""

    sc: torch.Tensor
    mins: torch.Tensor | None
    d: torch.Tensor
    dmin: torch.Tensor | None


def k_scales(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> KScales:
    """Q4_K, Q5_K or Q6_K scales of a 2-D matrix [rows, cols], row by row."""
    rows = shape[0]
    b = _blocks(raw, ggml_type)
    if ggml_type in (Q4_K, Q5_K):  # the same d, dmin and 12-byte scales up front
        sc, mn = _k_scales(b[:, 4:16])
        return KScales(
            sc=sc.to(torch.uint8).reshape(rows, -1),
            mins=mn.to(torch.uint8).reshape(rows, -1),
            d=_f16(b, 0).reshape(rows, -1),
            dmin=_f16(b, 2).reshape(rows, -1),
        )
    if ggml_type == Q6_K:
        return KScales(
            sc=b[:, 192:208].view(torch.int8).reshape(rows, -1),
            mins=None,
            d=_f16(b, 208).reshape(rows, -1),
            dmin=None,
        )
    raise GGUFError(f"ggml type {ggml_type} has no K-format scales")


def _dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    q, scale = _q6_k_blocks(b)
    nb = b.shape[0]
    return (scale.view(nb, 16, 1) * (q.to(torch.int16) - 32).float().view(nb, 16, 16)).reshape(
        nb, 256
    )


def q6_k_groups(raw: torch.Tensor, shape: tuple[int, ...]) -> AffineGroups:
    """Q6_K as 16-wide affine groups: ``w = q * scale + offset``, q in 0..63, with
    ``offset = -32 * scale``."""
    rows, cols = shape[0], int(np.prod(shape[1:]))
    q, scale = _q6_k_blocks(_blocks(raw, Q6_K))
    scale = scale.reshape(rows, cols // 16)
    return AffineGroups(q=q.reshape(rows, cols), scale=scale, offset=-32.0 * scale, bits=6)


def dequantize(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Float32 tensor of ``shape`` from raw ggml bytes."""
    if ggml_type == F32:
        out = raw.view(torch.float32)
    elif ggml_type == F16:
        out = raw.view(torch.float16).float()
    elif ggml_type == BF16:
        out = raw.view(torch.bfloat16).float()
    elif ggml_type == Q6_K:
        out = _dequant_q6_k(_blocks(raw, ggml_type))
    elif ggml_type in AFFINE_BITS:
        q, scale, offset = _affine_blocks(_blocks(raw, ggml_type), ggml_type)
        nb, e = q.shape
        qf = q.float().view(nb, e // 32, 32)
        out = qf * scale.view(nb, -1, 1) + offset.view(nb, -1, 1)
    else:
        name = GGML_TYPES.get(ggml_type, (str(ggml_type),))[0]
        raise GGUFError(f"unsupported tensor type {name}")
    return out.reshape(shape)


def dequantize_rows(
    raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], rows: torch.Tensor
) -> torch.Tensor:
    """Float32 rows ``rows`` of a 2-D tensor, touching only those rows' bytes (embedding lookup)."""
    _, block, size = GGML_TYPES[ggml_type]
    cols = shape[1]
    row_bytes = cols // block * size
    picked = raw.view(shape[0], row_bytes)[rows]
    return dequantize(picked.reshape(-1), ggml_type, (rows.shape[0], cols))
