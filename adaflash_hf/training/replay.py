# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Replayed tau: the acceptance greedy drafter-only serving would get, computed from ONE teacher-forced pass.

Training measures `tau_proxy` on blocks at uniformly sampled anchors. Serving does not draft at uniform anchors:
each round's anchor is the token the target committed right after the drafter's last miss. Replaying walks a
known greedy response exactly as the serving loop moves, so it measures what serving gets without running it:

* one target forward over `prompt + response` gives the context (hidden states at `target_layer_ids`);
* one drafter forward drafts a block at EVERY anchor `i >= prompt_len` (block-sparse mask, as in training);
* the walk starts at anchor `prompt_len` (the token the prefill committed), accepts the longest prefix of the
  block's greedy draft that equals the response, commits it plus the target's own token, and moves the anchor
  `accepted + 1` positions on. Each round drafts `min(B - 1, max_length - cur_len - 1)` tokens, as the generator
  does, and a round with no budget left is a plain round (it commits one token).

With greedy fp32 serving of the same drafter the replayed rounds equal the served rounds, except where a
near-tied argmax flips between the batched pass and the incremental forwards of serving
(`tests/test_replay.py` checks it on the real testbed model). Nothing in generation imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..utils.speculation import tau as tau_of
from .blocks import block_labels, draft_blocks, gather_context


