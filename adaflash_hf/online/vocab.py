# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Online growth of the drafter's draft vocabulary: tokens the target keeps committing become draftable.

A drafter with a draft vocabulary (`drafter.draft_vocab`, K token ids: the most frequent tokens of its training
data) can never propose any other token, and a drafted block ends at the first one. On traffic the drafter was not
trained for, that is where acceptance is lost first: on text-to-SQL requests 23% of the target's tokens lie outside
the shipped drafter's 8,192 (`SELECT`, ` FROM`, ` WHERE`, ` BY`, ...), the most predictable tokens of the kind. No
LoRA update can fix that (the softmax never sees them), so the online adapter also counts the committed tokens
outside the vocabulary and appends a token once the target has committed it `min_count` times (at most `limit`
tokens in all). The new rows are the target's own LM-head rows, like the others; the adapter's loss covers them
from then on. Growth happens on the serving thread at request boundaries only (deterministic; the background worker
never sees the vocabulary change under it), and `restore` puts the drafter's own vocabulary back.

Written by hand: neither PEFT nor transformers has a notion of a draft vocabulary.
"""

from collections import Counter

import torch


def set_draft_vocab(drafter, ids: torch.Tensor) -> None:
    """Replace the drafter's draft vocabulary by `ids [K']` (`AdaFlashDrafterModel.set_draft_vocab`: the config's
    `draft_vocab_size` follows, the cached LM-head slice is dropped)."""
    drafter.set_draft_vocab(ids)


class VocabGrowth:
    """Counts committed tokens outside a drafter's draft vocabulary and appends the frequent ones (module docstring).

    Args:
        limit: the most tokens ever appended (0: never grow).
        min_count: commits of one token before it is appended.
    """

    def __init__(self, limit: int = 1024, min_count: int = 2):
        self.limit, self.min_count = int(limit), int(min_count)
        self.counts: Counter = Counter()
        self.added: list[int] = []
        self.base: torch.Tensor | None = None  # the drafter's own vocabulary, kept for `restore`

    def observe(self, drafter, committed: torch.Tensor) -> list[int]:
        """Count `committed [n]` (token ids the target committed in one request) and grow `drafter`'s vocabulary
        with the tokens that reached `min_count`, in order of first commit. Returns the appended ids."""
        vocab = getattr(drafter, "draft_vocab", None)
        if vocab is None or self.limit <= 0 or len(self.added) >= self.limit or committed.numel() == 0:
            return []
        if self.base is None:
            self.base = vocab.detach().clone()
        tokens = committed.detach().reshape(-1).cpu()
        outside = tokens[~torch.isin(tokens, vocab.cpu())].tolist()
        new = []
        for token in outside:
            self.counts[token] += 1
            if self.counts[token] == self.min_count and len(self.added) + len(new) < self.limit:
                new.append(token)
        if new:
            self.added += new
            set_draft_vocab(drafter, torch.cat([vocab, torch.tensor(new, dtype=vocab.dtype, device=vocab.device)]))
        return new

    def restore(self, drafter) -> None:
        """Give `drafter` back the vocabulary it had before any growth."""
        if self.base is not None:
            set_draft_vocab(drafter, self.base.clone())

    def state_dict(self) -> dict:
        """JSON-able state (`counts` keys as strings)."""
        return {"limit": self.limit, "min_count": self.min_count, "added": list(self.added),
                "counts": {str(k): v for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict, drafter) -> None:
        """Restore the counts and re-append the tokens a saved adapter had added to `drafter`'s vocabulary."""
        self.counts = Counter({int(k): int(v) for k, v in state.get("counts", {}).items()})
        added = [int(t) for t in state.get("added", [])]
        vocab = getattr(drafter, "draft_vocab", None)
        if vocab is None:
            if added:
                raise ValueError("the saved adapter grew a draft vocabulary, but this drafter has none")
            return
        if self.base is None:
            self.base = vocab.detach().clone()
        self.added = added
        extra = torch.tensor(added, dtype=vocab.dtype, device=vocab.device)
        set_draft_vocab(drafter, torch.cat([self.base.to(vocab.device), extra]))


__all__ = ["VocabGrowth", "set_draft_vocab"]
