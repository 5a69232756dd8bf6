# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""OnlineSpec feedback from the batched engine: one `RoundFeedback` per row that verified drafted tokens.

After a draft round's verify forward, every row that verified `n_r >= 1` DRAFTED tokens (not lookup rows) hands the
runtime's adapter the row's block query embeddings, the last `context_window` target context states before the
anchor (kept per row by `BatchState` at their true positions), and the target's raw logits at the `n_r` drafted
positions. The adapter replays the row cache-free, so the shared batched drafting forward needs no gradients.
"""

import torch


def batch_feedback(adapter, lm_head, batch, noise: torch.Tensor, logits: torch.Tensor,
                   lengths: list[int], accepted: list[int], sources: list[str]) -> int:
    """Hand the adapter one `RoundFeedback` per row that verified drafted tokens (module docstring).

    Args:
        batch: the `BatchState` BEFORE this round's context is added (its window ends just before each anchor).
        noise: `[b, B, H]` the block query embeddings of the round's drafting forward.
        logits: `[b, M + 1, V]` the verify forward's raw logits.
    Returns:
        the number of rows observed.
    """
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
        adapter.on_round(noise[r : r + 1].clone(), context.clone(), positions, raw, a, lm_head)
        seen += 1
    return seen


__all__ = ["batch_feedback"]
