# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Per-row additions to the batched engine (`generation/batch.py`): hybrid n-gram lookup and OnlineSpec feedback.

Hybrid proposals (`RowLookup`, on when `drafter.config.hybrid_lookup`): every round, each row looks its last tokens
up in its own prompt + generated text with transformers' `PromptLookupCandidateGenerator` (as the bs=1 generator
does). A row with a match can then verify the lookup continuation instead of its drafted block:

* in a speculative round ("draft" arm: one drafter forward for the batch), row r verifies its lookup continuation
  when `min(E_r[accepted | lookup], lookup length) >= min(E_r[accepted | drafter], drafted length)`, where `E_r` are
  exponential moving averages of the accepted tokens of the row's own earlier rounds with that proposal (falling
  back to the batch's averages, then to "untried": the proposal lengths alone decide). A lookup continuation is cut
  to the batch's verify width `M` chosen for the drafted blocks (fixed length, whole block, or length head + cost
  model): a lookup proposal never widens a speculative round, whose width was already priced.
* in a lookup round ("lookup" arm of the `SpeculationSwitch`, only offered when some row has a match, and not under
  `speculation="always"`): no drafter forward; rows with a match verify their lookup continuation (up to
  `config.lookup_num_tokens`, the verify width is the longest of them), the other rows decode one token. The switch
  compares its committed tokens per second with the speculative and plain rounds', as the bs=1 `ProposalPolicy`
  compares drafter / lookup / none.

Every proposal is cut so that nothing is verified past `max_new_tokens` (`tokens left - 1`). Lookup proposals are
deterministic: greedy rows keep the longest prefix equal to the target's argmax (exact as before), sampling rows
use `rejection_sample` with a one-hot q (accept with probability p(d), after a rejection draw from p without d),
the same distribution as transformers' prompt-lookup path.

OnlineSpec (`online_feedback`, on when `drafter.online_adapter` is set): after a speculative round's verify
forward, every row that verified `n_r >= 1` DRAFTED tokens (not lookup rows) hands the adapter one `RoundFeedback`:
the row's block query embeddings, the last `context_window` target context states before the anchor (kept per row
by `BatchState` at their true positions), and the target's raw logits at the `n_r` drafted positions. The adapter
replays the row cache-free, so the shared batched drafting forward needs no gradients.
"""

import sys

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator


ARMS = ("drafter", "lookup")


class RowLookup:
    """n-gram prompt lookup per row and the per-row choice between drafted block and lookup continuation.

    Args:
        config: the drafter's config (`lookup_num_tokens`, `lookup_max_ngram`).
        eos: the run's EOS ids (a lookup continuation is cut before the first EOS, as transformers does).
        decay: weight of the newest round in the moving averages of accepted tokens.
    """

    def __init__(self, config, eos: set[int], decay: float = 0.3):
        # transformers' own matcher, called per row on the row's `[1, T]` ids: it is written for batch size 1, and
        # reusing it (rather than a batched re-implementation) keeps a row's proposals identical to those the bs=1
        # hybrid path would make for the same text (first match of the longest n-gram, EOS cut). `max_length` is
        # effectively unbounded: rows have different limits, applied by the caller's per-row caps.
        self.matcher = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(sorted(eos)) if eos else None,
            num_output_tokens=int(config.lookup_num_tokens),
            max_matching_ngram_size=int(config.lookup_max_ngram),
            max_length=sys.maxsize,
        )
        self.decay = decay
        self.rows: dict[int, dict[str, float]] = {}  # prompt index -> arm -> EMA of accepted tokens
        self.batch: dict[str, float | None] = dict.fromkeys(ARMS)

    def propose(self, sequences: list[list[int]], caps: list[int]) -> list[list[int]]:
        """Each row's lookup continuation (`[]`: no match), at most `caps[r]` tokens."""
        out = []
        for seq, cap in zip(sequences, caps):
            if cap <= 0 or len(seq) < 2:
                out.append([])
                continue
            candidates, _ = self.matcher.get_candidates(torch.tensor([seq], dtype=torch.long))
            out.append(candidates[0, len(seq) : len(seq) + cap].tolist())
        return out

    def estimate(self, i: int, arm: str) -> float:
        value = self.rows.get(i, {}).get(arm, self.batch[arm])
        return float("inf") if value is None else value

    def use_lookup(self, i: int, lookup_len: int, draft_len: int) -> bool:
        """Whether row (prompt) `i` verifies its lookup continuation rather than its drafted block (module doc)."""
        return lookup_len > 0 and min(self.estimate(i, "lookup"), lookup_len) >= min(self.estimate(i, "drafter"),
                                                                                      draft_len)

    def substitute(self, prompt_idx: list[int], proposals: list[list[int]], drafts: torch.Tensor,
                   lengths: torch.Tensor, sources: list[str]):
        """Speculative round: swap in the lookup continuation of the rows that prefer it, cut to the width `M`.

        Returns `(drafts [b, M], lengths [b], lookup rows [b] bool or None)`; `sources` is updated in place.
        """
        m = drafts.shape[1]
        if m == 0 or not any(proposals):
            return drafts, lengths, None
        drafts, lens = drafts.clone(), lengths.tolist()
        rows = torch.zeros(len(lens), dtype=torch.bool)
        for r, (i, proposal) in enumerate(zip(prompt_idx, proposals)):
            k = min(len(proposal), m)
            if k and self.use_lookup(i, k, lens[r]):
                drafts[r, :k] = torch.tensor(proposal[:k], dtype=drafts.dtype, device=drafts.device)
                lens[r], sources[r], rows[r] = k, "lookup", True
        if not rows.any():
            return drafts, lengths, None
        return drafts, torch.tensor(lens, dtype=lengths.dtype, device=lengths.device), rows.to(lengths.device)

    def record(self, prompt_idx: list[int], sources: list[str], accepted: list[int]) -> None:
        """Moving averages of accepted tokens per arm, per row and for the batch."""
        for i, source, a in zip(prompt_idx, sources, accepted):
            if source not in ARMS:
                continue
            row = self.rows.setdefault(i, {})
            for table in (row, self.batch):
                old = table.get(source)
                table[source] = float(a) if old is None else old + self.decay * (a - old)


