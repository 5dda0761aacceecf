"""Continuous batching over stages in one process: many sequences, one forward per step.

Each step runs every active sequence's next rows through the stages at once
(session.BatchSession): a decoding sequence its last sampled token, a sequence still in
its prompt the prompt's next chunk of ``chunk_size`` tokens, so a long prompt is prefilled
step by step among the others' decodes instead of stalling them. Sequences join (``add``)
and leave (a stop id, their ``max_new_tokens``, the context's end, ``stop_when``,
``cancel``) at any step, each with its own sampling parameters and seed.

Batch invariance: a sequence's tokens are a function of its own prompt, parameters and the
chunk size only, never of what runs beside it or when it joined. Its chunks are cut from
its own prompt (fixed boundaries, never a step's shared token budget), every kernel gives
a row the sums its own sequence's product gives it (qmm.c mvk_layers_batch), and its
sampler is its own (sampling.Sampler: a token's draw is a function of the sequence's seed
and the token's index). With ``chunk_size`` at least the prompt's length, a sequence's tokens
are generate.generate's (llama.cpp's logits, its prompt one ubatch). Shorter chunks
change no sums on Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 models (SmolLM2: the same tokens); on
Q4_K/Q5_K/Q6_K ones a chunk boundary moves some of llama.cpp's row-count-dependent sums
(as a different n_ubatch would in llama.cpp itself), so chunk_size is a trade between that
and how long a prompt's chunk holds up the others' next token.

Prefix reuse (DECISIONS 91, prefix_cache.py): where the stages keep prefixes
(``prefix_budget``), a joining sequence starts at the longest prefix of its prompt that
every stage holds (keyed by its token ids: the stages are in this process), copied into
its slot, and prefills only the rest, cut on the chunk boundaries it has alone; once its
prompt is fed, every stage keeps its prompt's whole blocks. The same tokens either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from mvp_core.batch_plan import Capacity, Entry, Row, plan_step
from mvp_core.models import ActivationDtype

from .boundary import from_boundary, to_boundary
from .formats import StageFormats
from .prefix_cache import PrefixCache, ids_bytes, reuse_bounds
from .sampling import Sampler, SamplingParams, TokenLogprobs, check_resume
from .session import BatchRow, BatchSession, ContextOverflow, NoFreeSlot
from .stage import Stage, check_whole_model

DEFAULT_CHUNK = 64


class Finish(Enum):
    STOP = "stop"  # a stop id was sampled (not emitted) or stop_when said so
    LENGTH = "length"  # max_new_tokens emitted
    CONTEXT = "context"  # the slot's max_seq_len is full
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Event:
    """What one step did for one sequence: ``token`` emitted (or None), ``finish``
    where the sequence left in this step (its slot is free again), and the token's
    ``logprobs`` where its sampling parameters ask for them."""

    seq_id: Hashable
    token: int | None
    finish: Finish | None = None
    logprobs: TokenLogprobs | None = None


@dataclass
class _Seq:
    seq_id: Hashable
    slot: int
    prompt: list[int]
    sampler: Sampler
    stops: frozenset[int]
    max_new_tokens: int | None
    stop_when: Callable[[Sequence[int]], bool] | None
    fed: int = 0  # prompt tokens fed
    pending: int | None = None  # the last sampled token, to feed next
    generated: list[int] = field(default_factory=list)
    replay: list[int] = field(default_factory=list)  # tokens it had: fed, not sampled
    reused: int = 0  # prompt tokens taken from the prefix caches


class BatchGenerator:
    """Up to ``slots`` sequences over ``stages`` (first to last layer, contiguous), each
    stage holding a BatchSession; the hidden state crosses each boundary as the data
    plane carries it (``activation_dtype``, boundary.py: float32 gives the 1-stage tokens
    bit for bit). ``step`` runs one forward over all active sequences and says what each
    did; ``close`` frees the caches. ``prefix_budget``: each stage's prefix cache in
    bytes (0: none; None: the node's setting, session.BatchSession)."""

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        slots: int,
        max_seq_len: int,
        chunk_size: int = DEFAULT_CHUNK,
        activation_dtype: ActivationDtype = ActivationDtype.FLOAT32,
        formats: StageFormats | None = None,
        prefix_budget: int | None = 0,
    ) -> None:
        """``formats``: the last stage's vocabulary for prompts with a response format
        (DECISIONS 89); None: such a prompt is refused at ``add``."""
        check_whole_model(stages)
        self.formats = formats
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.stages = list(stages)
        self.max_seq_len = max_seq_len
        self.chunk_size = chunk_size
        self.dtype = activation_dtype
        self.sessions: list[BatchSession] = []
        try:
            for s in stages:
                self.sessions.append(
                    s.new_batch_session(slots, max_seq_len, prefix_budget=prefix_budget)
                )
        except BaseException:
            self.close()
            raise
        self._seqs: dict[Hashable, _Seq] = {}  # in join order

    @property
    def active(self) -> list[Hashable]:
        return list(self._seqs)

    @property
    def free_slots(self) -> int:
        return self.sessions[0].free_slots if self.sessions else 0

    def add(
        self,
        seq_id: Hashable,
        prompt_ids: Sequence[int],
        *,
        sampling: SamplingParams = SamplingParams(),
        max_new_tokens: int | None = None,
        stop_ids: Collection[int] = (),
        stop_when: Callable[[Sequence[int]], bool] | None = None,
        resume: Sequence[int] = (),
    ) -> bool:
        """Join ``seq_id`` (its first chunk runs in the next step). ``stop_when`` is asked
        after each emitted token with the tokens so far (a text-level stop string); True
        ends the sequence, that token emitted. Returns False where ``max_new_tokens`` is
        0 (nothing to do: it does not join). Raises NoFreeSlot, ContextOverflow (the
        prompt alone does not fit), ValueError (an empty prompt, a known id).

        ``resume``: the tokens the sequence already generated elsewhere (stage recovery).
        They are fed one a step after the prompt, as they were the first time, without
        events, and count toward ``max_new_tokens``; the sampler then draws at the index
        it would have reached, so the tokens after them are the undisturbed ones."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already running")
        if not prompt_ids:
            raise ValueError("empty prompt")
        if len(prompt_ids) > self.max_seq_len:
            raise ContextOverflow(
                f"prompt of {len(prompt_ids)} tokens exceeds max_seq_len {self.max_seq_len}"
            )
        if len(prompt_ids) + len(resume) > self.max_seq_len:
            raise ContextOverflow(
                f"prompt of {len(prompt_ids)} tokens and {len(resume)} resumed exceed "
                f"max_seq_len {self.max_seq_len}"
            )
        check_resume(len(resume), sampling, max_new_tokens)
        sampler = Sampler(sampling, formats=self.formats)
        if max_new_tokens is not None and max_new_tokens <= len(resume):
            return False
        if self.free_slots == 0:
            raise NoFreeSlot(f"all {self.sessions[0].slots} slots hold a sequence")
        slots = {s.acquire() for s in self.sessions}
        assert len(slots) == 1, "the stages' sessions hand out slots in step"
        self._seqs[seq_id] = _Seq(
            seq_id, slots.pop(), list(prompt_ids), sampler, frozenset(stop_ids),
            max_new_tokens, stop_when, replay=list(resume),
        )  # fmt: skip
        self._reuse(self._seqs[seq_id])
        return True

    def cancel(self, seq_id: Hashable) -> bool:
        """Remove ``seq_id`` now (its slot is free for the next step); False if unknown."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return False
        for s in self.sessions:
            s.release(seq.slot)
        return True

    def reused(self, seq_id: Hashable) -> int:
        """How many of a running sequence's prompt tokens came from the prefix caches."""
        return self._seqs[seq_id].reused

    def _caches(self) -> list[PrefixCache]:
        """Every stage's prefix cache, or none where a stage keeps no prefixes."""
        caches = [s.prefix for s in self.sessions]
        return [c for c in caches if c is not None] if all(caches) else []

    def _reuse(self, q: _Seq) -> None:
        """A joining sequence starts at the longest prefix every stage holds."""
        caches = self._caches()
        if not caches:
            return
        chunk = self.chunk_size if self.chunk_size < len(q.prompt) else None
        limit, multiple, _ = reuse_bounds(len(q.prompt), chunk)
        keys = ids_bytes(q.prompt)
        digests = caches[0].chain(keys, 4)
        length = min(c.match(digests, keys, 4, limit, multiple) for c in caches)
        if length > 0:
            for s in self.sessions:
                s.load_prefix(q.slot, digests, length)
            q.fed = q.reused = length

    def _keep(self, q: _Seq) -> None:
        """Every stage keeps the whole blocks of a sequence's prompt, just fed."""
        caches = self._caches()
        if not caches:
            return
        chunk = self.chunk_size if self.chunk_size < len(q.prompt) else None
        upto = reuse_bounds(len(q.prompt), chunk)[2]
        keys = ids_bytes(q.prompt)
        digests = caches[0].chain(keys, 4)
        for s in self.sessions:
            s.store_prefix(q.slot, digests, keys, 4, upto)

    @staticmethod
    def _feed(seq: _Seq, row: Row) -> list[int]:
        """The tokens ``row`` feeds: its prompt's next chunk, else its last sampled one."""
        if row.prompt_tokens:
            return seq.prompt[seq.fed : seq.fed + row.prompt_tokens]
        assert seq.pending is not None
        return [seq.pending]

    def step(self) -> list[Event]:
        """One forward over every active sequence; one event per sequence that emitted a
        token or left (a sequence in the middle of its prompt has none)."""
        if not self._seqs:
            return []
        plan = plan_step(
            [Entry(q.seq_id, prompt_left=len(q.prompt) - q.fed) for q in self._seqs.values()],
            Capacity(chunk=self.chunk_size),
        )
        seqs = [self._seqs[r.key] for r in plan.rows]
        rows: list[BatchRow] = [
            (q.slot, self._feed(q, r)) for q, r in zip(seqs, plan.rows, strict=True)
        ]
        out = self.sessions[0].forward(rows)
        for (prev, _), (stage, sess) in itertools.pairwise(
            zip(self.stages, self.sessions, strict=True)
        ):
            rows = [
                (q.slot, from_boundary(stage, to_boundary(prev, out[q.slot], self.dtype)))
                for q in seqs
            ]
            out = sess.forward(rows)
        events = []
        for q, r in zip(seqs, plan.rows, strict=True):
            q.fed += r.prompt_tokens
            if r.prompt_tokens and q.fed == len(q.prompt):
                self._keep(q)
            if not r.samples:  # in the middle of its prompt
                continue
            if len(q.generated) < len(q.replay):  # resumed: the token it had, no event
                q.pending = q.replay[len(q.generated)]
                q.generated.append(q.pending)
                q.sampler.skip(q.pending)  # the draw this token took the first time
                continue
            ev = self._sample(q, out[q.slot])
            if ev.finish is not None:
                self._leave(q)
            events.append(ev)
        return events

    def _sample(self, q: _Seq, logits: torch.Tensor) -> Event:
        """generate._generate's order: the context's end, the stop ids, the limit."""
        if self.sessions[0].position(q.slot) >= self.max_seq_len:
            return Event(q.seq_id, None, Finish.CONTEXT)
        token, lp = q.sampler.choose(logits)
        if token in q.stops:
            return Event(q.seq_id, None, Finish.STOP)
        q.generated.append(token)
        q.pending = token
        if q.max_new_tokens is not None and len(q.generated) >= q.max_new_tokens:
            return Event(q.seq_id, token, Finish.LENGTH, lp)
        if q.stop_when is not None and q.stop_when(q.generated):
            return Event(q.seq_id, token, Finish.STOP, lp)
        return Event(q.seq_id, token, logprobs=lp)

    def _leave(self, q: _Seq) -> None:
        del self._seqs[q.seq_id]
        for s in self.sessions:
            s.release(q.slot)

    def run(self) -> dict[Hashable, list[int]]:
        """Step until no sequence is left; each sequence's emitted tokens."""
        got: dict[Hashable, list[int]] = {q: [] for q in self._seqs}
        while self._seqs:
            for ev in self.step():
                if ev.token is not None:
                    got.setdefault(ev.seq_id, []).append(ev.token)
        return got

    def close(self) -> None:
        for s in self.sessions:
            s.close()
        self.sessions = []
        self._seqs.clear()
