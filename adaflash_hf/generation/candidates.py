# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Multi-candidate (tree) verification: several drafted blocks per row, verified in ONE target forward.

On a launch-bound device a verify forward costs the same for 1 to 16 tokens per row
(`../shared/reference/h200-testbed-forward.json`: ~20 ms for 1-16 tokens x 1-64 rows). A row whose block is cut
to `m` drafted tokens leaves slots the device would verify for free. The block drafter's weakest token is its
first: on held-out prompts it is accepted about one time in three. Because a block is drafted in parallel from mask
queries, the later tokens do not depend on the first. So the drafter's `k` most likely first tokens, each followed
by the same drafted rest, are `k` candidate blocks at no extra drafting cost.

They share the anchor and are verified together as a token tree: SpecInfer's / Medusa's / EAGLE-2's tree attention,
here branching once, at the first drafted token. Each candidate token sees the cache, the anchor and its own
candidate's earlier tokens, at the RoPE position of its depth. Greedy acceptance keeps the candidate with the
longest accepted prefix (ties: the drafter's own block), and the round then goes on as if that candidate had been
the only proposal (`TreeVerdict.along_path`). Replayed on the 48 eval prompts with the shipped drafter, tau was 1.94
with one candidate, then 2.13 (k=2), 2.21 (3), 2.27 (4) and 2.38 (8).

The tree's shape (`tree_shape`): `k` candidates of `m` tokens, `1 + k * m` tokens per row. Replayed at a fixed
budget of 16 tokens (the H200's flat width), 5 candidates of 3 tokens (2.206) beat 2 of 7 (2.131) and 3 of 5
(2.187). The accepted tokens were close to a product, `E(k, m) ~ g(k) E(1, m)`, with `g = 1.21, 1.29, 1.40, 1.47`
for `k = 2, 3, 5, 8` at every width. So each round takes the shape with the most expected committed tokens per
predicted second: `(1 + g(k) E(m)) / seconds(1 + k m)`. `E(m)` is the policy's drafter curve. `g(k)` is learned
while serving (`FirstTokenHits`): the share of rows whose next target token was candidate `r`'s first token. The
first tree round of a run offers every candidate at width 1, so that every rank gets measured. Before `g` is known,
the round takes as many candidates as fit for free at the policy's width (`free_candidates`). The cost model is
never extrapolated: a tree must fit within the widest measured verify. A shape other than one block is considered
only where the device verifies a wider forward for at most `tolerance` more, so on this CPU, where width costs,
a round verifies one block and nothing changes.

Off by default (`draft_candidates=1`): on the projected H200 serving bench the tree rounds' host time still outweighs
their 8% fewer rounds (docs/fast_where_users_run.md, section 10).

Why by hand: transformers' assisted generation verifies one linear candidate sequence (its candidate-generator
protocol has no tree), and its 4D-mask support is the only piece used (a prepared 4D mask passes through
`create_causal_mask` unchanged). The engine's caches already mask any slot per row (`ragged_cache.py`), so the
rejected candidates' slots simply stay invalid, like rejected drafts.

Exactness: the committed tokens are the target's greedy tokens along the chosen path, each computed with exactly
the keys it would see alone (anchor + its own prefix + the row's valid cache), so outputs equal plain greedy decoding.
Greedy only: sampling would need multi-draft rejection sampling (SpecInfer's recursive rule), and processors
that read the sequence would need one sequence per tree slot. With either, a round verifies one candidate.
"""

from dataclasses import dataclass, field
from functools import cached_property

import torch


def tree_allowed(do_sample: bool, needs_sequences: bool, attn_implementation: str | None) -> bool:
    """Whether a call may verify several candidates: greedy, sequence-free processors, and an attention backend that
    takes a 4D additive mask (`sdpa` / `eager`; flash-attention kernels take no arbitrary mask)."""
    return not do_sample and not needs_sequences and attn_implementation in ("sdpa", "eager", None)


def free_candidates(cost, rows: int, width: int, most: int, tolerance: float = 0.05, seconds=None) -> int:
    """How many candidate blocks of `width` drafted tokens a row verifies this round (>= 1).

    The largest `k <= most` with `cost.seconds(1 + k * width, rows) <= (1 + tolerance) * cost.seconds(1 + width,
    rows)` and `1 + k * width` no wider than the widest measured verify. `cost` None, `most <= 1` or `width == 0`:
    one. `seconds`: `verify_seconds(cost, rows)`, when the caller has it."""
    if cost is None or most <= 1 or width <= 0:
        return 1
    seconds = verify_seconds(cost, rows) if seconds is None else seconds
    limit = (1.0 + tolerance) * seconds[1 + width] if 1 + width < len(seconds) else 0.0
    k = 1
    while k < most and 1 + (k + 1) * width < len(seconds) and seconds[1 + (k + 1) * width] <= limit:
        k += 1
    return k


def verify_seconds(cost, rows: int) -> list[float]:
    """`[cost.seconds(w, rows) for w in 0 .. widest measured]` (entry 0 unused): the table a round's shape is
    chosen from, interpolated once per round rather than once per shape."""
    return [0.0] + [cost.seconds(w, rows) for w in range(1, max(cost.num_tokens()) + 1)]


@dataclass
class FirstTokenHits:
    """Moving averages, per candidate rank `r`, of how often the target's token after the anchor was candidate
    `r`'s first token (rank 0: the drafter's own). `gain(k)`: what `k` candidates multiply the accepted tokens by,
    `sum(hits[:k]) / hits[0]`, None until rank `k - 1` was offered."""

    decay: float = 0.3
    hits: list[float] = field(default_factory=list)

    def record(self, firsts: torch.Tensor, target_first: torch.Tensor, rows: torch.Tensor) -> None:
        """One tree round: `firsts [b, k]` the candidates' first tokens, `target_first [b]` the target's token
        after each anchor, `rows [b]` bool: the rows that verified `k` candidates."""
        rates = ((firsts == target_first[:, None]) & rows[:, None]).sum(dim=0).tolist()
        count = int(rows.sum())
        if count == 0:
            return
        for r, hits in enumerate(rates):
            rate = hits / count
            if r == len(self.hits):
                self.hits.append(rate)
            else:
                self.hits[r] += self.decay * (rate - self.hits[r])

    def gain(self, k: int) -> float | None:
        if k > len(self.hits):
            return None
        return sum(self.hits[:k]) / max(self.hits[0], 1e-3)


def tree_shape(cost, rows: int, width: int, most: int, hits: FirstTokenHits | None, expected: list[float] | None,
               tolerance: float = 0.05) -> tuple[int, int]:
    """`(k, m)`: this round's candidates per row and drafted tokens per candidate (`m <= width`, the width the
    policy or length rule chose; module docstring).

    expected: `expected[w]` the expected accepted drafted tokens of one block verified `w` deep (the policy's
    curve, `w = 0 .. width`), or None when unknown. One block (`(1, width)`) where the device charges for width."""
    if cost is None or most <= 1 or width <= 0:
        return 1, width
    seconds = verify_seconds(cost, rows)
    explore = free_candidates(cost, rows, 1, most, tolerance, seconds)
    if explore == 1:
        return 1, width  # no free width at all (a CPU): one block
    if hits is None or expected is None:
        return free_candidates(cost, rows, width, most, tolerance, seconds), width
    if hits.gain(explore) is None:  # measure every rank once: all the candidates that fit, one token deep
        return explore, 1
    draft = cost.draft_seconds(rows)
    gains = [hits.gain(k) for k in range(1, min(most, len(hits.hits)) + 1)]
    best, shape = (1.0 + expected[width]) / (seconds[1 + width] + draft), (1, width)
    for m in range(1, width + 1):
        for k in range(2, len(gains) + 1):
            if 1 + k * m >= len(seconds):
                break
            score = (1.0 + gains[k - 1] * expected[m]) / (seconds[1 + k * m] + draft)
            if score > best:
                best, shape = score, (k, m)
    return shape


def first_token_alternatives(logits: torch.Tensor, vocab_ids: torch.Tensor | None, drafted: torch.Tensor,
                             k: int) -> torch.Tensor:
    """The drafter's next `k - 1` most likely first tokens after its own: `[b, k - 1]` (vocabulary ids).

    logits: `[b, V or K]` the drafted logits at the first drafted position; vocab_ids: `[K]` the draft vocabulary
    (None: full vocabulary); drafted: `[b]` the token the drafter drafted there (excluded)."""
    top = logits.float().topk(min(k, logits.shape[-1]), dim=-1).indices  # k: room for `drafted` among them
    if vocab_ids is not None:
        top = vocab_ids.to(top.device)[top]
    same = top == drafted.to(top.device)[:, None]
    order = torch.sort(same.to(torch.int8), dim=1, stable=True).indices  # the drafted token (if there) goes last
    return top.gather(1, order)[:, : k - 1]


@dataclass
class CandidateTree:
    """`k` candidate blocks per row sharing the row's anchor, flattened for one verify forward.

    Slot 0 is the anchor; candidate `j`'s token `t` (`t < m`) is slot `1 + j * m + t`, at depth `t + 1`.

    Attributes:
        drafts: `[b, k, m]` candidate `j` of each row (candidate 0 is the drafter's own block).
        lengths: `[b]` drafted tokens per candidate (`<= m`); branches: `[b]` live candidates per row (1 for rows
            that verify a lookup continuation or nothing).
    """

    drafts: torch.Tensor
    lengths: torch.Tensor
    branches: torch.Tensor

    @classmethod
    def from_proposals(cls, drafts: torch.Tensor, lengths: torch.Tensor, alternatives: torch.Tensor,
                       sources: list[str]) -> "CandidateTree":
        """The tree of `drafts [b, m]` with `alternatives [b, k - 1]` as the other candidates' first tokens; rows
        whose source is not the drafter keep one candidate."""
        b, m = drafts.shape
        k = alternatives.shape[1] + 1
        tree = drafts[:, None, :].repeat(1, k, 1)
        tree[:, 1:, 0] = alternatives.to(drafts.device)
        drafted = torch.tensor([s == "drafter" for s in sources], dtype=torch.bool, device=drafts.device)
        branches = torch.where(drafted & (lengths > 0), k, 1)
        return cls(tree, lengths, branches)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.drafts.shape)

    @property
    def width(self) -> int:
        """Tokens per row in the verify forward: `1 + k * m`."""
        _, k, m = self.shape
        return 1 + k * m

    def depth(self) -> torch.Tensor:
        """`[1 + k * m]`: each slot's offset from the anchor's position."""
        _, k, m = self.shape
        t = torch.arange(m, device=self.drafts.device).repeat(k)
        return torch.cat([t.new_zeros(1), t + 1])

    @cached_property
    def valid(self) -> torch.Tensor:
        """`[b, 1 + k * m]`: the anchor and each live candidate's first `lengths` tokens (the mask and the
        acceptance of a round both read it: computed once)."""
        _, k, m = self.shape
        dev = self.drafts.device
        live = (torch.arange(k, device=dev)[None, :, None] < self.branches[:, None, None]) & (
            torch.arange(m, device=dev)[None, None, :] < self.lengths[:, None, None])
        return torch.cat([live.new_ones(live.shape[0], 1), live.flatten(1)], dim=1)

    def input_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """`[b, 1 + k * m]`: the anchor, then every candidate's tokens."""
        return torch.cat([anchors[:, None], self.drafts.flatten(1)], dim=1)

    def attention_mask(self, past: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The additive 4D mask `[b, 1, 1 + k * m, S + 1 + k * m]` of the verify forward over `past [b, S]` (the
        cache's valid slots): every slot sees the valid cache, the anchor and its own candidate up to itself."""
        _, k, m = self.shape
        dev = self.drafts.device
        branch = torch.cat([torch.full((1,), -1, device=dev), torch.arange(k, device=dev).repeat_interleave(m)])
        depth = self.depth()
        tree = (branch[None, :] == -1) | ((branch[:, None] == branch[None, :]) & (depth[None, :] <= depth[:, None]))
        keys = torch.cat([past.to(dev).bool(), self.valid], dim=1)  # [b, S + q]
        see = torch.cat([past.new_ones(self.width, past.shape[1], dtype=torch.bool).to(dev), tree], dim=1)
        allowed = see[None, :, :] & keys[:, None, :]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=dev)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]

    def accept(self, target_tokens: torch.Tensor) -> "TreeVerdict":
        """Greedy acceptance of every candidate against the target's (processed) argmax `[b, 1 + k * m]`; keeps the
        one with the longest accepted prefix."""
        b, k, m = self.shape
        dev = target_tokens.device
        parents = torch.cat([target_tokens[:, None, :1].expand(b, k, 1),
                             target_tokens[:, 1:].view(b, k, m)[:, :, : m - 1]], dim=2)  # [b, k, m]
        live = self.valid[:, 1:].view(b, k, m)
        match = (self.drafts.to(dev) == parents) & live
        per_candidate = match.long().cumprod(dim=2).sum(dim=2)  # [b, k]
        chosen = per_candidate.argmax(dim=1)  # the first of the longest: candidate 0 on a tie
        accepted = per_candidate.gather(1, chosen[:, None]).squeeze(1)
        path = torch.cat([chosen.new_zeros(b, 1), 1 + chosen[:, None] * m + torch.arange(m, device=dev)], dim=1)
        next_tok = target_tokens.gather(1, path.gather(1, accepted[:, None])).squeeze(1)
        drafts = self.drafts.to(dev).gather(1, chosen[:, None, None].expand(b, 1, m)).squeeze(1)
        return TreeVerdict(chosen, accepted, next_tok, path, drafts, self.width)


@dataclass
class TreeVerdict:
    """What tree verification decided, per row.

    Attributes:
        chosen: `[b]` the kept candidate; accepted: `[b]` its accepted tokens; next_tok: `[b]` the target's token
            after them; path: `[b, m + 1]` the slots of the anchor and the kept candidate's tokens; drafts: `[b, m]`
            the kept candidate's tokens; width: tokens per row of the forward (`1 + k * m`).
    """

    chosen: torch.Tensor
    accepted: torch.Tensor
    next_tok: torch.Tensor
    path: torch.Tensor
    drafts: torch.Tensor
    width: int

    def cache_valid(self) -> torch.Tensor:
        """`[b, 1 + k * m]`: the forward's slots a row keeps (the anchor and its kept candidate's accepted tokens)."""
        b = self.path.shape[0]
        keep = torch.arange(self.path.shape[1], device=self.path.device)[None, :] <= self.accepted[:, None]
        return torch.zeros(b, self.width, dtype=torch.bool, device=self.path.device).scatter_(1, self.path, keep)

    def along_path(self, values: torch.Tensor) -> torch.Tensor:
        """`[b, 1 + k * m, ...]` per-slot values (logits, hidden states) -> `[b, m + 1, ...]` along the kept path."""
        index = self.path.to(values.device).view(*self.path.shape, *([1] * (values.dim() - 2)))
        return values.gather(1, index.expand(*self.path.shape, *values.shape[2:]))


__all__ = ["CandidateTree", "FirstTokenHits", "TreeVerdict", "first_token_alternatives", "free_candidates",
           "tree_allowed", "tree_shape", "verify_seconds"]
