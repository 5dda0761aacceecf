"""The native layouts cached on the node's disk (layout_cache.py, issue 36): a load that
maps them computes the very logits a load that builds them does, for every format family
the kernel has; a damaged, foreign or stale file is rebuilt, never used; the directory
stays under its cap; a cache that cannot be written is no cache, never a failed load."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.node.engine.arch_cases import PROMPT, write_case
from workers.node.engine import EngineOptions, load_stage, native
from workers.node.engine.kernels import NativeLinear
from workers.node.engine.layout_cache import ENV_DIR, ENV_GB, LayoutCache, open_cache

from .conftest import native_kernel

# Every layout the kernel has: group order (Q4_1, Q5_1), llama.cpp's order for the vec_dot
# formats (Q5_0, Q8_0) and repacked Q4_0, the K formats (Q4_K, Q5_K, Q6_K: no float scales
# kept, empty tensors in the file), fused parts of different formats.
CASES = ("llama-Q4_1", "qwen2-Q5_1", "gemma3-mix", "mistral-Q4_0-mix", "qwen2-Q5_K_M")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    where = tmp_path / "layouts"
    monkeypatch.setenv(ENV_DIR, str(where))
    monkeypatch.delenv(ENV_GB, raising=False)
    yield where


def _logits(path: str, n_layers: int, cache: bool) -> tuple[torch.Tensor, frozenset[str]]:
    with native_kernel():
        stage = load_stage(
            path, 0, n_layers, EngineOptions(device="cpu", threads=1, layout_cache=cache)
        )
        try:
            session = stage.new_session(64)
            out = session.forward_tokens(PROMPT)
            session.close()
            return out, stage.tensor_names_loaded
        finally:
            stage.close()


@pytest.mark.parametrize("case", CASES)
def test_a_mapped_layout_gives_the_built_layouts_logits(
    case: str, tmp_path: Path, cache_dir: Path
) -> None:
    model = write_case(case, tmp_path)
    n = model.spec.n_layers
    built, names = _logits(model.path, n, cache=False)
    assert not cache_dir.exists() or not any(cache_dir.iterdir())
    first, first_names = _logits(model.path, n, cache=True)  # builds, stores, maps
    files = sorted(p.name for p in cache_dir.iterdir())
    assert files and all(f.endswith(".layout") for f in files)
    mtimes = {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()}
    again, again_names = _logits(model.path, n, cache=True)  # maps only
    assert sorted(p.name for p in cache_dir.iterdir()) == files
    assert {p.name: p.stat().st_mtime_ns for p in cache_dir.iterdir()} != mtimes  # used
    assert torch.equal(first, built) and torch.equal(again, built)
    assert names == first_names == again_names  # the same tensors, whether built or mapped


def test_a_damaged_foreign_or_stale_file_is_rebuilt(tmp_path: Path, cache_dir: Path) -> None:
    model = write_case("gemma3-mix", tmp_path)
    n = model.spec.n_layers
    built, _ = _logits(model.path, n, cache=True)
    files = sorted(cache_dir.iterdir())
    # cut short, garbage, and another product's file under this one's name
    files[0].write_bytes(files[0].read_bytes()[:100])
    files[1].write_bytes(b"\0" * files[1].stat().st_size)
    files[2].write_bytes(files[3].read_bytes())
    again, _ = _logits(model.path, n, cache=True)
    assert torch.equal(again, built)
    cache = open_cache()
    assert cache is not None
    for f in files[:3]:  # rebuilt whole: they map now
        assert cache.get(f.name.removesuffix(".layout")) is not None
    # The model rewritten (another mtime): other keys, nothing of the old file used.
    before = {p.name for p in cache_dir.iterdir()}
    os.utime(model.path, ns=(1, 1))
    _logits(model.path, n, cache=True)
    after = {p.name for p in cache_dir.iterdir()}
    assert before < after and len(after) == 2 * len(before)


def test_the_directory_stays_under_its_cap_and_dead_writers_are_cleared(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir()
    for i in range(5):
        p = root / f"{i}.layout"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (1000 + i, 1000 + i))  # 0 used longest ago
    stale, fresh = root / ".tmp-1-aa", root / ".tmp-2-bb"
    stale.write_bytes(b"y")
    os.utime(stale, (1, 1))
    fresh.write_bytes(b"y")
    LayoutCache(root, max_bytes=2500).trim()
    assert sorted(p.name for p in root.iterdir()) == [".tmp-2-bb", "3.layout", "4.layout"]


def test_a_cache_that_cannot_be_written_is_none_and_off_is_off(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert open_cache({ENV_DIR: str(blocked / "layouts")}) is None
    assert open_cache({ENV_DIR: "off"}) is None
    assert open_cache({ENV_DIR: str(tmp_path / "ok"), ENV_GB: "0"}) is None
    cache = open_cache({ENV_DIR: str(tmp_path / "ok"), ENV_GB: "0.5"})
    assert cache is not None and cache.max_bytes == 1 << 29


def test_the_key_names_the_file_that_was_read_not_what_its_path_names_later(
    tmp_path: Path,
) -> None:
    """A model replaced by rename while a stage loads (a re-download): the layouts are
    keyed by the file that was mapped and read, never stored under the new file's key."""
    from workers.node.engine.gguf_reader import GGUFFile

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model = write_case("llama-Q4_1", tmp_path / "a")
    other = write_case("llama-Q4_1", tmp_path / "b")  # the same name, another file
    st = os.stat(model.path)
    f = GGUFFile(model.path)
    try:
        os.replace(other.path, model.path)
        assert f.identities == [(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)]
        assert os.stat(model.path).st_ino != st.st_ino
    finally:
        f.close()


