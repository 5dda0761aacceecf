"""The engine's own quantised matrix kernel (csrc/qmm.c), built for the host it runs on.

torch's CPU int4 kernel only vectorises bfloat16 activations and rounds its output to
bfloat16: on SmolLM2 that rounding cost most of the greedy agreement with llama.cpp, and
undoing it took three kernel calls per product (precision "exact", ~0.45x decode). This
kernel computes what llama.cpp computes (int8 activation blocks times the file's integer
codes, float32 scales, float32 sums) with AVX-512 VNNI, so the default path is both exact
in that sense and faster (figures in docs/benchmarks and docs/models.md). On a CPU without
AVX-512 VNNI the same source builds in plain C: each sum in the same order, lane by lane,
so the same bits, slower.

It is compiled once per host and source (C compiler ``cc``/``gcc``, ``-O3 -march=native``,
about a second; one call on qmm.c, which includes the rest of csrc/) into
``~/.cache/mvp-orchestrator/kernels/`` (or ``MVP_KERNELS_DIR``), with an atomic rename;
where no compiler works the engine falls back to torch's kernels and says why in the log.
``MVP_ENGINE_KERNEL`` chooses: ``auto`` (the default: the native kernel where the CPU has
AVX-512 VNNI, torch's elsewhere), ``native`` (the native kernel on any x86-64 CPU, in plain
C where there is no AVX-512 VNNI: llama.cpp's logits, slower) or ``torch`` (benchmarks,
comparisons).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mvp_io.kernel_dirs import KERNELS_DIR_ENV, PREBUILT_ENV, kernel_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "qmm.c"  # includes the other csrc/ files
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=c11", "-pthread")
ENV_CHOICE = "MVP_ENGINE_KERNEL"

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_why_not = ""
_formats: frozenset[str] | None = None  # the weight formats of the first model loaded

# What the AVX2 build (mvk_simd() == 2) computes in AVX2: a model whose matrices are all of
# these runs faster there than on torch's kernels; any other format (Q5_K) would run in
# plain C.
AVX2_FORMATS = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"})


def expect_formats(formats: frozenset[str]) -> None:
    """The weight formats (GGUF type names of the 2-D tensors) of the model this process
    loads: ``auto`` takes the AVX2 build for a model of AVX2_FORMATS alone. Once the
    choice is made (the first ``library()``) it holds for the process."""
    global _formats
    with _lock:
        if not _tried:
            _formats = formats


_P = ctypes.c_void_p
_I = ctypes.c_int64
_C = ctypes.c_int


def _cache_dirs() -> list[Path]:
    """Where a build is looked for, then may go: ``MVP_KERNELS_PREBUILT`` (looked in
    only: a container's read-only view of its host's builds), then ``MVP_KERNELS_DIR``,
    else the user's cache, else the temporary directory (a container whose home is
    read-only)."""
    first = [Path(p)] if (p := os.environ.get(PREBUILT_ENV)) else []
    if os.environ.get(KERNELS_DIR_ENV):
        return [*first, kernel_dir()]
    return [*first, kernel_dir(), Path(tempfile.gettempdir()) / "mvp-kernels"]


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def sources() -> list[Path]:
    """Every file of the kernel's source: qmm.c and the pieces it includes (csrc/)."""
    return sorted(p for p in SOURCE.parent.iterdir() if p.suffix in (".c", ".h"))


def cache_key(cc: str, extra_flags: tuple[str, ...] = ()) -> str:
    """The build's name in the cache: every source file (name and bytes), the compiler,
    the flags and the machine."""
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join((cc, *FLAGS, *extra_flags, platform.machine())).encode())
    return h.hexdigest()[:16]


