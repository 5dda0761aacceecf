"""The merge loops of the tokenizer's two models, as llama.cpp's ``llama-vocab.cpp`` runs
them: byte-level BPE merging adjacent symbols by merge rank, SentencePiece merging them by
token score. Pure functions over symbol lists (tokenizer.py holds the vocabulary)."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence

SHORT_WORD = 24  # below this many symbols a linear scan beats a heap


def merge_bpe(symbols: list[str], ranks: Mapping[str, int]) -> list[str]:
    """Repeatedly merge the lowest-ranked adjacent pair (``ranks``: "left right" -> rank,
    leftmost on ties) until no pair has a rank."""
    if len(symbols) < SHORT_WORD:
        return merge_short(symbols, ranks)
    return merge_long(symbols, ranks)


def merge_short(symbols: list[str], ranks: Mapping[str, int]) -> list[str]:
    """merge_bpe by a linear scan per merge."""
    while len(symbols) > 1:
        best_rank = -1
        best = -1
        prev = symbols[0]
        for i in range(1, len(symbols)):
            cur = symbols[i]
            rank = ranks.get(prev + " " + cur)
            if rank is not None and (best < 0 or rank < best_rank):
                best_rank = rank
                best = i
            prev = cur
        if best < 0:
            break
        symbols[best - 1 : best + 1] = [symbols[best - 1] + symbols[best]]
    return symbols


def _unlink(
    left: int, right: int, nxt: list[int], prv: list[int], push: Callable[[int, int], None]
) -> None:
    """``right`` has merged into ``left``: take it out of the linked list and queue the
    pairs ``left`` now forms with its neighbours."""
    nxt[left] = nxt[right]
    if nxt[right] >= 0:
        prv[nxt[right]] = left
    if prv[left] >= 0:
        push(prv[left], left)
    if nxt[left] >= 0:
        push(left, nxt[left])


def merge_long(symbols: list[str], ranks: Mapping[str, int]) -> list[str]:
    """Same result as merge_short in O(n log n): llama.cpp's linked list + heap."""
    text = list(symbols)
    n = len(text)
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    heap: list[tuple[int, int, int, str]] = []

    def push(left: int, right: int) -> None:
        rank = ranks.get(text[left] + " " + text[right])
        if rank is not None:
            heapq.heappush(heap, (rank, left, right, text[left] + text[right]))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        if not text[left] or not text[right] or text[left] + text[right] != merged:
            continue  # stale: one side has changed since this pair was queued
        text[left] = merged
        text[right] = ""
        _unlink(left, right, nxt, prv, push)
    return [t for t in text if t]


def merge_spm(text: str, token_to_id: Mapping[str, int], scores: Sequence[float]) -> list[str]:
    """SentencePiece-style merging of ``text``'s characters: the adjacent pair that forms
    the best-scored token first (leftmost on ties); the pieces in order."""
    sym = list(text)
    n = len(sym)
    size = [1] * n
    nxt = [*range(1, n), -1]
    prv = list(range(-1, n - 1))
    heap: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        token_id = token_to_id.get(sym[left] + sym[right])
        if token_id is not None:
            heapq.heappush(heap, (-scores[token_id], left, right, size[left] + size[right]))

    for i in range(n - 1):
        push(i, i + 1)
    while heap:
        _, left, right, merged_size = heapq.heappop(heap)
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != merged_size:
            continue
        sym[left] += sym[right]
        size[left] = merged_size
        sym[right] = ""
        size[right] = 0
        _unlink(left, right, nxt, prv, push)
    return [s for s in sym if s]