def _native_linears(obj: object, out: list[NativeLinear], depth: int = 0) -> list[NativeLinear]:
    if isinstance(obj, NativeLinear):
        out.append(obj)
    elif isinstance(obj, list | tuple):
        for x in obj:
            _native_linears(x, out, depth + 1)
    elif hasattr(obj, "__dict__") and depth < 4 and not isinstance(obj, torch.Tensor):
        for x in vars(obj).values():
            _native_linears(x, out, depth + 1)
    return out


def _built_layouts(path: str, n_layers: int, threads: int) -> list[Any]:
    """Every native product's layouts of a whole-model stage, built (no layout cache)."""
    with native_kernel():
        opts = EngineOptions(device="cpu", threads=threads, layout_cache=False)
        stage = load_stage(path, 0, n_layers, opts)
        layouts = [lin.layouts for lin in _native_linears(stage.model, [])]
        stage.close()
    return layouts


def _assert_same_layouts(a_list: list[Any], b_list: list[Any]) -> None:
    assert a_list and len(a_list) == len(b_list)
    for whole, other in zip(a_list, b_list, strict=True):
        assert len(whole) == len(other)
        for a, b in zip(whole, other, strict=True):
            for f in fields(a):
                x, y = getattr(a, f.name), getattr(b, f.name)
                if isinstance(x, torch.Tensor):
                    assert isinstance(y, torch.Tensor) and x.dtype == y.dtype, f.name
                    assert x.shape == y.shape and torch.equal(x, y), f.name
                else:
                    assert x == y, f.name


