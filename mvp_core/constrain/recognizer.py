"""An incremental recognizer of a compiled schema's JSON texts, byte by byte.

A state is a frozenset of threads (each a stack of frames, tuples, the top last): anyOf,
an enum's values that share a prefix and a number that may end or go on are threads side
by side. ``advance(state, byte)`` is the state after one more byte (empty: the byte is
not allowed); ``complete(state)`` says whether the text so far is a whole value.
States are immutable and hashable, so transitions and token masks can be cached by
state (vocab.py). Bytes, not characters: a byte-level BPE token may end inside a UTF-8
character; strings check UTF-8's structure (lead and continuation bytes).

Generation must end: whitespace runs are at most ``MAX_WS`` bytes (between tokens of
the value; ``MAX_TRAILING_WS`` after it), a number's digit runs at most ``MAX_DIGITS``;
a complete value takes nothing but that trailing whitespace (the stage then allows only its end
tokens). Strings and free-key objects are bounded by the prompt's max_tokens only.

Frames (tag first):
  ("R", done, ws)                 the root: done once the value is complete
  ("V", node, ws)                 a value of ``node`` to come, after ``ws`` whitespace
  ("O", node, seen, phase, key, ws)  an object: 0 after '{', 1 after a key (':' next),
                                  2 in a value, 3 after a value, 4 after ',', 5 in a key
  ("A", node, count, phase, ws)   an array: 0 after '[', 1 in a value, 2 after a value
  ("S", esc, pending)             a free string: esc 1 after '\\', 2-5 in \\uXXXX;
                                  ``pending`` UTF-8 continuation bytes owed
  ("L", texts, pos)               one of the literal texts, ``pos`` bytes matched
  ("N", integer, phase, digits)   a number, by JSON's grammar phases (see _number)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from mvp_core.constrain.schema import Node, NodeKind, Schema

__all__ = ["MAX_DIGITS", "MAX_TRAILING_WS", "MAX_WS", "Recognizer", "State", "utf8_next"]

MAX_WS = 8  # consecutive whitespace bytes (a newline and an indentation)
MAX_TRAILING_WS = 2  # after the value: then only the end token
MAX_DIGITS = 16  # digits of a number's integer part, fraction or exponent
_MEMO_MAX = 500_000

Frame = tuple[Any, ...]  # (tag, fields...): see the module docstring
Thread = tuple[Frame, ...]
State = frozenset[Thread]

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


# UTF-8 inside strings: what a character still owes. 1-3: that many continuation bytes
# (0x80-0xBF); 4-7: a lead byte whose next byte has a narrower range (E0: A0-BF, ED:
# 80-9F, F0: 90-BF, F4: 80-8F; no overlong forms, surrogates or code points past
# U+10FFFF), after which 1 or 2 more are owed.
_NARROW = {0xE0: 4, 0xED: 5, 0xF0: 6, 0xF4: 7}
_NARROW_RANGE = {4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}


def utf8_next(pending: int, b: int) -> int | None:
    """What is owed after byte ``b`` of a non-ASCII character where ``pending`` was
    owed (0: ``b`` leads a character); None where ``b`` cannot come there."""
    if pending == 0:
        if 0xC2 <= b <= 0xDF:
            return 1
        if b in _NARROW:
            return _NARROW[b]
        if 0xE1 <= b <= 0xEF:
            return 2
        if 0xF1 <= b <= 0xF3:
            return 3
        return None
    if pending >= 4:
        lo, hi, left = _NARROW_RANGE[pending]
        return left if lo <= b <= hi else None
    return pending - 1 if 0x80 <= b <= 0xBF else None


class Recognizer:
    """The JSON texts of one compiled schema (schema.compile_format)."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.nodes = schema.nodes
        self._memo: dict[tuple[State, int], State] = {}
        self.start: State = frozenset({(("R", False, 0), ("V", schema.root, 0))})

    # ------------------------------------------------------------------ public

    def advance(self, state: State, byte: int) -> State:
        """The state after ``byte`` (memoized); empty where it is not allowed."""
        key = (state, byte)
        got = self._memo.get(key)
        if got is None:
            if len(self._memo) >= _MEMO_MAX:
                self._memo.clear()
            out: set[Thread] = set()
            for thread in state:
                out.update(self._step(thread, byte))
            got = self._memo[key] = frozenset(out)
        return got

    def feed(self, state: State, data: Iterable[int]) -> State:
        for b in data:
            state = self.advance(state, b)
            if not state:
                break
        return state

    @staticmethod
    def complete(state: State) -> bool:
        """The bytes so far are a whole value (and its trailing whitespace)."""
        return any(t[-1][0] == "R" and t[-1][1] for t in state)

    def accepts(self, data: bytes) -> bool:
        """``data`` is a whole value of the schema (what the recognizer would let end)."""
        return self.complete(self.feed(self.start, data))

    @staticmethod
    def in_free_string(state: State) -> bool:
        """One thread, inside a free string between characters: every byte but '"', '\\'
        and control bytes keeps it there (vocab.TokenVocabulary's string-safe tokens)."""
        if len(state) != 1:
            return False
        (thread,) = state
        return thread[-1] == ("S", 0, 0)

    # ------------------------------------------------------------------ steps

    def _step(self, t: Thread, b: int) -> list[Thread]:
        top = t[-1]
        tag = top[0]
        if tag == "S":
            return self._string(t, b)
        if tag == "V":
            if b in _WS:
                return [(*t[:-1], ("V", top[1], top[2] + 1))] if top[2] < MAX_WS else []
            return self._begin(t[:-1], top[1], b)
        if tag == "L":
            return self._literal(t[:-1], top[1], top[2], b)
        if tag == "N":
            return self._number(t, b)
        if tag == "O":
            return self._object(t, b)
        if tag == "A":
            return self._array(t, b)
        if tag == "R":  # done: trailing whitespace only
            if b in _WS and top[2] < MAX_TRAILING_WS:
                return [(("R", True, top[2] + 1),)]
            return []
        raise AssertionError(f"unknown frame {top!r}")

    def _ws(self, t: Thread, b: int) -> list[Thread]:
        """Whitespace inside an object or array frame (its last field counts it)."""
        top = t[-1]
        if top[-1] >= MAX_WS:
            return []
        return [(*t[:-1], (*top[:-1], top[-1] + 1))]

    def _begin(self, rest: Thread, node_id: int, b: int) -> list[Thread]:
        """The first byte of a value of ``node_id`` (``rest``: the frames below it)."""
        node = self.nodes[node_id]
        kind = node.kind
        if kind is NodeKind.ANY_OF:
            out: list[Thread] = []
            for alt in node.alts:
                out.extend(self._begin(rest, alt, b))
            return out
        if kind is NodeKind.OBJECT:
            return [(*rest, ("O", node_id, frozenset(), 0, -1, 0))] if b == ord("{") else []
        if kind is NodeKind.ARRAY:
            return [(*rest, ("A", node_id, 0, 0, 0))] if b == ord("[") else []
        if kind is NodeKind.STRING:
            return [(*rest, ("S", 0, 0))] if b == _QUOTE else []
        if kind is NodeKind.LITERAL:
            return self._literal(rest, node.literals, 0, b)
        return self._number((*rest, ("N", kind is NodeKind.INTEGER, 0, 0)), b)

    def _done(self, rest: Thread, result: bytes | None = None) -> list[Thread]:
        """A value (or a key: ``result`` the literal it matched) ended; ``rest`` is the
        stack below it, whose top frame takes it."""
        parent = rest[-1]
        tag = parent[0]
        if tag == "R":
            return [(("R", True, 0),)]
        if tag == "O":
            _, node_id, seen, phase, _, _ = parent
            if phase == 5:  # a key
                node = self.nodes[node_id]
                key = node.keys.index(result) if result is not None else -1
                return [(*rest[:-1], ("O", node_id, seen, 1, key, 0))]
            return [(*rest[:-1], ("O", node_id, seen, 3, -1, 0))]
        if tag == "A":
            _, node_id, count, _, _ = parent
            node = self.nodes[node_id]
            cap = max(node.min_items, node.max_items or 0)
            return [(*rest[:-1], ("A", node_id, min(count + 1, cap), 2, 0))]
        raise AssertionError(f"a value ended under {parent!r}")

    def _literal(self, rest: Thread, texts: frozenset[bytes], pos: int, b: int) -> list[Thread]:
        going = frozenset(x for x in texts if len(x) > pos and x[pos] == b)
        out: list[Thread] = []
        ended = [x for x in going if len(x) == pos + 1]
        for x in ended:
            out.extend(self._done(rest, x))
        longer = frozenset(x for x in going if len(x) > pos + 1)
        if longer:
            out.append((*rest, ("L", longer, pos + 1)))
        return out

    def _string(self, t: Thread, b: int) -> list[Thread]:
        _, esc, pending = t[-1]
        rest = t[:-1]
        if pending:
            after = utf8_next(pending, b)
            return [] if after is None else [(*rest, ("S", 0, after))]
        if esc == 1:
            if b in _ESCAPES:
                return [(*rest, ("S", 0, 0))]
            return [(*rest, ("S", 2, 0))] if b == ord("u") else []
        if esc:
            if b not in _HEX:
                return []
            return [(*rest, ("S", 0 if esc == 5 else esc + 1, 0))]
        if b == _QUOTE:
            return self._done(rest)
        if b == _BACKSLASH:
            return [(*rest, ("S", 1, 0))]
        if b < 0x20:
            return []
        if b < 0x80:
            return [t]
        after = utf8_next(0, b)
        return [] if after is None else [(*rest, ("S", 0, after))]

    # A number's phases: 0 after '-'; 1 a leading 0; 2 integer digits; 3 after '.';
    # 4 fraction digits; 5 after 'e'; 6 after the exponent's sign; 7 exponent digits.
    _NUMBER_ENDS = frozenset({1, 2, 4, 7})

    def _number(self, t: Thread, b: int) -> list[Thread]:
        _, integer, phase, digits = t[-1]
        rest = t[:-1]
        nxt: tuple[int, int] | None = None  # (phase, digits)
        if b in _DIGITS:
            if phase == 0:
                nxt = (1, 1) if b == ord("0") else (2, 1)
            elif phase in (2, 4, 7):
                nxt = (phase, digits + 1) if digits < MAX_DIGITS else None
            elif phase in (3, 5, 6):
                nxt = (4 if phase == 3 else 7, 1)
        elif b == ord("-"):
            if phase == 0 and digits == 0 and t[-1] == ("N", integer, 0, 0):
                nxt = (0, -1)  # the sign: -1 marks it taken
            elif phase == 5:
                nxt = (6, 0)
        elif b == ord("+") and phase == 5:
            nxt = (6, 0)
        elif not integer and b == ord(".") and phase in (1, 2):
            nxt = (3, 0)
        elif not integer and b in b"eE" and phase in (1, 2, 4):
            nxt = (5, 0)
        if nxt is None:
            return []
        frame = (*rest, ("N", integer, *nxt))
        if nxt[0] in self._NUMBER_ENDS:
            # It may end here: a thread where it did, beside the one where it goes on.
            return [frame, *self._done(rest)]
        return [frame]

    def _object(self, t: Thread, b: int) -> list[Thread]:
        _, node_id, seen, phase, key, _ = t[-1]
        node: Node = self.nodes[node_id]
        rest = t[:-1]
        if phase == 5 or phase == 2:
            raise AssertionError("an object in a key or value is never the top frame")
        if b in _WS:
            return self._ws(t, b)
        if phase in (0, 4) and b == _QUOTE:
            this = ("O", node_id, seen, 5, -1, 0)
            if node.extra is not None:
                return [(*rest, this, ("S", 0, 0))]
            texts = frozenset(k for i, k in enumerate(node.keys) if i not in seen)
            return self._literal((*rest, this), texts, 0, b) if texts else []
        if phase in (0, 3) and b == ord("}"):
            return self._done(rest) if node.required <= seen else []
        if phase == 1 and b == ord(":"):
            value = node.extra if key == -1 else node.props[key][1]
            assert value is not None
            seen2 = seen if key == -1 else seen | {key}
            return [(*rest, ("O", node_id, seen2, 2, -1, 0), ("V", value, 0))]
        if phase == 3 and b == ord(","):
            more = node.extra is not None or len(seen) < len(node.props)
            return [(*rest, ("O", node_id, seen, 4, -1, 0))] if more else []
        return []

    def _array(self, t: Thread, b: int) -> list[Thread]:
        _, node_id, count, phase, _ = t[-1]
        node: Node = self.nodes[node_id]
        rest = t[:-1]
        if b in _WS:
            return self._ws(t, b)
        if b == ord("]") and phase in (0, 2):
            return self._done(rest) if count >= node.min_items else []
        if phase == 0:
            if node.max_items == 0:
                return []
            return self._begin((*rest, ("A", node_id, count, 1, 0)), node.items, b)
        if phase == 2 and b == ord(","):
            if node.max_items is not None and count >= node.max_items:
                return []
            return [(*rest, ("A", node_id, count, 1, 0), ("V", node.items, 0))]
        return []