def pad_proposals(proposals: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """`(drafts [b, max len], lengths [b])` from ragged token lists (padding: token 0, never verified)."""
    m = max((len(p) for p in proposals), default=0)
    drafts = torch.zeros(len(proposals), m, dtype=torch.long)
    for r, p in enumerate(proposals):
        drafts[r, : len(p)] = torch.tensor(p, dtype=torch.long)
    return drafts.to(device), torch.tensor([len(p) for p in proposals], dtype=torch.long, device=device)


def online_feedback(adapter, drafter, lm_head, batch, noise: torch.Tensor, logits: torch.Tensor,
                    lengths: list[int], accepted: list[int], sources: list[str]) -> int:
    """Hand the adapter one `RoundFeedback` per row that verified drafted tokens (module docstring).

    Args:
        batch: the `BatchState` BEFORE this round's context is added (its window ends just before each anchor).
        noise: `[b, B, H]` the block query embeddings of the round's drafting forward.
        logits: `[b, M + 1, V]` the verify forward's raw logits.
    Returns:
        the number of rows observed.
    """
    from ..online import RoundFeedback  # lazy: online learning pulls in PEFT

    block = noise.shape[1]
    seen = 0
    for r, (n, a, source) in enumerate(zip(lengths, accepted, sources)):
        if source != "drafter" or n < 1:
            continue
        valid = batch.win_mask[r]
        context = batch.win[r][valid][None]  # [1, W, F]
        anchor = batch.next_pos[r].to(context.device)
        positions = torch.cat([batch.win_pos[r][valid].to(context.device),
                               anchor + torch.arange(block, device=context.device)])[None]
        raw = logits[r, :n].detach().clone().to(context.device)  # position k predicts drafted token k + 1
        feedback = RoundFeedback.from_round(drafter, noise[r : r + 1].clone(), context.clone(), positions, raw, a)
        adapter.observe(feedback, lm_head)
        seen += 1
    return seen


__all__ = ["RowLookup", "online_feedback", "pad_proposals"]
