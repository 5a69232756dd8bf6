# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`DrafterTrainer`: offline drafter training with the DFlash recipe, on transformers' `Trainer`.

What `Trainer` already gives us (and we therefore do not write): the optimisation loop, gradient accumulation,
mixed precision, checkpointing and `resume_from_checkpoint`, progress bars, logging, early stopping callbacks and
multi-GPU / multi-node through `accelerate launch`. What none of transformers / TRL does, and is written here:

* the collator samples anchors and builds block labels from recorded target data (`blocks.py`);
* `compute_loss` drafts every block of a batch in ONE drafter forward (block-sparse mask) and applies the
  target's frozen LM head only to the labelled rows (the full-vocabulary head dominates a CPU step);
* `prediction_step` also returns, per block, how many leading drafted tokens match the target (a teacher-forced
  acceptance proxy); `compute_metrics` turns it into `tau_proxy` = 1 + mean accepted length, the metric used for
  early stopping.

The trained model is the drafter alone: `save_pretrained` writes it with `auto_map` (the target's embedding and
LM head stay outside the checkpoint).
"""

import numpy as np
import torch
import torch.nn.functional as F
from transformers import EvalPrediction, Trainer

from ..utils.speculation import draft_positions, tau as tau_of
from .blocks import block_labels, block_soft_labels, draft_blocks, position_weights, sample_anchors, sample_reveal
from .drafter_config import DrafterTrainingConfig
from .replay import draft_every_anchor, greedy_prefix_len, pooled_tau, walk_rounds


class DrafterDataCollator:
    """Pads recorded sequences and samples anchors/labels (see `blocks.py`).

    Yields `input_ids [b, T]`, `context [b, T, L*H]` (float32), `anchors [b, n]`, `labels [b, n, B-1]`,
    `label_mask [b, n, B-1]`, `seq_lens [b]` and `anchor_valid [b, n]`; with `domains` (a list of names) also
    `domain_index [b]` (the row's `domain` in that list, -1 if absent), for per-domain evaluation; with
    `reveal_prob > 0` also `reveal_len [b, n]` (`blocks.sample_reveal`: prefix-revealed training); with
    `soft_labels` also `soft_ids` / `soft_logits [b, n, B-1, k]` (`blocks.block_soft_labels`).
    """

    def __init__(self, block_size: int, num_anchors: int, max_length: int, seed: int | None = None,
                 domains: list[str] | None = None, reveal_prob: float = 0.0, soft_labels: bool = False):
        self.block_size, self.num_anchors, self.max_length = block_size, num_anchors, max_length
        self.reveal_prob, self.soft_labels = reveal_prob, soft_labels
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.domains = list(domains) if domains else None

    def reset(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        lens = torch.tensor([min(len(f["input_ids"]), self.max_length) for f in features])
        T = int(lens.max())
        width = len(features[0]["hidden_states"][0])
        input_ids = torch.zeros(len(features), T, dtype=torch.long)
        argmax = torch.zeros(len(features), T, dtype=torch.long)
        context = torch.zeros(len(features), T, width, dtype=torch.float32)
        for row, f in enumerate(features):
            n = int(lens[row])
            input_ids[row, :n] = torch.as_tensor(f["input_ids"][:n])
            argmax[row, :n] = torch.as_tensor(f["target_argmax"][:n])
            context[row, :n] = torch.as_tensor(np.asarray(f["hidden_states"][:n], dtype=np.float32))
        starts = torch.tensor([max(int(f["prompt_len"]) - 1, 0) for f in features])
        anchors, anchor_valid = sample_anchors(lens, starts, self.num_anchors, self.block_size, self.generator)
        labels, label_mask = block_labels(input_ids, argmax, lens, anchors, anchor_valid, self.block_size)
        batch = {"input_ids": input_ids, "context": context, "anchors": anchors, "labels": labels,
                 "label_mask": label_mask, "seq_lens": lens, "anchor_valid": anchor_valid}
        if self.soft_labels:
            batch["soft_ids"], batch["soft_logits"] = self._soft_labels(features, lens, anchors)
        if self.reveal_prob > 0:  # prefix-revealed blocks: the first reveal_len labels are shown, not predicted
            batch["reveal_len"] = sample_reveal(label_mask, self.reveal_prob, self.generator)
        if self.domains is not None:
            index = {name: i for i, name in enumerate(self.domains)}
            batch["domain_index"] = torch.tensor([index.get(str(f.get("domain")), -1) for f in features])
        return batch

    def _soft_labels(self, features, lens, anchors):
        if "target_topk_ids" not in features[0]:
            raise ValueError("soft_label_weight > 0 needs a dataset recorded with the target's top-k logits "
                             "(columns target_topk_ids / target_topk_logits): re-record it with this version")
        k = len(features[0]["target_topk_ids"][0])
        ids = torch.zeros(len(features), int(lens.max()), k, dtype=torch.int32)
        logits = torch.zeros(ids.shape, dtype=torch.float32)
        for row, f in enumerate(features):
            n = int(lens[row])
            ids[row, :n] = torch.as_tensor(np.asarray(f["target_topk_ids"][:n], dtype=np.int32))
            logits[row, :n] = torch.as_tensor(np.asarray(f["target_topk_logits"][:n], dtype=np.float32))
        return block_soft_labels(ids.long(), logits, anchors, self.block_size)


def soft_label_kl(logits, vocab_ids, soft_ids, soft_logits):
    """Per row `KL(p || q)`: `p` the target's recorded top-k distribution renormalised over the tokens the drafter
    can draft, `q` the drafter's softmax. logits: `[N, V]` (V = K with a draft vocabulary `vocab_ids [K]`);
    soft_ids / soft_logits: `[N, k]`. Returns `(kl [N], usable [N] bool)` (usable: some top-k token is draftable).
    """
    positions = draft_positions(soft_ids, vocab_ids)
    present = positions >= 0
    usable = present.any(dim=-1)
    masked = soft_logits.float().masked_fill(~present, float("-inf")).masked_fill(~usable[:, None], 0.0)
    p = torch.softmax(masked, dim=-1)  # exact zeros off the draft vocabulary: xlogy keeps them out of the sum
    q_log = torch.log_softmax(logits, dim=-1).gather(-1, positions.clamp_min(0))
    kl = (torch.xlogy(p, p) - p * q_log).sum(dim=-1)
    return kl, usable


def block_cross_entropy(hidden, drafter, lm_head, labels, label_mask, weights, soft=None, soft_weight: float = 0.0):
    """Weighted CE of drafted positions against target tokens, LM head applied to labelled rows only.

    With a draft vocabulary (`drafter.draft_vocab`) the softmax runs over those K tokens only (a `[K, H]` slice of
    the LM head: much cheaper than the full vocabulary), exactly as generation drafts; labels outside it cannot be
    drafted and are left out of the loss (they still count as misses in `tau_proxy`).

    With `soft = (soft_ids, soft_logits)` (`[b, n, B-1, k]`) and `soft_weight = alpha > 0` the loss is
    `(1 - alpha) * CE + alpha * KL` (`soft_label_kl`), both weighted by position.

    hidden: `[b, n, B-1, H]`; labels / label_mask: `[b, n, B-1]`; weights: `[B-1]`.
    Returns `(loss, predicted token ids of the rows [N], row_index tuple)`.
    """
    rows = label_mask.nonzero(as_tuple=True)
    logits, vocab_ids = drafter.draft_logits(hidden[rows], lm_head)
    logits = logits.float()
    targets = labels[rows]
    w = weights.to(logits.device)[rows[2]]
    if vocab_ids is not None:
        targets = draft_positions(targets, vocab_ids)
        w = w * (targets >= 0)
        targets = targets.clamp_min(0)
    ce = F.cross_entropy(logits, targets, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp_min(1e-8)
    if soft is not None and soft_weight > 0:
        kl, usable = soft_label_kl(logits, vocab_ids, soft[0][rows], soft[1][rows])
        w_soft = weights.to(logits.device)[rows[2]] * usable
        loss = (1 - soft_weight) * loss + soft_weight * (kl * w_soft).sum() / w_soft.sum().clamp_min(1e-8)
    predicted = logits.argmax(dim=-1)
    if vocab_ids is not None:
        predicted = vocab_ids[predicted]
    return loss, predicted, rows


def accepted_lengths(predictions, labels, label_mask):
    """Per block, leading drafted positions that equal the target's token: `[b, n]` (greedy acceptance proxy)."""
    correct = (predictions == labels) & label_mask
    return correct.long().cumprod(dim=-1).sum(dim=-1)


class DrafterTrainer(Trainer):
    """Trains an `AdaFlashDrafterModel` on recorded target data (`training.data.build_training_dataset`).

    Args:
        model: the drafter to train.
        args: a `DrafterTrainingConfig`.
        target_embeddings / target_lm_head: the target's input embedding and LM head (frozen; not saved).
        train_dataset / eval_dataset: recorded datasets (columns `input_ids`, `prompt_len`, `target_argmax`,
            `hidden_states`).
        eval_domains: domain names; evaluation then also reports `tau_proxy_<domain>` for each (from the eval
            rows' `domain` column).
    """

    def __init__(self, model, args: DrafterTrainingConfig, target_embeddings, target_lm_head, train_dataset=None,
                 eval_dataset=None, callbacks=None, eval_domains: list[str] | None = None, **kwargs):
        for module in (target_embeddings, target_lm_head):
            module.requires_grad_(False)
        self.target_embeddings, self.target_lm_head = target_embeddings, target_lm_head
        self.position_weights = position_weights(model.config.block_size, args.loss_decay_gamma)
        self.eval_domains = list(eval_domains) if eval_domains else None
        collator = DrafterDataCollator(model.config.block_size, args.num_anchors, args.max_length, seed=args.seed,
                                       reveal_prob=args.reveal_prob, soft_labels=args.soft_label_weight > 0)
        self.eval_collator = DrafterDataCollator(model.config.block_size, args.num_anchors, args.max_length,
                                                 seed=args.eval_seed, domains=self.eval_domains)
        super().__init__(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         data_collator=collator, compute_metrics=self._acceptance_metrics, callbacks=callbacks,
                         **kwargs)

    def get_eval_dataloader(self, eval_dataset=None):
        # Same anchors at every evaluation, so eval metrics are comparable across steps.
        self.eval_collator.reset(self.args.eval_seed)
        train_collator, self.data_collator = self.data_collator, self.eval_collator
        try:
            return super().get_eval_dataloader(eval_dataset)
        finally:
            self.data_collator = train_collator

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                         metric_key_prefix)
        if self.args.replay_eval and getattr(dataloader, "dataset", None) is not None:
            replayed = self.replay_metrics(dataloader.dataset)
            output.metrics.update({f"{metric_key_prefix}_{k}": v for k, v in replayed.items()})
        return output

    @torch.no_grad()
    def replay_metrics(self, dataset) -> dict[str, float]:
        """`replay_tau` (and `replay_tau_<domain>`): the tau drafter-only greedy serving gets on the recorded
        responses, walked round by round from one teacher-forced pass each (`training/replay.py`), on the part of
        each response that follows the target's greedy path."""
        drafter = self.accelerator.unwrap_model(self.model)
        device = next(drafter.parameters()).device
        embed, head = self.target_embeddings.to(device), self.target_lm_head.to(device)
        was_training = drafter.training
        drafter.eval()
        by_domain: dict[str, list] = {}
        for row in dataset:
            ids = torch.as_tensor(np.asarray(row["input_ids"]), dtype=torch.long)
            start = int(row["prompt_len"])
            end = greedy_prefix_len(ids, np.asarray(row["target_argmax"]), start)
            if end - start < 2:
                continue
            context = torch.as_tensor(np.asarray(row["hidden_states"][:end], dtype=np.float32))
            drafts = draft_every_anchor(drafter, embed, head, ids[:end], context, start)
            by_domain.setdefault(str(row.get("domain", "all")), []).append(walk_rounds(drafts, ids[:end], start))
        drafter.train(was_training)
        metrics = {"replay_tau": pooled_tau([r for rs in by_domain.values() for r in rs])}
        if self.eval_domains:
            metrics.update({f"replay_tau_{d}": pooled_tau(rs) for d, rs in by_domain.items()})
        return metrics

    def _block_hidden(self, model, inputs):
        device = self.args.device
        self.target_embeddings.to(device)
        self.target_lm_head.to(device)
        states = draft_blocks(model, self.target_embeddings, inputs["input_ids"], inputs["context"],
                              inputs["anchors"], revealed=inputs["labels"], reveal_len=inputs.get("reveal_len"))
        return states[:, :, 1:]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        hidden = self._block_hidden(model, inputs)
        drafter = self.accelerator.unwrap_model(model)
        label_mask = inputs["label_mask"]
        if "reveal_len" in inputs:  # revealed positions are given, not predicted
            k = torch.arange(1, label_mask.shape[-1] + 1, device=label_mask.device)
            label_mask = label_mask & (k > inputs["reveal_len"][..., None])
        soft = (inputs["soft_ids"], inputs["soft_logits"]) if "soft_ids" in inputs else None
        loss, predicted, rows = block_cross_entropy(hidden, drafter, self.target_lm_head, inputs["labels"],
                                                    label_mask, self.position_weights, soft,
                                                    self.args.soft_label_weight)
        return (loss, (predicted, rows)) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, (predicted, rows) = self.compute_loss(model, inputs, return_outputs=True)
        if prediction_loss_only:
            return loss.detach(), None, None
        predictions = torch.full_like(inputs["labels"], -1)
        predictions[rows] = predicted
        accepted = accepted_lengths(predictions, inputs["labels"], inputs["label_mask"]).flatten()
        usable = inputs["label_mask"][..., 0].flatten()  # blocks whose first position is labelled
        if "domain_index" in inputs:  # the "labels" of each block: its row's domain
            tags = inputs["domain_index"][:, None].expand_as(inputs["label_mask"][..., 0]).flatten()
        else:
            tags = torch.zeros_like(accepted)
        return loss.detach(), accepted[usable].float(), tags[usable].float()

    def _acceptance_metrics(self, prediction: EvalPrediction) -> dict[str, float]:
        accepted = np.asarray(prediction.predictions, dtype=np.float64).reshape(-1)
        tags = np.asarray(prediction.label_ids, dtype=np.float64).reshape(-1)
        keep = accepted >= 0  # padding of uneven batches is -100
        accepted, tags = accepted[keep], tags[keep]
        metrics = {"tau_proxy": tau_of(accepted.tolist())}
        for i, name in enumerate(self.eval_domains or []):
            mine = accepted[tags == i]
            if mine.size:
                metrics[f"tau_proxy_{name}"] = tau_of(mine.tolist())
        return metrics


__all__ = ["DrafterDataCollator", "DrafterTrainer", "accepted_lengths", "block_cross_entropy", "soft_label_kl"]