def build(
    out_dir: Path | None = None, extra_flags: tuple[str, ...] = (), compiler: str | None = None
) -> Path:
    """Compile the kernel (or find it already built); raises RuntimeError saying why not."""
    cc = compiler or _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    key = cache_key(cc, extra_flags)
    if out_dir is None:
        prebuilt = os.environ.get(PREBUILT_ENV)
        for candidate in _cache_dirs():
            if (candidate / f"qmm-{key}.so").exists():
                return candidate / f"qmm-{key}.so"
            if prebuilt and candidate == Path(prebuilt):
                continue  # looked in, never written
            try:
                candidate.mkdir(parents=True, exist_ok=True)
            except OSError:
                continue
            if os.access(candidate, os.W_OK):
                out_dir = candidate
                break
        else:
            raise RuntimeError("no writable folder for the kernel build (MVP_KERNELS_DIR)")
    target = out_dir / f"qmm-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".qmm-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *FLAGS, *extra_flags, "-o", tmp, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.mvk_quantize.argtypes = [_P, _I, _I, _I, _I, _C, _P, _P, _P, _P]
    lib.mvk_quantize.restype = None
    lib.mvk_matmul.argtypes = [
        _P,
        _P,
        _P,
        _P,
        _I,
        _I,
        _P,
        _P,
        _P,
        _I,
        _C,
        _C,
        _C,
        _C,
        _P,
        _I,
        _P,
        _I,
        _C,
    ]
    lib.mvk_matmul.restype = None
    lib.mvk_linear.argtypes = [_P, _P, _I, _I, _I, _P, _P, _I]
    lib.mvk_linear.restype = _C
    lib.mvk_linear_rows.argtypes = [_P, _P, _I, _I, _I, _P, _P, _I, _P]
    lib.mvk_linear_rows.restype = _C
    lib.mvk_set_threads.argtypes = [_C]
    lib.mvk_set_threads.restype = _C
    lib.mvk_threads.argtypes = []
    lib.mvk_threads.restype = _C
    lib.mvk_last_ran.argtypes = []
    lib.mvk_last_ran.restype = _C
    lib.mvk_build_q4k.argtypes = [_P, _I, _I, _P, _P, _P, _P, _P]
    lib.mvk_build_q4k.restype = None
    lib.mvk_build_q6k.argtypes = [_P, _I, _I, _P, _P, _P]
    lib.mvk_build_q6k.restype = None
    lib.mvk_build_q5k.argtypes = [_P, _I, _I, _P, _P, _P, _P, _P]
    lib.mvk_build_q5k.restype = None
    lib.mvk_build_q0.argtypes = [_P, _I, _I, _C, _C, _P, _P, _P]
    lib.mvk_build_q0.restype = None
    lib.mvk_set_prefetch.argtypes = [_C]
    lib.mvk_set_prefetch.restype = _C
    lib.mvk_profile.argtypes = [_C, _P, _C]
    lib.mvk_profile.restype = _C
    lib.mvk_simd.argtypes = []
    lib.mvk_simd.restype = _C
    lib.mvk_rope_cache.argtypes = [ctypes.c_float, ctypes.c_float, _P, _I, _I, _I, _P, _P]
    lib.mvk_rope_cache.restype = None
    lib.mvk_rope_neox.argtypes = [_P, _I, _I, _I, _P, _P]
    lib.mvk_rope_neox.restype = None
    lib.mvk_rope_norm.argtypes = [_P, _I, _I, _I, _P, _P]
    lib.mvk_rope_norm.restype = None
    lib.mvk_attention.argtypes = [_P, _I, _I, _I, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P]
    lib.mvk_attention.restype = _C
    lib.mvk_swiglu.argtypes = [_P, _I, _I, _I, _P]
    lib.mvk_swiglu.restype = _C
    lib.mvk_rms_norm.argtypes = [_P, _I, _I, _I, _P, ctypes.c_float, _P]
    lib.mvk_rms_norm.restype = None
    lib.mvk_geglu.argtypes = [_P, _I, _I, _I, _P]
    lib.mvk_geglu.restype = None
    lib.mvk_layers.argtypes = [_P, _P, _I, _P, _I, _I, _P, _P, _I]
    lib.mvk_layers.restype = _C
    lib.mvk_layers_batch.argtypes = [_P, _P, _I, _P, _I, _P, _I]
    lib.mvk_layers_batch.restype = _C
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (torch's kernels are used; ``why_not()`` says why)."""
    global _lib, _tried, _why_not
    with _lock:
        if _tried:
            return _lib
        _tried = True
        choice = os.environ.get(ENV_CHOICE, "auto")
        if choice == "torch":
            _why_not = f"{ENV_CHOICE}=torch"
            return None
        if choice not in ("auto", "native"):
            raise ValueError(f"{ENV_CHOICE} must be 'auto', 'native' or 'torch', not {choice!r}")
        if platform.machine() not in ("x86_64", "AMD64"):
            _why_not = f"no native kernel for {platform.machine()}"
            return None
        try:
            lib = load(build())
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _why_not = str(e)
            log.warning("engine: native kernel unavailable, using torch's: %s", e)
            return None
        simd = lib.mvk_simd()
        if simd == 2 and choice == "auto" and _formats is not None and _formats <= AVX2_FORMATS:
            log.info(
                "engine: native kernel, AVX2 (no AVX-512 VNNI; %s)", ", ".join(sorted(_formats))
            )
        elif simd != 1:
            # The plain C build (or the AVX2 one with formats it runs in plain C): every
            # sum in the AVX-512 build's order, lane by lane, so the same bits (llama.cpp's
            # logits) on any x86-64 CPU, but several times slower than torch's kernels:
            # only when asked for (MVP_ENGINE_KERNEL=native).
            if choice == "auto":
                why = "this CPU has no AVX-512 VNNI"
                if simd == 2:
                    others = sorted((_formats or frozenset()) - AVX2_FORMATS)
                    why += f" and the model has {', '.join(others) or 'unknown formats'}"
                _why_not = f"{why} (MVP_ENGINE_KERNEL=native: plain C for those)"
                log.info("engine: %s; using torch's kernels", why)
                return None
            log.info("engine: native kernel without AVX-512 VNNI: exact, slower")
        _lib = lib
        return _lib


def forget() -> None:
    """Drop the cached choice, so the next ``library()`` reads MVP_ENGINE_KERNEL again."""
    global _lib, _tried, _why_not, _formats
    with _lock:
        _lib, _tried, _why_not, _formats = None, False, "", None


def use(lib: ctypes.CDLL) -> None:
    """Make an explicitly built and loaded kernel (``load(build(out, flags))``) the
    process's, in place of ``library()``'s choice: tests and benchmarks run another build
    (plain C, AVX2) through the whole engine. ``forget()`` undoes it."""
    global _lib, _tried, _why_not
    with _lock:
        _lib, _tried, _why_not = lib, True, ""


def why_not() -> str:
    return _why_not


def set_threads(n: int) -> int:
    """From now on ``n`` threads (the caller's included) share each of the kernel's
    products in this process: the pool grows, or parks the threads past ``n``. Returns the
    count in effect (0 without the kernel)."""
    lib = library()
    if lib is None:
        return 0
    return int(lib.mvk_set_threads(max(1, n)))


def threads() -> int:
    """The kernel's thread count in effect (0 without the kernel)."""
    lib = library()
    return 0 if lib is None else int(lib.mvk_threads())


def last_ran() -> int:
    """How many threads ran a part of the kernel's last product (the caller's included)."""
    lib = library()
    return 0 if lib is None else int(lib.mvk_last_ran())


PROFILE_PHASES = ("qkv", "attention", "wo", "gate_up", "activation", "down", "prep", "layers")


def profile(on: bool) -> dict[str, float]:
    """The layers' time by phase in seconds since the last call (qmm.c mvk_profile: each
    product's bracket includes its activations' preparation, which ``prep`` also counts;
    ``layers`` is the whole of mvk_layers), and counting switched on or off from now."""
    lib = library()
    if lib is None:
        return {}
    out = (ctypes.c_int64 * len(PROFILE_PHASES))()
    n = int(lib.mvk_profile(int(on), ctypes.addressof(out), len(out)))
    return {name: out[i] / 1e9 for i, name in enumerate(PROFILE_PHASES[:n])}


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: ``taskset``, a container's
    ``--cpuset-cpus``), not the machine's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


