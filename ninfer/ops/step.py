"""What the step-level ops read of an execution step (the family's `StepBatch` has these members).

The ops below the model (GDN state updates, prefill attention) need a few facts of the step beyond their
tensors: its row bounds on the host, each row's state slots, the uniform token count, and a per-step
memo for values made once and shared by all layers of the step. `StepFacts` names them; the ops never
import the family's types.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["StepFacts"]


class StepFacts(Protocol):
    """One execution step over B rows holding N tokens (the shapes as in the family's `StepBatch`)."""

    @property
    def query_start(self) -> torch.Tensor: ...  # [B+1] int32: row r owns tokens [qs[r], qs[r+1])

    @property
    def context_lens(self) -> torch.Tensor: ...  # [B] int32: the row's KV length after the step

    @property
    def block_table(self) -> torch.Tensor: ...  # [B, maxp] int32: the row's KV pages

    @property
    def state_in(self) -> torch.Tensor: ...  # [B] long: the GDN slot each row reads

    @property
    def state_out(self) -> torch.Tensor: ...  # [B] or [B, T] long: where the state after the row goes

    @property
    def fresh(self) -> torch.Tensor: ...  # [B] bool: the row starts from zero state

    @property
    def tokens_per_row(self) -> int | None: ...  # T when every row has T tokens, else None

    @property
    def num_rows(self) -> int: ...

    @property
    def padded(self) -> bool: ...  # tokens from query_start[-1] on are padding (a prefill graph's capacity)

    @property
    def memo(self) -> dict[str, object]: ...  # made once per step, shared by its layers

    def query_bounds(self) -> list[int]: ...  # query_start on the host (no device read when known)

    def context_lengths(self) -> list[int]: ...  # context_lens on the host
