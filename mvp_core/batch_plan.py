"""Which rows run now: the one per-step batching decision of the node's token loops.

Plain data in (the work waiting, in the order it came; the prompts in flight; the
capacity), plain data out (how much of the queue this step takes, and the rows that run);
no torch, no threads, no clock, so it is tested alone (tests/core/test_batch_plan.py) and
the loops only carry it out (vLLM's ``schedule()`` at this project's scale):

- ``workers/node/engine/batch_generate.py``: every active sequence's next rows in one forward, a prompt
  cut into chunks of its own (never a step's shared budget: batch invariance), else its
  last sampled token;
- ``workers/node/scheduler.py``: which waiting prompts join, first come first served, while a KV cache
  slot is free;
- ``workers/node/pipeline.StageLink``: which records that came in run as one batch: one record per
  prompt, at most a 1/depth share of the prompts in flight, so on an N-stage pipeline the
  prompts go round in N groups and every stage is busy (DECISIONS 62).

Nothing overtakes: a step takes a prefix of the queue, and the first entry it cannot take
(the share is full, its prompt already runs in this step, no slot is free) ends it.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

__all__ = ["Capacity", "Entry", "Kind", "Row", "StepPlan", "plan_step"]


class Kind(Enum):
    BEGIN = "begin"  # a prompt that takes a KV cache slot now (a joining prompt, a BEGIN record)
    NEXT = "next"  # the next rows of a prompt that holds a slot
    ABORT = "abort"  # frees the prompt's slot; runs no rows


@dataclass(frozen=True)
class Entry:
    """One piece of waiting work of prompt ``key``. ``prompt_left``: the prompt tokens the
    loop holds for it and has not fed yet (0: its rows come with it, a record's, or it
    feeds its last sampled token)."""

    key: Hashable
    kind: Kind = Kind.NEXT
    prompt_left: int = 0


@dataclass(frozen=True)
class Capacity:
    """``free_slots``: KV cache slots for BEGIN entries (None: not limited here, the loop
    checks). ``depth``: the pipeline's stages (a step runs at most a 1/depth share of the
    prompts in flight). ``chunk``: prompt tokens an entry feeds per step (None: all)."""

    free_slots: int | None = None
    depth: int = 1
    chunk: int | None = None


@dataclass(frozen=True)
class Row:
    """An entry that runs rows now: ``prompt_tokens`` of its prompt (0: its record's rows
    or its last token); ``samples``: its prompt is all fed after this step, so its last
    row gives a token."""

    key: Hashable
    kind: Kind
    prompt_tokens: int
    samples: bool


@dataclass(frozen=True)
class StepPlan:
    """``taken``: entries from the front of the queue this step consumes (ABORTs among
    them run no rows); ``rows``: those that run, in queue order."""

    taken: int
    rows: tuple[Row, ...]

    @property
    def admitted(self) -> list[Hashable]:
        """The prompts that take a slot in this step, in order."""
        return [r.key for r in self.rows if r.kind is Kind.BEGIN]


def plan_step(
    queue: Sequence[Entry], capacity: Capacity, in_flight: Collection[Hashable] = ()
) -> StepPlan:
    """This step's plan for ``queue`` (oldest first) beside the prompts ``in_flight``
    (holding a slot, whether or not they wait in the queue)."""
    prompts = {*in_flight, *(e.key for e in queue)}
    share = max(1, -(-len(prompts) // max(1, capacity.depth)))
    free = capacity.free_slots
    rows: list[Row] = []
    running: set[Hashable] = set()
    taken = 0
    for entry in queue:
        if len(rows) >= share or entry.key in running:
            break
        if entry.kind is Kind.BEGIN and free is not None:
            if free <= 0:
                break
            free -= 1
        taken += 1
        if entry.kind is Kind.ABORT:
            continue
        rows.append(_row(entry, capacity.chunk))
        running.add(entry.key)
    return StepPlan(taken, tuple(rows))


def _row(entry: Entry, chunk: int | None) -> Row:
    left = entry.prompt_left
    if left <= 0:
        return Row(entry.key, entry.kind, 0, samples=True)
    fed = left if chunk is None else min(chunk, left)
    return Row(entry.key, entry.kind, fed, samples=fed == left)
