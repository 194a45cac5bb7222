"""Thinking/content channel split of the Qwen3.6 output stream.

Template convention (both 3.6 and 3.8): an assistant turn renders as
``<think>\\n`` + reasoning + ``\\n</think>\\n\\n`` + content, and the template strips newlines around the
reasoning and leading newlines of the content. The splitter applies the same stripping while streaming,
so the reasoning and content it reports re-render to exactly the tokens the model produced:

- text before ``</think>`` is reasoning (when the prompt opened ``<think>``, output starts there);
- ``<think>`` emitted by the model opens reasoning; a stray marker in the wrong channel is dropped;
- the markers themselves, leading newlines of each channel and the newlines before ``</think>`` are not
  part of either text. Newlines at the end of reasoning are held until what follows is known.
"""

from __future__ import annotations

from typing import Literal

from ninfer.targets.qwen3_6.frontend.stop import partial_suffix_len

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_MARKERS = (THINK_OPEN, THINK_CLOSE)

Channel = Literal["reasoning", "content"]


class ChannelSplitter:
    __slots__ = ("channel", "_held", "_strip_leading")

    def __init__(self, starts_in_reasoning: bool) -> None:
        self.channel: Channel = "reasoning" if starts_in_reasoning else "content"
        self._held = ""
        # newlines right after <think> (and after </think>) are template separators, not text
        self._strip_leading = starts_in_reasoning

    def copy(self) -> ChannelSplitter:
        # field by field: copy.copy takes the generic __reduce_ex__ path (microseconds per preview)
        new = ChannelSplitter.__new__(ChannelSplitter)
        new.channel = self.channel
        new._held = self._held
        new._strip_leading = self._strip_leading
        return new

    def _emit(self, out: list[tuple[Channel, str]], text: str) -> None:
        if self._strip_leading:
            text = text.lstrip("\n")
            if not text:
                return
            self._strip_leading = False
        if text:
            out.append((self.channel, text))

    def feed(self, text: str) -> list[tuple[Channel, str]]:
        """Segments (channel, text) in order; text that may be part of a marker or separator is held."""
        out: list[tuple[Channel, str]] = []
        buf = self._held + text
        while True:
            hits = [(buf.find(m), m) for m in _MARKERS]
            hits = [(i, m) for i, m in hits if i >= 0]
            if not hits:
                break
            i, marker = min(hits)
            before, buf = buf[:i], buf[i + len(marker) :]
            if marker == THINK_CLOSE and self.channel == "reasoning":
                self._emit(out, before.rstrip("\n"))
                self.channel, self._strip_leading = "content", True
            elif marker == THINK_OPEN and self.channel == "content":
                self._emit(out, before)
                self.channel, self._strip_leading = "reasoning", True
            else:
                self._emit(out, before)  # marker of the channel we are already in: dropped
        keep = partial_suffix_len(buf, _MARKERS)
        body, tail = buf[: len(buf) - keep], buf[len(buf) - keep :]
        if self.channel == "reasoning":
            # trailing newlines are dropped if </think> follows, so hold them
            stripped = body.rstrip("\n")
            body, tail = stripped, body[len(stripped) :] + tail
        self._emit(out, body)
        self._held = tail
        return out

    def flush(self) -> list[tuple[Channel, str]]:
        """End of output: held text is text (reasoning still drops its trailing newlines)."""
        out: list[tuple[Channel, str]] = []
        held, self._held = self._held, ""
        self._emit(out, held.rstrip("\n") if self.channel == "reasoning" else held)
        return out