# How activations are quantised (qmm.c): llama.cpp's vec_dot_type of each weight format.
Q8_0_ACT, Q8_1_ACT, Q8_K_ACT = 0, 1, 2
# qmm.c MVK_ARITH_*: how a row's float sum is formed (see there)
ARITH_GROUPS, ARITH_Q0, ARITH_Q4K, ARITH_Q6K, ARITH_Q0R, ARITH_Q5K = 0, 1, 2, 3, 4, 5


class Weights(ctypes.Structure):
    """qmm.c's ``mvk_weights``: one matrix, described once."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("min", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("kp", ctypes.c_int64),
        ("nibble", ctypes.c_int32),
        ("sub", ctypes.c_int32),
        ("zero", ctypes.c_int32),
        ("mode", ctypes.c_int32),
        ("f32", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("norm", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("arith", ctypes.c_int32),
        ("zrow", ctypes.c_void_p),
        ("ksc", ctypes.c_void_p),
        ("kmin", ctypes.c_void_p),
        ("kd", ctypes.c_void_p),
        ("kdmin", ctypes.c_void_p),
        ("zg", ctypes.c_void_p),
        ("zlist", ctypes.c_int32 * 4),
        ("nz", ctypes.c_int32),
        ("next", ctypes.c_void_p),
    ]


class Activations:
    """int8 blocks of ``x`` [T, K] float32, padded to ``kp`` columns (see qmm.c)."""

    __slots__ = ("dxe", "kp", "qx", "rows", "s16", "s32")

    def __init__(self, lib: ctypes.CDLL, x: torch.Tensor, kp: int, mode: int = 0) -> None:
        t, k = x.shape
        if x.stride(1) != 1 or x.dtype != torch.float32:
            x = x.contiguous().float()
        self.rows, self.kp = t, kp
        self.qx = torch.empty(t, kp, dtype=torch.int8)
        self.dxe = torch.empty(t, kp // 4)
        self.s16 = torch.empty(t, kp // 16)
        self.s32 = torch.empty(t, kp // 32)
        lib.mvk_quantize(
            x.data_ptr(),
            t,
            k,
            x.stride(0),
            kp,
            mode,
            self.qx.data_ptr(),
            self.dxe.data_ptr(),
            self.s16.data_ptr(),
            self.s32.data_ptr(),
        )


class Rope:
    """Rope as ggml's CPU backend computes it (qmm.c mvk_rope_cache / mvk_rope_neox /
    mvk_rope_norm): float32 angles by repeated multiplication, libm cosf/sinf, fused
    multiply-adds. Whole heads, half-split pairs (``neox``) or adjacent ones (llama's
    unpermuted q/k); tables [positions, head_dim / 2], grown on demand."""

    def __init__(
        self, lib: ctypes.CDLL, base: float, freq_scale: float, head_dim: int, neox: bool = True,
        freq_factors: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        self.lib, self.base, self.freq_scale, self.head_dim = lib, base, freq_scale, head_dim
        # Llama 3's rope_freqs: [head_dim / 2] float32 divisors of each pair's angle
        self.freq_factors = (
            None if freq_factors is None else freq_factors.float().contiguous()[: head_dim // 2]
        )
        if self.freq_factors is not None and self.freq_factors.numel() != head_dim // 2:
            raise ValueError("native rope: rope_freqs needs head_dim / 2 factors")
        self._rotate = lib.mvk_rope_neox if neox else lib.mvk_rope_norm
        self.cos = torch.empty(0, head_dim // 2)
        self.sin = torch.empty(0, head_dim // 2)
        # Tables a grown one replaced stay alive: a call on another thread may still be
        # reading them in C (the GIL is released there).
        self._retired: list[torch.Tensor] = []

    def ensure(self, n: int) -> None:
        have = self.cos.shape[0]
        if have >= n:
            return
        n = max(n, 2 * have, 64)
        cos, sin = torch.empty(n, self.head_dim // 2), torch.empty(n, self.head_dim // 2)
        ff = None if self.freq_factors is None else self.freq_factors.data_ptr()
        self.lib.mvk_rope_cache(
            self.base, self.freq_scale, ff, self.head_dim, 0, n, cos.data_ptr(), sin.data_ptr()
        )
        self._retired += [self.cos, self.sin]
        self.cos, self.sin = cos, sin

    def apply_(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] (float32, contiguous) in place at pos..pos+T-1."""
        t, heads, hd = x.shape
        if hd != self.head_dim or x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("native rope: x must be contiguous float32 [T, heads, head_dim]")
        self.ensure(pos + t)
        self._rotate(x.data_ptr(), t, heads, hd, self.cos[pos].data_ptr(), self.sin[pos].data_ptr())
        return x


def attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    pos: int,
    window: int,
    scale: float = 1.0,
) -> torch.Tensor | None:
    """Attention of T queries ``q`` [T, nh, hd] at pos..pos+T-1 over the layer's caches
    ``kc``/``vc`` [nkv, max_seq, hd] (float16, ggml's default cache type; positions up to
    pos+T-1 written), as ggml computes it (qmm.c mvk_attention; ``scale`` multiplies q.k
    as ggml's kq_scale): [T, nh * hd], or None where the native kernel is not built for
    this CPU or the tensors do not fit it."""
    lib = library()
    if lib is None or kc.dtype != torch.float16 or vc.dtype != torch.float16:
        return None
    if not (kc.is_contiguous() and vc.is_contiguous()):
        return None
    t, nh, hd = q.shape
    if hd % 16:
        return None
    q = q.contiguous().float()
    npad = (pos + t + 63) // 64 * 64
    scratch = torch.empty(2 * npad + hd + 64 * hd + kc.shape[0] * hd * npad)  # qmm.c
    out = torch.empty(t, nh * hd)
    rc = lib.mvk_attention(
        q.data_ptr(), t, nh, hd, kc.data_ptr(), vc.data_ptr(), kc.shape[0], kc.shape[1],
        pos, window, scale, out.data_ptr(), scratch.data_ptr(),
    )  # fmt: skip
    return out if rc == 0 else None