@pytest.mark.parametrize(
    "case",
    [
        "llama-Q4_K", "phi3-Q6_K", "llama3-Q4_K_M", "gemma3-mix", "qwen2-Q5_K_M",
        "qwen3-Q4_0", "llama3-Q8_0", "mistral-Q4_0-mix", "gemma3-Q4_0", "llama-Q4_1",
        "qwen2-Q5_1",
    ],
)  # fmt: skip
def test_layouts_from_blocks_are_the_decoded_codes_layouts(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layouts built straight from the GGUF blocks in C (loader.BLOCKS_DIRECT: Q4_K, Q5_K,
    Q6_K, Q4_0 repacked or not, Q4_1, Q5_0, Q5_1, Q8_0) are, field for field, the ones
    built through the decoded codes in torch: every product of files with those formats
    alone, fused with each other (a Q4_K_M q/k/v; a q/k/v of repacked Q4_0 and Q8_0;
    Gemma's mix of Q5_0 and Q8_0), beside products that stay in torch (permuted rows), in
    chunks of 32 rows by 1 and 3 threads."""
    from workers.node.engine import loader
    from workers.node.engine.kernels import BlocksLayout

    model = write_case(case, tmp_path)
    monkeypatch.setattr(loader, "_CHUNK_ROWS", 32)
    direct_calls: list[tuple[int, int]] = []
    fill = BlocksLayout.fill

    def counted(self: BlocksLayout, *args: Any, **kw: Any) -> None:
        direct_calls.append((id(self.codes), self.type))
        fill(self, *args, **kw)

    monkeypatch.setattr(BlocksLayout, "fill", counted)
    built = {}
    for direct, threads in ((False, 1), (True, 1), (True, 3)):
        monkeypatch.setattr(loader, "BLOCKS_DIRECT", direct)
        built[direct, threads] = _built_layouts(model.path, model.spec.n_layers, threads)
    _assert_same_layouts(built[False, 1], built[True, 1])
    _assert_same_layouts(built[False, 1], built[True, 3])
    # every layout of a llama.cpp-order product of the direct builds came from its blocks
    # (of those files, none is permuted or scaled by other than a power of two)
    arith = (native.ARITH_Q4K, native.ARITH_Q5K, native.ARITH_Q6K)
    arith += (native.ARITH_Q0, native.ARITH_Q0R)
    for key in ((True, 1), (True, 3)):
        codes = {id(x.codes) for lays in built[key] for x in lays if x.arith in arith}
        from_blocks = {c for c, _ in direct_calls}
        assert codes, key
        assert codes <= from_blocks, key
    if case == "llama3-Q4_K_M":
        assert {t for _, t in direct_calls} == {int(QT.Q4_K), int(QT.Q6_K)}


def test_layouts_from_blocks_refuse_blocks_that_do_not_fit() -> None:
    """The C builder is handed exactly its matrix's bytes, or a clear error (it would read
    past them)."""
    from workers.node.engine.kernels import BlocksLayout, layout_from_blocks

    lib = native.library()
    assert lib is not None
    q4k, q6k, q8 = int(QT.Q4_K), int(QT.Q6_K), int(QT.Q8_0)
    with pytest.raises(ValueError, match="16 x 256 blocks of type 12 do not fit 2000 bytes"):
        layout_from_blocks(lib, torch.zeros(2000, dtype=torch.uint8), q4k, 16, 256)
    with pytest.raises(ValueError, match="a 8 x 256 layout of type 14 needs 16-row groups"):
        layout_from_blocks(lib, torch.zeros(8 * 210, dtype=torch.uint8), q6k, 8, 256)
    with pytest.raises(ValueError, match="a 16 x 48 layout of type 8 needs 16-row groups"):
        layout_from_blocks(lib, torch.zeros(16 * 51, dtype=torch.uint8), q8, 16, 48)
    built = BlocksLayout(lib, q6k, 32, 256)
    with pytest.raises(ValueError, match=r"rows \[16, 48\) of 32 are not whole groups"):
        built.fill(torch.zeros(32 * 210, dtype=torch.uint8), 16, 32)


@pytest.mark.parametrize("case", CASES)
def test_layouts_built_by_row_chunks_are_the_whole_matrixs(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A matrix's layout built 32 rows at a time and joined (loader.CHUNKED_LAYOUTS: a
    chunk's temporaries instead of the matrix's), on one thread or by three at once (the
    stage's thread count), is the layout built whole, field by field, for every product
    of every format family."""
    from workers.node.engine import loader

    model = write_case(case, tmp_path)
    monkeypatch.setattr(loader, "_CHUNK_ROWS", 32)
    monkeypatch.setattr(loader, "BLOCKS_DIRECT", False)  # the torch path, K formats too
    built = {}
    for chunked, threads in ((False, 1), (True, 1), (True, 3)):
        monkeypatch.setattr(loader, "CHUNKED_LAYOUTS", chunked)
        built[chunked, threads] = _built_layouts(model.path, model.spec.n_layers, threads)
    _assert_same_layouts(built[False, 1], built[True, 1])
    _assert_same_layouts(built[False, 1], built[True, 3])
