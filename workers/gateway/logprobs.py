"""A choice's log probabilities, as OpenAI's two APIs shape them.

The head node sends each generated token's logprobs with the text delta its text
completes (``TextDelta.logprobs``: the token's own text and bytes, its log probability,
the step's most likely tokens). ``LogprobTrack`` places each token at its offset in the
choice's text, so that they are released together with the text the stop strings let
through: a token is returned once its whole text is, and a stop string keeps the tokens
that begin before it. ``chat_logprobs`` and ``completion_logprobs`` shape them for
``/v1/chat/completions`` and ``/v1/completions``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mvp_core.models import TextDelta, TokenLogprob


@dataclass(frozen=True)
class Placed:
    """A token's logprobs and where its text starts in the choice's text."""

    offset: int
    entry: TokenLogprob


@dataclass
class LogprobTrack:
    """The tokens of the text received so far, each with its span of that text."""

    _spans: list[tuple[int, int, TokenLogprob]] = field(default_factory=list)
    _received: int = 0  # characters of text received
    _released: int = 0  # tokens returned so far
    missing: bool = False  # some text came without its logprobs (a resumed prompt's)

    def push(self, delta: TextDelta) -> None:
        """A delta's tokens: each spans its own text where the tokens' texts make up the
        delta's (else up to the delta's end: a character split between tokens)."""
        start, end = self._received, self._received + len(delta.text)
        self._received = end
        entries = delta.logprobs
        if entries is None or len(entries) < (delta.tokens or 0):
            self.missing = True
        for k, entry in enumerate(entries or ()):
            a = min(start, end)
            start += len(entry.token)
            b = end if k == len(entries or ()) - 1 else min(start, end)
            self._spans.append((a, b, entry))

    def release(self, emitted: int) -> list[Placed]:
        """The tokens not returned yet whose whole text lies within the first
        ``emitted`` characters of the choice's text."""
        return self._take(lambda a, b: b <= emitted)

    def cut(self, emitted: int) -> list[Placed]:
        """The text ends at ``emitted`` (a stop string): the tokens not returned yet that
        begin before it; those after it are never returned."""
        out = self._take(lambda a, b: a < emitted)
        self._released = len(self._spans)
        return out

    def rest(self) -> list[Placed]:
        """The text is whole: every token not returned yet."""
        return self._take(lambda a, b: True)

    def _take(self, keep: Callable[[int, int], bool]) -> list[Placed]:
        out: list[Placed] = []
        while self._released < len(self._spans):
            a, b, entry = self._spans[self._released]
            if not keep(a, b):
                break
            out.append(Placed(a, entry))
            self._released += 1
        return out


def chat_logprobs(placed: list[Placed]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or a chunk's)."""
    return {
        "content": [p.entry.model_dump(include={"token", "logprob", "bytes", "top_logprobs"})
                    for p in placed],
        "refusal": None,
    }  # fmt: skip


def completion_logprobs(placed: list[Placed]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a text completion (or a chunk's): each token's text,
    logprob and offset in the completion's text, and per token a dict of the step's most
    likely tokens (the ``logprobs`` asked for) and the sampled one, text -> logprob (a
    text two tokens share keeps the likelier)."""
    tops: list[dict[str, float]] = []
    for p in placed:
        top: dict[str, float] = {}
        for alt in [*p.entry.top_logprobs, p.entry]:
            top.setdefault(alt.token, alt.logprob)
        tops.append(top)
    return {
        "tokens": [p.entry.token for p in placed],
        "token_logprobs": [p.entry.logprob for p in placed],
        "top_logprobs": tops,
        "text_offset": [p.offset for p in placed],
    }
