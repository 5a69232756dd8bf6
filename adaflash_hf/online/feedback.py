# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""What the served traffic teaches the drafter, and the loss of a drafter on it.

Two kinds of feedback (the adapter's `update_mode` picks one, `OnlineSpecConfig`):

* `RoundFeedback` (`update_mode="round"`): ONE verification round of one sequence: the block as drafted, the
  context window before its anchor, and the target's raw logits at the drafted positions. Cross-entropy on the
  target's greedy tokens or reverse KL, up to and including the first rejected position. An update after every
  round (or every `update_every` rounds) - on the request's critical path.
* `SequenceFeedback` (`update_mode="request"` / `"background"`): a whole served request: its tokens and the
  target's hidden states at `target_layer_ids` of every position, which decoding computed anyway (every verify
  forward returns them for the drafter's context). The target's greedy continuation of every position is then known
  (the committed tokens), so every position is a training anchor, exactly as in offline DFlash training
  (`training/blocks.py`): `anchors_per_update` blocks drafted in one cache-free forward with the block-sparse mask,
  cross-entropy against the committed tokens with DFlash's position decay. Far more signal per update (every
  verified position, whichever proposal verified it: lookup and plain rounds teach too), and one update per request,
  between requests, or in a background worker (`online/background.py`).

Both losses are computed on the drafter module given (the live drafter, or the background worker's shadow copy)
with the target LM head's rows of the draft vocabulary (`head_rows`, built outside inference mode).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..training.blocks import block_attention_mask, block_labels, block_position_ids, position_weights, sample_anchors
from ..utils.speculation import draft_positions


@dataclass
class RoundFeedback:
    """What one verification round of one sequence teaches the drafter.

    Attributes:
        noise_embeds: `[1, B, H]` the block's query embeddings (anchor + mask tokens), as drafted.
        context: `[1, W, F]` target hidden states (at `target_layer_ids`) of the `W <= context_window` tokens
            before the anchor.
        position_ids: `[1, W + B]` positions of the context tokens, then of the block.
        target_logits: `[n, V']` the target's raw logits at drafted positions 1..n, restricted to the drafter's
            draft vocabulary (`V' = draft_vocab_size`, or the full vocabulary).
        target_tokens: `[n]` index in `V'` of the target's greedy token (-100 where it lies outside the draft vocab).
        num_accepted: drafted tokens the target accepted this round (`0 <= num_accepted <= n`).
        draft_logits: optional `[n, V']` drafted logits WITH their autograd graph, from the drafting forward itself
            (then learning needs no replay forward); used once, for the update of this round, then dropped.
    """

    noise_embeds: torch.Tensor
    context: torch.Tensor
    position_ids: torch.Tensor
    target_logits: torch.Tensor
    target_tokens: torch.Tensor
    num_accepted: int
    draft_logits: torch.Tensor | None = None

    @property
    def num_drafted(self) -> int:
        return self.target_logits.shape[0]

    @property
    def positions(self) -> int:
        """Drafted positions this feedback can teach (all of the round's)."""
        return self.num_drafted

    @classmethod
    def from_round(cls, drafter, noise_embeds, context, position_ids, raw_logits, num_accepted: int,
                   draft_logits: torch.Tensor | None = None):
        """Build from the round's data; `raw_logits` `[n, V]` are the target's logits over its full vocabulary."""
        raw_logits = raw_logits.detach().float()
        tokens = raw_logits.argmax(dim=-1)
        vocab = getattr(drafter, "draft_vocab", None)
        if vocab is not None:
            vocab = vocab.to(raw_logits.device)
            tokens, raw_logits = draft_positions(tokens, vocab, fill=-100), raw_logits[:, vocab]
        return cls(noise_embeds.detach(), context.detach(), position_ids.detach(), raw_logits, tokens,
                   int(num_accepted), draft_logits)

    def detached(self) -> "RoundFeedback":
        """A copy whose tensors are ordinary (not inference-mode) tensors, without the drafting graph."""
        return RoundFeedback(*(t.clone() for t in (self.noise_embeds, self.context, self.position_ids,
                                                   self.target_logits, self.target_tokens)), self.num_accepted)


@dataclass
class SequenceFeedback:
    """A served request as training data for the drafter (module docstring).

    Attributes:
        noise_embeds: `[1, n * B, H]` the queries of `n` blocks (anchor token + mask tokens), target embeddings.
        context: `[1, T, F]` the target's hidden states at `target_layer_ids` of positions `0..T-1`.
        attention_mask: `[1, 1, n * B, T + n * B]` the block-sparse mask (each block sees the context before its
            anchor and itself); position_ids: `[1, T + n * B]`.
        labels / label_mask: `[1, n, B - 1]` the committed token at each block position, and which positions count.
        num_accepted / num_drafted: drafted tokens accepted / proposed in the request's drafter rounds.
        committed: `[n]` the tokens the target committed in the request (what `online/vocab.py` counts), or None.
    """

    noise_embeds: torch.Tensor
    context: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    num_accepted: int
    num_drafted: int
    committed: torch.Tensor | None = None

    @property
    def positions(self) -> int:
        """Block positions this feedback teaches (every labelled position of every anchor)."""
        return int(self.label_mask.sum())

    @classmethod
    def from_sequence(cls, drafter, embeddings, input_ids: torch.Tensor, context: torch.Tensor, prompt_len: int,
                      num_accepted: int, num_drafted: int, num_anchors: int,
                      generator: torch.Generator | None = None) -> "SequenceFeedback | None":
        """Blocks at up to `num_anchors` positions of a served sequence (None when it has no anchor).

        Args:
            input_ids: `[T']` the request's prompt + committed tokens; context: `[T, F]` (`T <= T'`) the target's
                hidden states of its first `T` positions. An anchor `p` needs the context of `p - 1` and at least one
                committed token after it: `prompt_len - 1 <= p <= min(T, T' - 2)`.
        """
        config = drafter.config
        block = int(config.block_size)
        length, ctx_len = int(input_ids.shape[-1]), int(context.shape[0])
        seq_lens = torch.tensor([min(length, ctx_len + 2)])
        anchors, valid = sample_anchors(seq_lens, torch.tensor([max(prompt_len - 1, 0)]), num_anchors, block,
                                        generator)
        if not valid.any():
            return None
        ids = input_ids.reshape(1, -1).cpu()
        # Committed tokens are the target's own choices: the label after position j is the token at j + 1.
        argmax = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        labels, mask = block_labels(ids, argmax, torch.tensor([length]), anchors, valid, block)
        param = next(drafter.parameters())
        anchor_ids = ids.gather(1, anchors)
        masks = torch.full((1, anchors.shape[1], block - 1), int(config.mask_token_id), dtype=torch.long)
        noise_ids = torch.cat([anchor_ids[..., None], masks], dim=-1).reshape(1, -1).to(embeddings.weight.device)
        with torch.no_grad():
            noise = embeddings(noise_ids)
        return cls(noise.detach().to(device=param.device, dtype=param.dtype).clone(),
                   context[None].detach().to(device=param.device, dtype=param.dtype).clone(),
                   block_attention_mask(anchors, ctx_len, block, dtype=param.dtype).to(param.device),
                   block_position_ids(anchors, ctx_len, block).to(param.device),
                   labels.to(param.device), mask.to(param.device), int(num_accepted), int(num_drafted),
                   ids[0, max(prompt_len, 0) :].clone())


# What a saved feedback holds (`feedback_state`): its tensors, and its integers. A round's `draft_logits` (the
# drafting forward's graph) is not state: without it the round is replayed, with the same parameters.
FEEDBACK_LAYOUT = {
    "round": (RoundFeedback, ("noise_embeds", "context", "position_ids", "target_logits", "target_tokens"),
              ("num_accepted",)),
    "sequence": (SequenceFeedback, ("noise_embeds", "context", "attention_mask", "position_ids", "labels",
                                    "label_mask"), ("num_accepted", "num_drafted")),
}
OPTIONAL_TENSORS = ("committed",)  # saved when present; a state without them loads as None


def feedback_state(feedback) -> tuple[dict, dict[str, torch.Tensor]]:
    """`(meta, tensors)` of a feedback: `meta` JSON-able (`kind` and its integers), `tensors` by field name."""
    kind = "round" if isinstance(feedback, RoundFeedback) else "sequence"
    _, tensor_fields, int_fields = FEEDBACK_LAYOUT[kind]
    optional = {f: t for f in OPTIONAL_TENSORS if (t := getattr(feedback, f, None)) is not None}
    return ({"kind": kind, **{f: int(getattr(feedback, f)) for f in int_fields}, "optional": sorted(optional)},
            {f: getattr(feedback, f).detach() for f in tensor_fields} | {f: t.detach() for f, t in optional.items()})


def feedback_tensor_names(meta: dict) -> tuple[str, ...]:
    """The tensors a saved feedback `meta` (from `feedback_state`) comes with."""
    return (*FEEDBACK_LAYOUT[meta["kind"]][1], *meta.get("optional", ()))


def feedback_from_state(meta: dict, tensors: dict[str, torch.Tensor], device=None):
    """The feedback `feedback_state` described (tensors moved to `device`)."""
    cls, tensor_fields, int_fields = FEEDBACK_LAYOUT[meta["kind"]]
    optional = {f: tensors[f].to(device) for f in OPTIONAL_TENSORS if f in tensors}
    return cls(**{f: tensors[f].to(device) for f in tensor_fields}, **{f: int(meta[f]) for f in int_fields},
               **optional)


def round_loss(module, head_rows: torch.Tensor, feedback: RoundFeedback, config,
               logits: torch.Tensor | None = None) -> torch.Tensor:
    """Loss of one round under `module`'s active adapter(s) (a scalar with gradients).

    `logits` `[n, V']`: the round's drafted logits if already computed with gradients (else a replay forward).
    """
    n = feedback.num_drafted
    if logits is None:
        states = module(noise_embeds=feedback.noise_embeds, context_hidden_states=feedback.context,
                        position_ids=feedback.position_ids).last_hidden_state[:, 1 : 1 + n]
        logits = F.linear(states.to(device=head_rows.device, dtype=head_rows.dtype), head_rows)[0]
    logits = logits.float()  # [n, V']
    if config.loss == "ce":
        per = F.cross_entropy(logits, feedback.target_tokens, ignore_index=-100, reduction="none")
    else:  # KL(q_drafter || p_target) over the draft vocabulary
        log_q = logits.log_softmax(-1)
        per = (log_q.exp() * (log_q - feedback.target_logits.log_softmax(-1))).sum(-1)
    per = per.clamp(max=config.kl_clip)
    k = torch.arange(n, device=per.device, dtype=torch.float32)
    weights = torch.ones_like(k) if config.loss_decay_gamma is None else torch.exp(-k / config.loss_decay_gamma)
    if not config.learn_after_rejection:
        weights = weights * (k <= feedback.num_accepted)  # up to and including the first rejected position
    if config.loss == "ce":
        weights = weights * (feedback.target_tokens != -100)
    return (per * weights).sum() / weights.sum().clamp_min(1e-8)


def sequence_loss(module, head_rows: torch.Tensor, feedback: SequenceFeedback, config,
                  draft_vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Position-decayed cross-entropy of every labelled block position of a served sequence (a scalar)."""
    block = feedback.labels.shape[-1] + 1
    states = module(noise_embeds=feedback.noise_embeds, context_hidden_states=feedback.context,
                    attention_mask=feedback.attention_mask, position_ids=feedback.position_ids).last_hidden_state
    states = states.reshape(1, -1, block, states.shape[-1])[:, :, 1:]  # [1, n, B-1, H]
    rows = feedback.label_mask.nonzero(as_tuple=True)
    logits = F.linear(states[rows].to(device=head_rows.device, dtype=head_rows.dtype), head_rows).float()
    targets = feedback.labels[rows]
    weights = position_weights(block, config.loss_decay_gamma).to(logits.device)[rows[2]]
    if draft_vocab is not None:  # labels outside the draft vocabulary cannot be drafted: left out
        targets = draft_positions(targets, draft_vocab)
        weights = weights * (targets >= 0)
        targets = targets.clamp(min=0)
    per = F.cross_entropy(logits, targets, reduction="none").clamp(max=config.kl_clip)
    return (per * weights).sum() / weights.sum().clamp_min(1e-8)


__all__ = ["FEEDBACK_LAYOUT", "RoundFeedback", "SequenceFeedback", "feedback_from_state", "feedback_state",
           "round_loss", "sequence_loss"]
