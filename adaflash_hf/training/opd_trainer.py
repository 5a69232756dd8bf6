# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`OPDTrainer`: on-policy distillation of a block drafter with reverse KL (AdaFlash, part i).

One step, for a batch of recorded sequences (prompt + target response, with the target's hidden states):

1. anchors are sampled and the drafter drafts a block at each, all in one forward (`blocks.draft_blocks`);
2. on-policy prefixes: each block's tokens are sampled from the drafter's own distribution (`temperature`, or
   greedy); a `1 - lmbda` share of blocks keeps the recorded response instead (teacher-forced);
3. the target scores every drafted block in one forward, the same pass as verification
   (`blocks.score_blocks`), giving `p_T(. | context, drafted prefix)` at every block position;
4. loss per position = divergence(q_drafter || p_target) computed exactly over the drafter's serving support (its
   draft vocabulary when it has one, the target's distribution renormalised there: `serving_head`), chunked, by TRL's
   `ChunkedDivergenceFunction` (`beta=1`: reverse KL, as `GKDTrainer`'s `beta`), clamped per token at `kl_clip`,
   weighted by the DFlash position decay and by `rkl_weight`, plus `alpha` x cross-entropy on the target's argmax
   token (`OPDConfig(preset="adaflash_reference")`: 0.8 CE + 0.2 reverse KL on greedy blocks, as the AdaFlash
   reference runs it).

Built on `DrafterTrainer` (so transformers' `Trainer` provides the loop, accumulation, checkpoints, `accelerate
launch`). Overridden, and why: `compute_loss` (TRL's distillation trainers distil a causal student on whole
completions generated with `generate`; a block drafter drafts many parallel blocks per sequence and its teacher
must score each block under its own prefix, which needs the block-sparse target pass above). Evaluation is the
parent's: `tau_proxy`, optionally per domain (`evaluate_per_domain`).
"""

import torch
import torch.nn.functional as F
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

from ..utils.speculation import draft_positions
from .blocks import draft_blocks, score_blocks
from .drafter_trainer import DrafterTrainer
from .opd_config import OPDConfig


def reverse_kl_per_token(student_hidden, teacher_hidden, lm_head_weight, beta: float = 1.0, temperature: float = 1.0):
    """Per-row divergence between `softmax(student_hidden @ W.T)` and `softmax(teacher_hidden @ W.T)`.

    `[N, H]` x2 -> `[N]`, chunked over the vocabulary by TRL's kernel (never materialises `[N, V]` twice).
    `beta=1` gives `KL(q_student || p_teacher)`.
    """
    divergence, _ = ChunkedDivergenceFunction.apply(
        student_hidden, lm_head_weight, None, teacher_hidden.detach(), lm_head_weight, None, beta, temperature,
        1.0, None, 1.0, None,
    )
    return divergence


def serving_head(drafter, lm_head_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(weight [K, H], vocab_ids [K] or None)`: the rows of the target's LM head the drafter drafts with.

    A drafter with a draft vocabulary (`drafter.draft_vocab`, K ids) serves `softmax` over those K tokens only
    (`draft_logits`), so OPD samples its blocks and computes its divergence over that support. The target's
    distribution is taken on the same support, renormalised: `p_K = p / p(K)`. For the reverse KL this loses
    nothing: with `q` zero outside K, `KL(q || p) = KL(q || p_K) - log p(K)`, and `p(K)` does not depend on the
    drafter, so both have the same gradient; the target mass outside K is a constant the drafter cannot change.
    Without a draft vocabulary this is the full head.
    """
    vocab_ids = getattr(drafter, "draft_vocab", None)
    if vocab_ids is None:
        return lm_head_weight, None
    vocab_ids = vocab_ids.to(lm_head_weight.device)
    return lm_head_weight[vocab_ids], vocab_ids


class OPDTrainer(DrafterTrainer):
    """On-policy distillation trainer. Args as `DrafterTrainer`, plus the frozen `target` model itself."""

    def __init__(self, model, args: OPDConfig, target, train_dataset=None, eval_dataset=None, callbacks=None,
                 **kwargs):
        target.requires_grad_(False)
        target.eval()
        self.target = target
        super().__init__(model, args, target.get_input_embeddings(), target.get_output_embeddings(),
                         train_dataset=train_dataset, eval_dataset=eval_dataset, callbacks=callbacks, **kwargs)

    @torch.no_grad()
    def sample_blocks(self, logits: torch.Tensor) -> torch.Tensor:
        """Drafted tokens `[..., B-1]` from drafter logits `[..., B-1, V]`: sampled at `temperature`, or argmax."""
        if self.args.temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.float() / self.args.temperature, dim=-1)
        return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).reshape(probs.shape[:-1])

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        input_ids, anchors = inputs["input_ids"], inputs["anchors"]
        self.target.to(self.args.device)
        hidden = draft_blocks(model, self.target_embeddings, input_ids, inputs["context"], anchors)[:, :, 1:]
        weight, vocab_ids = serving_head(self.accelerator.unwrap_model(model), self.target_lm_head.weight)
        # On-policy blocks need no agreement with the recorded response: every position inside the sequence counts.
        k = torch.arange(1, hidden.shape[2] + 1, device=anchors.device)
        mask = inputs["anchor_valid"][:, :, None] & ((anchors[:, :, None] + k) < inputs["seq_lens"][:, None, None])

        with torch.no_grad():
            drafted = self.sample_blocks(F.linear(hidden.detach().to(weight.dtype), weight))
            if vocab_ids is not None:  # indices into the draft vocabulary -> token ids
                drafted = vocab_ids[drafted]
            if self.args.lmbda < 1.0:  # teacher-forced share: the recorded response as the prefix
                positions = (anchors[:, :, None] + k).clamp(max=input_ids.shape[1] - 1)
                recorded = torch.gather(input_ids, 1, positions.reshape(input_ids.shape[0], -1)).reshape(drafted.shape)
                off_policy = torch.rand(anchors.shape, device=anchors.device) >= self.args.lmbda
                drafted = torch.where(off_policy[..., None], recorded, drafted)
            teacher = score_blocks(self.target, input_ids, anchors, drafted)

        rows = mask.nonzero(as_tuple=True)
        h_s, h_t = hidden[rows].to(weight.dtype), teacher[rows].to(weight.dtype)
        # Both distributions on the drafter's support (see `serving_head`).
        divergence = reverse_kl_per_token(h_s, h_t, weight, beta=self.args.beta)
        if self.args.kl_clip is not None:
            divergence = divergence.clamp(max=self.args.kl_clip)
        w = self.position_weights.to(divergence.device)[rows[2]]
        loss = self.args.rkl_weight * (divergence * w).sum() / w.sum().clamp_min(1e-8)
        if self.args.alpha > 0:
            with torch.no_grad():  # the target's greedy token; one the drafter cannot draft is left out
                target_tokens = F.linear(h_t, self.target_lm_head.weight).argmax(dim=-1)
                target_tokens = draft_positions(target_tokens, vocab_ids)
            w_ce = w * (target_tokens >= 0)
            ce = F.cross_entropy(F.linear(h_s, weight).float(), target_tokens.clamp_min(0), reduction="none")
            loss = loss + self.args.alpha * (ce * w_ce).sum() / w_ce.sum().clamp_min(1e-8)
        if return_outputs:
            # Evaluation reuses the parent's teacher-forced acceptance proxy.
            _, outputs = super().compute_loss(model, inputs, return_outputs=True)
            return loss, outputs
        return loss

    def evaluate_per_domain(self, datasets_by_domain: dict) -> dict[str, float]:
        """`tau_proxy` per domain (`{domain: dataset}`), plus their mean and standard deviation."""
        metrics = {}
        for domain, dataset in datasets_by_domain.items():
            result = self.evaluate(eval_dataset=dataset, metric_key_prefix=f"eval_{domain}")
            metrics[domain] = result[f"eval_{domain}_tau_proxy"]
        values = torch.tensor(list(metrics.values()))
        metrics["mean"] = float(values.mean())
        metrics["std"] = float(values.std(unbiased=False))
        return metrics


__all__ = ["OPDTrainer", "reverse_kl_per_token", "serving_head"]
