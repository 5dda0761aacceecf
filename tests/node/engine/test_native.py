"""The engine's own quantised kernel (workers/node/engine/native.py, csrc/qmm.c).

Its products are held to an emulation of the arithmetic it claims (llama.cpp's: int8
activation blocks, the file's codes and scales, float32 sums) computed here in float64
from the same quantised activations, for every layout it has: nibble and byte codes,
16- and 32-wide groups, float16 and float32 scales, per-group mins or a fixed zero code,
all three activation quantisations, 1 to 9 rows, one thread and several. The plain C
build (no AVX-512) must agree with the vectorised one.
"""

from __future__ import annotations

import ctypes
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from workers.node.engine import native
from workers.node.engine.kernels import NativeLayout, NativeLinear, NativePart, native_layout
from workers.node.engine.quants import KScales

from .conftest import ONCE_UPON_A_TIME, SMOLLM, native_kernel, native_stage

CASES = [
    # rows, K, code bits, group width, zero code (None: mins), activation mode, f16 scales
    (96, 576, 4, 32, None, native.Q8_1_ACT, True),  # Q4_1 (SmolLM2), K off the 128 grid
    (64, 576, 4, 32, 8, native.Q8_0_ACT, True),  # Q4_0
    (80, 640, 5, 32, 16, native.Q8_0_ACT, True),  # Q5_0 (Gemma)
    (128, 576, 8, 32, 128, native.Q8_0_ACT, True),  # Q8_0 (the heads)
    (48, 512, 4, 32, None, native.Q8_K_ACT, False),  # Q4_K
    (80, 512, 6, 16, 32, native.Q8_K_ACT, False),  # Q6_K
    (33, 96, 4, 32, None, native.Q8_0_ACT, True),  # rows off every chunk size
]


@pytest.fixture(scope="module", autouse=True)
def _native_kernel() -> Iterator[None]:
    """The kernel's own tests run it on any x86-64 CPU (plain C without AVX-512 VNNI)."""
    with native_kernel():
        yield


@pytest.fixture(scope="module")
def lib(_native_kernel: None) -> ctypes.CDLL:
    got = native.library()
    assert got is not None, f"the native kernel did not build here: {native.why_not()}"
    return got


