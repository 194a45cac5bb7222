"""The Program side of the causal_scoring purpose: one window at a time on temporary empty state.

Allocated only when an Engine starts with ``purpose="causal_scoring"``: one StateImage slot and the KV
pages of one window. Every window starts from zero state (``fresh``) and leaves nothing behind that a
later window or request could see. Log-probs are computed from the final hidden states in row chunks,
so a long window never materialises a ``[T, 248320]`` logits matrix at once; the top-n alternatives and
the next-token prediction come from the same chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.runtime.contract.types import TopLogprobs, WindowScores
from ninfer.targets.qwen3_6.kernels import select_kernels
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.types import MAX_TOP_LOGPROBS

_LOGPROB_ROWS = 256  # hidden rows per lm_head chunk (bounds the fp32 logits staging)


class Qwen36ScoringProgram:
    def __init__(
        self,
        variant: Variant,
        view: ModelView,
        *,
        window: int,
        page_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kernels: str = "auto",
    ) -> None:
        self.variant = variant
        self.kernels = select_kernels(device, kernels)
        self.view = view
        self.window = window
        self.device = device
        pages = -(-window // page_size)
        self._page_size = page_size
        self.store = StateStore.allocate(variant, 1, pages, page_size, dtype, device)
        self._block_table = torch.arange(pages, dtype=torch.int32, device=device).unsqueeze(0)

    @property
    def max_context(self) -> int:
        return self.window

    @torch.inference_mode()
    def score_window(
        self, token_ids: Sequence[int], top_n: int = 0, *, predict_next: bool = False
    ) -> WindowScores:
        n = len(token_ids)
        if not 1 <= n <= self.window:
            raise ValueError(f"a scoring window holds 1..{self.window} tokens, got {n}")
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_n must be 0..{MAX_TOP_LOGPROBS}, got {top_n}")
        rows = n - 1 + int(predict_next)  # hidden rows whose logits are needed
        if rows == 0:
            return WindowScores(logprobs=())
        dev = self.device
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=dev)
        pos = torch.arange(n, dtype=torch.long, device=dev)
        batch = StepBatch(
            token_ids=ids,
            positions=pos.expand(3, -1),
            query_start=torch.tensor([0, n], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_table=self._block_table,
            slot_mapping=pos,  # pages 0.. in order: flat slot == position
            state_in=torch.zeros(1, dtype=torch.long, device=dev),
            state_out=torch.zeros(1, dtype=torch.long, device=dev),
            fresh=torch.ones(1, dtype=torch.bool, device=dev),
            query_start_host=(0, n),
            context_lens_host=(n,),
        )
        hidden = forward(
            self.view, self.variant, batch, self.store, logits="none", kernels=self.kernels
        ).hidden
        lm_head = self.view.text.lm_head
        logprobs: list[float] = []
        top: list[TopLogprobs] = []
        next_top: TopLogprobs = ()
        for start in range(0, rows, _LOGPROB_ROWS):
            stop = min(start + _LOGPROB_ROWS, rows)
            logits = torch.nn.functional.linear(hidden[start:stop], lm_head).float()
            log_norm = torch.logsumexp(logits, dim=-1)
            scored = min(stop, n - 1) - start  # rows of this chunk that predict a token of the window
            # Every value is (fp32 logit) - (log-sum-exp): a greedy token's logprob equals its top-1 value
            # bit for bit, which OpenAI-style clients compare with ==.
            targets = ids[start + 1 : start + 1 + scored]
            lp = logits[:scored].gather(1, targets.unsqueeze(1)).squeeze(1) - log_norm[:scored]
            logprobs.extend(lp.tolist())
            k = max(top_n, 1) if stop > n - 1 else top_n  # the next-token row needs at least the greedy one
            if k == 0:
                continue
            values, indices = logits.topk(k, dim=-1)
            values = values - log_norm.unsqueeze(1)
            pairs = [tuple(zip(i_row, v_row)) for i_row, v_row in zip(indices.tolist(), values.tolist())]
            if top_n:
                top.extend(row[:top_n] for row in pairs[:scored])
            if stop > n - 1:
                next_top = pairs[-1]
        return WindowScores(logprobs=tuple(logprobs), top=tuple(top), next_top=next_top)
