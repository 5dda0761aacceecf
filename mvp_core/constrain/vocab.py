"""Token masks: which of a vocabulary's tokens a recognizer state allows next.

The vocabulary's token byte strings are kept sorted, with each one's common prefix
with the one before (``lcp``): walking them in order is walking a prefix tree, the
recognizer's state after each prefix reused by the tokens that share it, and a prefix
the state refuses skips every token under it at once (a bisection). Masks are cached by
state (states are small and hashable); inside a free string, the tokens that cannot
leave it (no '"', '\\' nor control byte, UTF-8 well formed) are allowed whatever
follows the string, so only the few thousand others are walked.

A mask is a ``bytearray`` of one byte per token id (1: allowed), for the engine to view
as a boolean tensor without a copy. The end tokens (``eos_ids``) are allowed exactly
where the value is complete; tokens of no bytes (control tokens) never are.
"""

from __future__ import annotations

import codecs
import json
import re
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Any

from mvp_core.constrain.recognizer import Recognizer, State
from mvp_core.constrain.schema import compile_format

__all__ = ["Constraint", "FormatCache", "FormatMasks", "TokenVocabulary"]

MASK_CACHE = 256  # masks kept per format (LRU): 49k-262k bytes each
FORMAT_CACHE = 16  # compiled formats kept per vocabulary (LRU)


class _Sorted:
    """Token byte strings sorted, each one's ids, and its common prefix with the one
    before (the prefix tree, flat)."""

    def __init__(self, pieces: dict[bytes, list[int]]) -> None:
        self.texts = sorted(pieces)
        self.ids = [pieces[t] for t in self.texts]
        self.lcp = [0] * len(self.texts)
        for i in range(1, len(self.texts)):
            a, b = self.texts[i - 1], self.texts[i]
            n = min(len(a), len(b))
            # The first differing byte, from the XOR of the two as big-endian integers.
            x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
            self.lcp[i] = n - (x.bit_length() + 7) // 8

    def walk(self, rec: Recognizer, start: State, mask: bytearray) -> None:
        """Set ``mask`` for every token ``rec`` can take from ``start``."""
        texts, lcp, ids = self.texts, self.lcp, self.ids
        advance = rec.advance
        n = len(texts)
        states = [start]  # states[d]: after the current token's first d bytes
        i = 0
        while i < n:
            text = texts[i]
            depth = lcp[i]
            del states[depth + 1 :]
            state = states[depth]
            while depth < len(text):
                state = advance(state, text[depth])
                depth += 1
                if not state:
                    break
                states.append(state)
            if state:
                for t in ids[i]:
                    mask[t] = 1
                i += 1
            else:  # no token under text[:depth] is allowed: skip them all
                i = bisect_left(texts, _after(text[:depth]), i + 1)


def _after(prefix: bytes) -> bytes:
    """The least byte string above every string that starts with ``prefix``."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return b"\xff" * (len(prefix) + 1)  # above all: only 0xff-strings remain
    p[-1] += 1
    return bytes(p)


_LEAVES_STRING = re.compile(rb'["\\\x00-\x1f]')


def _string_safe(data: bytes) -> bool:
    """Whether ``data`` stays inside a free string from between two characters (no
    '"', '\\' nor control byte; UTF-8 well formed, maybe ending inside a character:
    the string's next token goes on with it). Python's UTF-8 decoder refuses what the
    recognizer refuses (overlong forms, surrogates, past U+10FFFF)."""
    if _LEAVES_STRING.search(data):
        return False
    if data.isascii():
        return True
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        pass  # maybe a character cut at the end
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        return False
    return True


class TokenVocabulary:
    """A model's tokens as bytes (``pieces[id]``; b"" for a control token) and its end
    tokens: built once per stage, shared by every prompt that asks for a format."""

    def __init__(self, pieces: Sequence[bytes], eos_ids: Collection[int]) -> None:
        self.size = len(pieces)
        self.pieces = list(pieces)
        self.eos_ids = frozenset(i for i in eos_ids if 0 <= i < self.size)
        groups: dict[bytes, list[int]] = {}
        special: dict[bytes, list[int]] = {}
        self.string_safe = bytearray(self.size)
        for i, p in enumerate(pieces):
            if not p or i in self.eos_ids:
                continue
            groups.setdefault(p, []).append(i)
            if _string_safe(p):
                self.string_safe[i] = 1
            else:
                special.setdefault(p, []).append(i)
        self.all = _Sorted(groups)
        self.special = _Sorted(special)

    def masks(self, fmt: dict[str, Any]) -> FormatMasks:
        return FormatMasks(Recognizer(compile_format(fmt)), self)


class FormatMasks:
    """One format's recognizer over one vocabulary, its masks cached by state."""

    def __init__(self, rec: Recognizer, vocab: TokenVocabulary) -> None:
        self.rec = rec
        self.vocab = vocab
        self._cache: OrderedDict[State, bytearray] = OrderedDict()

    def mask(self, state: State) -> bytearray:
        """The tokens allowed from ``state`` (the caller must not change it)."""
        got = self._cache.get(state)
        if got is not None:
            self._cache.move_to_end(state)
            return got
        vocab = self.vocab
        if self.rec.in_free_string(state):
            mask = bytearray(vocab.string_safe)
            vocab.special.walk(self.rec, state, mask)
        else:
            mask = bytearray(vocab.size)
            vocab.all.walk(self.rec, state, mask)
        if self.rec.complete(state):
            for t in vocab.eos_ids:
                mask[t] = 1
        if 1 not in mask:  # no token can go on (it should not happen): let it end
            for t in vocab.eos_ids:
                mask[t] = 1
        self._cache[state] = mask
        if len(self._cache) > MASK_CACHE:
            self._cache.popitem(last=False)
        return mask

    def constraint(self) -> Constraint:
        return Constraint(self)


class Constraint:
    """One sequence's place in its format: the mask of its next token, and the state
    after each token it took."""

    def __init__(self, masks: FormatMasks) -> None:
        self.masks = masks
        self.state: State = masks.rec.start

    def allowed(self) -> bytearray:
        return self.masks.mask(self.state)

    def take(self, token: int) -> None:
        """Advance by ``token``'s bytes (an end token or a refused one leaves it as is:
        the sequence ends there, or was resumed from tokens of its own)."""
        vocab = self.masks.vocab
        if token in vocab.eos_ids or not 0 <= token < vocab.size:
            return
        after = self.masks.rec.feed(self.state, vocab.pieces[token])
        if after:
            self.state = after

    @property
    def complete(self) -> bool:
        return self.masks.rec.complete(self.state)


class FormatCache:
    """Compiled formats by their canonical text, for one vocabulary (LRU)."""

    def __init__(self, vocab: TokenVocabulary) -> None:
        self.vocab = vocab
        self._formats: OrderedDict[str, FormatMasks] = OrderedDict()

    def constraint(self, text: str) -> Constraint:
        got = self._formats.get(text)
        if got is None:
            got = self.vocab.masks(json.loads(text))
            self._formats[text] = got
            if len(self._formats) > FORMAT_CACHE:
                self._formats.popitem(last=False)
        else:
            self._formats.move_to_end(text)
        return got.constraint()
