"""The native kernel's weight layouts, cached on the node's disk (issue 36).

Building a stage's layouts from the GGUF bytes (loader.WeightBuilder._native: codes
unpacked, scales split, rows interleaved by 16) runs at about 100 MB/s here; the layouts
themselves are plain arrays. So the first load of a matrix writes its layouts to a file of
their own, and every later load of it, by this node or another on the same host, maps
that file instead: a load then costs what reading the page cache costs, and nodes that
hold the same layers share their pages.

* **One file per product** (a fused q|k|v, gate|up, the head): any layer range reuses
  the files of its layers, so a replacement or another split of the same model hits.
* **Keyed by what the layout is made of:** the model files' identity (device, inode,
  size, modification time: a file rewritten or fetched into is another key), the
  tensors' names, formats, shapes and offsets, the permutation and factor folded into
  their rows, the summation order, and a digest of the code that builds layouts (a
  change to it is another key, never a stale layout).
* **Safe under concurrent starts:** written under a temporary name and renamed into
  place, so a reader sees a whole file or none; two nodes building the same file both
  rename a whole one. A file is checked against its key and its recorded size when
  mapped: anything else is a miss (removed, rebuilt), never an error.
* **Bounded:** ``MVP_LAYOUT_CACHE_GB`` (default 32; 0 turns it off) caps the directory;
  the files used longest ago go first, temporary files of a node that died are cleared,
  and nothing is written where it would leave under 1 GiB of disk free.
* **Durable:** a file is synced before its name appears (no whole-sized file of zeros
  after a power loss); one that cannot be mapped now (no memory, no descriptor) is kept.
* **Where:** ``MVP_LAYOUT_CACHE`` (a directory; ``off`` turns it off), else
  ``~/.cache/mvp-orchestrator/layouts``. A directory that cannot be written is no
  cache (said once in the log), never a failed load.

The mapping is read-only and shared: the kernel never writes weights, and its pages are
the page cache's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import secrets
import struct
import time
import warnings
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from .kernels import NativeLayout

log = logging.getLogger("mvp.node.engine")

ENV_DIR = "MVP_LAYOUT_CACHE"
ENV_GB = "MVP_LAYOUT_CACHE_GB"
DEFAULT_GB = 32.0
_MAGIC = b"MVPLAY01"
_ALIGN = 64
_STALE_TMP_S = 3600.0
# The code a layout is built by and read by: a change to any of these files (the
# kernel's C sources included) is a new key.
_SOURCES = ("kernels.py", "quants.py", "loader.py", "layout_cache.py", "native.py")
# NativeLayout's tensor fields, all of them (a field added there is stored here too).
_TENSOR_FIELDS = tuple(f.name for f in fields(NativeLayout) if "Tensor" in str(f.type))
_FREE_MARGIN = 1 << 30  # a file is not written where it would leave less disk than this
_DTYPES = {
    str(d): d
    for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.float16, torch.float32)
}


def _source_digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for path in [*(here / n for n in _SOURCES), *sorted((here / "csrc").iterdir())]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


_SOURCE = _source_digest()


def layout_key(files: list[tuple[int, int, int, int]], what: dict[str, Any]) -> str:
    """The file name of one product's layouts: a digest of the model files' identity,
    ``what`` (its tensors, row changes and summation order) and the building code."""
    text = json.dumps({"files": files, "what": what, "source": _SOURCE}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def tensor_digest(t: torch.Tensor | None) -> str | None:
    """A small tensor's content as key material (a row permutation)."""
    if t is None:
        return None
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


