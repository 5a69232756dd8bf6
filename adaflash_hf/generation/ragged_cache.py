# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Ragged KV caches for batched speculative decoding (`generation/batch.py`).

A `RaggedCache` is a transformers `DynamicCache` (or `DFlashCache`) holding one row per sequence, plus a boolean
validity mask `[b, S]` over its `S` slots. Rows grow by the same number of slots per forward (the batch is padded),
but only some of those slots are *valid* for a given row: left padding of the prompts, padding of short verify
blocks, drafted tokens the target rejected, padding of the drafter's per-row context. Invalid slots stay in the
cache, and are masked out forever through the 2D attention mask built from `mask`; positions (RoPE) are passed
explicitly by the caller and count only the valid tokens of each row, so a row sees exactly the keys/values it
would see decoding alone.

Why this is exact: transformers builds the causal mask from *slot* indices (a query at slot `s` sees slots `<= s`)
ANDed with the 2D padding mask, and new tokens are always appended after every existing slot. The relative order of
a row's valid slots is never changed, so which keys a query sees (and at which RoPE positions) is the same as in an
unpadded bs=1 run.

Operations (all act on every layer's `keys`/`values` `[b, kv_heads, S, head_dim]`):

* `attention_mask(new_valid)`: the 2D mask `[b, S + n]` for a forward that appends `n` slots.
* `append(new_valid)`: record the validity of the `n` slots the forward appended.
* `select(indices)`: keep some rows (finished rows leave the batch).
* `merge(other)`: concatenate two batches along the batch axis; the shorter one is left-padded with invalid
  zero slots (continuous batching: a newly prefilled segment joins the running batch).
* `compact()`: per row, gather the valid slots to the right end (stable), dropping columns that are invalid
  for every row; `S` becomes the largest per-row valid count. Called when holes waste too much.

Only plain full-attention `DynamicLayer`s are supported (sliding-window / linear-attention layers would not see
the holes correctly): `check_layers` refuses anything else.
"""

import torch
from transformers.cache_utils import Cache, DynamicLayer


class RaggedCache:
    """A transformers cache with per-row valid slots.

    Args:
        cache: a `DynamicCache` / `DFlashCache` whose layers hold `[b, heads, S, dim]` tensors (or are not yet
            initialised, when `S == 0`).
        mask: `[b, S]` bool, True where the slot holds a token of that row.
    """

    def __init__(self, cache: Cache, mask: torch.Tensor):
        self.cache = cache
        self.mask = mask.bool()

    # ------------------------------------------------------------------ queries

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]

    @property
    def num_slots(self) -> int:
        return self.mask.shape[1]

    def valid_counts(self) -> torch.Tensor:
        """`[b]` number of valid slots per row (= the row's token count in this cache)."""
        return self.mask.sum(dim=1)

    def attention_mask(self, new_valid: torch.Tensor) -> torch.Tensor:
        """2D mask `[b, S + n]` for a forward that appends `n` slots whose validity is `new_valid [b, n]`."""
        return torch.cat([self.mask, new_valid.to(device=self.mask.device, dtype=torch.bool)], dim=1)

    def check_layers(self) -> None:
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(
                    f"batched speculative decoding supports full-attention DynamicLayer caches only, got "
                    f"{type(layer).__name__} (sliding-window / linear-attention layers cannot be masked per slot)."
                )

    def check_consistent(self) -> None:
        """Raise if a layer's batch or slot count differs from the mask's (a bookkeeping bug)."""
        for i, layer in enumerate(self.cache.layers):
            n = _layer_len(layer)
            rows = layer.keys.shape[0] if n else self.batch_size
            if n != self.num_slots or rows != self.batch_size:
                raise RuntimeError(f"cache layer {i} holds [{rows} rows, {n} slots], the mask [{self.batch_size}, "
                                   f"{self.num_slots}].")

    # ------------------------------------------------------------------ updates

    def append(self, new_valid: torch.Tensor) -> None:
        """Record that the last forward appended `n` slots with validity `new_valid [b, n]`."""
        self.mask = self.attention_mask(new_valid)

    def crop(self, num_slots: int) -> None:
        """Drop the last `num_slots` slots from every layer (slots not recorded in `mask`, e.g. a drafted block)."""
        if num_slots > 0:
            self.cache.crop(-num_slots)

    def select(self, indices: torch.Tensor) -> None:
        """Keep rows `indices` (`[b']` long), in that order."""
        indices = indices.to(self.mask.device)
        for layer in self.cache.layers:
            if _layer_len(layer) == 0:  # nothing cached: back to lazy initialisation (no stale batch size)
                layer.reset()
                continue
            layer.keys = layer.keys.index_select(0, indices.to(layer.keys.device))
            layer.values = layer.values.index_select(0, indices.to(layer.values.device))
        self.mask = self.mask.index_select(0, indices)

    def merge(self, other: "RaggedCache") -> None:
        """Append the rows of `other` after ours (batch axis), left-padding the shorter cache with invalid slots."""
        s = max(self.num_slots, other.num_slots)
        b_self, b_other = self.batch_size, other.batch_size
        for i in range(max(len(self.cache.layers), len(other.cache.layers))):
            ours = self.cache.layers[i] if i < len(self.cache.layers) else None
            theirs = other.cache.layers[i] if i < len(other.cache.layers) else None
            ref = ours if _layer_len(ours) > 0 else theirs if _layer_len(theirs) > 0 else None
            if ref is None:
                if ours is not None:
                    ours.reset()
                continue
            if ours is None:
                raise RuntimeError("cannot merge caches with different numbers of layers.")
            keys = torch.cat([_left_pad(ours, "keys", ref, b_self, s), _left_pad(theirs, "keys", ref, b_other, s)])
            values = torch.cat(
                [_left_pad(ours, "values", ref, b_self, s), _left_pad(theirs, "values", ref, b_other, s)]
            )
            if not ours.is_initialized:
                ours.lazy_initialization(keys, values)
            ours.keys, ours.values = keys, values
        pad_self = self.mask.new_zeros(b_self, s - self.num_slots)
        pad_other = other.mask.new_zeros(b_other, s - other.num_slots)
        self.mask = torch.cat(
            [torch.cat([pad_self, self.mask], dim=1), torch.cat([pad_other, other.mask.to(self.mask.device)], dim=1)]
        )

    def wasted_slots(self) -> int:
        """Slots that `compact()` would remove: `S - max(valid count per row)`."""
        if self.batch_size == 0:
            return 0
        return self.num_slots - int(self.valid_counts().max())

    def compact(self) -> None:
        """Move every row's valid slots to the right end (order kept) and drop the columns left empty."""
        if self.batch_size == 0:
            return
        counts = self.valid_counts()
        keep = int(counts.max())
        # A stable sort of the validity puts each row's invalid slots first and its valid slots last, in order.
        order = torch.sort(self.mask.to(torch.int8), dim=1, stable=True).indices[:, self.num_slots - keep :]
        for layer in self.cache.layers:
            if _layer_len(layer) == 0:
                continue
            b, h, _, d = layer.keys.shape
            idx = order.to(layer.keys.device)[:, None, :, None].expand(b, h, keep, d)
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.mask = self.mask.gather(1, order)


def _layer_len(layer) -> int:
    if layer is None or not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
        return 0
    return layer.keys.shape[-2]


def _left_pad(layer, name: str, ref, batch: int, slots: int) -> torch.Tensor:
    """`layer.<name>` left-padded with zeros to `slots` slots (zeros `[batch, ...]` if the layer is empty)."""
    ref_t = getattr(ref, name)
    if _layer_len(layer) == 0:
        return ref_t.new_zeros(batch, ref_t.shape[1], slots, ref_t.shape[3])
    t = getattr(layer, name).to(ref_t.device)
    missing = slots - t.shape[2]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3]), t], dim=2)


__all__ = ["RaggedCache"]
