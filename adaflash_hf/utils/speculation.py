# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Definitions every part of the library shares (generation, training, OnlineSpec), written once:

* `draft_positions`: token ids -> their positions in a drafter's draft vocabulary (the inverse of scattering
  draft-vocabulary values back to the full vocabulary, `generation.drafting.to_full_vocab`);
* `tau`: tokens committed per verification round from per-round accepted-draft counts.
"""

from collections.abc import Iterable, Mapping

import torch


def draft_positions(tokens: torch.Tensor, vocab_ids: torch.Tensor | None, fill: int = -1) -> torch.Tensor:
    """`tokens` (any shape, token ids) -> their indices in the draft vocabulary `vocab_ids [K]`, `fill` for tokens
    outside it; `tokens` unchanged when `vocab_ids` is None (the drafter drafts over the whole vocabulary)."""
    if vocab_ids is None:
        return tokens
    vocab_ids = vocab_ids.to(tokens.device)
    size = max(int(vocab_ids.max()), int(tokens.max()) if tokens.numel() else 0) + 1
    index = torch.full((size,), fill, dtype=torch.long, device=tokens.device)
    index[vocab_ids] = torch.arange(vocab_ids.numel(), device=tokens.device)
    return index[tokens]


def tau(accepted: Iterable[int | float]) -> float:
    """Tokens committed per verification round: the mean number of accepted drafted tokens per round, plus the
    target's own token (correction or bonus); `0.0` without rounds. Pool several runs by concatenating their
    rounds."""
    accepted = list(accepted)
    return sum(accepted) / len(accepted) + 1.0 if accepted else 0.0


def pooled_tau(rows: Iterable[Mapping[str, int]]) -> float:
    """`tau` pooled over the rounds of several requests, from per-request counts (`{"accepted": total accepted
    drafted tokens, "rounds": verification rounds}`); `0.0` without rounds."""
    rows = list(rows)
    rounds = sum(r["rounds"] for r in rows)
    return sum(r["accepted"] for r in rows) / rounds + 1.0 if rounds else 0.0


__all__ = ["draft_positions", "pooled_tau", "tau"]
