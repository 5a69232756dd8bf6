# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Training blocks of the DFlash recipe: anchors, the block-sparse attention mask, labels and loss weights.

A training sequence `x[0..T)` comes with the target's hidden states `h[0..T)` at `target_layer_ids` and the
target's greedy next token `a[t] = argmax p_T(. | x[<=t])` at every position. A block at anchor `i` is
`[x[i], mask, ..., mask]` (length B); its queries see the context `h[j]` for `j < i` only (what the drafter sees
at inference when `x[i]` is the last committed token) and the whole block itself. Block position `k` (1..B-1)
drafts the token at `i + k`, whose label is `a[i + k - 1]`, the target's greedy token after `x[..i+k-1]`.

That label is exact only while the sequence agrees with the target's greedy path inside the block
(`x[i+j] == a[i+j-1]` for `0 < j < k`): always true for target-generated responses, and a cheap way to use
teacher-forced corpora (prefill only) without training on positions the drafter would never be asked about.

All functions here are pure tensor code, shared by the offline trainer, OPD and the length-head data collection.
"""

import math

import torch


def sample_anchors(
    seq_lens: torch.Tensor,
    starts: torch.Tensor,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick `num_anchors` distinct anchor positions per sequence, uniformly in `[max(start, 1), len - 2]`.

    Args:
        seq_lens: `[batch]` real lengths (without padding).
        starts: `[batch]` first position allowed as an anchor (e.g. `prompt_len - 1`: the last prompt token is the
            anchor of the first drafted block). Anchors need at least one context token, so never below 1.
        num_anchors: anchors per sequence. Sequences with fewer valid positions repeat some (their duplicates get
            zero loss weight through `anchor_valid`).
        block_size: block length (unused for the range, kept so callers state it; blocks may run past the end,
            and positions past the end simply get zero weight).
    Returns:
        `(anchors [batch, num_anchors] long, anchor_valid [batch, num_anchors] bool)`, anchors sorted per row.
    """
    del block_size
    batch = seq_lens.shape[0]
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)
    valid = torch.zeros(batch, num_anchors, dtype=torch.bool)
    for b in range(batch):
        lo, hi = max(int(starts[b]), 1), int(seq_lens[b]) - 2
        if hi < lo:
            continue
        n_pos = hi - lo + 1
        take = min(num_anchors, n_pos)
        chosen = torch.randperm(n_pos, generator=generator)[:take] + lo
        chosen, _ = chosen.sort()
        anchors[b, :take] = chosen
        anchors[b, take:] = chosen[-1]
        valid[b, :take] = True
    return anchors, valid


def block_attention_mask(
    anchors: torch.Tensor, context_len: int, block_size: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive 4D mask `[batch, 1, n * B, context_len + n * B]` for `n` blocks drafted in one forward.

    Block `b` (queries `b*B .. b*B+B-1`) sees context keys `j < anchors[:, b]` and the keys of its own block,
    nothing of the other blocks. 0 where visible, the dtype's minimum elsewhere.
    """
    batch, n = anchors.shape
    q = n * block_size
    block_of_query = torch.arange(q) // block_size  # [q]
    ctx_visible = torch.arange(context_len)[None, None, :] < anchors[:, block_of_query][:, :, None]  # [b, q, ctx]
    own_block = block_of_query[:, None] == block_of_query[None, :]  # [q, q]
    visible = torch.cat([ctx_visible, own_block[None].expand(batch, q, q)], dim=-1)
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[:, None]


def block_position_ids(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """`[batch, context_len + n * B]`: context positions `0..T-1`, then `anchor + k` for each block."""
    batch, _ = anchors.shape
    ctx = torch.arange(context_len)[None].expand(batch, -1)
    blocks = (anchors[:, :, None] + torch.arange(block_size)[None, None]).reshape(batch, -1)
    return torch.cat([ctx, blocks], dim=-1)


def block_labels(
    input_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    seq_lens: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and validity of block positions 1..B-1.

    Args:
        input_ids: `[batch, T]` the sequences; target_argmax: `[batch, T]` the target's greedy token after each
            position; seq_lens: `[batch]`; anchors / anchor_valid: `[batch, n]` from `sample_anchors`.
    Returns:
        `(labels [batch, n, B-1] long, valid [batch, n, B-1] bool)`. Position `k` is valid iff it lies inside the
        sequence and the sequence follows the target's greedy path from the anchor up to it.
    """
    batch, T = input_ids.shape
    k = torch.arange(1, block_size)  # [B-1]
    label_pos = anchors[:, :, None] + k - 1  # a[i + k - 1]
    in_range = (anchors[:, :, None] + k) < seq_lens[:, None, None]
    label_pos_c = label_pos.clamp(max=T - 1)
    labels = torch.gather(target_argmax, 1, label_pos_c.reshape(batch, -1)).reshape(label_pos.shape)
    # agree[j] = (x[i+j] == a[i+j-1]) for j = 1..B-1; position k needs agree[1..k-1].
    next_tok = torch.gather(input_ids, 1, (label_pos + 1).clamp(max=T - 1).reshape(batch, -1)).reshape(label_pos.shape)
    agree = (next_tok == labels) & in_range
    on_path = torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1]], dim=-1).cumprod(dim=-1).bool()
    valid = in_range & on_path & anchor_valid[:, :, None]
    return labels.masked_fill(~valid, 0), valid


