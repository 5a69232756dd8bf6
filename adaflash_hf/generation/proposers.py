# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Proposers: what a round verifies, behind one small row-batched interface (the shape of vLLM's spec_decode).

A proposer looks at the active rows (`DraftRows`: `b` rows, their anchors, budgets and drafter state) and returns
`Proposals` (`drafts [b, m]`, `lengths [b]`, per-row sources, and for sampling the draft distribution `q`):

* `BlockDraftProposer`: ONE drafter forward drafts a block per row (queries `[anchor, mask x (B-1)]`, keys/values =
  the drafter's cached context + the rows' new context + the block), the `LengthChooser` picks the verify lengths
  and the call's `SpeculativeSampler` the drafted tokens. It is the library's only drafting forward: the batched
  engine (`batch.py`) calls it for `b` rows, the bs=1 candidate generator for one row;
* `LookupProposer`: each row's n-gram prompt-lookup continuation (`lookup.BatchLookup`);
* `NoDraftProposer`: nothing to verify (a plain round: the target's own next token only).

Which proposer a round uses, and which rows swap a drafted block for their lookup continuation, is decided by the
one `ProposalPolicy` (`policy.py`, `swap_in_lookup`). No proposer affects what is committed: the target verifies.
"""

from dataclasses import dataclass
from typing import Protocol

import torch

from .batch_state import BatchState
from .candidates import first_token_alternatives
from .drafting import LengthChooser, draft_logits, finite_prefix, noise_embeds, to_full_vocab
from .lookup import BatchLookup
from .sampler import SpeculativeSampler


@dataclass
class Proposals:
    """What a round verifies: `drafts [b, m]`, `lengths [b]` (per row, `<= m`), the rows' sources (`"drafter"`,
    `"lookup"` or `"none"`), and for sampling the drafter's `q [b, m, V]` and which rows hold deterministic (lookup)
    drafts (`one_hot [b]`).

    Only from the block drafter: `noise [b, B, H]` the block queries of its forward (OnlineSpec feedback);
    `logits [b, m, V]` the processed draft logits (with `return_logits`: transformers' `_speculative_sampling` takes
    them at bs=1); `raw_logits [b, n, K]` the drafted logits with their autograd graph (`propose(learn=True)`);
    `survival [b, n]` the length head's survival when it chose the lengths.
    """

    arm: str
    drafts: torch.Tensor
    lengths: torch.Tensor
    sources: list[str]
    q: torch.Tensor | None = None
    one_hot: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    raw_logits: torch.Tensor | None = None
    survival: torch.Tensor | None = None
    host_lengths: list[int] | None = None  # `lengths` as read to the host by the proposer (no second sync)
    alternatives: torch.Tensor | None = None  # [b, k - 1] other candidates' first tokens (`candidates.py`)

    @classmethod
    def empty(cls, b: int, device) -> "Proposals":
        """A plain round for `b` rows: `drafts [b, 0]`, `lengths [b]` zeros."""
        return cls("plain", torch.zeros(b, 0, dtype=torch.long, device=device),
                   torch.zeros(b, dtype=torch.long, device=device), ["none"] * b, host_lengths=[0] * b)

    def cut(self, width: int) -> "Proposals":
        """The same proposals verifying at most `width` tokens per row."""
        lens = [min(n, width) for n in self.lengths_list()]
        m = max(lens, default=0)
        return Proposals(self.arm, self.drafts[:, :m], self.lengths.clamp(max=width),
                         ["none" if n == 0 else s for n, s in zip(lens, self.sources)],
                         None if self.q is None else self.q[:, :m], self.one_hot, host_lengths=lens)

    def lengths_list(self) -> list[int]:
        """`lengths` as host ints."""
        if self.host_lengths is None:
            self.host_lengths = self.lengths.tolist()
        return self.host_lengths


@dataclass
class DraftRows:
    """The active rows as a proposer sees them.

    Attributes:
        state: the rows' `BatchState`: anchors `last_tok [b]` at positions `next_pos [b]`, the drafter's
            `RaggedCache` and the target context it has not seen yet (a proposer that drafts consumes it).
        budgets: per row, the most drafted tokens it may verify (host ints: the policy reads them too).
        keys: the rows' keys in the `ProposalPolicy` (prompt indices).
        sequences: each row's tokens so far (prompt + committed, anchor included) when the sampler's processors
            read them, else None.
    """

    state: BatchState
    budgets: list[int]
    keys: list
    sequences: list[torch.Tensor] | None = None

    @property
    def size(self) -> int:
        return len(self.budgets)


class Proposer(Protocol):
    """`propose(rows) -> Proposals` for all `rows.size` rows at once."""

    def propose(self, rows: DraftRows) -> Proposals: ...


class NoDraftProposer:
    """Proposes nothing: the round verifies only the target's own next token."""

    def __init__(self, device):
        self.device = device

    def propose(self, rows: DraftRows) -> Proposals:
        return Proposals.empty(rows.size, self.device)


