"""The node's stage runtime: the loaded stage, its tokenizer, and direct-mode generation.

The engine runs in a worker thread; the asyncio side (Temporal activities, heartbeats,
stream publishing) never blocks on it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from mvp_core.generation import StopRule
from mvp_core.models import StageProvision, SubmitPrompt
from workers.engine import (
    ContextOverflow,
    EngineOptions,
    SamplingParams,
    Stage,
    generate,
    load_stage,
)
from workers.engine.tokenizer import Tokenizer


class PromptTooLong(ValueError):
    """A prompt-local fault: the run keeps serving."""


@dataclass
class GenerationResult:
    text: str
    tokens: int
    elapsed_ms: int
    stop_reason: str


class StageRuntime:
    """One provisioned stage of this node."""

    def __init__(
        self, provision: StageProvision, stage: Stage, tokenizer: Tokenizer, load_s: float
    ) -> None:
        self.provision = provision
        self.stage = stage
        self.tokenizer = tokenizer
        self.load_s = load_s
        self.lock = threading.Lock()  # one active prompt on this stage

    @classmethod
    def load(cls, provision: StageProvision) -> StageRuntime:
        started = time.perf_counter()
        opts = EngineOptions(
            device=provision.engine.device,
            precision=provision.engine.precision,
            threads=provision.engine.threads,
        )
        stage = load_stage(provision.model_path, provision.layers.start, provision.layers.end, opts)
        tokenizer = Tokenizer.from_gguf(provision.tokenizer_path)
        return cls(provision, stage, tokenizer, time.perf_counter() - started)

    def encode(self, prompt: SubmitPrompt) -> list[int]:
        text = prompt.prompt_text
        if prompt.chat:
            if not self.tokenizer.has_chat_template:
                raise PromptTooLong("chat requested but the model has no chat template")
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}])
            ids = self.tokenizer.encode(text, add_special=True, parse_special=True)
        else:
            ids = self.tokenizer.encode(text, add_special=True, parse_special=False)
        if not ids:
            raise PromptTooLong("the prompt encodes to no tokens")
        limit = self.provision.max_seq_len
        if len(ids) >= limit:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens; the planned context holds {limit} "
                f"(prompt plus at least one generated token)"
            )
        return ids

    def run_direct(
        self,
        prompt: SubmitPrompt,
        max_new_tokens: int | None,
        on_text: Callable[[str], None],
        should_stop: Callable[[], bool],
    ) -> GenerationResult:
        """Generate in this thread; ``on_text`` gets each complete piece of text."""
        started = time.perf_counter()
        ids = self.encode(prompt)
        stop_ids = set(self.tokenizer.eog_token_ids)
        if self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        rule = StopRule(
            max_new_tokens=max_new_tokens, stop_ids=stop_ids, max_seq_len=self.provision.max_seq_len
        )
        sampling = SamplingParams(
            temperature=prompt.temperature, top_k=prompt.top_k, top_p=prompt.top_p, seed=prompt.seed
        )
        decoder = self.tokenizer.incremental_decoder()
        pieces: list[str] = []
        with self.lock:
            try:
                for n, token in enumerate(
                    generate(
                        [self.stage],
                        ids,
                        max_new_tokens=max_new_tokens,
                        max_seq_len=self.provision.max_seq_len,
                        sampling=sampling,
                        stop_ids=stop_ids,
                        should_stop=should_stop,
                    )
                ):
                    rule.accept(token, len(ids) + n + 1)
                    piece = decoder.push(token)
                    if piece:
                        pieces.append(piece)
                        on_text(piece)
            except ContextOverflow as err:
                raise PromptTooLong(str(err)) from None
            tail = decoder.flush()
            if tail:
                pieces.append(tail)
                on_text(tail)
        reason = rule.reason or ("cancelled" if should_stop() else "eos_or_context")
        return GenerationResult(
            text="".join(pieces),
            tokens=rule.generated,
            elapsed_ms=int((time.perf_counter() - started) * 1000),
            stop_reason=reason,
        )

    def close(self) -> None:
        self.stage.close()


async def load_async(provision: StageProvision) -> StageRuntime:
    return await asyncio.to_thread(StageRuntime.load, provision)
