"""Loading a contiguous layer range of a GGUF model as a runnable stage."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mvp_core.stage_share import stage_tensors

from . import native
from .config import ArchConfig, EngineModelFacts, arch_config, facts_of
from .gguf_reader import GGUFError, GGUFFile
from .layout_cache import open_cache
from .loader import WeightBuilder, fix_mmap_threshold, trim_heap
from .models import StageModel, build_stage_model
from .quants import as_torch_bytes, dequantize_rows
from .session import BatchSession, StageSession

log = logging.getLogger("mvp.node.engine")


@dataclass(frozen=True)
class EngineOptions:
    """How a stage is loaded: device ("auto" | "cpu" | "cuda"), precision ("default" =
    compact weights; "exact" = compact weights, decode products exact in float32, loader.py;
    "float32" = everything dequantized, the reference path), CPU threads
    (None = all cores), and layer boundaries after which a single stage rounds the hidden
    state to float16 (to reproduce a float16 pipeline split in one process, boundary.py)."""

    device: str = "auto"
    precision: str = "default"
    threads: int | None = None
    fp16_split_points: tuple[int, ...] = ()
    # The native kernel's layouts kept on disk and mapped by later loads (layout_cache.py;
    # MVP_LAYOUT_CACHE=off turns it off for a process).
    layout_cache: bool = True


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}; use auto, cpu or cuda")
    return torch.device(name)


class Embedding:
    """Token rows dequantized on demand from the mapped file (never the whole table)."""

    def __init__(self, f: GGUFFile, device: torch.device) -> None:
        info = f.tensors["token_embd.weight"]
        self._raw = as_torch_bytes(f.raw("token_embd.weight"))
        self._type = info.ggml_type
        self._shape = info.shape
        self._device = device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self._shape[0]):
            raise ValueError(f"token id out of range [0, {self._shape[0]})")
        return dequantize_rows(self._raw, self._type, self._shape, ids).to(self._device)


class Stage:
    """Weights of layers ``[layer_start, layer_end)``; sessions hold the per-request state."""

    def __init__(
        self,
        file: GGUFFile,
        cfg: ArchConfig,
        facts: EngineModelFacts,
        layer_start: int,
        layer_end: int,
        model: StageModel[Any],
        embedding: Embedding | None,
        device: torch.device,
        options: EngineOptions,
    ) -> None:
        self.file = file
        self.cfg = cfg
        self.facts = facts
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.is_first = layer_start == 0
        self.is_last = layer_end == cfg.n_layers
        self.model = model
        self.embedding = embedding
        self.device = device.type
        self.torch_device = device
        self.options = options
        self.tensor_names_loaded: frozenset[str] = frozenset(file.materialized)
        self.closed = False

    @property
    def float16_scale(self) -> float:
        """What a float16 hand-over multiplies the hidden state by (boundary.py)."""
        return self.model.float16_scale

    def new_session(self, max_seq_len: int) -> StageSession:
        if self.closed:
            raise RuntimeError("stage is closed")
        return StageSession(self, max_seq_len)

    def new_batch_session(
        self,
        slots: int,
        max_seq_len: int,
        *,
        prefix_budget: int | None = 0,
        keep_rows: bool = False,
    ) -> BatchSession:
        """State for up to ``slots`` sequences at once (session.BatchSession), with a
        prefix cache of ``prefix_budget`` bytes (0: none; None: the node's setting)."""
        if self.closed:
            raise RuntimeError("stage is closed")
        return BatchSession(
            self, slots, max_seq_len, prefix_budget=prefix_budget, keep_rows=keep_rows
        )

    def close(self) -> None:
        """Drop the weights and the file mapping."""
        self.closed = True
        self.model.layers = []
        self.model.head = None
        self.embedding = None
        self.file.close()


def weight_formats(path: str) -> frozenset[str]:
    """The formats (GGUF type names) of the model's matrices, from its header alone."""
    f = GGUFFile(path, map_tensors=False)
    try:
        return frozenset(t.type_name for t in f.tensors.values() if len(t.shape) == 2)
    finally:
        f.close()


def uses_native_kernel(path: str, options: EngineOptions) -> bool:
    """Whether ``load_stage(path, ..., options)`` runs the engine's own kernel (the CPU,
    the default precision, and the kernel built and chosen for the model's formats:
    native.library). Decides the process's kernel choice if nothing had yet."""
    if options.precision != "default" or resolve_device(options.device).type != "cpu":
        return False
    native.expect_formats(weight_formats(path))
    return native.library() is not None


class LoadObserver(Protocol):
    """Told a stage's tensors (name -> bytes) once known, then each tensor's name as the
    loader takes it up (a stage's load progress, DECISIONS 93)."""

    def begin(self, sizes: Mapping[str, int]) -> None: ...

    def tensor(self, name: str) -> None: ...


def load_stage(
    path: str,
    layer_start: int,
    layer_end: int,
    options: EngineOptions = EngineOptions(),
    *,
    progress: LoadObserver | None = None,
) -> Stage:
    """Map the GGUF and build layers ``[layer_start, layer_end)`` (end exclusive);
    ``progress`` is told what it loads."""
    device = resolve_device(options.device)
    if device.type == "cpu":
        native.expect_formats(weight_formats(path))
        threads = options.threads or native.usable_cores()
        if options.precision == "default" and native.library() is not None:
            # The native kernel's pool does the matrix products; torch's own threads would
            # only spin beside it (its remaining ops are small), so torch gets one.
            torch.set_num_threads(1)
            native.set_threads(threads)
        else:
            torch.set_num_threads(threads)
    fix_mmap_threshold()
    f = GGUFFile(path)
    try:
        cfg = arch_config(f)
        facts = facts_of(f)
        if not 0 <= layer_start < layer_end <= cfg.n_layers:
            raise GGUFError(
                f"layer range [{layer_start}, {layer_end}) is outside the model's "
                f"{cfg.n_layers} layers"
            )
        if progress is not None:
            first, last = layer_start == 0, layer_end == cfg.n_layers
            wanted = stage_tensors(f.header, layer_start, layer_end, first=first, last=last)
            progress.begin({t.name: t.n_bytes for t in wanted})
            f.on_tensor = progress.tensor
        cache = None
        if device.type == "cpu" and options.precision == "default" and options.layout_cache:
            cache = open_cache()
        b = WeightBuilder(f, options.precision, device, cache)
        span = range(layer_start, layer_end)
        model = build_stage_model(b, cfg, span, options.fp16_split_points)
        if cache is not None and (cache.hits or cache.misses):
            log.info(
                "engine: layouts of %d products from the cache, %d built (%.0f MB written)",
                cache.hits,
                cache.misses,
                cache.written / 1e6,
            )
            if cache.written:
                cache.trim()
        with torch.inference_mode():
            embedding = Embedding(f, device) if layer_start == 0 else None
    except BaseException:
        f.close()
        raise
    f.on_tensor = None
    model.attention_f16 = options.precision == "default"
    f.release_pages()
    trim_heap()
    return Stage(f, cfg, facts, layer_start, layer_end, model, embedding, device, options)


def check_whole_model(stages: Sequence[Stage]) -> None:
    """``stages`` cover the model from its first to its last layer, one after another
    (ValueError naming the gap otherwise): what a generation loop over them needs."""
    if not stages:
        raise ValueError("no stages")
    if not stages[0].is_first or not stages[-1].is_last:
        raise ValueError("stages must cover the model from its first to its last layer")
    for a, b in itertools.pairwise(stages):
        if a.layer_end != b.layer_start:
            raise ValueError(
                f"stages are not contiguous: [{a.layer_start}, {a.layer_end}) then "
                f"[{b.layer_start}, {b.layer_end})"
            )
