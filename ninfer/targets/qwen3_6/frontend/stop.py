"""Stop strings over a text stream, across token boundaries.

Text that could still become the start of a stop string is held back, so a consumer never sees the
beginning of a stop string that later completes.
"""

from __future__ import annotations


def partial_suffix_len(text: str, needles: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``needles``."""
    best = 0
    size = len(text)
    for needle in needles:
        # such a suffix starts with needle[0] within the last len(needle) - 1 characters: try those
        # positions, longest suffix first (usually there is none, and this is one find per needle)
        first = needle[:1]
        i = text.find(first, max(size - len(needle) + 1, 0))
        while i >= 0 and size - i > best:
            if needle.startswith(text[i:]):
                best = size - i
                break
            i = text.find(first, i + 1)
    return best


class StopStringMatcher:
    __slots__ = ("_stops", "_include", "_held", "last_hit")

    def __init__(self, stop_strings: tuple[str, ...], include_stop_str: bool) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._stops = stop_strings
        self._include = include_stop_str
        self._held = ""
        self.last_hit: str | None = None  # the stop string that completed

    def copy(self) -> StopStringMatcher:
        # field by field: copy.copy takes the generic __reduce_ex__ path (microseconds per preview)
        new = StopStringMatcher.__new__(StopStringMatcher)
        new._stops = self._stops
        new._include = self._include
        new._held = self._held
        new.last_hit = self.last_hit
        return new

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string completed). After a stop, the rest is dropped."""
        buf = self._held + text
        hit: tuple[int, str] | None = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (hit is None or i < hit[0] or (i == hit[0] and len(s) > len(hit[1]))):
                hit = (i, s)
        if hit is not None:
            self._held = ""
            i, s = hit
            self.last_hit = s
            return buf[: i + len(s)] if self._include else buf[:i], True
        keep = partial_suffix_len(buf, self._stops)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release held text (the stream ended without completing a stop string)."""
        out, self._held = self._held, ""
        return out
