"""A prompt's events as an OpenAI completion: the request turned into the run's prompt
(:class:`Prepared`), its text with the request's stop strings applied (and the logprobs
of that text's tokens, where asked), the head node's token counts, and a prompt's Fault
as its HTTP error (by its type, never by its text)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from mvp_core.errors import ErrorType
from mvp_core.models import Done, Fault, TextDelta
from workers.gateway.logprobs import LogprobTrack, Placed
from workers.gateway.service import PromptSession, ServedModel
from workers.gateway.stops import StopMatcher, cut_at_stop
from workers.gateway.wire import ApiError, ChatRequest, CompletionRequest, invalid


@dataclass
class Prepared:
    """A request turned into the run's prompt."""

    fields: dict[str, Any]
    param: Literal["prompt", "messages"]  # what a refusal of the prompt names
    stops: list[str]
    include_usage: bool
    stream: bool
    n: int = 1  # choices: each its own prompt (a given seed + i for choice i)
    logprobs: bool = False  # the prompt asks for its tokens' logprobs

    def choice_fields(self, index: int) -> dict[str, Any]:
        """Choice ``index``'s prompt: a sequence of its own. With a seed, choice i draws
        with seed + i (so a request's choices differ, and repeat as a whole); without
        one, the run draws each choice's seed."""
        seed = self.fields.get("seed")
        if index == 0 or seed is None:
            return self.fields
        return {**self.fields, "seed": (int(seed) + index) % (1 << 64)}

    @classmethod
    def of(
        cls,
        req: CompletionRequest | ChatRequest,
        fields: dict[str, Any],
        param: Literal["prompt", "messages"],
    ) -> Prepared:
        """``fields`` (the prompt) with the request's limit, stop strings and sampling."""
        return cls(
            fields={
                **fields,
                "max_tokens": req.token_limit(),
                "stop": req.stops(),
                **req.sampling(),
                **req.logprob_fields(),
                **req.format_fields(),
            },
            param=param,
            stops=req.stops(),
            include_usage=req.include_usage(),
            stream=bool(req.stream),
            n=req.n or 1,
            logprobs=bool(req.logprob_fields()),
        )


@dataclass
class Finish:
    reason: Literal["stop", "length"]
    completion_tokens: int
    prompt_tokens: int  # as the head node encoded the prompt (0: a node that did not say)
    final_text: str | None = None  # the run's whole text, when no stop string cut it
    logprobs_missing: bool = False  # some text came without its tokens' logprobs
    cached_tokens: int | None = None  # of the prompt's, from the head's prefix cache


@dataclass
class Piece:
    """Text of a choice, and where asked the logprobs of the tokens it completes."""

    text: str
    logprobs: list[Placed] = field(default_factory=list)


@dataclass
class Collected:
    text: str = ""
    finish: Finish | None = None
    pieces: list[str] = field(default_factory=list)
    logprobs: list[Placed] = field(default_factory=list)


async def drive(
    session: PromptSession, prep: Prepared, served: ServedModel
) -> AsyncIterator[Piece | Finish]:
    """The prompt's text with stop strings applied, then one Finish. A Fault raises its
    ApiError. Token counts are the head node's: the prompt's from its first delta (or its
    Done), the completion's at a stop string the tokens of the deltas up to the one that
    completed it. Where the prompt asked for logprobs, each piece has those of the tokens
    whose text it completes (at a stop string: the tokens that begin before it)."""
    matcher = StopMatcher(prep.stops)
    track = LogprobTrack()
    prompt_tokens: int | None = None
    cached: int | None = None
    tokens = 0
    emitted = 0  # characters of text yielded
    async for event in session.events():
        if isinstance(event, TextDelta):
            if prompt_tokens is None:
                prompt_tokens = event.prompt_tokens
            if cached is None:
                cached = event.cached_tokens
            tokens += event.tokens or 0
            if prep.logprobs:
                track.push(event)
            text, hit = matcher.push(event.text)
            emitted += len(text)
            placed = (track.cut if hit else track.release)(emitted) if prep.logprobs else []
            if text or placed:
                yield Piece(text, placed)
            if hit:
                session.cancel()
                yield Finish("stop", tokens, prompt_tokens or 0, None, track.missing, cached)
                return
        elif isinstance(event, Done):
            tail = matcher.flush()
            placed = track.rest() if prep.logprobs else []
            if tail or placed:
                yield Piece(tail, placed)
            reason: Literal["stop", "length"] = "stop" if event.stop_reason == "eos" else "length"
            n_prompt = event.prompt_tokens if event.prompt_tokens is not None else prompt_tokens
            missing = track.missing or (prep.logprobs and event.tokens_generated > tokens)
            n_cached = event.cached_tokens if event.cached_tokens is not None else cached
            yield Finish(
                reason, event.tokens_generated, n_prompt or 0, event.final_text, missing, n_cached
            )
            return
        else:
            raise fault_error(event, prep.param, served)


def fault_error(fault: Fault, param: str, served: ServedModel) -> ApiError:
    """The HTTP answer to a prompt's Fault, by its type (never by its text)."""
    if fault.kind == ErrorType.PROMPT_TOO_LONG:
        has = "" if fault.prompt_tokens is None else f"; your prompt has {fault.prompt_tokens}"
        return invalid(
            f"This model's maximum context length is {served.max_seq_len} tokens{has} (the "
            f"prompt and at least one generated token must fit).",
            param,
            "context_length_exceeded",
        )
    if fault.kind == ErrorType.CHAT_TEMPLATE_REFUSED:
        return invalid(fault.error, "messages", "chat_template_refused")
    if fault.kind == ErrorType.INVALID_PROMPT:
        return invalid(fault.error, param, "invalid_prompt")
    return ApiError(
        500, f"the prompt faulted: {fault.error}", type="server_error", code="prompt_fault"
    )


async def collect(session: PromptSession, prep: Prepared, served: ServedModel) -> Collected:
    out = Collected()
    async for item in drive(session, prep, served):
        if isinstance(item, Piece):
            out.pieces.append(item.text)
            out.logprobs.extend(item.logprobs)
        else:
            out.finish = item
    out.text = "".join(out.pieces)
    finish = out.finish
    assert finish is not None
    if finish.final_text is not None and finish.final_text != out.text:
        # The run's own text is the reference (the stream is its batched copy).
        out.text, hit = cut_at_stop(finish.final_text, prep.stops)
        if hit:
            finish.reason = "stop"
    return out
