"""Speculative decoding (``mtp:K``, K = 1..4) through the Engine's commit path, 200 scripted scenarios.

`BookProgram(spec_k=K)` runs MTP's verify round over the real `ResourceBook` (K + 2 state slots a
sequence, 2K extra positions in every reservation): K drafts a row, right for a random number of
leading positions, K + 1 verify positions and K - 1 drafter positions written past the frontier, up to
``min(accepted drafts + 1, budget)`` tokens produced a row, committed by slot selection. So PendingBatches
carry multi-token rows with per-row accepted prefixes; rows end inside their drafts (EOS, a stop id, a
stop string, max_tokens), are capped by the thinking budget's control horizon and go to forced
control, are cancelled mid-round, and continue or publish checkpoints (the cache on or off).

Checked, besides everything `cache_harness.Harness` checks after every boundary and after the drain
(tokens equal plain decoding's run alone and cold, pools at baseline, catalog, refcounts):
- every committed row: a cancelled row accepts 0 and is terminal; any other has
  ``1 <= accepted <= produced <= budget``; a row that goes on accepted all it produced; a row that
  accepts fewer stops (is terminal);
- every decode row produces at most K + 1 tokens and the Engine's budget for it;
- usage: the drafts a request kept are at most those proposed, K a round.
"""

from __future__ import annotations

from typing import Any

from cache_harness import (
    CANCEL_POINTS,
    SYSTEMS,
    Harness,
    cold_tokens,
    event,
    make_harness,
    property_settings,
    run_actions,
)
from hypothesis import given, note
from hypothesis import strategies as st

from ninfer import GenerationRequest


class RoundWatch:
    """Budgets the Engine gave each decode row (the Program's decode call) and the checks above."""

    def __init__(self, h: Harness, k: int) -> None:
        self.h, self.k = h, k
        self.budgets: list[tuple[int, ...]] = []
        program = h.program
        decode = program.decode

        def watched(handles: Any, budgets: Any, **kw: Any) -> Any:
            self.budgets.append(tuple(budgets))
            batch = decode(handles, budgets, **kw)
            for row, budget in zip(batch.rows, budgets):
                assert 1 <= row.produced <= min(budget, k + 1), (row.produced, budget, k)
            return batch

        program.decode = watched  # type: ignore[method-assign]

    def check(self) -> None:
        for kind, row, decision in self.h.program.decisions:
            accepted, produced = decision.accepted_tokens, row.produced
            if decision.cancelled:
                assert accepted == 0 and decision.terminal
                event(f"a cancelled {kind} row")
                continue
            assert 1 <= accepted <= produced
            assert decision.terminal or accepted == produced, "a row that goes on dropped tokens"
            if kind == "decode" and produced > 1:
                event("a multi-token row")
                if accepted < produced:
                    event("a row ended inside its drafts")


def chat(system: int, topic: int, max_tokens: int, seed: int, ending: int, budget: int | None) -> tuple:
    messages = [{"role": "system", "content": SYSTEMS[system % len(SYSTEMS)]},
                {"role": "user", "content": f"topic {topic}?"}]
    fields: dict[str, Any] = {}
    if ending == 1:
        fields["stop"] = ["e"]  # a stop string inside a span: accepted < produced
    elif ending == 2:
        fields["stop_token_ids"] = [ord("a") + seed % 26]
    if budget is not None:
        fields.update(thinking_budget=budget, chat_template_kwargs={"enable_thinking": True})
    request = GenerationRequest(messages=messages, max_tokens=max_tokens, seed=seed, session_id=f"m{topic}",
                                **fields)
    return ("submit", request, messages)


seed = st.integers(0, 2**16)
action = st.one_of(
    st.builds(chat, st.integers(0, 2), st.integers(0, 99), st.integers(1, 24), seed, st.integers(0, 3),
              st.one_of(st.none(), st.integers(1, 7))),
    st.builds(chat, st.integers(0, 2), st.integers(0, 99), st.integers(1, 24), seed, st.integers(0, 3),
              st.none()),
    st.tuples(st.just("follow"), st.integers(0, 30), st.integers(0, 99), st.integers(1, 16), seed),
    st.tuples(st.just("document"), st.integers(1, 120), st.integers(0, 11), st.integers(1, 30), seed),
    st.tuples(st.just("step"), st.integers(1, 24)),
    st.tuples(st.just("step"), st.integers(1, 24)),
    st.tuples(st.just("burst"), st.integers(2, 4), seed),
    st.tuples(
        st.just("cancel"),
        st.sampled_from(["decode", "decode_b2", "decode_b2", "force", *CANCEL_POINTS]),
        st.integers(0, 40),
    ),
)


@property_settings(200)
@given(
    k=st.integers(1, 4),
    mc=st.integers(1, 4),
    cache=st.booleans(),
    checkpoint_slots=st.integers(0, 3),
    polls=st.integers(0, 1),
    chunk=st.integers(4, 40),
    actions=st.lists(action, min_size=6, max_size=40),
)
def test_speculative_rounds_commit_exactly_and_give_plain_tokens(
    k: int, mc: int, cache: bool, checkpoint_slots: int, polls: int, chunk: int, actions: list[tuple]
) -> None:
    note(repr(dict(k=k, mc=mc, cache=cache, checkpoint_slots=checkpoint_slots, polls=polls, chunk=chunk,
                   actions=actions)))
    h = make_harness(mc=mc, page_size=8, kv_pages=None, checkpoint_slots=checkpoint_slots, polls=polls,
                     chunk=chunk, capture_interval=32, spec_k=k, prefix_cache=cache)
    watch = RoundWatch(h, k)
    run_actions(h, actions)
    h.finish(cold_tokens)
    watch.check()
    for entry in h.submitted:
        usage = entry.result.usage
        assert 0 <= usage.accepted_draft_tokens <= usage.drafted_tokens
        assert usage.drafted_tokens % k == 0
