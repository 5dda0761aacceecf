"""The head node's continuous batching, where one node holds the whole model.

Every prompt the run has active (``max_active_prompts``, DECISIONS 62) joins one
``BatchGenerator`` driven by one thread: each step is one forward over every active
sequence's next rows (a decoding sequence its last token, a joining one its prompt), so
sequences join and leave at any step and none waits for another to finish. A sequence's
tokens are those it gets alone, bit for bit (batch_generate.py): its prompt goes in as
one chunk, as ``generate`` feeds it, and every kernel gives a row the sums its own
sequence gives it.

Callers are the generate activities' threads: ``run`` blocks until its sequence ends and
says why (``eos``, ``max_tokens``, ``context``, ``cancelled``), calling ``on_token`` from
the scheduler's thread for each token as it is sampled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from mvp_core.batch_plan import Capacity, Entry, Kind, plan_step
from temporal.telemetry import ForwardTimer
from workers.node.affinity import Placement
from workers.node.engine import SamplingParams, Stage
from workers.node.engine.batch_generate import BatchGenerator, Finish
from workers.node.engine.formats import StageFormats
from workers.node.engine.prefix_cache import PrefixCache
from workers.node.engine.sampling import TokenLogprobs
from workers.node.nodestream import StepStats

log = logging.getLogger("mvp.scheduler")

_REASONS = {
    Finish.STOP: "eos",
    Finish.LENGTH: "max_tokens",
    Finish.CONTEXT: "context",
    Finish.CANCELLED: "cancelled",
}


class SchedulerClosed(RuntimeError):
    """The stage was stopped while the sequence ran."""


@dataclass(eq=False)
class _Job:
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int | None
    on_token: Callable[[int, TokenLogprobs | None], None]
    should_stop: Callable[[], bool]
    resume: Sequence[int] = ()
    on_cached: Callable[[int], None] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    reason: str | None = None
    error: BaseException | None = None
    prefilled: bool = False

    def finish(self, reason: str | None = None, error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.reason, self.error = reason, error
            self.done.set()


class Scheduler:
    """Up to ``slots`` sequences over ``stages`` (the whole model, in this process)."""

    def __init__(
        self,
        stages: Sequence[Stage],
        *,
        slots: int,
        max_seq_len: int,
        stop_ids: Collection[int],
        placement: Placement | None = None,
        forward_timer: ForwardTimer | None = None,
        formats: StageFormats | None = None,
        step_stats: StepStats | None = None,
    ) -> None:
        if slots <= 0:
            raise ValueError("slots must be positive")
        self.stages = list(stages)
        self.slots = slots
        self.max_seq_len = max_seq_len
        self.stop_ids = frozenset(stop_ids)
        self.placement = placement or Placement()
        self.forward_timer = forward_timer
        self.step_stats = step_stats  # the node's datastream: steps, KV slots (DECISIONS 93)
        self.formats = formats  # the vocabulary of prompts with a response format
        # The stage's prefix cache (its stats: what it holds and did; DECISIONS 91).
        self.prefix: PrefixCache | None = None
        self._cond = threading.Condition()
        self._joining: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def run(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        max_new_tokens: int | None,
        on_token: Callable[[int, TokenLogprobs | None], None],
        should_stop: Callable[[], bool],
        resume: Sequence[int] = (),
        on_cached: Callable[[int], None] | None = None,
    ) -> str:
        """Generate for one sequence beside the others; returns why it stopped. Raises
        what the engine raised for it (ContextOverflow: the prompt does not fit).
        ``on_token`` gets each token and, where ``sampling`` asks for them, its logprobs.
        ``resume``: tokens it generated before (BatchGenerator.add), not passed to
        ``on_token`` again. ``on_cached`` gets, as it joins, how many of its prompt's
        tokens came from the prefix cache (DECISIONS 91)."""
        job = _Job(
            list(prompt_ids), sampling, max_new_tokens, on_token, should_stop, resume, on_cached
        )
        with self._cond:
            if self._closed:
                raise SchedulerClosed("the stage is stopped")
            self._joining.append(job)
            self._cond.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.reason is not None
        return job.reason

    @property
    def active(self) -> int:
        """Sequences joined or waiting to join."""
        with self._cond:
            return len(self._running) + len(self._joining)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the thread
    def _main(self) -> None:
        self.placement.adopt()
        gen: BatchGenerator | None = None
        try:
            while True:
                with self._cond:
                    while not self._closed and not self._running and not self._joining:
                        self._cond.wait()
                    if self._closed:
                        return
                if gen is None:
                    gen = BatchGenerator(
                        self.stages,
                        slots=self.slots,
                        max_seq_len=self.max_seq_len,
                        chunk_size=self.max_seq_len,  # a prompt in one chunk, as alone
                        formats=self.formats,
                        prefix_budget=None,  # the node's setting (DECISIONS 91)
                    )
                    self.prefix = gen.sessions[0].prefix
                try:
                    self._join(gen)
                    self._cancel(gen)
                    if self._running:
                        self._step(gen)
                    if self.step_stats is not None:
                        self.step_stats.slots_in_use = len(self._running)
                except Exception as err:  # an engine fault: every sequence in it ends
                    log.error("batched step failed: %s: %s", type(err).__name__, err)
                    with self._cond:
                        running, self._running = self._running, []
                    for job in running:
                        job.finish(error=err)
                    gen.close()
                    gen = None
        finally:
            if self.step_stats is not None:
                self.step_stats.slots_in_use = 0
            if gen is not None:
                gen.close()
            with self._cond:
                left = [*self._running, *self._joining]
                self._running, self._joining = [], deque()
            for job in left:
                job.finish(error=SchedulerClosed("the stage was stopped"))

    def _join(self, gen: BatchGenerator) -> None:
        """The waiting prompts the plan admits join, in order; a slot that one of them
        leaves free (it failed, or has nothing to generate) goes to the next in line."""
        while True:
            with self._cond:
                waiting = [Entry(job, Kind.BEGIN) for job in self._joining]
            admitted = plan_step(waiting, Capacity(free_slots=gen.free_slots)).admitted
            if not admitted:
                return
            for key in admitted:
                with self._cond:
                    job = self._joining.popleft()
                assert job is key
                self._add(gen, job)

    def _add(self, gen: BatchGenerator, job: _Job) -> None:
        try:
            joined = gen.add(
                job,
                job.prompt_ids,
                sampling=job.sampling,
                max_new_tokens=job.max_new_tokens,
                stop_ids=self.stop_ids,
                resume=job.resume,
            )
        except Exception as err:  # ContextOverflow, a bad prompt: this one only
            job.finish(error=err)
            return
        if not joined:
            job.finish("max_tokens")  # nothing to generate
            return
        if job.on_cached is not None:
            try:
                job.on_cached(gen.reused(job))
            except Exception as err:  # the caller's side failed: this one only
                gen.cancel(job)
                job.finish(error=err)
                return
        with self._cond:
            self._running.append(job)

    def _cancel(self, gen: BatchGenerator) -> None:
        for job in list(self._running):
            try:
                stop = job.should_stop()
            except Exception:  # the caller's side is gone: nobody reads this sequence
                stop = True
            if stop:
                gen.cancel(job)
                self._drop(job)
                job.finish("cancelled")

    def _drop(self, job: _Job) -> None:
        with self._cond:
            self._running.remove(job)

    def _step(self, gen: BatchGenerator) -> None:
        timer, stats = self.forward_timer, self.step_stats
        prefill = any(not j.prefilled for j in self._running)
        sampled = timer is not None and timer.wants(prefill)
        t0 = time.perf_counter() if sampled or stats is not None else 0.0
        events = gen.step()
        if sampled or stats is not None:
            took = time.perf_counter() - t0
            if sampled:
                assert timer is not None
                timer.record(took, prefill)
            if stats is not None:
                stats.record(took, prefill, len(self._running))
        for job in self._running:
            job.prefilled = True  # a prompt goes in one chunk: one step prefills it
        for ev in events:
            seq = ev.seq_id
            assert isinstance(seq, _Job)
            job = seq
            try:
                if ev.token is not None:
                    job.on_token(ev.token, ev.logprobs)
            except Exception as err:  # the caller's side failed: end this sequence
                if ev.finish is None:
                    gen.cancel(job)
                self._drop(job)
                job.finish(error=err)
                continue
            if ev.finish is not None:
                self._drop(job)
                job.finish(_REASONS[ev.finish])
