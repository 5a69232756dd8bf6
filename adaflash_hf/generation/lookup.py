# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Hybrid proposals in the batched engine: each row's n-gram prompt-lookup continuation.

Every round, each row looks its last tokens up in its own prompt + generated text with transformers'
`PromptLookupCandidateGenerator` (as the bs=1 generator does). Which rows verify their lookup continuation, and
whether a round drafts at all, is decided by the one `ProposalPolicy` (`generation/policy.py`) both engines share.

Lookup proposals are deterministic: greedy rows keep the longest prefix equal to the target's argmax, sampling rows
use `rejection_sample` with a one-hot q (accept with probability p(d), after a rejection draw from p without d),
the distribution transformers' prompt-lookup path gets.
"""

import sys

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator


class RowLookup:
    """n-gram prompt lookup per row.

    Args:
        num_tokens: longest continuation proposed; max_ngram: longest n-gram matched (the drafter's
            `generation_config.prompt_lookup_num_tokens` / `max_matching_ngram_size`).
        eos: the run's EOS ids (a continuation is cut before the first EOS, as transformers does).
    """

    def __init__(self, num_tokens: int, max_ngram: int, eos: set[int]):
        # transformers' own matcher, called per row on the row's `[1, T]` ids: it is written for batch size 1, and
        # reusing it (rather than a batched re-implementation) keeps a row's proposals identical to those the bs=1
        # hybrid path would make for the same text (first match of the longest n-gram, EOS cut). `max_length` is
        # effectively unbounded: rows have different limits, applied by the caller's per-row caps.
        self.matcher = PromptLookupCandidateGenerator(
            eos_token_id=torch.tensor(sorted(eos)) if eos else None,
            num_output_tokens=int(num_tokens),
            max_matching_ngram_size=int(max_ngram),
            max_length=sys.maxsize,
        )

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


def pad_proposals(proposals: list[list[int]], device, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(drafts [b, width], lengths [b])` from ragged token lists cut to `width` (padding: token 0, never verified)."""
    m = max((len(p) for p in proposals), default=0) if width is None else width
    drafts = torch.zeros(len(proposals), m, dtype=torch.long)
    lengths = []
    for r, p in enumerate(proposals):
        p = p[:m]
        drafts[r, : len(p)] = torch.tensor(p, dtype=torch.long)
        lengths.append(len(p))
    return drafts.to(device), torch.tensor(lengths, dtype=torch.long, device=device)


__all__ = ["RowLookup", "pad_proposals"]
