# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Hybrid proposals in both engines: each row's n-gram prompt-lookup continuation, for all rows at once.

Every round, each row looks its last tokens up in its own prompt + generated text, exactly as transformers'
`PromptLookupCandidateGenerator` does at batch size 1: for n from `max_ngram` down to 1, the first (leftmost) earlier
occurrence of the row's last n tokens that has a continuation gives up to `num_tokens` following tokens, cut before
the first EOS (a row whose first match yields nothing after the cut proposes nothing). Written here because
transformers' class takes one row and re-scans the whole sequence on the device per call. `BatchLookup` keeps each
row's text on the host with an index of the leftmost start of every n-gram (n <= `max_ngram`), extended by the tokens
each round commits: a proposal is one dictionary lookup per n, a round's lookups for 64 rows a fraction of a
millisecond, and no kernel. A first version matched every row in tensor ops on the device: ~75 small kernels and
a host sync per n every round, which on the H200 reference cost a hybrid engine's PLAIN rounds ~3 ms each at 64
rows (a sixth of the forward) and left it at 0.74x of the plain engine when the policy chose plain rounds. This is
what vLLM's n-gram proposer does too (on the host, over token lists). The bs=1 generator uses it for its one row,
so both engines share one lookup (`LookupProposer`); `tests/test_batch_hybrid.py` and `tests/test_proposers.py`
check it against transformers' matcher. Unlike that class it does not pre-screen continuations with the call's
logits processors: a token they forbid is rejected by verification instead (never committed).

Which rows verify their lookup continuation, and whether a round drafts at all, is decided by the one
`ProposalPolicy` (`generation/policy.py`) both engines share. Lookup proposals are deterministic: greedy rows keep
the longest prefix equal to the target's argmax, sampling rows use `rejection_sample` with a one-hot q.
"""

import torch


class BatchLookup:
    """n-gram prompt lookup for every row of a run, over host token lists (module docstring).

    Args:
        prompts: every prompt of the run (token ids); each row's text grows by its committed tokens.
        num_tokens: longest continuation proposed; max_ngram: longest n-gram matched.
        eos: the run's EOS ids (continuations are cut before the first one).
        device: where proposals are returned.
    """

    def __init__(self, prompts: list[list[int]], num_tokens: int, max_ngram: int, eos: set[int], device):
        self.num_tokens, self.max_ngram, self.device = int(num_tokens), int(max_ngram), device
        self.texts = [[int(t) for t in p] for p in prompts]
        self.eos = frozenset(int(t) for t in eos or ())
        # per row, built on its first lookup: index[i][n - 1] maps an n-gram to its leftmost start in the text
        self._index: list[list[dict] | None] = [None] * len(prompts)
        self._indexed = [0] * len(prompts)  # how many of the row's tokens the index covers

    def text(self, i: int) -> list[int]:
        """Row `i`'s prompt + committed tokens (a copy)."""
        return list(self.texts[i])

    def append(self, prompt_idx: torch.Tensor, new: torch.Tensor, counts: torch.Tensor) -> None:
        """Append each row's committed tokens: row r of `new [b, w]` holds `counts[r]` tokens for `prompt_idx[r]`."""
        if new.numel() == 0:
            return
        self.extend(prompt_idx.tolist(), [tokens[:count] for tokens, count in zip(new.tolist(), counts.tolist())])

    def extend(self, prompt_idx: list[int], committed: list[list[int]]) -> None:
        """Host form of `append`: row `prompt_idx[r]`'s text grows by `committed[r]`."""
        for i, tokens in zip(prompt_idx, committed):
            self.texts[i].extend(tokens)

    def _indexed_row(self, i: int) -> list[dict]:
        """Row `i`'s n-gram index, extended over the tokens appended since the last lookup."""
        if self._index[i] is None:
            self._index[i] = [{} for _ in range(self.max_ngram)]
        index, text = self._index[i], self.texts[i]
        for end in range(self._indexed[i], len(text)):  # every n-gram ending at `end`, first occurrence kept
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                index[n - 1].setdefault(tuple(text[end - n + 1 : end + 1]), end - n + 1)
        self._indexed[i] = len(text)
        return index

    def continuation(self, i: int, cap: int) -> list[int]:
        """Row `i`'s lookup continuation, at most `cap` tokens (transformers' semantics, module docstring)."""
        index, text = self._indexed_row(i), self.texts[i]
        length = len(text)
        for n in range(min(self.max_ngram, length - 1), 0, -1):  # transformers tries n <= length - 1
            start = index[n - 1].get(tuple(text[length - n :]))
            if start is None or start + n >= length:  # the leftmost occurrence is the tail itself: no match
                continue
            found = []
            for token in text[start + n : start + n + self.num_tokens]:
                if token in self.eos:
                    break
                found.append(token)
            return found[: max(cap, 0)]
        return []

    def propose(self, prompt_idx: torch.Tensor, caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(proposals [b, num_tokens], lengths [b])` on `device`: each row's continuation, at most `caps[r]` tokens
        (0: none; positions past a row's length hold token 0: embeddable, never verified)."""
        found = [self.continuation(i, cap) for i, cap in zip(prompt_idx.tolist(), caps.tolist())]
        padded = [tokens + [0] * (self.num_tokens - len(tokens)) for tokens in found]
        proposals = torch.tensor(padded, dtype=torch.long).reshape(len(found), self.num_tokens)
        lengths = torch.tensor([len(tokens) for tokens in found], dtype=torch.long)
        return proposals.to(self.device), lengths.to(self.device)


__all__ = ["BatchLookup"]