@pytest.fixture(scope="module")
def generic(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    out = tmp_path_factory.mktemp("generic")
    lib = native.load(native.build(out, ("-DMVK_GENERIC",)))
    assert lib.mvk_simd() == 0
    return lib


def _case(
    case: tuple[int, int, int, int, int | None, int, bool], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, NativePart]:
    n, k, bits, width, zero, mode, f16 = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    scale = torch.rand(n, k // width, generator=gen) * 0.01 + 1e-4
    if f16:
        scale = scale.half().float()
    if zero is None:
        offset = -torch.rand(n, k // width, generator=gen) * 0.05
        offset = offset.half().float() if f16 else offset
    else:
        offset = -zero * scale
    return q, scale, offset, NativePart(q, scale, offset, width, zero, mode, f16)


def _emulated(lib: ctypes.CDLL, lin: NativeLinear, x: torch.Tensor, q, scale, offset, width):
    """float64 products of the kernel's own quantised activations (codes times d, and the
    block sums, float16 ones for Q8_1) with the exact codes, scales and mins."""
    k = x.shape[1]
    act = native.Activations(lib, x, lin.kp, lin.layout.mode)
    xq = (act.qx.double() * act.dxe.double().repeat_interleave(4, 1))[:, :k]
    sums = (act.s16 if width == 16 else act.s32).double()[:, : k // width]
    w = q.double() * scale.double().repeat_interleave(width, 1)
    return xq @ w.T + sums @ offset.double().T


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-b{c[2]}-g{c[3]}-m{c[5]}")
def test_products_are_the_emulated_arithmetic(lib: ctypes.CDLL, generic: ctypes.CDLL, case) -> None:
    q, scale, offset, part = _case(case, seed=case[1])
    layout = native_layout([part], case[2])
    assert layout is not None
    assert layout.nibble == (case[2] <= 4) and layout.sub == case[3]
    assert (layout.offset is None) == (case[4] is not None)
    assert layout.scale.dtype == (torch.float16 if case[6] else torch.float32)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, case[1], generator=gen) * 3
        add = torch.randn(rows, case[0], generator=gen)
        for build in (lib, generic):
            lin = NativeLinear(build, layout, case[0], case[1], None)
            want = _emulated(build, lin, x, q, scale, offset, case[3])
            got = lin(x, add).double() - add.double()
            err = float((got - want).abs().max() / want.abs().max())
            assert err < 2e-6, (rows, build is lib, err)


Q0_CASES = [c for c in CASES if c[3] == 32 and c[5] != native.Q8_K_ACT and c[6]]


@pytest.mark.parametrize("case", Q0_CASES, ids=lambda c: f"{c[0]}x{c[1]}-b{c[2]}")
def test_llamacpp_order_is_the_same_in_plain_c(
    lib: ctypes.CDLL, generic: ctypes.CDLL, case
) -> None:
    """llama.cpp's order for Q4_0/Q4_1/Q5_0/Q8_0 (qmm.c rows_q0, 16 rows interleaved, rows
    off the 16-grid masked): the plain C build gives the same bits, for 1 to 9 activation
    rows, and both are the emulated arithmetic."""
    q, scale, offset, part = _case(case, seed=case[1] + 1)
    layout = native_layout([part], case[2], llamacpp_order=True)
    assert layout is not None and layout.arith == native.ARITH_Q0 and layout.kp == case[1]
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, case[1], generator=gen) * 3
        add = torch.randn(rows, case[0], generator=gen)
        got = NativeLinear(lib, layout, case[0], case[1], None)(x, add)
        plain = NativeLinear(generic, layout, case[0], case[1], None)(x, add)
        assert torch.equal(got, plain), rows
        lin = NativeLinear(lib, layout, case[0], case[1], None)
        want = _emulated(lib, lin, x, q, scale, offset, 32)
        err = float(((got.double() - add.double()) - want).abs().max() / want.abs().max())
        assert err < 2e-6, (rows, err)


def test_activation_blocks_follow_llamacpp(lib: ctypes.CDLL) -> None:
    """Q8_0 blocks: d = max|x| / 127 kept as float16, codes rounded to even; Q8_K: 256-wide
    blocks with the signed extreme at -127 (d negative when it is positive)."""
    x = torch.zeros(1, 512)
    x[0, :32] = torch.linspace(-1.0, 2.0, 32)
    x[0, 32:64] = 0.0  # an all-zero block
    x[0, 64:] = torch.randn(448, generator=torch.Generator().manual_seed(3))
    a = native.Activations(lib, x, 512, native.Q8_0_ACT)
    d = np.float32(2.0) / np.float32(127.0)
    assert float(a.dxe[0, 0]) == float(np.float16(d))
    assert int(a.qx[0, 31]) == 127 and int(a.qx[0, 0]) == round(-1.0 * 127 / 2.0)
    assert torch.all(a.qx[0, 32:64] == 0) and float(a.dxe[0, 8]) == 0.0
    k = native.Activations(lib, x, 512, native.Q8_K_ACT)
    assert torch.all(k.dxe[0, :64] == k.dxe[0, 0])  # one d per 256 elements
    assert int(k.qx[0, :256].abs().max()) == 127
    top = int(x[0, :256].abs().argmax())
    assert int(k.qx[0, top]) == -127
    assert (float(k.dxe[0, 0]) < 0) == (float(x[0, top]) > 0)


def test_llamacpp_order_with_mixed_zero_codes(lib: ctypes.CDLL, generic: ctypes.CDLL) -> None:
    """Q5_0 (zero 16) fused with Q8_0 (zero 128), 24 rows each: one group of each zero code
    (qmm.c starts its products from the zero's term) and one mixed (the -q product)."""
    a = _case((24, 640, 5, 32, 16, native.Q8_0_ACT, True), seed=13)
    b = _case((24, 640, 8, 32, 128, native.Q8_0_ACT, True), seed=14)
    layout = native_layout([a[3], b[3]], 8, llamacpp_order=True)
    assert layout is not None and layout.arith == native.ARITH_Q0
    assert layout.zlist == (16, 128) and layout.zg is not None
    assert layout.zg.tolist() == [0, -1, 1]
    q = torch.cat([a[0], b[0]])
    gen = torch.Generator().manual_seed(15)
    for rows in (1, 2, 4, 5):
        x = torch.randn(rows, 640, generator=gen)
        got = NativeLinear(lib, layout, 48, 640, None)(x)
        assert torch.equal(got, NativeLinear(generic, layout, 48, 640, None)(x)), rows
        lin = NativeLinear(lib, layout, 48, 640, None)
        want = _emulated(lib, lin, x, q, torch.cat([a[1], b[1]]), torch.cat([a[2], b[2]]), 32)
        assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-6


def _random_q4k(
    n: int, k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, NativeLayout]:
    """A random Q4_K matrix's codes, scales and offsets, and its layout in llama.cpp's
    order (its 6-bit scales and mins, float32 d and dmin)."""
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    sc = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=gen)
    mins = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=gen)
    d = torch.rand(n, k // 256, generator=gen) * 1e-3
    dmin = torch.rand(n, k // 256, generator=gen) * 1e-3
    scale = d.repeat_interleave(8, 1) * sc.float()
    offset = -dmin.repeat_interleave(8, 1) * mins.float()
    part = NativePart(
        q, scale, offset, 32, None, native.Q8_K_ACT, False, KScales(sc, mins, d, dmin)
    )
    layout = native_layout([part], 4, llamacpp_order=True)
    assert layout is not None and layout.arith == native.ARITH_Q4K
    return q, scale, offset, layout


def test_q4k_order_is_the_same_in_plain_c(lib: ctypes.CDLL, generic: ctypes.CDLL) -> None:
    """Q4_K in llama.cpp's order (qmm.c q4k_tile: its 6-bit scales and mins, 16 rows
    interleaved, rows off the 16-grid masked; per 256 for 1 to 3 activation rows, per 64
    for rows in whole fours): the plain C build gives the same bits, and both are the
    emulated arithmetic."""
    n, k = 40, 512
    gen = torch.Generator().manual_seed(12)
    q, scale, offset, layout = _random_q4k(n, k, gen)
    for rows in (1, 2, 3, 4, 5, 8, 9):
        x = torch.randn(rows, k, generator=gen) * 3
        add = torch.randn(rows, n, generator=gen)
        got = NativeLinear(lib, layout, n, k, None)(x, add)
        assert torch.equal(got, NativeLinear(generic, layout, n, k, None)(x, add)), rows
        lin = NativeLinear(lib, layout, n, k, None)
        want = _emulated(lib, lin, x, q, scale, offset, 32)
        err = float(((got.double() - add.double()) - want).abs().max() / want.abs().max())
        assert err < 2e-6, (rows, err)


def test_q4k_prompt_rows_past_one_tile_are_the_same_in_plain_c(
    lib: ctypes.CDLL, generic: ctypes.CDLL
) -> None:
    """A prompt's Q4_K rows in whole fours go through q4k_tile64, up to 64 at a time, its
    mins' terms as 16-bit pairs of the activations' sums per 32: runs of 64 and a rest,
    rows whose every sum per 32 is the largest (+-32 * 127) among them, give plain C's
    bits."""
    n, k = 40, 512
    gen = torch.Generator().manual_seed(13)
    *_, layout = _random_q4k(n, k, gen)  # the same draws as before
    for rows in (64, 68, 130):
        x = torch.randn(rows, k, generator=gen) * 3
        x[0], x[1] = 1.0, -1.0  # every activation code +-127
        got = NativeLinear(lib, layout, n, k, None)(x)
        assert torch.equal(got, NativeLinear(generic, layout, n, k, None)(x)), rows


def test_q6k_order_is_the_same_in_plain_c(lib: ctypes.CDLL, generic: ctypes.CDLL) -> None:
    """Q6_K in llama.cpp's order (qmm.c q6k_tile: vec_dot's 8 lanes below 8 activation
    rows, the tiled GEMM's per-block total from 8 on): plain C gives the same bits, and
    both are the emulated arithmetic."""
    n, k = 40, 512
    gen = torch.Generator().manual_seed(16)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
    sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
    d = torch.rand(n, k // 256, generator=gen) * 1e-3
    scale = d.repeat_interleave(16, 1) * sc.float()
    part = NativePart(
        q, scale, -32 * scale, 16, 32, native.Q8_K_ACT, False, KScales(sc, None, d, None)
    )
    layout = native_layout([part], 6, llamacpp_order=True)
    assert layout is not None and layout.arith == native.ARITH_Q6K
    for rows in (1, 2, 7, 8, 9):
        x = torch.randn(rows, k, generator=gen) * 3
        add = torch.randn(rows, n, generator=gen)
        got = NativeLinear(lib, layout, n, k, None)(x, add)
        assert torch.equal(got, NativeLinear(generic, layout, n, k, None)(x, add)), rows
        lin = NativeLinear(lib, layout, n, k, None)
        want = _emulated(lib, lin, x, q, scale, -32 * scale, 16)
        err = float(((got.double() - add.double()) - want).abs().max() / want.abs().max())
        assert err < 2e-6, (rows, err)


def test_q6k_prompt_rows_past_one_tile_are_the_same_in_plain_c(
    lib: ctypes.CDLL, generic: ctypes.CDLL
) -> None:
    """A prompt's Q6_K rows (8 or more: the tiled GEMM) go through q6k_tile64, up to 64 at
    a time: runs of 64 and a rest, rows with every activation code at +-127, give plain
    C's bits."""
    n, k = 40, 512
    gen = torch.Generator().manual_seed(17)
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=gen)
    sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
    d = torch.rand(n, k // 256, generator=gen) * 1e-3
    scale = d.repeat_interleave(16, 1) * sc.float()
    part = NativePart(
        q, scale, -32 * scale, 16, 32, native.Q8_K_ACT, False, KScales(sc, None, d, None)
    )
    layout = native_layout([part], 6, llamacpp_order=True)
    assert layout is not None and layout.arith == native.ARITH_Q6K
    for rows in (64, 70, 130):
        x = torch.randn(rows, k, generator=gen) * 3
        x[0], x[1] = 1.0, -1.0
        got = NativeLinear(lib, layout, n, k, None)(x)
        assert torch.equal(got, NativeLinear(generic, layout, n, k, None)(x)), rows


def test_activation_quantisation_is_the_same_in_plain_c(
    lib: ctypes.CDLL, generic: ctypes.CDLL
) -> None:
    """The vectorised quantisation (AVX-512) and the plain C one give the same codes, scales
    and sums in every mode: ties rounded to even, K off the 16-grid (zero padding), a
    block's largest magnitude repeated with either sign (Q8_K takes the first)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 700, generator=gen) * 4
    x[0, :32] = torch.arange(32) - 15.5  # max 16.5 ... every x * id a half-way case or near
    x[0, 32:64] = torch.tensor([127.0, 2.5, -2.5, 3.5, 0.5, -0.5] + [1.0] * 26)
    x[1, :256] = x[1, :256].clamp(-8.0, 8.0)
    x[1, 10], x[1, 200] = -9.0, 9.0  # Q8_K: equal magnitudes, the first (negative) wins
    x[2, 256:512] = 0.0  # an all-zero 256-block
    for mode, kp in ((native.Q8_0_ACT, 704), (native.Q8_1_ACT, 704), (native.Q8_K_ACT, 768)):
        a = native.Activations(lib, x, kp, mode)
        b = native.Activations(generic, x, kp, mode)
        for name in ("qx", "dxe", "s16", "s32"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (mode, name)
    assert int(native.Activations(lib, x, 704, native.Q8_0_ACT).qx[0, 34]) == -int(
        native.Activations(lib, x, 704, native.Q8_0_ACT).qx[0, 33]
    )


def test_threads_do_not_change_a_single_bit(lib: ctypes.CDLL) -> None:
    part = _case((4096, 576, 4, 32, None, native.Q8_1_ACT, True), seed=5)[3]
    layout = native_layout([part], 4)
    assert layout is not None
    lin = NativeLinear(lib, layout, 4096, 576, None)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(6))
    assert lib.mvk_set_threads(1) == 1
    one = [lin(x[:1]), lin(x)]
    for count in (3, 8, 1, 2):  # a forced count past the cores, and the pool shrinking
        assert lib.mvk_set_threads(count) == count == lib.mvk_threads()
        ran = set()
        for _ in range(20):  # many products, so the chunks land on different threads
            assert torch.equal(lin(x[:1]), one[0]) and torch.equal(lin(x), one[1])
            ran.add(lib.mvk_last_ran())
        # Never more threads than the count (a busy machine may give fewer their turn).
        assert max(ran) <= count and min(ran) >= 1, (count, ran)
    lib.mvk_set_threads(1)
    lin(x)
    assert lib.mvk_last_ran() == 1  # the workers started for 8 stay parked


def test_a_stage_runs_the_thread_count_it_was_loaded_with_in_both_directions() -> None:
    """Issue 36: a stage loaded with 1 thread after one with 2 runs 1 (the pool used only
    to grow, so it ran 2), and its logits are the same at 1, 2 and a forced 5."""
    logits = {}
    for count in (2, 1, 5, 1):
        with native_stage(str(SMOLLM), 30, threads=count) as stage:
            assert native.threads() == count
            session = stage.new_session(32)
            logits[count] = session.forward_tokens(ONCE_UPON_A_TIME)
            session.close()
            if count == 1:
                assert native.last_ran() == 1
    assert all(torch.equal(v, logits[1]) for v in logits.values())


def test_the_layers_profile_counts_only_while_on() -> None:
    """scripts/profile_decode.py's per-phase figures (qmm.c mvk_profile): while on, a step
    adds to every phase of the layers, the phases within the whole; off, nothing moves."""
    with native_stage(str(SMOLLM), 30, threads=1) as stage:
        session = stage.new_session(32)
        session.forward_tokens(ONCE_UPON_A_TIME)
        native.profile(True)
        session.forward_tokens([42])
        on = native.profile(False)
        session.forward_tokens([43])
        off = native.profile(False)
        session.close()
    assert set(on) == set(native.PROFILE_PHASES)
    products = ("qkv", "attention", "wo", "gate_up", "activation", "down")
    assert all(on[p] > 0 for p in (*products, "prep", "layers")), on
    assert sum(on[p] for p in products) <= on["layers"]
    assert on["prep"] < sum(on[p] for p in ("qkv", "wo", "gate_up", "down"))
    assert all(v == 0 for v in off.values()), off


def test_fused_parts_with_different_zero_codes_keep_mins(lib: ctypes.CDLL) -> None:
    """Gemma's q|k|v fuses Q5_0 (zero 16) with Q8_0 (zero 128): one layout with mins."""
    a = _case((64, 640, 5, 32, 16, native.Q8_0_ACT, True), seed=7)
    b = _case((64, 640, 8, 32, 128, native.Q8_0_ACT, True), seed=8)
    layout = native_layout([a[3], b[3]], 8)
    assert layout is not None and layout.offset is not None and not layout.nibble
    lin = NativeLinear(lib, layout, 128, 640, None)
    x = torch.randn(2, 640, generator=torch.Generator().manual_seed(9))
    q = torch.cat([a[0], b[0]])
    want = _emulated(lib, lin, x, q, torch.cat([a[1], b[1]]), torch.cat([a[2], b[2]]), 32)
    assert float((lin(x).double() - want).abs().max() / want.abs().max()) < 2e-6


def test_scales_beyond_float16_are_refused() -> None:
    q, scale, offset, _ = _case((16, 64, 4, 32, 8, native.Q8_0_ACT, True), seed=10)
    big = NativePart(q, scale * 1e6, offset * 1e6, 32, 8, native.Q8_0_ACT, True)
    assert native_layout([big], 4) is None


def test_build_is_cached_and_failures_say_why(tmp_path: Path) -> None:
    first = native.build(tmp_path)
    cc = native._compiler()
    assert cc is not None and first.name == f"qmm-{native.cache_key(cc)}.so"
    mtime = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # nothing half-written
    with pytest.raises(RuntimeError, match="failed"):
        native.build(tmp_path / "bad", ("-DMVK_NO_SUCH_FLAG", "-Wl,--no-such-option"))
    assert not any((tmp_path / "bad").iterdir())
    with pytest.raises(RuntimeError, match=r"no C compiler|failed|No such file"):
        try:
            native.build(tmp_path / "none", compiler="/nonexistent/cc")
        except FileNotFoundError as e:
            raise RuntimeError(str(e)) from e


def test_a_prebuilt_kernel_folder_is_looked_in_and_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MVP_KERNELS_PREBUILT (a Docker node's read-only view of its host's builds, DECISIONS
    87): a build of this source there is used as it is; a folder without one is not
    written to: the build goes to the node's own folder."""
    from mvp_io.kernel_dirs import KERNELS_DIR_ENV, PREBUILT_ENV

    built = native.build()
    pre, own, empty = tmp_path / "pre", tmp_path / "own", tmp_path / "empty"
    pre.mkdir()
    empty.mkdir()
    shutil.copy(built, pre / built.name)
    monkeypatch.setenv(KERNELS_DIR_ENV, str(own))
    monkeypatch.setenv(PREBUILT_ENV, str(pre))
    assert native.build() == pre / built.name
    assert not own.exists()
    monkeypatch.setenv(PREBUILT_ENV, str(empty))
    with pytest.raises(RuntimeError, match="failed"):
        native.build(compiler="false")  # a compiler that fails: where did it try?
    assert not any(empty.iterdir()) and own.is_dir()


def test_the_choice_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        monkeypatch.setenv(native.ENV_CHOICE, "torch")
        native.forget()
        assert native.library() is None and native.why_not() == f"{native.ENV_CHOICE}=torch"
        monkeypatch.setenv(native.ENV_CHOICE, "fastest")
        native.forget()
        with pytest.raises(ValueError, match="MVP_ENGINE_KERNEL must be"):
            native.library()
    finally:
        monkeypatch.undo()
        native.forget()
    assert native.library() is not None


def test_auto_takes_the_avx2_build_for_a_model_of_its_formats_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DECISIONS 64: ``auto`` takes the kernel with AVX-512 VNNI for any model, the AVX2
    build for a model of Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K matrices alone (both bundled
    models), and torch's kernels otherwise (a Q5_K matrix: plain C there); once made, the
    choice holds for the process."""
    simd = native.load(native.build()).mvk_simd()
    gemma = frozenset({"Q4_K", "Q6_K", "Q8_0", "Q5_0"})
    smollm, q5k = frozenset({"Q4_1", "Q8_0"}), frozenset({"Q5_K", "Q6_K"})
    try:
        monkeypatch.setenv(native.ENV_CHOICE, "auto")
        native.forget()
        native.expect_formats(smollm)
        chosen = native.library()
        assert (chosen is not None) == (simd in (1, 2)), native.why_not()
        native.forget()
        native.expect_formats(gemma)
        assert (native.library() is not None) == (simd in (1, 2)), native.why_not()
        native.forget()
        native.expect_formats(q5k)
        chosen = native.library()
        assert (chosen is not None) == (simd == 1)
        if simd == 2:
            assert "the model has Q5_K" in native.why_not()
        native.expect_formats(smollm)  # too late: this process has chosen
        assert native.library() is chosen
    finally:
        monkeypatch.undo()
        native.forget()
    assert native.library() is not None


# The kernel's builds (native.py: -march=native and these flags after it): the host's own
# (AVX-512 VNNI where the CPU has it), the AVX2 one (a CPU without AVX-512), plain C on
# request (MVK_GENERIC) and plain C by the CPU (an x86-64 without AVX2: no F16C either).
BUILDS = {
    "simd": (),
    "avx2": ("-mno-avx512f",),
    "plain-c": ("-DMVK_GENERIC",),
    "plain-c-x86-64": ("-march=x86-64",),
}


@pytest.mark.parametrize("build", list(BUILDS))
def test_every_build_compiles_without_a_warning(tmp_path: Path, build: str) -> None:
    """Every build of qmm.c, with every piece it includes, compiles clean under -Wall
    -Wextra -Werror: a warning (an unused function, a missing initializer) is an error
    here, not noise in a node log. Each is the build it says (mvk_simd; a host without
    AVX2 has no AVX2 build)."""
    lib = native.library()
    assert lib is not None, native.why_not()
    host = lib.mvk_simd()
    want = {"simd": host, "avx2": 2 if host else 0}.get(build, 0)
    out = native.build(tmp_path, ("-Wall", "-Wextra", "-Werror", *BUILDS[build]))
    assert native.load(out).mvk_simd() == want


def test_qmm_c_includes_every_piece_once() -> None:
    """qmm.c is the one translation unit (one compiler call): it includes every other file
    of csrc/ once and no piece includes another, so no piece escapes a build or the
    warning check above."""
    included = re.findall(r'^#include "([^"]+)"$', native.SOURCE.read_text(), re.M)
    pieces = [p for p in native.sources() if p != native.SOURCE]
    assert len(pieces) > 1 and sorted(included) == sorted(p.name for p in pieces)
    for p in pieces:
        assert '#include "' not in p.read_text(), p.name


def test_the_build_cache_key_covers_every_source_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A change to any file of csrc/ (qmm.c or a piece it includes), a new piece or other
    flags is another build: a cached library is never one of other sources."""
    src = tmp_path / "csrc"
    shutil.copytree(native.SOURCE.parent, src)
    names = [p.name for p in native.sources()]
    monkeypatch.setattr(native, "SOURCE", src / "qmm.c")
    assert [p.name for p in native.sources()] == names and "qmm.c" in names
    base = native.cache_key("cc")
    seen = {base}
    for name in names:
        before = (src / name).read_bytes()
        (src / name).write_bytes(before + b"\n")
        seen.add(native.cache_key("cc"))
        (src / name).write_bytes(before)
        assert native.cache_key("cc") == base
    assert len(seen) == len(names) + 1
    (src / "extra.h").write_text("")
    assert native.cache_key("cc") not in seen
    (src / "extra.h").unlink()
    assert native.cache_key("cc", ("-DMVK_GENERIC",)) != base != native.cache_key("gcc")


def _k_layout(bits: int, seed: int) -> tuple[NativeLayout, int, int]:
    """A random Q4_K (bits 4) or Q6_K (bits 6) matrix in llama.cpp's order."""
    n, k = 40, 512
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, generator=gen)
    d = torch.rand(n, k // 256, generator=gen) * 1e-3
    if bits == 4:
        sc = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=gen)
        mins = torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=gen)
        dmin = torch.rand(n, k // 256, generator=gen) * 1e-3
        scale = d.repeat_interleave(8, 1) * sc.float()
        offset = -dmin.repeat_interleave(8, 1) * mins.float()
        part = NativePart(
            q, scale, offset, 32, None, native.Q8_K_ACT, False, KScales(sc, mins, d, dmin)
        )
    else:
        sc6 = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=gen)
        scale = d.repeat_interleave(16, 1) * sc6.float()
        part = NativePart(
            q, scale, -32 * scale, 16, 32, native.Q8_K_ACT, False, KScales(sc6, None, d, None)
        )
    layout = native_layout([part], bits, llamacpp_order=True)
    assert layout is not None
    return layout, n, k


@pytest.mark.parametrize("bits", [4, 6])
def test_a_batch_gives_each_row_its_own_sequences_sums(
    lib: ctypes.CDLL, generic: ctypes.CDLL, bits: int
) -> None:
    """Continuous batching's invariance at the kernel: several sequences' rows in one
    product, with their row kinds (native.segment_kinds), give each sequence's rows the
    bits of its own product, in the AVX-512 and the plain C build, whatever their order;
    as one product of all the rows (llama.cpp's choice by the row count) they would not."""
    layout, n, k = _k_layout(bits, 20 + bits)
    gen = torch.Generator().manual_seed(bits)
    lengths = [1, 5, 1, 9, 2, 4, 3]
    xs = [torch.randn(t, k, generator=gen) * 3 for t in lengths]
    for build in (lib, generic):
        lin = NativeLinear(build, layout, n, k, None)
        alone = [lin(x) for x in xs]
        for order in (list(range(len(xs))), list(reversed(range(len(xs)))), [3, 0, 6, 1, 5, 2, 4]):
            x = torch.cat([xs[i] for i in order])
            got = lin(x, row_kinds=native.segment_kinds([lengths[i] for i in order]))
            assert torch.equal(got, torch.cat([alone[i] for i in order])), order
        plain = lin(torch.cat(xs))
        assert not torch.equal(plain, torch.cat(alone))
