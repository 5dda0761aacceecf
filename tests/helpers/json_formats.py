"""JSON output helpers shared by the constrainer's tests (DECISIONS 89): a schema with
every supported keyword, a validator of the supported subset (the project has no
jsonschema), random texts a recognizer lets through, and the token-by-token mask."""

from __future__ import annotations

import random
from typing import Any

from mvp_core.constrain import Recognizer, State
from mvp_core.constrain.vocab import FormatMasks

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "city": {"enum": ["Paris", "Rome", "Zürich"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "zip": {"const": "75001"}},
            "required": ["street"],
            "additionalProperties": False,
        },
        "spouse": {"anyOf": [{"type": "null"}, {"type": "string"}]},
        "alive": {"type": "boolean"},
        "kind": {"type": ["integer", "null"]},
    },
    "required": ["name", "age", "address"],
    "additionalProperties": False,
}


def validates(value: Any, s: Any) -> bool:
    """The subset's JSON Schema semantics, written out (no jsonschema in the project)."""
    if s is True or s == {}:
        return True
    if "const" in s:
        return _same(value, s["const"])
    if "enum" in s:
        return any(_same(value, v) for v in s["enum"])
    if "anyOf" in s:
        return any(validates(value, a) for a in s["anyOf"])
    kinds = s["type"] if isinstance(s["type"], list) else [s["type"]]
    return any(_typed(value, s, k) for k in kinds)


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _typed(value: Any, s: dict[str, Any], kind: str) -> bool:
    if kind == "object":
        if not isinstance(value, dict) or not set(s.get("required", [])) <= value.keys():
            return False
        props = s.get("properties", {})
        extra = s.get("additionalProperties", True)
        for k, v in value.items():
            sub = props.get(k, extra)
            if sub is False or not validates(v, sub):
                return False
        return True
    if kind == "array":
        lo, hi = s.get("minItems", 0), s.get("maxItems", 10**9)
        items = s.get("items", True)
        return (
            isinstance(value, list)
            and lo <= len(value) <= hi
            and all(validates(v, items) for v in value)
        )
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    return bool(checks[kind](value))


# The bytes random texts are made of: ASCII, and a few of UTF-8's leads and continuations.
_BYTES = [*range(0x7F), 0x80, 0x9F, 0xA9, 0xBC, 0xC3, 0xE0, 0xE2, 0xED, 0xF0, 0xF4, 0xFF]


def random_text(rec: Recognizer, rnd: random.Random, limit: int = 300) -> bytes | None:
    """A random walk through the bytes the recognizer allows, ending where it may."""
    state, out = rec.start, bytearray()
    for _ in range(limit):
        if rec.complete(state) and rnd.random() < 0.3:
            return bytes(out)
        choices = [b for b in _BYTES if rec.advance(state, b)]
        if not choices:  # only a complete value (its whitespace bound reached) ends so
            assert rec.complete(state), f"a dead end after {bytes(out)!r}"
            return bytes(out)
        # Prefer closing brackets and quotes so that walks end within the limit.
        closers = [b for b in choices if b in b'}]"']
        b = rnd.choice(closers if closers and rnd.random() < 0.3 else choices)
        out.append(b)
        state = rec.advance(state, b)
    return bytes(out) if rec.complete(state) else None


def brute_mask(masks: FormatMasks, state: State) -> bytearray:
    rec, vocab = masks.rec, masks.vocab
    out = bytearray(vocab.size)
    for i, piece in enumerate(vocab.pieces):
        if i in vocab.eos_ids:
            out[i] = rec.complete(state)
        elif piece and rec.feed(state, piece):
            out[i] = 1
    if not any(out):  # no token goes on: the end tokens, so that it ends (vocab.py)
        for i in vocab.eos_ids:
            out[i] = 1
    return out


def states_along(rec: Recognizer, texts: list[bytes], rnd: random.Random) -> list[State]:
    """States along random prefixes of valid texts (and the start)."""
    out = [rec.start]
    for text in texts:
        for cut in sorted(rnd.sample(range(len(text) + 1), min(6, len(text) + 1))):
            out.append(rec.feed(rec.start, text[:cut]))
    return out
