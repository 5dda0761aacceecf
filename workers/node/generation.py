"""A prompt's token loop in a thread of its own, and what its generate activity reads
of it: the text pipe, the stop, the tokens so far. Started by the generate, or earlier by
an early start that the generate then adopts (``workers/node/early.py``, DECISIONS 103)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mvp_core.models import SubmitPrompt, TokenLogprob
from workers.node.config import FaultInjection
from workers.node.textpath import TextPipe

if TYPE_CHECKING:
    from workers.node.runtime import GenerationResult, StageRuntime

TEXT_GATE_POLL_S = 0.05  # held text (fault injection) looks for its gate this often


@dataclass(eq=False)  # one loop is itself: compared and hashed by identity
class Generation:
    """One prompt's token loop, running in its own thread."""

    prompt: SubmitPrompt
    max_new_tokens: int | None
    pipe: TextPipe
    stopped: threading.Event
    task: asyncio.Future[GenerationResult]
    prompt_tokens: list[int] = field(default_factory=list)  # set once, before any text
    cached_tokens: list[int] = field(default_factory=list)  # of them, from the prefix cache
    generated: list[int] = field(default_factory=list)  # the tokens so far
    # Their logprobs, where the prompt asks for them (the engine thread appends).
    logprobs: list[TokenLogprob | None] | None = None
    started_at: float = field(default_factory=time.perf_counter)
    ticket: object | None = None  # an early start's: whose reader started it

    def stop(self) -> None:
        """Stop at the engine's next step (its thread ends, its KV slot is freed)."""
        self.stopped.set()


def start_generation(
    runtime: StageRuntime,
    prompt: SubmitPrompt,
    max_new_tokens: int | None,
    *,
    resume: Sequence[int] = (),
    text_from: int | None = None,
) -> Generation:
    """Start ``prompt``'s token loop in a thread (on the running event loop's pool); its
    text goes to the returned generation's pipe as it comes."""
    pipe = TextPipe(asyncio.get_running_loop())
    stopped = threading.Event()
    on_text = _held_text(FaultInjection.from_env(), pipe.put, stopped)
    prompt_tokens: list[int] = []
    cached_tokens: list[int] = []
    generated: list[int] = []
    logprobs: list[TokenLogprob | None] | None = [] if prompt.logprobs else None

    def work() -> GenerationResult:
        try:
            return runtime.run(
                prompt,
                max_new_tokens,
                on_text,
                stopped.is_set,
                prompt_tokens.append,
                resume=resume,
                text_from=text_from,
                generated=generated,
                logprobs=logprobs,
                on_cached=cached_tokens.append,
            )
        finally:
            pipe.close()

    return Generation(
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        pipe=pipe,
        stopped=stopped,
        task=asyncio.ensure_future(asyncio.to_thread(work)),
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        generated=generated,
        logprobs=logprobs,
    )


def _held_text(
    faults: FaultInjection, put: Callable[[str, int], None], stopped: threading.Event
) -> Callable[[str, int], None]:
    """The engine's text callback, with the test-only faults that hold text: each piece
    ``text_delay_s``, and every piece after the first until ``text_gate`` exists."""
    delay, gate = faults.text_delay_s, faults.text_gate
    if delay <= 0 and gate is None:
        return put
    pieces = 0

    def held(piece: str, tokens: int) -> None:  # the engine's thread
        nonlocal pieces
        pieces += 1
        time.sleep(delay)
        while gate is not None and pieces > 1 and not os.path.exists(gate):
            if stopped.wait(TEXT_GATE_POLL_S):
                break
        put(piece, tokens)

    return held
