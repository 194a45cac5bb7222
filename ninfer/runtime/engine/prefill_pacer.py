"""`PrefillPacer`: the staged prefill's chunk size while other requests decode.

The Scheduler runs a decode round after every prefill unit, so a decoding request waits one prefill
chunk plus one round between two tokens. A full chunk (8,192 tokens on the fast table: about 0.7 s on
the 27B) would be that gap whenever a long prompt arrives. While any request decodes, the pacer sizes
the chunk so that the gap stays under ``max_gap_s``; with no request decoding the chunk is full again,
which is what keeps a lone long prompt's TTFT.

A chunk's cost is not proportional to its tokens: each prefill unit pays a fixed host cost (Python over
every layer, tens of milliseconds on the large models) below which a smaller chunk saves nothing. So
the pacer keeps a table of measured costs by chunk size, the sizes being ``GRANULE`` times a power of
two up to the full chunk, and chooses the largest size whose cost fits the room (the bound less a
round). Where even the smallest size does not fit, the bound cannot be met by any chunk, and shrinking
would only multiply the gaps: the room is then the smallest measured cost with ``FLOOR_SLACK``, and the
chunk the largest that costs about as little. It moves one size at a time: down while every measured
size is over the room, up to a size not yet measured while the largest fitting one fits, and back up to
a size found too dear every ``REPROBE`` chunks (its cost depends on the context the chunk attends to,
which changes from prompt to prompt). Where a size keeps the bound, a larger one is tried only if the
line through the costs of that size and the one below it (a fixed cost plus a cost per token) predicts
that it keeps it too, so that the probes themselves do not break the bound (the largest gap is what a
user sees); the size below is run once to measure that line.

Costs are learned from the gaps the worker sees between decode commits (on the Engine's clock): a
round alone, and a round with one prefill chunk before it (the gap less a round is the chunk's cost,
for a chunk of exactly one table size: a prompt's tail or a chunk cut at a capture point measures
nothing). Each is an exponential mean. A commit waits for the device, so these are device times, not
host enqueue times. Until a chunk has been measured the pacer starts at ``first_chunk`` tokens.
"""

from __future__ import annotations

# the weight of a new observation in the running means
SMOOTHING = 0.5
# chunk sizes are this many tokens times a power of two (and never below one granule)
GRANULE = 64
# where no size fits the room, a size costing at most this much more than the cheapest measured one
FLOOR_SLACK = 1.2
# a size found too dear is tried again after this many chunks at the size below it
REPROBE = 32


class PrefillPacer:
    """Chunk sizes for the staged prefill (module docstring). ``max_gap_s=None``: always ``full_chunk``."""

    def __init__(self, max_gap_s: float | None, full_chunk: int, first_chunk: int = 512) -> None:
        self.max_gap_s = max_gap_s
        self.full_chunk = full_chunk
        sizes = []
        size = GRANULE
        while size < full_chunk:
            sizes.append(size)
            size *= 2
        self.sizes = (*sizes, full_chunk)  # ascending; the full chunk last, whatever its size
        self.first_chunk = max(s for s in self.sizes if s <= max(first_chunk, self.sizes[0]))
        self.round_s: float | None = None  # one decode round
        self.cost_s: dict[int, float] = {}  # one prefill chunk of each measured size, while requests decode
        self._held = 0  # chunks chosen below a size found too dear, since it was last tried
        self._last_commit: float | None = None  # when the last decode round committed
        self._between: int | None = 0  # prefill tokens run since then (None: something else ran)

    def chunk(self, decoding: bool) -> int:
        """The next prefill unit's token budget; ``decoding``: some request is decoding meanwhile."""
        if self.max_gap_s is None or not decoding:
            return self.full_chunk
        if self.round_s is None or not self.cost_s:
            return self.first_chunk
        room = self.max_gap_s - self.round_s
        smallest = min(self.cost_s)
        if self.cost_s[smallest] > room and smallest > self.sizes[0]:
            return self._below(smallest)  # nothing measured fits yet: try a smaller chunk
        bound_met = min(self.cost_s.values()) <= room
        room = max(room, FLOOR_SLACK * min(self.cost_s.values()))
        fitting = [size for size, cost in self.cost_s.items() if cost <= room]
        if not fitting:
            return smallest
        best = max(fitting)
        if best == self.full_chunk:
            return best
        above = self.sizes[self.sizes.index(best) + 1]
        if bound_met:  # a chunk keeps the bound: try a larger one only where it is predicted to keep it too
            predicted = self._predicted(best, above)
            if predicted is None:
                return self._below(best)  # one chunk below, for the slope the prediction needs
            if predicted > room:
                return best
        if above not in self.cost_s:
            return above  # not measured yet: it may cost hardly more (the fixed cost dominates)
        self._held += 1
        if self._held >= REPROBE:
            self._held = 0
            return above
        return best

    def _predicted(self, best: int, above: int) -> float | None:
        """The cost of ``above`` extrapolated along the line through ``best`` and the size below it (a
        fixed cost plus a cost per token; the attention's share grows with the prefix, and the two
        measured costs grow with it). None when the size below is not measured; the smallest size, whose
        slope cannot be measured, is predicted to cost what it costs."""
        i = self.sizes.index(best)
        if i == 0:
            return self.cost_s[best]
        below = self.sizes[i - 1]
        if below not in self.cost_s:
            return None
        slope = max(0.0, (self.cost_s[best] - self.cost_s[below]) / (best - below))
        return self.cost_s[best] + slope * (above - best)

    def _below(self, size: int) -> int:
        return self.sizes[self.sizes.index(size) - 1]

    # ---- observations (the worker calls these as units run) --------------------------------------
    def prefill_ran(self, tokens: int) -> None:
        if self._between is not None:
            self._between += tokens

    def other_unit_ran(self) -> None:
        """A unit that is neither a decode round nor a prefill chunk (forced control): the next gap
        measures nothing."""
        self._between = None

    def idle(self) -> None:
        """The worker waited for work: the next gap would count the wait."""
        self._last_commit = None

    def decode_committed(self, now: float) -> None:
        """A decode round committed at ``now``: the gap since the last one is one observation."""
        last, between = self._last_commit, self._between
        self._last_commit, self._between = now, 0
        if last is None or between is None:
            return
        gap = now - last
        if between == 0:
            self.round_s = gap if self.round_s is None else _mix(self.round_s, gap)
        elif self.round_s is not None and between in self.sizes:
            cost = max(0.0, gap - self.round_s)
            known = self.cost_s.get(between)
            self.cost_s[between] = cost if known is None else _mix(known, cost)


def _mix(mean: float, value: float) -> float:
    return (1 - SMOOTHING) * mean + SMOOTHING * value