def block_soft_labels(topk_ids: torch.Tensor, topk_logits: torch.Tensor, anchors: torch.Tensor, block_size: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's recorded top-k next-token logits at block positions 1..B-1 (the soft labels of `block_labels`:
    position `k` of the block at anchor `i` is predicted from `a[i + k - 1]`'s distribution).

    topk_ids / topk_logits: `[batch, T, k]`; anchors: `[batch, n]`.
    Returns `(ids [batch, n, B-1, k] long, logits [batch, n, B-1, k] float)`; out-of-range positions repeat the last
    recorded one (`block_labels`' mask leaves them out of the loss).
    """
    batch, T, k = topk_ids.shape
    pos = (anchors[:, :, None] + torch.arange(block_size - 1)).clamp(max=T - 1).reshape(batch, -1, 1)
    pos = pos.expand(-1, -1, k)
    shape = (*anchors.shape, block_size - 1, k)
    return (torch.gather(topk_ids, 1, pos).reshape(shape).long(),
            torch.gather(topk_logits, 1, pos).reshape(shape).float())


def position_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """DFlash's decay `w_k = exp(-(k - 1) / gamma)` for block positions k = 1..B-1 (`gamma=None`: all ones).

    Early positions matter most: a draft is accepted only up to its first error.
    """
    k = torch.arange(1, block_size, dtype=torch.float32)
    if gamma is None or math.isinf(gamma):
        return torch.ones_like(k)
    return torch.exp(-(k - 1) / gamma)


def gather_context(hidden_states: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    """`hidden_states` tuple from a transformers forward (index 0 = embeddings) -> `[b, T, len(layer_ids) * H]`."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


__all__ = [
    "block_attention_mask",
    "block_labels",
    "block_position_ids",
    "draft_blocks",
    "gather_context",
    "position_weights",
    "sample_anchors",
    "sample_reveal",
    "score_blocks",
]


def draft_blocks(
    drafter, embed_tokens, input_ids: torch.Tensor, context: torch.Tensor, anchors: torch.Tensor,
    revealed: torch.Tensor | None = None, reveal_len: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draft `n` blocks per sequence in ONE drafter forward (the training-time view of a generation round).

    Args:
        drafter: an `AdaFlashDrafterModel` (possibly wrapped by DDP/PEFT: it is only called).
        embed_tokens: the target's input embedding module.
        input_ids: `[batch, T]`; context: `[batch, T, len(target_layer_ids) * H]` target hidden states.
        anchors: `[batch, n]` anchor positions.
        revealed / reveal_len: prefix-revealed blocks (multi-step drafting): block position `k` (1..B-1) gets the
            token `revealed[..., k-1]` (`[batch, n, B-1]`) instead of the mask when `k <= reveal_len` (`[batch, n]`).
            None: every drafted position is a mask (one-step drafting).
    Returns:
        `[batch, n, B, H]` block output states; `[..., 1:, :]` feed the target's LM head.
    """
    config = getattr(drafter, "module", drafter).config  # DDP (data-parallel training) has no `config`
    block = config.block_size
    batch, n = anchors.shape
    anchor_ids = torch.gather(input_ids, 1, anchors)
    masks = torch.full((batch, n, block - 1), config.mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    if revealed is not None and reveal_len is not None:
        shown = torch.arange(1, block, device=input_ids.device) <= reveal_len[..., None].to(input_ids.device)
        masks = torch.where(shown, revealed.to(masks), masks)
    noise_ids = torch.cat([anchor_ids[..., None], masks], dim=-1).reshape(batch, n * block)
    dtype = next(drafter.parameters()).dtype
    noise = embed_tokens(noise_ids).to(dtype)
    mask = block_attention_mask(anchors.cpu(), context.shape[1], block, dtype=dtype).to(noise.device)
    positions = block_position_ids(anchors.cpu(), context.shape[1], block).to(noise.device)
    out = drafter(noise_embeds=noise, context_hidden_states=context.to(dtype), attention_mask=mask,
                  position_ids=positions)
    return out.last_hidden_state.reshape(batch, n, block, -1)


def sample_reveal(label_mask: torch.Tensor, reveal_prob: float, generator: torch.Generator | None = None
                  ) -> torch.Tensor:
    """`[b, n]` revealed prefix lengths for prefix-revealed training: with probability `reveal_prob` a block shows
    its first `r` labels (r uniform in 1..B-2, cut to the block's leading labelled positions), else none.

    label_mask: `[b, n, B-1]` from `block_labels` (a revealed token must be one serving could have accepted).
    """
    b, n, m = label_mask.shape
    if reveal_prob <= 0 or m < 2:
        return torch.zeros(b, n, dtype=torch.long)
    chosen = torch.rand(b, n, generator=generator) < reveal_prob
    length = torch.randint(1, m, (b, n), generator=generator)
    leading = label_mask.long().cumprod(dim=-1).sum(dim=-1)
    return torch.where(chosen, torch.minimum(length, (leading - 1).clamp_min(0)), torch.zeros_like(length))


def score_blocks(target, input_ids: torch.Tensor, anchors: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """The target's view of drafted blocks: ONE forward over the sequences and all their drafted blocks.

    This is the verification pass of generation, done for many anchors at once: block `j` (drafted tokens
    `y_1..y_{B-1}` after anchor `i_j`) is appended as `y_1..y_{B-2}` whose queries see the sequence up to `i_j` and
    their own block causally, at positions `i_j + 1 ...`.

    Args:
        target: the causal LM (frozen); its base model is called, the LM head is left to the caller.
        input_ids: `[batch, T]`; anchors: `[batch, n]`; drafted: `[batch, n, B-1]` drafted tokens.
    Returns:
        `[batch, n, B-1, H]` final-norm target states whose LM-head logits are `p_T(. | x[<=i], y[<k])` for drafted
        position k = 1..B-1 (position 1 comes from the sequence itself, at the anchor).
    """
    batch, T = input_ids.shape
    n, m = drafted.shape[1], drafted.shape[2]
    L = m - 1
    ids = torch.cat([input_ids, drafted[:, :, :-1].reshape(batch, n * L)], dim=1)
    q = T + n * L
    anchors_cpu = anchors.cpu()
    visible = torch.zeros(batch, q, q, dtype=torch.bool)
    visible[:, :T, :T] = torch.ones(T, T, dtype=torch.bool).tril()
    if L > 0:
        block_of = torch.arange(n * L) // L  # block index of each appended query
        pos_in = torch.arange(n * L) % L
        visible[:, T:, :T] = torch.arange(T)[None, None, :] <= anchors_cpu[:, block_of][:, :, None]
        same_block = block_of[:, None] == block_of[None, :]
        causal = pos_in[:, None] >= pos_in[None, :]
        visible[:, T:, T:] = (same_block & causal)[None]
        block_pos = (anchors_cpu[:, block_of] + 1 + pos_in[None, :])
    else:
        block_pos = torch.zeros(batch, 0, dtype=torch.long)
    positions = torch.cat([torch.arange(T)[None].expand(batch, -1), block_pos], dim=1).to(input_ids.device)
    dtype = target.dtype
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)[:, None]
    out = target.base_model(input_ids=ids, attention_mask=mask.to(input_ids.device), position_ids=positions)
    states = out.last_hidden_state
    first = torch.gather(states[:, :T], 1, anchors[:, :, None].expand(-1, -1, states.shape[-1]))
    rest = states[:, T:].reshape(batch, n, L, -1)
    return torch.cat([first[:, :, None], rest], dim=2)
