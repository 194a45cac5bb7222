"""`PrefillPacer`: the staged prefill's chunk size while other requests decode.

The Scheduler runs a decode round after every prefill unit, so a decoding request waits one prefill
chunk plus one round between two tokens. A full chunk (8,192 tokens on the fast table: about 0.7 s on
the 27B) would be that gap whenever a long prompt arrives. While any request decodes, the pacer sizes
the chunk so that the gap stays under ``max_gap_s``; with no request decoding the chunk is full again,
which is what keeps a lone long prompt's TTFT.

It learns the costs from the gaps it sees (on the Engine's clock): the time between two decode
rounds' commits with nothing between them (one round), and with one prefill chunk of n tokens between
them (one round + the chunk): an exponential mean of each, the chunk's as a cost per token. A
per-token cost measured on small chunks includes their fixed cost, so it errs on the long side and the
chunk grows back as larger chunks are measured. Until a chunk has been measured the pacer starts at
``first_chunk`` tokens. A commit waits for the device, so these are device times, not host enqueue times.
"""

from __future__ import annotations

# the weight of a new observation in the running means
SMOOTHING = 0.5
# chunk sizes are multiples of this many tokens (and never below one multiple)
GRANULE = 64


class PrefillPacer:
    """Chunk sizes for the staged prefill (module docstring). ``max_gap_s=None``: always ``full_chunk``."""

    def __init__(self, max_gap_s: float | None, full_chunk: int, first_chunk: int = 512) -> None:
        self.max_gap_s = max_gap_s
        self.full_chunk = full_chunk
        self.first_chunk = min(first_chunk, full_chunk)
        self.round_s: float | None = None  # one decode round
        self.token_s: float | None = None  # one prefill token, while requests decode
        self._last_commit: float | None = None  # when the last decode round committed
        self._between: int | None = 0  # prefill tokens run since then (None: something else ran)

    def chunk(self, decoding: bool) -> int:
        """The next prefill unit's token budget; ``decoding``: some request is decoding meanwhile."""
        if self.max_gap_s is None or not decoding:
            return self.full_chunk
        if self.token_s is None:
            return self.first_chunk
        room = self.max_gap_s - (self.round_s or 0.0)
        tokens = int(room / self.token_s) if self.token_s > 0 else self.full_chunk
        return max(min(self.full_chunk, tokens // GRANULE * GRANULE), min(GRANULE, self.full_chunk))

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
        elif self.round_s is not None:
            per_token = max(0.0, gap - self.round_s) / between
            self.token_s = per_token if self.token_s is None else _mix(self.token_s, per_token)


def _mix(mean: float, value: float) -> float:
    return (1 - SMOOTHING) * mean + SMOOTHING * value
