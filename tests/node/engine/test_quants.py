"""Our vectorised dequantisers and int4 packing against gguf-py's reference decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from tests.node.engine.tiny_models import quantize
from workers.node.engine.kernels import Int4Linear, int4_codes, int4_rows, pack_int4
from workers.node.engine.quants import AFFINE_BITS, affine_groups, dequantize, dequantize_rows

ALL_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


def _sample(qtype: QT, rows: int = 64, cols: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes, gguf-py float reference) of a random matrix."""
    rng = np.random.default_rng(int(qtype))
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == QT.BF16:
        data = np.asarray(gq.quantize(values, QT.BF16))
    else:
        data = quantize(values, qtype, rng)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    ref = gq.dequantize(raw, qtype).reshape(rows, cols) if qtype not in (QT.F32, QT.F16) else data
    return raw, np.asarray(ref, dtype=np.float32)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference(qtype: QT) -> None:
    raw, ref = _sample(qtype)
    ours = dequantize(torch.from_numpy(raw), int(qtype), ref.shape)
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), ref)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.Q6_K], ids=lambda t: t.name)
def test_dequantize_rows_reads_only_requested_rows(qtype: QT) -> None:
    raw, ref = _sample(qtype)
    rows = torch.tensor([5, 0, 63, 5])
    ours = dequantize_rows(torch.from_numpy(raw), int(qtype), ref.shape, rows)
    np.testing.assert_array_equal(ours.numpy(), ref[rows.numpy()])


@pytest.mark.parametrize("qtype", sorted(AFFINE_BITS), ids=lambda t: QT(t).name)
def test_affine_groups_are_exact(qtype: int) -> None:
    raw, ref = _sample(QT(qtype))
    g = affine_groups(torch.from_numpy(raw), qtype, ref.shape)
    w = g.q.float().view(64, -1, 32) * g.scale[..., None] + g.offset[..., None]
    np.testing.assert_array_equal(w.reshape(ref.shape).numpy(), ref)
    assert int(g.q.max()) < 2**g.bits


@pytest.mark.parametrize("qtype", sorted(AFFINE_BITS), ids=lambda t: QT(t).name)
def test_int4_packing_reproduces_weights_exactly_with_float32_scales(qtype: int) -> None:
    """With float32 activations and scales the int4 kernel computes the exact product."""
    raw, ref = _sample(QT(qtype))
    g = affine_groups(torch.from_numpy(raw), qtype, ref.shape)
    split = g.bits > 4
    codes, scale, zero = int4_codes(g.q, g.scale, g.offset, g.bits, split)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
    x = torch.randn(3, ref.shape[1], generator=torch.Generator().manual_seed(0))
    xx = torch.cat([x, x], dim=-1) if split else x
    y = torch._weight_int4pack_mm_for_cpu(xx, pack_int4(codes), 32, sz)
    expected = x.double() @ torch.from_numpy(ref).double().T
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q4_K, QT.Q5_K], ids=lambda t: t.name)
def test_zero_correction_columns_reduce_the_bf16_error(qtype: QT) -> None:
    raw, ref = _sample(qtype, rows=128)
    g = affine_groups(torch.from_numpy(raw), int(qtype), ref.shape)
    split = g.bits > 4
    x = torch.randn(4, ref.shape[1], generator=torch.Generator().manual_seed(1))
    exact = x.double() @ torch.from_numpy(ref).double().T
    errors = []
    for correct in (False, True):
        codes, sz, extra = int4_rows(*int4_codes(g.q, g.scale, g.offset, g.bits, split), correct)
        lin = Int4Linear(pack_int4(codes), sz.contiguous(), 128, ref.shape[1], split, extra, None)
        assert (extra > 0) is correct
        errors.append(float((lin(x).double() - exact).norm() / exact.norm()))
    assert errors[1] < errors[0] < 0.01
