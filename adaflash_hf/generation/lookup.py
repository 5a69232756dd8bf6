# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Hybrid proposals in both engines: each row's n-gram prompt-lookup continuation, for all rows at once.

Every round, each row looks its last tokens up in its own prompt + generated text, exactly as transformers'
`PromptLookupCandidateGenerator` does at batch size 1: for n from `max_ngram` down to 1, the first (leftmost) earlier
occurrence of the row's last n tokens that has a continuation gives up to `num_tokens` following tokens, cut before
the first EOS (a row whose first match yields nothing after the cut proposes nothing). Written here because
transformers' class takes one row and re-scans a Python-sliced sequence per call: `BatchLookup` does every row in a
few tensor operations on the device, over a preallocated token buffer that the engine appends each round's committed
tokens to. The bs=1 generator uses it for its one row, so both engines share one lookup (`LookupProposer`);
`tests/test_batch_hybrid.py` and `tests/test_proposers.py` check it against transformers' matcher. Unlike that
class it does not pre-screen continuations with the call's logits processors: a token they forbid is rejected by
verification instead (never committed).

Which rows verify their lookup continuation, and whether a round drafts at all, is decided by the one
`ProposalPolicy` (`generation/policy.py`) both engines share. Lookup proposals are deterministic: greedy rows keep
the longest prefix equal to the target's argmax, sampling rows use `rejection_sample` with a one-hot q.
"""

import torch


class BatchLookup:
    """n-gram prompt lookup for every row of a run, over a `[num_prompts, capacity]` token buffer.

    Args:
        prompts: every prompt of the run (token ids).
        max_new_tokens: the run's limit (sizes the buffer).
        num_tokens: longest continuation proposed; max_ngram: longest n-gram matched.
        eos: the run's EOS ids (continuations are cut before the first one).
        device: where the buffer and the matching live.
    """

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, num_tokens: int, max_ngram: int,
                 eos: set[int], device):
        self.num_tokens, self.max_ngram = int(num_tokens), int(max_ngram)
        n, capacity = len(prompts), max(len(p) for p in prompts) + int(max_new_tokens) + 1
        self.tokens = torch.full((n, capacity), -1, dtype=torch.long)
        for i, p in enumerate(prompts):
            self.tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        self.tokens = self.tokens.to(device)
        self.lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=device)
        self.eos = torch.tensor(sorted(eos), dtype=torch.long, device=device) if eos else None

    def append(self, prompt_idx: torch.Tensor, new: torch.Tensor, counts: torch.Tensor) -> None:
        """Append each row's committed tokens: row r of `new [b, w]` holds `counts[r]` tokens for `prompt_idx[r]`."""
        if new.numel() == 0:
            return
        j = torch.arange(new.shape[1], device=new.device)
        keep = j[None, :] < counts[:, None]
        rows = prompt_idx[:, None].expand_as(new)[keep]
        cols = (self.lengths[prompt_idx][:, None] + j[None, :])[keep]
        self.tokens[rows, cols] = new[keep]
        self.lengths[prompt_idx] += counts

    def propose(self, prompt_idx: torch.Tensor, caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(proposals [b, num_tokens], lengths [b])`: each row's continuation, at most `caps[r]` tokens (0: none;
        positions past a row's length hold token 0).

        Semantics of transformers' `PromptLookupCandidateGenerator.get_candidates` (module docstring).
        """
        seqs, lengths = self.tokens[prompt_idx], self.lengths[prompt_idx]  # [b, T], [b]
        b, width = seqs.shape
        k = self.num_tokens
        device = seqs.device
        decided = torch.zeros(b, dtype=torch.bool, device=device)
        start = torch.zeros(b, dtype=torch.long, device=device)
        for n in range(min(self.max_ngram, width - 1), 0, -1):
            usable = (lengths - 1 >= n) & ~decided  # transformers tries n <= length - 1
            if not usable.any():
                continue
            windows = seqs.unfold(1, n, 1)  # [b, T - n + 1, n]
            tail = seqs.gather(1, (lengths[:, None] - n).clamp(min=0) + torch.arange(n, device=device))  # [b, n]
            j = torch.arange(windows.shape[1], device=device)
            match = (windows == tail[:, None, :]).all(-1) & (j[None, :] + n < lengths[:, None])
            found = match.any(-1) & usable
            first = match.float().argmax(-1)  # leftmost match
            start = torch.where(found, first + n, start)
            decided |= found
        index = (start[:, None] + torch.arange(k, device=device)).clamp(max=width - 1)
        proposal = seqs.gather(1, index)
        valid = decided[:, None] & (start[:, None] + torch.arange(k, device=device) < lengths[:, None])
        if self.eos is not None:  # cut before the first EOS
            valid &= ~torch.isin(proposal, self.eos).long().cumsum(-1).bool()
        length = valid.long().cumprod(-1).sum(-1).minimum(caps.to(device).clamp(min=0))
        # Positions past a row's length are padding (token 0: embeddable, never verified).
        return proposal.masked_fill(torch.arange(k, device=device)[None, :] >= length[:, None], 0), length


__all__ = ["BatchLookup"]
