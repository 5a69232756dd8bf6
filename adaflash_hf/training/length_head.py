# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Training data and training for the adaptive length head (AdaFlash, part ii).

`collect_length_data` runs the drafter on recorded target sequences (many anchors per sequence, one drafter
forward) and verifies every drafted block with the target in one forward (`blocks.score_blocks`, the same pass
as generation's verification). With a greedy target this gives the REAL acceptance of each block: drafted
position k is accepted iff it equals the target's greedy token given the context and drafted positions < k
(which, up to the first rejection, are the target's own tokens). The head is then fitted with its survival BCE
by transformers' `Trainer` (its forward returns the loss).
"""

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import Trainer

from ..models.length_head import probability_features
from .blocks import draft_blocks, score_blocks
from .drafter_trainer import DrafterDataCollator


class LengthDataset(torch.utils.data.Dataset):
    """Blocks with their acceptance outcomes: tensors `[N, B-1, ...]` served as dicts for `Trainer`."""

    def __init__(self, block_states, prob_features, labels, label_mask):
        self.block_states, self.prob_features = block_states, prob_features
        self.labels, self.label_mask = labels, label_mask

    def __len__(self):
        return self.labels.shape[0]

    def __getitem__(self, i):
        return {"block_states": self.block_states[i], "prob_features": self.prob_features[i],
                "labels": self.labels[i], "label_mask": self.label_mask[i]}

    def split(self, fraction: float, seed: int = 0):
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        cut = int(len(self) * (1 - fraction))
        pick = lambda idx: LengthDataset(self.block_states[idx], self.prob_features[idx], self.labels[idx],  # noqa
                                         self.label_mask[idx])
        return pick(order[:cut]), pick(order[cut:])


@torch.no_grad()
def collect_length_data(drafter, target, dataset, num_anchors: int = 16, batch_size: int = 2, max_length: int = 512,
                        seed: int = 0, progress: bool = True) -> LengthDataset:
    """Draft greedily at random anchors of `dataset` (recorded sequences) and record real acceptance."""
    drafter.eval()
    block = drafter.config.block_size
    collator = DrafterDataCollator(block, num_anchors, max_length, seed=seed)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    out = {"states": [], "features": [], "labels": [], "mask": []}
    for start in tqdm(range(0, len(dataset), batch_size), desc="collecting acceptance", disable=not progress):
        batch = collator([dataset[i] for i in range(start, min(start + batch_size, len(dataset)))])
        states = draft_blocks(drafter, embed, batch["input_ids"], batch["context"], batch["anchors"])[:, :, 1:]
        logits, vocab_ids = drafter.draft_logits(states, head)
        drafted = logits.argmax(dim=-1)
        if vocab_ids is not None:
            drafted = vocab_ids[drafted]
        teacher = score_blocks(target, batch["input_ids"], batch["anchors"], drafted)
        target_tokens = F.linear(teacher.to(head.weight.dtype), head.weight).argmax(dim=-1)
        k = torch.arange(1, block)
        mask = batch["anchor_valid"][:, :, None] & ((batch["anchors"][:, :, None] + k) < batch["seq_lens"][:, None, None])
        usable = mask[..., 0]
        out["states"].append(states[usable].float())
        out["features"].append(probability_features(logits)[usable])
        out["labels"].append((drafted == target_tokens)[usable].float())
        out["mask"].append(mask[usable].float())
    cat = {key: torch.cat(values) for key, values in out.items()}
    return LengthDataset(cat["states"], cat["features"], cat["labels"], cat["mask"])


def expected_acceptance(labels: torch.Tensor) -> torch.Tensor:
    """Accepted length of each block (leading accepted positions): `[N, B-1] -> [N]`."""
    return labels.long().cumprod(dim=-1).sum(dim=-1)


class LengthHeadTrainer(Trainer):
    """`Trainer` for the length head; evaluation also reports calibration of predicted accepted length."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The head's forward takes `**kwargs` but computes a mean loss (it ignores `num_items_in_batch`): without
        # this, Trainer multiplies the loss by the number of processes under data parallelism (2x the loss and the
        # gradients with `--num_processes 2`).
        self.model_accepts_loss_kwargs = False

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            out = model(**inputs)
        predicted = out.survival.sum(dim=-1)
        actual = expected_acceptance(inputs["labels"] * inputs["label_mask"]).float()
        return out.loss.detach(), predicted, actual


def length_metrics(prediction) -> dict[str, float]:
    predicted, actual = (torch.as_tensor(x).float().flatten() for x in (prediction.predictions, prediction.label_ids))
    return {"mean_predicted_accepted": float(predicted.mean()), "mean_actual_accepted": float(actual.mean()),
            "mae_accepted": float((predicted - actual).abs().mean())}


__all__ = ["LengthDataset", "LengthHeadTrainer", "collect_length_data", "expected_acceptance", "length_metrics"]
