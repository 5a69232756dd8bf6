# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The active rows of batched speculative decoding (`generation/batch.py`): tokens, positions, caches, context.

`BatchState` holds, per row, the last committed token and its position, the target's and the drafter's
`RaggedCache`, the target context the drafter has not seen yet, and (with an OnlineSpec adapter) a rolling window
of each row's last context states. Rows leave (`select`) and join (`merge`) between rounds.
"""

from dataclasses import dataclass

import torch

from .ragged_cache import RaggedCache


@dataclass
class BatchState:
    """The active rows. `last_tok [b]`: last committed token (not yet in the target cache), at position
    `next_pos [b]` (= the row's valid target-cache slots). `ctx [b, n, F]` / `ctx_mask [b, n]` / `ctx_pos [b, n]`:
    target context (hidden states at `target_layer_ids`) not yet seen by the drafter, padded per row.
    `win [b, W, F]` / `win_mask [b, W]` / `win_pos [b, W]` (only with an OnlineSpec adapter, else None): each row's
    last `W` context states (all tokens the target has processed and kept, seen by the drafter or not), right-aligned
    with their true positions: the window the adapter replays a row's drafting forward on."""

    prompt_idx: list[int]
    last_tok: torch.Tensor
    next_pos: torch.Tensor
    target: RaggedCache
    drafter: RaggedCache | None
    ctx: torch.Tensor | None = None
    ctx_mask: torch.Tensor | None = None
    ctx_pos: torch.Tensor | None = None
    win: torch.Tensor | None = None
    win_mask: torch.Tensor | None = None
    win_pos: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(self.prompt_idx)

    @property
    def prompt_tensor(self) -> torch.Tensor:
        """`prompt_idx` as a `[b]` long tensor on the rows' device."""
        return torch.tensor(self.prompt_idx, dtype=torch.long, device=self.last_tok.device)

    def start_window(self, width: int, features: int, dtype, device) -> None:
        """Keep a rolling window of the last `width` context states per row (OnlineSpec), empty for now."""
        b = self.size
        self.win = torch.zeros(b, width, features, dtype=dtype, device=device)
        self.win_mask = torch.zeros(b, width, dtype=torch.bool, device=device)
        self.win_pos = torch.zeros(b, width, dtype=torch.long, device=device)

    def _roll_window(self, ctx, mask, pos) -> None:
        width = self.win.shape[1]
        states = torch.cat([self.win, ctx.to(self.win.dtype)], dim=1)
        valid = torch.cat([self.win_mask, mask], dim=1)
        positions = torch.cat([self.win_pos, pos], dim=1)
        # A stable sort of the validity puts each row's valid states last, in order: keep the last `width` of them.
        order = torch.sort(valid.to(torch.int8), dim=1, stable=True).indices[:, -width:]
        self.win = states.gather(1, order[..., None].expand(-1, -1, states.shape[2]))
        self.win_mask, self.win_pos = valid.gather(1, order), positions.gather(1, order)

    def add_context(self, ctx, mask, pos) -> None:
        mask, pos = mask.to(device=ctx.device, dtype=torch.bool), pos.to(ctx.device)
        if self.win is not None:
            self._roll_window(ctx, mask, pos)
        if self.ctx is None:
            self.ctx, self.ctx_mask, self.ctx_pos = ctx, mask, pos
        else:  # the drafter skipped a round: keep everything it has not seen
            self.ctx = torch.cat([self.ctx, ctx], dim=1)
            self.ctx_mask = torch.cat([self.ctx_mask, mask], dim=1)
            self.ctx_pos = torch.cat([self.ctx_pos, pos], dim=1)

    def select(self, keep: list[int]) -> None:
        index = torch.tensor(keep, dtype=torch.long, device=self.last_tok.device)
        self.prompt_idx = [self.prompt_idx[r] for r in keep]
        self.last_tok, self.next_pos = self.last_tok[index], self.next_pos[index]
        self.target.select(index)
        if self.drafter is not None:
            self.drafter.select(index)
        if self.ctx is not None:
            i = index.to(self.ctx.device)
            self.ctx, self.ctx_mask, self.ctx_pos = self.ctx[i], self.ctx_mask[i], self.ctx_pos[i]
        if self.win is not None:
            i = index.to(self.win.device)
            self.win, self.win_mask, self.win_pos = self.win[i], self.win_mask[i], self.win_pos[i]

    def merge(self, other: "BatchState") -> "BatchState":
        if other.size == 0:
            return self
        if self.size == 0:
            return other
        if self.ctx is not None or other.ctx is not None:
            ours, theirs = _pad_context(self, other), _pad_context(other, self)
            self.ctx, self.ctx_mask, self.ctx_pos = (torch.cat([x, y.to(x.device)]) for x, y in zip(ours, theirs))
        if self.win is not None:  # both batches keep windows of the same width (one generator, one adapter)
            self.win, self.win_mask, self.win_pos = (torch.cat([x, y.to(x.device)]) for x, y in zip(
                (self.win, self.win_mask, self.win_pos), (other.win, other.win_mask, other.win_pos)))
        self.prompt_idx = self.prompt_idx + other.prompt_idx
        self.last_tok = torch.cat([self.last_tok, other.last_tok])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])
        self.target.merge(other.target)
        if self.drafter is not None:
            self.drafter.merge(other.drafter)
        return self


def _pad_context(batch: BatchState, other: BatchState):
    """`batch`'s pending context right-padded to the longer of the two (zeros, masked)."""
    n = max(x.ctx.shape[1] for x in (batch, other) if x.ctx is not None)
    ref = batch if batch.ctx is not None else other
    b = batch.size
    if batch.ctx is None:
        return (ref.ctx.new_zeros(b, n, ref.ctx.shape[2]), ref.ctx_mask.new_zeros(b, n),
                ref.ctx_pos.new_zeros(b, n))
    pad = n - batch.ctx.shape[1]
    return (torch.cat([batch.ctx, batch.ctx.new_zeros(b, pad, batch.ctx.shape[2])], dim=1),
            torch.cat([batch.ctx_mask, batch.ctx_mask.new_zeros(b, pad)], dim=1),
            torch.cat([batch.ctx_pos, batch.ctx_pos.new_zeros(b, pad)], dim=1))


__all__ = ["BatchState"]
