"""Early starts (DECISIONS 103): a client with the run's text-stream token may hand the
head node a prompt it is about to submit, together with its request for the prompt's
text. An idle head starts the prompt's token loop at once, while the run admits it; the
prompt's generate, when it comes with the same prompt, adopts the running loop instead of
starting one. Until then nothing of it is published: its text waits in its pipe, and its
readers see the prompt only once its generate opened it. The run stays the authority:
what it never hands the head (a refusal, a queue, a different prompt) is stopped, and so
is an early start nobody adopts within ``hold_s``, whose reader leaves, or that any other
prompt's generate finds (the head is busy from then on)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mvp_core.models import SubmitPrompt
from workers.node.generation import Generation
from workers.node.textpath import TextRequestError

if TYPE_CHECKING:
    from workers.node.runtime import GenerationResult

log = logging.getLogger(__name__)

# An early start its generate has not adopted by then is stopped: a backstop for a
# client gone without closing its stream (a refusal closes it, any generate stops it),
# longer than an admission takes on a loaded control plane.
EARLY_HOLD_S = 10.0


def early_threads(shares_control_host: bool, threads: int, cores: int) -> int | None:
    """The engine threads an idle head runs an early start on until its generate adopts
    it (then its own ``threads`` again), or None where it starts nothing early.

    On a host of its own, its ``threads``. On the control plane's host (the process
    provider's nodes) the early start overlaps the admission, which needs a core: its
    ``threads`` where they leave one of the host's ``cores`` free, else one fewer than
    the cores (on a 2-core host a 1-stage head's prefill on both cores slowed its
    admission more than it saved: DECISIONS 103), and nothing on a 1-core host.
    ``threads`` 0: not known, taken as every core."""
    if not shares_control_host or 0 < threads < cores:
        return threads
    return cores - 1 if cores > 1 else None


class EarlyStart(BaseModel):
    """What a reader's request line may carry as ``"start"``: the prompt as it submits it,
    and the tokens the run will give it (``max_tokens``: an early start is for a prompt
    whose cap the client knows)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: SubmitPrompt
    max_new_tokens: int = Field(ge=1)


class EarlyStarts:
    """The head node's early starts, at most one at a time, on the node's event loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        start: Callable[[SubmitPrompt, int], Generation | None],
        idle: Callable[[], bool],
        hold_s: float = EARLY_HOLD_S,
        settled: Callable[[], None] = lambda: None,
    ) -> None:
        self._loop = loop
        self._start = start  # the token loop's start (None: no stage to run it on)
        self._idle = idle  # nothing generates here, and no generate is on its way in
        # Told once the early start held has been adopted or stopped (the head restores
        # the engine threads an early start ran on).
        self._settled = settled
        self._hold_s = hold_s
        self._held: dict[str, Generation] = {}
        self._ending: set[Generation] = set()  # stopped, their loops not ended yet
        self.started = self.adopted = self.dropped = 0

    # ------------------------------------------------------------------ the text stream's side
    def offer(self, key: str, raw: object) -> object:
        """A reader's ``start`` for prompt ``key`` (the text stream's thread): checked
        here, begun on the event loop where this node is idle. Returns the start's ticket,
        for :meth:`left`. TextRequestError names what is wrong with it."""
        try:
            start = EarlyStart.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(["start", *(str(p) for p in first["loc"])])
            raise TextRequestError(f"{where}: {first['msg']}") from None
        ticket = object()
        self._loop.call_soon_threadsafe(self._begin, key, start, ticket)
        return ticket

    def left(self, key: str, ticket: object) -> None:
        """The reader whose start got ``ticket`` went (the text stream's thread): what that
        start began stops, unless its generate adopted it."""
        self._loop.call_soon_threadsafe(self._left, key, ticket)

    # ------------------------------------------------------------------ the event loop's side
    def _begin(self, key: str, start: EarlyStart, ticket: object) -> None:
        # One at a time, where nothing generates or is on its way in, and no stopped one
        # still runs (a pipeline's sequences are keyed by request id).
        if self._held or self._ending or not self._idle():
            return
        try:
            generation = self._start(start.prompt, start.max_new_tokens)
        except Exception as err:  # a stage that stopped under it: the generate will say
            log.warning("early start of %s: %s: %s", key, type(err).__name__, err)
            return
        if generation is None:
            return
        generation.ticket = ticket
        self._held[key] = generation
        self.started += 1
        self._loop.call_later(self._hold_s, self.drop, key, generation)

    def _left(self, key: str, ticket: object) -> None:
        held = self._held.get(key)
        if held is not None and held.ticket is ticket:
            self.drop(key, held)

    def drop(self, key: str, generation: Generation | None = None) -> None:
        """Stop ``key``'s early start if it is still held (and is ``generation``)."""
        held = self._held.get(key)
        if held is None or (generation is not None and held is not generation):
            return
        del self._held[key]
        self._stop(held)
        self._settled()
        log.info("early start of %s dropped: its generate did not come", key)

    def _stop(self, generation: Generation) -> None:
        generation.stop()
        self.dropped += 1
        self._ending.add(generation)

        def ended(task: asyncio.Future[GenerationResult]) -> None:
            self._ending.discard(generation)
            if not task.cancelled():
                task.exception()  # retrieved: nobody reads a dropped loop's end

        generation.task.add_done_callback(ended)

    def take(
        self, key: str, prompt: SubmitPrompt, max_new_tokens: int | None, *, adopt: bool = True
    ) -> tuple[Generation | None, list[Generation]]:
        """The generate of ``key``: the early start it adopts where one runs with this
        very prompt and cap (None otherwise, or where it may not: a resume, or a loop
        that failed), and the stopped early starts of its request id whose loops must end
        before it starts its own (a pipeline's sequences are keyed by request id). Every
        other early start held stops: the head is busy from here on."""
        held = self._held.pop(key, None)
        if held is not None and adopt and self._adoptable(held, prompt, max_new_tokens):
            self.adopted += 1
            self._stop_all()
            self._settled()
            return held, []
        if held is not None:
            log.info("early start of %s dropped: the run's prompt is not the one started", key)
            self._stop(held)
        self._stop_all()
        self._settled()
        ending = [g for g in self._ending if g.prompt.request_id == prompt.request_id]
        return None, ending

    @staticmethod
    def _adoptable(held: Generation, prompt: SubmitPrompt, max_new_tokens: int | None) -> bool:
        if held.prompt != prompt or held.max_new_tokens != max_new_tokens:
            return False
        task = held.task
        return not task.done() or (not task.cancelled() and task.exception() is None)

    def _stop_all(self) -> None:
        for key in list(self._held):
            self._stop(self._held.pop(key))

    async def aclose(self, wait_s: float) -> None:
        """The stage stops: every early start held stops, their loops are given
        ``wait_s`` to end, and what they came to is said."""
        self._stop_all()
        self._settled()
        if self._ending:
            with contextlib.suppress(Exception):
                await asyncio.wait({g.task for g in self._ending}, timeout=wait_s)
        if self.started:
            log.info(
                "early starts: %d started, %d adopted, %d dropped",
                self.started,
                self.adopted,
                self.dropped,
            )