class LayoutCache:
    """One directory of layout files (see the module's docstring)."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.written = 0
        self._maps: list[mmap.mmap] = []  # kept for the life of the tensors on them

    def _path(self, key: str) -> Path:
        return self.root / f"{key}.layout"

    def get(self, key: str) -> tuple[list[NativeLayout], list[int]] | None:
        """The layouts and row counts stored under ``key``, mapped; None on a miss (a
        file absent, or not whole and this key's: then removed)."""
        got = self.reopen(key)
        if got is None:
            self.misses += 1
        else:
            self.hits += 1
        return got

    def reopen(self, key: str) -> tuple[list[NativeLayout], list[int]] | None:
        """As ``get``, uncounted: what ``put`` has just stored, mapped."""
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            got = self._read(fd, key)
        except (ValueError, KeyError, TypeError, struct.error, RuntimeError) as e:
            log.warning("engine: layout cache file %s unusable (%s): rebuilding it", path, e)
            got = None
            try:
                path.unlink()
            except OSError:
                pass
        except OSError as e:  # the file may be sound (no memory, no descriptor): kept
            log.warning("engine: layout cache file %s not mapped (%s): building", path, e)
            got = None
        finally:
            os.close(fd)
        if got is None:
            return None
        try:
            os.utime(path)  # most recently used: kept longest
        except OSError:
            pass
        return got

    def _read(self, fd: int, key: str) -> tuple[list[NativeLayout], list[int]] | None:
        size = os.fstat(fd).st_size
        if size < 16:
            raise ValueError(f"{size} bytes")
        mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        try:
            if mm[:8] != _MAGIC:
                raise ValueError("not a layout file")
            (n,) = struct.unpack_from("<Q", mm, 8)
            if 16 + n > size:
                raise ValueError("header past the end")
            meta = json.loads(bytes(mm[16 : 16 + n]))
            if meta["key"] != key or meta["size"] != size:
                raise ValueError("another key's, or not whole")
            layouts = []
            for entry in meta["layouts"]:
                tensors: dict[str, torch.Tensor | None] = {}
                for name in _TENSOR_FIELDS:
                    spec = entry["tensors"].get(name)
                    if spec is None:
                        tensors[name] = None
                        continue
                    dtype, shape, offset, nbytes = spec
                    if offset % _ALIGN or offset + nbytes > size:
                        raise ValueError(f"{name} outside the file")
                    if nbytes == 0:  # the K formats' unused float scales
                        tensors[name] = torch.empty(shape, dtype=_DTYPES[dtype])
                        continue
                    with warnings.catch_warnings():  # read-only: the kernel never writes
                        warnings.simplefilter("ignore", UserWarning)
                        raw = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset)
                    tensors[name] = raw.view(_DTYPES[dtype]).view(shape)
                scalars = entry["scalars"]
                layouts.append(
                    NativeLayout(
                        **tensors,  # type: ignore[arg-type]
                        nibble=bool(scalars["nibble"]),
                        sub=int(scalars["sub"]),
                        zero=int(scalars["zero"]),
                        mode=int(scalars["mode"]),
                        kp=int(scalars["kp"]),
                        arith=int(scalars["arith"]),
                        zlist=tuple(int(z) for z in scalars["zlist"]),
                        bits5=bool(scalars["bits5"]),
                    )
                )
            rows = [int(r) for r in meta["rows"]]
        except BaseException:
            mm.close()
            raise
        self._maps.append(mm)
        return layouts, rows

    def put(self, key: str, layouts: list[NativeLayout], rows: list[int]) -> None:
        """Store ``layouts`` under ``key`` (whole, or not at all; errors only logged)."""
        entries: list[dict[str, Any]] = []
        blobs: list[tuple[int, torch.Tensor]] = []
        offset = 0
        for lay in layouts:
            tensors: dict[str, list[Any]] = {}
            for name in _TENSOR_FIELDS:
                t = getattr(lay, name)
                if t is None:
                    continue
                t = t.detach().contiguous()
                nbytes = t.numel() * t.element_size()
                tensors[name] = [str(t.dtype), list(t.shape), offset, nbytes]
                blobs.append((offset, t))
                offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            entries.append(
                {
                    "tensors": tensors,
                    "scalars": {
                        "nibble": lay.nibble,
                        "sub": lay.sub,
                        "zero": lay.zero,
                        "mode": lay.mode,
                        "kp": lay.kp,
                        "arith": lay.arith,
                        "zlist": list(lay.zlist),
                        "bits5": lay.bits5,
                    },
                }
            )
        # The header's length depends on the offsets it holds: fix the data's start first.
        meta: dict[str, Any] = {"key": key, "rows": rows, "layouts": entries, "size": 0}
        specs = sum(len(e["tensors"]) for e in entries)
        head = len(json.dumps(meta)) + 24 * (specs + 1)  # room for the offsets' digits
        start = (16 + head + _ALIGN - 1) // _ALIGN * _ALIGN
        for entry in entries:
            for spec in entry["tensors"].values():
                spec[2] += start
        meta["size"] = start + offset
        text = json.dumps(meta).encode()
        if 16 + len(text) > start:
            return  # cannot happen (the header only grew by digits counted above)
        tmp = self.root / f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(self.root)
            if st.f_bavail * st.f_frsize < meta["size"] + _FREE_MARGIN:
                log.warning("engine: layout cache %s: disk nearly full, not stored", self.root)
                return
            with open(tmp, "wb") as f:
                f.write(_MAGIC + struct.pack("<Q", len(text)) + text)
                for off, t in blobs:
                    f.seek(start + off)
                    f.write(t.view(torch.uint8).reshape(-1).numpy().data)
                f.truncate(meta["size"])
                # On disk before its name is: a power loss never leaves a whole-sized file
                # of zeros under a key.
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(key))
            self.written += meta["size"]
        except OSError as e:
            log.warning("engine: layout cache %s not written (%s): loads rebuild", self.root, e)
            try:
                tmp.unlink()
            except OSError:
                pass

    def trim(self) -> None:
        """Keep the directory under its cap (least recently used first) and clear the
        temporary files of nodes that died writing."""
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return
        now = time.time()
        files = []
        for e in entries:
            try:
                st = e.stat()
            except OSError:
                continue
            if e.name.startswith(".tmp-"):
                if now - st.st_mtime > _STALE_TMP_S:
                    _unlink(e.path)
            elif e.name.endswith(".layout"):
                files.append((st.st_mtime, st.st_size, e.path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            _unlink(path)
            total -= size


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_warned: set[str] = set()


def open_cache(environ: dict[str, str] | None = None) -> LayoutCache | None:
    """This node's layout cache (``MVP_LAYOUT_CACHE``, ``MVP_LAYOUT_CACHE_GB``), or None
    where it is off or its directory cannot be written."""
    env = os.environ if environ is None else environ
    where = env.get(ENV_DIR, "").strip()
    if where.lower() in ("off", "0", "false", "no"):
        return None
    root = Path(where) if where else Path.home() / ".cache" / "mvp-orchestrator" / "layouts"
    try:
        gb = float(env.get(ENV_GB, "") or DEFAULT_GB)
    except ValueError:
        gb = DEFAULT_GB
    if gb <= 0:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(f"{root} is not writable")
    except OSError as e:
        if str(root) not in _warned:
            _warned.add(str(root))
            log.warning("engine: no layout cache (%s): every load builds its layouts", e)
        return None
    return LayoutCache(root, int(max(gb, 0.0) * (1 << 30)))
