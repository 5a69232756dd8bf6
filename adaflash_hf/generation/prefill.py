# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Which waiting prompts the batched engine prefills in one target forward (length-grouped prefill).

A padded prefill computes every row at the longest prompt's length: 16 held-out prompts of 43-183 tokens cost
16 x 183 = 2,928 token positions for 1,796 real ones, and on a CPU (where a forward's cost grows with its tokens) that
padding was ~40% of a 16-request, 64-token run. Splitting the prompts, sorted by length, into consecutive groups, one
forward each, removes most of the padding at the price of one forward's fixed cost per extra group.
`prefill_groups` picks the split that minimises `sum_groups (overhead + rows x longest)` in token positions (an exact
dynamic program over the sorted lengths, O(n^2) for n prompts), where `overhead` is what one more forward costs in
token positions on this device (`forward_overhead_tokens`): ~16-32 on a CPU, unbounded on an accelerator whose
forward is flat in its tokens (the H200 reference: one forward for 1-1,024 tokens costs the same), where everything
is prefilled together as padded `generate` does.

transformers' continuous batching avoids the padding with a paged cache; our engine keeps a contiguous ragged cache
(`ragged_cache.py`), so it groups instead: the groups' states are merged into one batch (`BatchState.merge`) exactly as
a continuous-batching join is. Nothing here changes what a row computes: each row is prefilled with less left padding,
all of it masked.
"""

import math


CPU_OVERHEAD_TOKENS = 32  # without a cost model: one CPU forward's fixed cost in token positions (~50 ms / ~2 ms)


def prefill_groups(lengths: list[int], overhead_tokens: float | None) -> list[list[int]]:
    """Indices into `lengths`, grouped: each group is prefilled by one forward padded to its longest prompt.

    Args:
        lengths: each prompt's token count.
        overhead_tokens: one extra forward's cost in token positions; `None` or `inf`: one group (no split).
    Returns:
        groups in increasing length order, each a list of indices (ascending length within the group); together
        they cover every index once.
    """
    if any(n <= 0 for n in lengths):
        raise ValueError(f"every prompt needs at least one token, got lengths {lengths}.")
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    if overhead_tokens is None or math.isinf(overhead_tokens) or len(order) <= 1:
        return [order] if order else []
    sizes = [lengths[i] for i in order]
    # best[j]: least cost of prefilling the j shortest prompts; cut[j]: where its last group starts
    best, cut = [0.0] + [math.inf] * len(sizes), [0] * (len(sizes) + 1)
    for j in range(1, len(sizes) + 1):
        for i in range(j):  # last group = sizes[i:j], padded to sizes[j - 1]
            cost = best[i] + overhead_tokens + (j - i) * sizes[j - 1]
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(sizes)
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def forward_overhead_tokens(cost, device) -> float | None:
    """One extra target forward's cost in token positions, from the device's `TargetCostModel` when there is one:
    the one-row, one-token forward over the per-token slope of the largest measured forward (rows x tokens). A
    forward flat in its tokens (an accelerator's launch-bound regime) gives None: never split. Without a cost model:
    `CPU_OVERHEAD_TOKENS` on a CPU, None elsewhere (one padded forward, as `generate` does)."""
    if cost is None or not cost.points:
        return CPU_OVERHEAD_TOKENS if str(device).startswith("cpu") else None
    fixed = cost.seconds(1, 1)
    rows = max(cost.points)
    width = max(cost.points[rows])
    total = rows * width
    slope = (cost.points[rows][width] - fixed) / max(total - 1, 1)
    if total <= 1 or slope <= 0 or fixed / slope > total:  # flat up to the widest measured forward
        return None
    return fixed / slope


__all__ = ["CPU_OVERHEAD_TOKENS", "forward_overhead_tokens", "prefill_groups"]