@dataclass
class ReplayResult:
    """Replayed rounds of one response: `accepted[r]` drafted tokens accepted out of `drafted[r]` proposed."""

    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Tokens committed per verification round (the target's own token included), as `SpeculationStats.tau`."""
        return tau_of(self.accepted)


def pooled_tau(results: list[ReplayResult]) -> float:
    """Committed tokens over rounds of several responses (the bench's `tau`: tokens / forwards, pooled)."""
    return tau_of([a for r in results for a in r.accepted])


def target_context(target, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """`[T, L*H]`: the target's hidden states at `layer_ids` over one sequence `input_ids [T]` (one forward)."""
    with torch.no_grad():
        out = target(input_ids=input_ids.to(target.device)[None], output_hidden_states=True)
    return gather_context(out.hidden_states, layer_ids)[0]


@torch.no_grad()
def draft_every_anchor(drafter, embed_tokens, lm_head, input_ids: torch.Tensor, context: torch.Tensor,
                       first_anchor: int, max_anchors_per_pass: int = 256, steps: int = 1,
                       candidates: int = 1) -> torch.Tensor:
    """Greedy drafts `[n, B-1]` (token ids) at anchors `first_anchor .. T-1` of ONE sequence `input_ids [T]`;
    with `candidates = k > 1`, `[n, k, B-1]`: the block and `k - 1` candidates with the drafter's next most likely
    first tokens (`generation/candidates.py`, multi-candidate verification).

    Args:
        drafter: an `AdaFlashDrafterModel` (its draft vocabulary is used, as in serving).
        embed_tokens / lm_head: the target's input embedding and LM head.
        input_ids: `[T]` prompt + response.
        context: `[T, L*H]` the target's hidden states at the drafter's layers (`target_context`, or recorded).
        first_anchor: the first anchor (the prompt length: the prefill's committed token).
        max_anchors_per_pass: anchors per drafter forward (bounds the `[n*B, T + n*B]` attention mask).
        steps: denoising steps per block (multi-step drafting): step 1 drafts from all masks; step `s > 1` feeds the
            first `s - 1` drafted tokens back into the block (in place of masks) and re-predicts the rest. One
            drafter forward per step.
        candidates: candidate blocks per anchor (first-token alternatives of the first step's logits).
    """
    from ..generation.candidates import first_token_alternatives

    device = next(drafter.parameters()).device
    ids, context = input_ids.to(device)[None], context.to(device)[None]
    drafts = []
    for chunk in torch.arange(first_anchor, ids.shape[1], device=device).split(max_anchors_per_pass):
        tokens = None
        for step in range(steps):
            shown = None if tokens is None else torch.full((1, chunk.numel()), step, device=device)
            states = draft_blocks(drafter, embed_tokens, ids, context, chunk[None], revealed=tokens,
                                  reveal_len=shown)[:, :, 1:]
            logits, vocab_ids = drafter.draft_logits(states, lm_head)
            new = logits.argmax(dim=-1)
            new = vocab_ids.to(new.device)[new] if vocab_ids is not None else new
            if step == 0 and candidates > 1:
                alternatives = first_token_alternatives(logits[0, :, 0], vocab_ids, new[0, :, 0], candidates)
            tokens = new if tokens is None else torch.cat([tokens[..., :step], new[..., step:]], dim=-1)
        if candidates > 1:
            tree = tokens[0][:, None, :].repeat(1, candidates, 1)
            tree[:, 1:, 0] = alternatives
            drafts.append(tree)
        else:
            drafts.append(tokens[0])
    if not drafts:
        shape = (0, candidates, drafter.config.block_size - 1) if candidates > 1 else (0, drafter.config.block_size - 1)
        return torch.zeros(shape, dtype=torch.long)
    return torch.cat(drafts).cpu()


def walk_rounds(drafts: torch.Tensor, input_ids: torch.Tensor, first_anchor: int, max_length: int | None = None,
                width: int | None = None) -> ReplayResult:
    """Walk a greedy response round by round, as drafter-only greedy serving moves (see the module docstring).

    Args:
        drafts: `[T - first_anchor, B-1]` drafted tokens at each anchor (`draft_every_anchor`), or `[T -
            first_anchor, k, B-1]` candidate blocks (a round keeps the candidate with the longest accepted prefix,
            as tree verification does).
        input_ids: `[T]` prompt + the target's greedy response (the whole output of the served call).
        first_anchor: the prompt length.
        max_length: the call's `max_length` (prompt + max_new_tokens); bounds each round's draft as the generator
            does. Default: the sequence length.
        width: the most drafted tokens a round verifies (default: the whole block).
    """
    seq = input_ids.tolist()
    total = len(seq)
    max_length = total if max_length is None else max_length
    trees = drafts if drafts.dim() == 3 else drafts[:, None, :]
    result = ReplayResult()
    anchor = first_anchor
    while anchor < total - 1:  # tokens after the anchor remain to be committed
        cur_len = anchor + 1
        budget = min(trees.shape[2] if width is None else min(width, trees.shape[2]), max_length - cur_len - 1)
        remaining = total - cur_len  # the last of them is always the target's own token
        matched = 0
        for row in (trees[anchor - first_anchor].tolist() if budget > 0 else []):
            n = 0
            while n < min(budget, remaining - 1) and row[n] == seq[cur_len + n]:
                n += 1
            matched = max(matched, n)
        result.accepted.append(matched)
        result.drafted.append(max(budget, 0))
        anchor += matched + 1
    return result


def replay(drafter, target, input_ids: torch.Tensor, prompt_len: int, max_new_tokens: int | None = None,
           context: torch.Tensor | None = None, steps: int = 1) -> ReplayResult:
    """Replayed rounds of one served call: `input_ids [T]` = prompt + the target's greedy output; `context`
    `[T, L*H]` the target's hidden states (one target forward when None); `steps` drafting steps per block."""
    if context is None:
        context = target_context(target, input_ids, drafter.config.target_layer_ids)
    drafts = draft_every_anchor(drafter, target.get_input_embeddings(), target.get_output_embeddings(), input_ids,
                                context, prompt_len, steps=steps)
    max_length = None if max_new_tokens is None else prompt_len + max_new_tokens
    return walk_rounds(drafts, input_ids, prompt_len, max_length)


def uniform_anchor_accepted(drafts: torch.Tensor, input_ids: torch.Tensor, target_argmax: torch.Tensor,
                            first_anchor: int) -> torch.Tensor:
    """Training's view of the same drafts: accepted length `[n]` at EVERY anchor `first_anchor .. T-2`, labelled as
    `blocks.block_labels` labels them (the target's greedy token, valid while the sequence stays on its path).

    `1 + mean` is the expectation of `tau_proxy` (which samples 32 of these anchors per sequence).
    drafts: `[T - first_anchor, B-1]` from `draft_every_anchor(..., first_anchor)`; input_ids / target_argmax: `[T]`.
    """
    T = input_ids.shape[0]
    anchors = torch.arange(first_anchor, T - 1)[None]
    if anchors.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    labels, valid = block_labels(input_ids[None], target_argmax[None], torch.tensor([T]), anchors,
                                 torch.ones_like(anchors, dtype=torch.bool), drafts.shape[1] + 1)
    correct = (drafts[: anchors.shape[1]][None] == labels) & valid
    return correct.long().cumprod(dim=-1).sum(dim=-1)[0]


def cached_greedy_responses(target, tokenizer, prompts: list[list[int]], max_new_tokens: int, cache=None,
                            batch_size: int = 8, progress: bool = True) -> list[list[int]]:
    """`prompt + greedy response` token ids for each token-id prompt, generated in left-padded batches
    (`label_store.generate_greedy`) and kept in `cache` (a JSONL file keyed by prompt ids and length) so that
    replaying more drafters on the same prompts never regenerates them. Replay only the part that follows the
    served target's greedy path (`greedy_prefix_len`): batch padding may flip a near-tied argmax."""
    import json
    from pathlib import Path

    from .label_store import generate_greedy

    cache = Path(cache) if cache is not None else None
    keyed = {}
    if cache is not None and cache.is_file():
        keyed = {(tuple(r["prompt_ids"]), r["max_new_tokens"]): r["ids"] for r in map(json.loads, cache.open())}
    missing = [p for p in dict.fromkeys(tuple(p) for p in prompts) if (p, max_new_tokens) not in keyed]
    for start in range(0, len(missing), batch_size):
        chunk = missing[start : start + batch_size]
        for prompt, (response, _) in zip(chunk, generate_greedy(target, tokenizer, [list(p) for p in chunk],
                                                                max_new_tokens)):
            keyed[(prompt, max_new_tokens)] = list(prompt) + response
        if progress:
            print(f"greedy responses: {min(start + batch_size, len(missing))}/{len(missing)}", flush=True)
        if cache is not None:  # after every batch: a killed run keeps what it generated
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text("".join(json.dumps({"prompt_ids": list(p), "max_new_tokens": m, "ids": ids}) + "\n"
                                     for (p, m), ids in keyed.items()))
    return [keyed[(tuple(p), max_new_tokens)] for p in prompts]


def greedy_prefix_len(input_ids, target_argmax, prompt_len: int) -> int:
    """Length of the longest prefix of `input_ids [T]` whose response follows `target_argmax [T]` (the target's
    greedy token after each position): a stored response generated in another dtype is replayed only as far as
    it stays on the served target's greedy path."""
    ids, argmax = torch.as_tensor(input_ids), torch.as_tensor(target_argmax)
    off = (ids[prompt_len:] != argmax[prompt_len - 1 : -1]).nonzero()
    return int(prompt_len + off[0]) if len(off) else int(ids.shape[0])


__all__ = ["ReplayResult", "cached_greedy_responses", "draft_every_anchor", "greedy_prefix_len", "pooled_tau", "replay", "target_context",
           "uniform_anchor_accepted", "walk_rounds"]
