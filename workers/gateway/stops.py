"""Stop sequences over streamed text.

The run knows nothing of stop strings: the gateway watches the text as it streams,
holds back any tail that could be the start of a stop string, and on a match releases
only the text before it (the caller then cancels the prompt)."""

from __future__ import annotations


class StopMatcher:
    """Feed text deltas in order; ``push`` returns what is safe to release and whether a
    stop string has appeared (then nothing from it on is ever released). Splitting the
    same text into other deltas gives the same result."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        # The stop that completes first wins (as if the text were checked token by token;
        # a tie goes to the one that starts first): the cut never depends on how the run
        # batched its text.
        best: tuple[int, int] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best):
                best, self.matched = (i + len(s), i), s
        if best is not None:
            self._held = ""
            return buf[: best[1]], True
        keep = self._open_tail(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The end of the text: whatever was held back is released."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _open_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of a stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string in it, and whether one was found."""
    matcher = StopMatcher(stops)
    head, hit = matcher.push(text)
    return (head, True) if hit else (head + matcher.flush(), False)
