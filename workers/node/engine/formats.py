"""A stage's response formats (DECISIONS 89): the constrainer's token table, made from
the stage's tokenizer (the GGUF header's vocabulary) at the first prompt that asks for a
format, and the formats compiled so far. The sampler takes each prompt's Constraint
from here (sampling.Sampler)."""

from __future__ import annotations

import threading
from collections.abc import Collection

from mvp_core.constrain import Constraint, FormatCache, TokenVocabulary

from .tokenizer import Tokenizer

__all__ = ["StageFormats"]


class StageFormats:
    """``tokenizer``'s tokens as bytes and ``eos_ids`` (the stage's end tokens: allowed
    exactly where the value is complete), built once, lazily; thread-safe."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self._eos_ids = frozenset(eos_ids)
        self._lock = threading.Lock()
        self._cache: FormatCache | None = None

    def _formats(self) -> FormatCache:
        if self._cache is None:
            tok = self._tokenizer
            pieces = [tok.token_to_bytes(i) for i in range(tok.vocab_size)]
            self._cache = FormatCache(TokenVocabulary(pieces, self._eos_ids))
        return self._cache

    def constraint(self, fmt: str) -> Constraint:
        """A new sequence's constraint for the format whose canonical JSON is ``fmt``."""
        with self._lock:
            return self._formats().constraint(fmt)
