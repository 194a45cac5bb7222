"""Stop strings over a text stream, across token boundaries.

Text that could still become the start of a stop string is held back, so a consumer never sees the
beginning of a stop string that later completes.
"""

from __future__ import annotations

import copy


def partial_suffix_len(text: str, needles: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``needles``."""
    best = 0
    for needle in needles:
        for n in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:n]):
                best = n
                break
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
        return copy.copy(self)

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