def swiglu(gu: torch.Tensor, n: int) -> torch.Tensor | None:
    """silu(gate) * up of ``gu`` [T, 2n] (gate | up) as ggml computes it (qmm.c
    mvk_swiglu), or None where the native kernel is not built or n is not a multiple of 16."""
    lib = library()
    if lib is None or gu.dtype != torch.float32 or gu.stride(-1) != 1 or n % 16:
        return None
    out = torch.empty(gu.shape[0], n)
    if lib.mvk_swiglu(gu.data_ptr(), gu.shape[0], n, gu.stride(0), out.data_ptr()) != 0:
        return None
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMS norm over the last dim as ggml computes it (qmm.c rms_norm: squares summed in
    double, 1 / sqrtf(mean + eps) in float32, then x * scale * w), or None where the
    native kernel is not built."""
    lib = library()
    if lib is None or x.dtype != torch.float32 or w.dtype != torch.float32:
        return None
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], k)
    wc = w.contiguous()  # alive through the call
    lib.mvk_rms_norm(
        x2.data_ptr(), x2.shape[0], k, x2.stride(0), wc.data_ptr(), eps, out.data_ptr()
    )
    return out.view(x.shape)


def geglu(gu: torch.Tensor, n: int) -> torch.Tensor | None:
    """gelu(gate) * up of ``gu`` [T, 2n] (gate | up) as ggml computes it (qmm.c
    mvk_geglu: its float16 gelu table), or None where the native kernel is not built."""
    lib = library()
    if lib is None or gu.dtype != torch.float32 or gu.stride(-1) != 1:
        return None
    out = torch.empty(gu.shape[0], n)
    lib.mvk_geglu(gu.data_ptr(), gu.shape[0], n, gu.stride(0), out.data_ptr())
    return out


class LayerSpec(ctypes.Structure):
    """qmm.c's ``mvk_layer``: one decoder layer for ``mvk_layers``."""

    _fields_ = [
        ("qkv", ctypes.c_void_p),
        ("wo", ctypes.c_void_p),
        ("gate_up", ctypes.c_void_p),
        ("down", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("post_attn", ctypes.c_void_p),
        ("post_ffn", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("neox", ctypes.c_int32),
        ("geglu", ctypes.c_int32),
        ("window", ctypes.c_int64),
        ("kq_scale", ctypes.c_float),
        ("round_scale", ctypes.c_float),
        ("qkv_bias", ctypes.c_void_p),
        ("q_scale", ctypes.c_float),
        ("out_last", ctypes.c_int32),
    ]


class Dims(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("nh", ctypes.c_int64),
        ("nkv", ctypes.c_int64),
        ("hd", ctypes.c_int64),
        ("ffn", ctypes.c_int64),
        ("eps", ctypes.c_float),
    ]


# qmm.c MVK_ROW_*: a row's share of llama.cpp's row-count-dependent sums
ROW_PER64, ROW_TILED = 1, 2


def feed_forward_rows(t: int) -> torch.Tensor:
    """Row kinds of the model's last layer's feed-forward products over a prompt's ``t``
    rows: llama.cpp keeps only the last row after the attention (ggml_get_rows of the
    output rows), so that row's products are one-row products (qmm.c mvk_layer.out_last);
    the other rows' results are never used."""
    kinds = segment_kinds([t])
    kinds[-1] = 0
    return kinds


def segment_kinds(lengths: list[int]) -> torch.Tensor:
    """Row kinds (uint8, one per row) for a batch of sequences' rows, ``lengths`` rows
    each in row order: every row the kind its own sequence's product of that many rows
    gives it (qmm.c seg_kind: in its whole fours, PER64 (Q4_K's gemm); 8 rows or more,
    TILED (Q6_K's GEMM))."""
    kinds = []
    for t in lengths:
        tiled = ROW_TILED if t >= 8 else 0
        kinds += [(ROW_PER64 if i < t // 4 * 4 else 0) | tiled for i in range(t)]
    return torch.tensor(kinds, dtype=torch.uint8)


class Segment(ctypes.Structure):
    """qmm.c's ``mvk_seg``: one sequence's rows of a batch (``Layers.forward_batch_``)."""

    _fields_ = [
        ("row0", ctypes.c_int64),
        ("t", ctypes.c_int64),
        ("pos", ctypes.c_int64),
        ("kc", ctypes.c_void_p),
        ("vc", ctypes.c_void_p),
        ("max_seq", ctypes.c_int64),
    ]


@dataclass
class LayerPlan:
    """One layer for ``Layers``: its four products (NativeLinear ``_weights``, norms fused
    into qkv and gate_up), optional per-head q/k norms and post norms (float32 vectors,
    kept alive here), its rope, window, kq_scale and the float16 hand-over scale before
    it (0: none)."""

    qkv: Any
    wo: Any
    gate_up: Any
    down: Any
    rope: Rope
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None
    post_ffn: torch.Tensor | None = None
    geglu: bool = False
    window: int = 0
    kq_scale: float = 1.0
    round_scale: float = 0.0
    qkv_bias: torch.Tensor | None = None  # Qwen 2's q/k/v biases
    q_scale: float = 0.0  # q *= q_scale after the rope (Phi-3); 0: none
    out_last: bool = False  # the model's last layer (feed-forward_rows)


class Layers:
    """A stage's decoder layers as one foreign call per forward (qmm.c mvk_layers): the
    same kernels and float order as the per-op forward in models/, without a
    torch op or Python call between them."""

    def __init__(
        self, lib: ctypes.CDLL, hidden: int, nh: int, nkv: int, hd: int, ffn: int, eps: float,
        plans: list[LayerPlan],
    ) -> None:  # fmt: skip
        self.lib, self.plans = lib, plans
        self.dims = Dims(hidden, nh, nkv, hd, ffn, eps)
        self.specs = (LayerSpec * len(plans))()
        for spec, p in zip(self.specs, plans, strict=True):
            spec.qkv, spec.wo = ctypes.addressof(p.qkv), ctypes.addressof(p.wo)
            spec.gate_up, spec.down = ctypes.addressof(p.gate_up), ctypes.addressof(p.down)
            spec.q_norm = spec.k_norm = spec.post_attn = spec.post_ffn = spec.qkv_bias = None
            for name in ("q_norm", "k_norm", "post_attn", "post_ffn", "qkv_bias"):
                v = getattr(p, name)
                if v is not None:
                    v = v.float().contiguous()
                    setattr(p, name, v)
                    setattr(spec, name, v.data_ptr())
            spec.neox = int(p.rope._rotate is lib.mvk_rope_neox)
            spec.geglu, spec.window = int(p.geglu), p.window
            spec.kq_scale, spec.round_scale = p.kq_scale, p.round_scale
            spec.q_scale, spec.out_last = p.q_scale, int(p.out_last)
        self._tables: list[tuple[int, int]] = []

    def _ensure_tables(self, end: int) -> None:
        for p in self.plans:
            p.rope.ensure(end)
        tables = [(p.rope.cos.data_ptr(), p.rope.sin.data_ptr()) for p in self.plans]
        if tables != self._tables:  # a table grew (moved)
            for spec, (c, s) in zip(self.specs, tables, strict=True):
                spec.cos, spec.sin = c, s
            self._tables = tables

    def forward_batch_(
        self, h: torch.Tensor, segments: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    ) -> bool:
        """Run the layers on a batch of sequences' rows ``h`` [T, hidden] (float32,
        contiguous; updated in place): ``segments`` in row order, each (rows, position, k
        cache, v cache) of one sequence, its caches [layers, nkv, max_seq, hd] (contiguous
        views of a session's slot). Each sequence's rows come out as ``forward_`` computes
        them for that sequence alone, bit for bit (qmm.c mvk_layers_batch); False where
        the kernel is not built for this CPU (nothing was changed then)."""
        segs = (Segment * len(segments))()
        row0, end = 0, 0
        for seg, (t, pos, kc, vc) in zip(segs, segments, strict=True):
            f16 = kc.dtype == vc.dtype == torch.float16
            if not (kc.is_contiguous() and vc.is_contiguous() and f16):
                raise ValueError("native layers: caches must be contiguous float16")
            seg.row0, seg.t, seg.pos = row0, t, pos
            seg.kc, seg.vc, seg.max_seq = kc.data_ptr(), vc.data_ptr(), kc.shape[2]
            row0 += t
            end = max(end, pos + t)
        if row0 != h.shape[0]:
            raise ValueError(f"segments cover {row0} rows, h has {h.shape[0]}")
        self._ensure_tables(end)
        rc = self.lib.mvk_layers_batch(
            ctypes.byref(self.dims), self.specs, len(self.plans), h.data_ptr(), row0,
            segs, len(segments),
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("native kernel: no memory for the layers' buffers")
        return bool(rc == 0)

    def forward_(self, h: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: int) -> bool:
        """Run the layers on ``h`` [T, hidden] (float32, contiguous; updated in place) at
        pos..pos+T-1 with the session's caches [layers, nkv, max_seq, hd]; False where the
        kernel is not built for this CPU (nothing was changed then)."""
        if not (
            kc.dtype == vc.dtype == torch.float16 and kc.is_contiguous() and vc.is_contiguous()
        ):
            raise ValueError("native layers: caches must be contiguous float16")
        t = h.shape[0]
        self._ensure_tables(pos + t)
        rc = self.lib.mvk_layers(
            ctypes.byref(self.dims), self.specs, len(self.plans), h.data_ptr(), t, pos,
            kc.data_ptr(), vc.data_ptr(), kc.shape[2],
        )  # fmt: skip
        if rc == -1:
            raise MemoryError("native kernel: no memory for the layers' buffers")
        return bool(rc == 0)
