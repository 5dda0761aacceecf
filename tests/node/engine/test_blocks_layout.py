"""Native layouts built straight from GGUF blocks in C (kernels.BlocksLayout, qmm.c
mvk_build_*) are byte for byte the ones kernels.native_layout builds in llama.cpp's order
from the codes decoded in torch (loader.native_piece): for every format the native kernel
holds, alone and fused within a vec_dot family, at the edges of their scales (d = 0,
negative, float16's extremes, power-of-two row scales), refused where native_layout
refuses; and the loader takes that path for them (issue 36)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import fields

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from workers.node.engine import loader, native
from workers.node.engine.kernels import BlocksLayout, NativeLayout, native_layout
from workers.node.engine.loader import _NATIVE, Part, native_piece

from .conftest import native_kernel

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = (int(t) for t in (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0))
Q4_K, Q5_K, Q6_K = int(QT.Q4_K), int(QT.Q5_K), int(QT.Q6_K)
# byte offsets of each format's float16 fields in a block (d first; mins/dmin second)
_HALVES = {
    Q4_0: (0,), Q8_0: (0,), Q5_0: (0,), Q4_1: (0, 2), Q5_1: (0, 2),
    Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,),
}  # fmt: skip
# float16 values at the edges: zero, negative zero, negative, the smallest subnormal and
# normal, float16's largest (refused where an offset of a zero code passes it)
_EDGES = np.array([0.0, -0.0, -0.75, 2**-24, 2**-14, 1.0, -3.5e-3, 0.0125], dtype=np.float16)


@pytest.fixture(scope="module", autouse=True)
def _native_kernel() -> Iterator[None]:
    with native_kernel():
        yield


@pytest.fixture(scope="module")
def lib(_native_kernel: None) -> ctypes.CDLL:
    got = native.library()
    assert got is not None, f"the native kernel did not build here: {native.why_not()}"
    return got


def _blocks(t: int, rows: int, k: int, seed: int, big: float | None = None) -> torch.Tensor:
    """Random blocks of format ``t`` whose float16 fields are drawn from _EDGES and small
    random values (``big``: one row's d that large)."""
    per, size = BlocksLayout.BLOCK_BYTES[t]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, k // per, size), dtype=np.uint8)
    for at in _HALVES[t]:
        d = rng.normal(0, 0.01, (rows, k // per)).astype(np.float16)
        pick = rng.random((rows, k // per)) < 0.3
        d[pick] = rng.choice(_EDGES, int(pick.sum()))
        if big is not None:
            d[rows // 2] = big
        b[:, :, at : at + 2] = d.view(np.uint8).reshape(rows, k // per, 2)
    return torch.from_numpy(b.reshape(-1))


def _decoded(parts: list[tuple[int, int, torch.Tensor, float]], k: int) -> NativeLayout | None:
    """native_layout of (type, rows, blocks, row scale) parts, 16 rows a piece."""
    pieces = []
    for t, rows, raw, scale in parts:
        row_bytes = raw.numel() // rows
        for r in range(0, rows, 16):
            chunk = raw[r * row_bytes : (r + 16) * row_bytes]
            pieces.append(native_piece(Part("w", row_scale=scale), t, k, False, 16, chunk))
    bits = max(_NATIVE[t][0] for t, _, _, _ in parts)
    return native_layout(pieces, bits, llamacpp_order=True)


def _direct(
    lib: ctypes.CDLL, parts: list[tuple[int, int, torch.Tensor, float]], k: int
) -> NativeLayout | None:
    """BlocksLayout of the same parts, filled 16 rows at a time from the last to the first
    (as a pool's threads may)."""
    types = [t for t, _, _, _ in parts]
    built = BlocksLayout(lib, types[0], sum(r for _, r, _, _ in parts), k, types=types)
    fills, row0 = [], 0
    for t, rows, raw, scale in parts:
        row_bytes = raw.numel() // rows
        for r in range(0, rows, 16):
            fills.append((raw[r * row_bytes : (r + 16) * row_bytes], row0 + r, scale, t))
        row0 += rows
    for raw, at, scale, t in reversed(fills):
        built.fill(raw, at, 16, scale, t)
    return built.layout()


def _assert_same_bytes(a: NativeLayout, b: NativeLayout) -> None:
    for f in fields(NativeLayout):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), f.name
            assert (x.dtype, x.shape) == (y.dtype, y.shape), f.name
            xb, yb = x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)
            assert torch.equal(xb, yb), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("ggml_type", [Q4_1, Q5_0, Q5_1, Q5_K, Q4_0, Q8_0, Q4_K, Q6_K])
@pytest.mark.parametrize("row_scale", [1.0, 2.0, 0.5, 0.0625])
def test_a_formats_layout_from_its_blocks_is_the_decoded_codes_layout(
    lib: ctypes.CDLL, ggml_type: int, row_scale: float
) -> None:
    """Every format alone, 48 rows, at the edges of its scales and times a power-of-two
    row scale (a Gemma q's 1/16)."""
    k = 512
    raw = _blocks(ggml_type, 48, k, seed=ggml_type)
    parts = [(ggml_type, 48, raw, row_scale)]
    want, got = _decoded(parts, k), _direct(lib, parts, k)
    assert want is not None and got is not None
    _assert_same_bytes(want, got)


@pytest.mark.parametrize(
    "types", [(Q5_0, Q8_0, Q5_0), (Q8_0, Q5_0), (Q4_1, Q5_1), (Q5_1, Q4_1, Q4_1)]
)
def test_fused_formats_of_one_family_make_the_decoded_codes_layout(
    lib: ctypes.CDLL, types: tuple[int, ...]
) -> None:
    """A fused run of one vec_dot family's formats (Gemma's q/k/v: Q5_0, Q5_0, Q8_0) is one
    layout in the widest format's bits, with each row's zero code (Q5_0 with Q8_0) or mins
    (Q4_1 with Q5_1), the second part's rows scaled."""
    k = 640
    parts = [
        (t, 16 * (i + 1), _blocks(t, 16 * (i + 1), k, seed=10 + i), 2.0 if i == 1 else 1.0)
        for i, t in enumerate(types)
    ]
    want, got = _decoded(parts, k), _direct(lib, parts, k)
    assert want is not None and got is not None
    _assert_same_bytes(want, got)


@pytest.mark.parametrize(
    ("ggml_type", "big", "row_scale"),
    [(Q5_0, 4096.0, 1.0), (Q8_0, 1024.0, 1.0), (Q4_1, 65504.0, 2.0), (Q5_1, 40000.0, 2.0)],
)
def test_scales_beyond_float16_are_refused_as_native_layout_refuses_them(
    lib: ctypes.CDLL, ggml_type: int, big: float, row_scale: float
) -> None:
    """A scale or offset (zero code x scale) past float16's range: both ways refused, so
    the loader's torch path is taken and refuses it too (the product then runs in torch);
    just inside it, both ways kept."""
    k = 256
    raw = _blocks(ggml_type, 32, k, seed=3, big=big)
    parts = [(ggml_type, 32, raw, row_scale)]
    assert _decoded(parts, k) is None
    assert _direct(lib, parts, k) is None
    inside = [(ggml_type, 32, raw, row_scale / 4)]
    want, got = _decoded(inside, k), _direct(lib, inside, k)
    assert want is not None and got is not None
    _assert_same_bytes(want, got)


def test_formats_of_different_families_do_not_make_one_layout(lib: ctypes.CDLL) -> None:
    """Q5_0 (Q8_0 activations) with Q5_1 (Q8_1) or a K format: not one layout here (the
    loader never runs them as one)."""
    assert BlocksLayout.joins([Q5_0, Q8_0]) and BlocksLayout.joins([Q4_1, Q5_1])
    assert not BlocksLayout.joins([Q5_0, Q5_1]) and not BlocksLayout.joins([Q4_K, Q5_K])
    with pytest.raises(ValueError, match="do not make one layout"):
        BlocksLayout(lib, Q5_0, 32, 256, types=[Q5_0, Q4_1])
    built = BlocksLayout(lib, Q5_0, 32, 256)
    with pytest.raises(ValueError, match="is not one of this layout's"):
        built.fill(_blocks(Q8_0, 16, 256, seed=1), 0, 16, 1.0, Q8_0)


def test_the_bundled_gemmas_every_layout_comes_from_its_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gemma 3 270M (Q5_0, Q8_0, Q4_K, Q6_K; a q/k/v of Q5_0 and Q8_0): every product's
    layout is filled from its blocks, none through the decoded codes."""
    from mvp_io.model_store import GEMMA3_BUNDLED, fetch_bundled
    from workers.node.engine import EngineOptions, load_stage

    path = fetch_bundled(GEMMA3_BUNDLED)
    decoded: list[int] = []
    fills: set[int] = set()
    fill = BlocksLayout.fill

    def counted(
        self: BlocksLayout,
        raw: torch.Tensor,
        row0: int,
        n: int,
        d_scale: float = 1.0,
        ggml_type: int | None = None,
    ) -> None:
        fills.add(self.type if ggml_type is None else ggml_type)
        fill(self, raw, row0, n, d_scale, ggml_type)

    def piece(*args: object) -> object:
        decoded.append(1)
        return native_piece(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(BlocksLayout, "fill", counted)
    monkeypatch.setattr(loader, "native_piece", piece)
    opts = EngineOptions(device="cpu", threads=1, layout_cache=False)
    stage = load_stage(str(path), 0, 18, opts)
    try:
        assert not decoded
        assert fills == {Q5_0, Q8_0, Q4_K, Q6_K}
    finally:
        stage.close()
