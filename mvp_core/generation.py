"""Pure rules of the token loop (actor spec 7.3, 7.4, 12.4).

The head node's driver uses these; they are unit-tested without an engine.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from mvp_core.errors import ErrorType


class TokenSequenceViolation(RuntimeError):
    """A token-out record arrived out of order: a run fault (DECISIONS 14)."""


@dataclass
class TokenFeedback:
    """Consumes token-out records in strict order and decides what to inject next.

    The next feedback sequence is released only after the previous one was consumed.
    """

    expected: int = 0
    injected: int = 0  # sequence 0 is the prompt record

    def consume(self, sequence: int) -> int:
        """Validate a token-out sequence; returns the sequence to inject as feedback."""
        if sequence != self.expected:
            raise TokenSequenceViolation(
                f"pipeline token sequence violation: expected {self.expected}, got {sequence}"
            )
        self.expected += 1
        self.injected = sequence + 1
        return self.injected


@dataclass
class StopRule:
    """EOS, the token limit and the context end stop generation."""

    max_new_tokens: int | None
    stop_ids: Collection[int]
    max_seq_len: int
    generated: int = 0
    reason: str | None = field(default=None)

    def accept(self, token_id: int, position: int) -> bool:
        """Record a sampled token; False means stop (and the token is not emitted if EOS)."""
        if token_id in self.stop_ids:
            self.reason = "eos"
            return False
        self.generated += 1
        if self.max_new_tokens is not None and self.generated >= self.max_new_tokens:
            self.reason = "max_tokens"
        elif position >= self.max_seq_len:
            self.reason = "context"
        return True

    @property
    def done(self) -> bool:
        return self.reason is not None


def effective_max_tokens(requested: int | None, run_default: int | None) -> int | None:
    """CONTRACTS: absent or 0 means no arbitrary cap, unless the run sets a default."""
    if requested:
        return requested
    if run_default:
        return run_default
    return None


def fixed_address_layout(setting: str, host_nodes: int) -> bool:
    """Whether a node starts with address-space randomization off (engine.address_layout):
    co-located stages then run their shared code at the same virtual addresses, and the
    front-end state one stage leaves on a core still fits the next stage's code."""
    if setting not in ("auto", "fixed", "randomized"):
        raise ValueError(f"address_layout must be auto, fixed or randomized, not {setting!r}")
    return setting == "fixed" or (setting == "auto" and host_nodes > 1)


class PromptRefused(ValueError):
    """A prompt the head node refuses after reading it: the prompt gets a Fault of this
    ``kind`` (its client answers by the type, never by the text) and the run keeps
    serving."""

    kind: ErrorType = ErrorType.INVALID_PROMPT

    def __init__(self, message: str, *, prompt_tokens: int | None = None) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens


class PromptTooLong(PromptRefused):
    """The prompt does not fit the planned context (with one generated token)."""

    kind = ErrorType.PROMPT_TOO_LONG


class ChatTemplateRefused(PromptRefused):
    """Chat asked of a model without a chat template, or its template refused the
    conversation."""

    kind = ErrorType.CHAT_TEMPLATE_REFUSED