class LookupProposer:
    """Each row's n-gram prompt-lookup continuation, at most its budget (`BatchLookup`, over a run's prompts)."""

    def __init__(self, lookup: BatchLookup):
        self.lookup = lookup

    def append(self, prompt_idx: torch.Tensor, new: torch.Tensor, counts: torch.Tensor) -> None:
        """The rows' committed tokens join their lookup texts (`BatchLookup.append`)."""
        self.lookup.append(prompt_idx, new, counts)

    def propose(self, rows: DraftRows) -> Proposals:
        """`drafts [b, m]` with `m` the longest continuation; rows without a match propose nothing."""
        device = rows.state.last_tok.device
        drafts, lengths = self.lookup.propose(rows.state.prompt_tensor, torch.tensor(rows.budgets, device=device))
        lens = lengths.tolist()
        return Proposals("lookup", drafts[:, : max(lens, default=0)], lengths,
                         ["lookup" if n else "none" for n in lens], host_lengths=lens)


class BlockDraftProposer:
    """A block drafter's proposals: one drafter forward for every row, verify lengths, drafted tokens.

    Args:
        drafter: the DFlash-contract drafter. embeddings / lm_head: the target's input embeddings and LM head.
        sampler: the call's `SpeculativeSampler` (its logits processors apply to the drafted logits too).
        lengths: the call's `LengthChooser`; cost: the device's cost model (the length head's fixed drafting cost).
        return_logits: also return the processed draft logits (`Proposals.logits`, for transformers' bs=1 loop;
            drafted tokens are then picked position by position on the kept positions only).
    """

    def __init__(self, drafter, embeddings, lm_head, sampler: SpeculativeSampler, lengths: LengthChooser,
                 cost=None, return_logits: bool = False):
        self.drafter, self.embeddings, self.lm_head = drafter, embeddings, lm_head
        self.sampler, self.lengths, self.cost, self.return_logits = sampler, lengths, cost, return_logits
        self.block_size = int(drafter.config.block_size)
        self.mask_token_id = int(drafter.config.mask_token_id)
        self.features = len(drafter.config.target_layer_ids) * embeddings.weight.shape[1]
        self.vocab_size = lm_head.weight.shape[0]
        self.param = next(drafter.parameters())

    def forward(self, state: BatchState) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafting forward of every row of `state`; consumes its pending context. Returns
        `(queries, states)`, both `[b, B, H]`. Afterwards the drafter's cache holds the context only (the block's
        entries are cropped at once, so they never need a later crop)."""
        dev, dtype, block, b = self.param.device, self.param.dtype, self.block_size, state.size
        ctx, ctx_mask, ctx_pos = state.ctx, state.ctx_mask, state.ctx_pos
        state.ctx = state.ctx_mask = state.ctx_pos = None
        if ctx is None:
            ctx = torch.zeros(b, 0, self.features, dtype=dtype, device=dev)
            ctx_mask = torch.zeros(b, 0, dtype=torch.bool, device=dev)
            ctx_pos = torch.zeros(b, 0, dtype=torch.long, device=dev)
        ctx_mask = ctx_mask.to(dev)
        noise_ids = torch.full((b, block), self.mask_token_id, dtype=torch.long, device=state.last_tok.device)
        noise_ids[:, 0] = state.last_tok
        queries = noise_embeds(self.embeddings, noise_ids).to(device=dev, dtype=dtype)
        position_ids = torch.cat([ctx_pos.to(dev), state.next_pos.to(dev)[:, None] + torch.arange(block, device=dev)],
                                 dim=1)
        attention_mask = state.drafter.attention_mask(
            torch.cat([ctx_mask, torch.ones(b, block, dtype=torch.bool, device=dev)], dim=1))
        context = ctx.to(device=dev, dtype=dtype).masked_fill(~ctx_mask[..., None], 0.0) if ctx.shape[1] else None
        out = self.drafter(noise_embeds=queries, context_hidden_states=context, attention_mask=attention_mask,
                           position_ids=position_ids, cache=state.drafter.cache)
        state.drafter.crop(block)
        state.drafter.append(ctx_mask)
        if torch.is_grad_enabled():  # recorded for a learner: cached entries must not carry autograd history
            for layer in state.drafter.cache.layers:
                layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        return queries, out.last_hidden_state

    def propose(self, rows: DraftRows, learn: bool = False, tree=None) -> Proposals:
        """Draft up to `max(rows.budgets)` tokens per row. `learn`: the forward and the drafted logits keep their
        autograd graph (`Proposals.raw_logits`) for an OnlineSpec adapter that learns from this very draft.
        `tree`: `m -> (k, m')`, the round's candidate blocks per row and their width once the lengths are chosen
        (`candidates.tree_shape`); `k > 1` fills `Proposals.alternatives` and cuts the drafts to `m'`."""
        device = rows.state.last_tok.device
        budgets = torch.tensor(rows.budgets, device=device)
        with torch.enable_grad() if learn else torch.no_grad():
            queries, states = self.forward(rows.state)
            states = states[:, 1 : 1 + max(rows.budgets)]  # [b, n, H] the drafted positions
            raw, vocab_ids = draft_logits(self.drafter, states, self.lm_head)  # [b, n, V or K]
        logits, states = raw.detach().to(device), states.detach()
        fixed = self.cost.draft_seconds(rows.size) + self.cost.overhead_seconds("spec", rows.size) \
            if self.cost is not None and self.lengths.uses_head else 0.0  # paid whatever length the head picks
        lengths, survival = self.lengths(states, logits, budgets, fixed)
        lengths = lengths.to(device)
        if self.return_logits:
            lengths = torch.minimum(lengths, finite_prefix(logits).to(device))  # a non-finite position ends a draft
            lens = lengths.tolist()
            m, q, processed = max(lens), None, None
            drafts = torch.zeros(rows.size, 0, dtype=torch.long, device=device)
            if m:
                full = to_full_vocab(_finite(logits[:, :m]), vocab_ids, self.vocab_size, float("-inf"))
                drafts, processed = self.sampler.draft_scores(full, rows.sequences)
        else:
            drafts, q, usable = self.sampler.draft(logits, vocab_ids, self.vocab_size, rows.sequences)
            lengths = torch.minimum(lengths, usable.to(device))
            lens = lengths.tolist()
            m = max(lens)
            drafts, q, processed = drafts[:, :m], (None if q is None else q[:, :m]), None
        k, width = tree(m) if tree is not None and m > 0 else (1, m)
        alternatives = None
        if k > 1:
            alternatives = first_token_alternatives(logits[:, 0], vocab_ids, drafts[:, 0], k)
            if width < m:
                lengths, lens, m = lengths.clamp(max=width), [min(n, width) for n in lens], width
                drafts, q = drafts[:, :m], (None if q is None else q[:, :m])
        return Proposals("draft", drafts, lengths, ["drafter" if n else "none" for n in lens], q,
                         noise=queries, logits=processed, raw_logits=raw if raw.requires_grad else None,
                         survival=survival, host_lengths=lens, alternatives=alternatives)


def swap_in_lookup(draft: Proposals, lookup: Proposals | None, policy, keys: list) -> Proposals:
    """Rows whose lookup continuation (cut to the round's width `m`) promises more than their drafted tokens, by
    `policy.row_source`, verify it instead (deterministic drafts: `one_hot`). Returns `draft`, updated."""
    m = draft.drafts.shape[1]
    if lookup is None or m == 0 or lookup.drafts.shape[1] == 0:
        return draft
    cut, drafted = [min(n, m) for n in lookup.lengths_list()], draft.lengths_list()
    swap = [policy.row_source(k, c, n) == "lookup" for k, c, n in zip(keys, cut, drafted)]
    if not any(swap):
        return draft
    device = draft.drafts.device
    one_hot = torch.tensor(swap, dtype=torch.bool, device=device)
    props = lookup.drafts[:, :m].to(device)
    if props.shape[1] < m:
        props = torch.nn.functional.pad(props, (0, m - props.shape[1]))
    draft.drafts = torch.where(one_hot[:, None], props, draft.drafts)
    draft.lengths = torch.where(one_hot, torch.tensor(cut, device=device), draft.lengths)
    draft.host_lengths = [c if use else n for use, c, n in zip(swap, cut, drafted)]
    draft.sources = ["lookup" if use else s for use, s in zip(swap, draft.sources)]
    draft.one_hot = one_hot
    return draft


def lookup_hindsight(lookup: Proposals | None, committed: list[list[int]], verified: list[str]
                     ) -> tuple[list[int], list[int], list[int]] | None:
    """How the rows' unverified lookup continuations would have fared against what the round committed (for
    `ProposalPolicy.record_hindsight`): `(matched, known, lengths)` per row. Only rows that verified no proposal
    (`verified[r] == "none"`: a plain round, or a block cut to nothing) count: their committed token is the target's
    whatever the text, whereas the tokens a drafter got accepted are the easy stretches, where lookup looks better
    than it is. Other rows, and rows without a continuation, get length 0. None without lookup.

    committed: each row's committed tokens this round (host lists: compared on the host, no kernel)."""
    if lookup is None or lookup.drafts.shape[1] == 0:
        return None
    lengths = lookup.lengths_list()
    matched = []
    for proposal, tokens, n in zip(lookup.drafts.tolist(), committed, lengths):
        k = 0
        while k < min(n, len(tokens)) and proposal[k] == tokens[k]:
            k += 1
        matched.append(k)
    return matched, [len(tokens) for tokens in committed], [
        n if source == "none" else 0 for n, source in zip(lengths, verified)]


def _finite(logits: torch.Tensor) -> torch.Tensor:
    """Non-finite drafted positions zeroed (they are never verified; the sampler must not see NaNs there)."""
    bad = ~torch.isfinite(logits).all(dim=-1, keepdim=True)
    return torch.where(bad, torch.zeros_like(logits), logits)


__all__ = ["BlockDraftProposer", "DraftRows", "LookupProposer", "NoDraftProposer", "Proposals", "Proposer",
           "lookup_hindsight", "swap_in_lookup"]
