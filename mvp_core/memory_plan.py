"""Planning by memory: what a stage needs, and layer ranges that fit each node.

Pure. A stage holds its layers' tensors at about their GGUF size (the engine keeps
quantised weights quantised on CPU), the token embedding on the first stage (and on the
last where the output head is tied to it), the output norm and head on the last; its KV
cache (``kv_bytes`` an element: float16 at the engine's default precision, float32 at
its "exact" and "float32" ones, ``kv_bytes_for``) for ``max_seq_len`` positions of each of its
``slots`` (the run's ``max_active_prompts``); scratch for a prompt's prefill; then a
margin and the node process's own footprint:

    need = ceil((weights + kv + scratch) x (1 + MARGIN_PERCENT / 100)) + RUNTIME_BYTES
    kv = layers x max_seq_len x slots x kv_elements x kv_bytes
    scratch = SCRATCH_ROWS x max_seq_len x hidden x 4

(docs/contracts.md, "Planning by memory"). Given each node's memory, the planner gives
contiguous ranges that fit and, of those, the most even work (``balanced`` ranges under a
capacity); a fleet that cannot hold the model is a planning error naming each node's
shortfall on the split that comes closest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

from mvp_core.models import LayerRange, ModelBytes

KV_BYTES = 2  # the engine's caches: float16 at the default precision (engine/session.py)


def kv_bytes_for(precision: str) -> int:
    """Bytes of a KV cache element at ``precision``: float16 (2) at "default", where the
    engine rounds keys and values to float16 as llama.cpp's cache does; float32 (4) at
    "exact" and "float32" (workers/node/engine/session.kv_dtype)."""
    return KV_BYTES if precision == "default" else 4


SCRATCH_ROWS = 8  # hidden-sized float32 rows per position a prefill holds at once, bounded
MARGIN_PERCENT = 10
RUNTIME_BYTES = 512 << 20  # Python, torch and the kernel library of a node process
GIB = 1 << 30


@dataclass(frozen=True)
class StageNeed:
    weights: int
    kv: int
    scratch: int

    @property
    def total(self) -> int:
        held = self.weights + self.kv + self.scratch
        return -(-held * (100 + MARGIN_PERCENT) // 100) + RUNTIME_BYTES


def _need(
    sizes: ModelBytes,
    layer_bytes: int,
    n: int,
    *,
    first: bool,
    last: bool,
    max_seq_len: int,
    slots: int,
    hidden: int,
    kv_bytes: int = KV_BYTES,
) -> StageNeed:
    """The module's formula for a stage of ``n`` layers holding ``layer_bytes``."""
    weights = layer_bytes
    if first or (last and sizes.tied_head):
        weights += sizes.embedding
    if last:
        weights += sizes.output
    kv = n * max_seq_len * max(1, slots) * sizes.kv_elements * kv_bytes
    return StageNeed(weights, kv, SCRATCH_ROWS * max_seq_len * hidden * 4)


def stage_need(
    sizes: ModelBytes,
    layers: LayerRange,
    *,
    first: bool,
    last: bool,
    max_seq_len: int,
    slots: int,
    hidden: int,
    kv_bytes: int = KV_BYTES,
) -> StageNeed:
    """What a stage of ``layers`` needs (see the module's formula)."""
    layer_bytes = sum(sizes.layers[layers.start : layers.end])
    n = layers.end - layers.start
    return _need(
        sizes, layer_bytes, n, first=first, last=last, max_seq_len=max_seq_len, slots=slots,
        hidden=hidden, kv_bytes=kv_bytes,
    )  # fmt: skip


def stage_needs(
    sizes: ModelBytes,
    stage_count: int,
    *,
    max_seq_len: int,
    slots: int,
    hidden: int,
    kv_bytes: int = KV_BYTES,
) -> Callable[[int, int, int], int]:
    """need(stage, a, b): ``stage_need(...).total`` of stage ``stage`` of ``stage_count``
    holding layers [a, b), in constant time (the planner's searches call it often)."""
    prefix = list(accumulate(sizes.layers, initial=0))

    def need(stage: int, a: int, b: int) -> int:
        return _need(
            sizes, prefix[b] - prefix[a], b - a, first=stage == 0, last=stage == stage_count - 1,
            max_seq_len=max_seq_len, slots=slots, hidden=hidden, kv_bytes=kv_bytes,
        ).total  # fmt: skip

    return need


def size_text(n: int) -> str:
    """Bytes as people read them: 613.3 MiB, 7.52 GiB."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def closest_ranges(
    stages: int, layer_count: int, need: Callable[[int, int, int], int], memory: Sequence[int]
) -> list[LayerRange]:
    """Where nothing fits: the split whose largest shortfall (need - memory) is least."""
    n = layer_count
    inf = float("inf")
    most: list[list[float]] = [[inf] * (n + 1) for _ in range(stages + 1)]
    most[0][n] = -inf
    for k in range(1, stages + 1):
        stage = stages - k
        for i in range(n - k, -1, -1):
            most[k][i] = min(
                max(need(stage, i, j) - memory[stage], most[k - 1][j])
                for j in range(i + 1, n - k + 2)
            )
    ranges, start = [], 0
    for k in range(stages, 0, -1):
        stage = stages - k
        j = next(
            j
            for j in range(start + 1, n - k + 2)
            if max(need(stage, start, j) - memory[stage], most[k - 1][j]) == most[k][start]
        )
        ranges.append(LayerRange(start=start, end=j))
        start = j
    return ranges


def host_shortfall(needs: Sequence[int], available: int, host: str) -> str | None:
    """Where every stage runs on one host (process and Docker nodes with no per-node
    memory given): the stages' needs together against what the host has available now;
    the reason to refuse the run, or None where they fit."""
    total = sum(needs)
    if total <= available:
        return None
    return (
        f"the run's {len(needs)} stage(s) need about {size_text(total)} together (CONTRACTS "
        f"'Planning by memory'); this host ({host}) has {size_text(available)} available: "
        f"short by {total - available} bytes ({size_text(total - available)})"
    )
