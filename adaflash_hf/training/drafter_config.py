# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`DrafterTrainingConfig`: the offline (DFlash-recipe) drafter training arguments, TRL style."""

from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class DrafterTrainingConfig(TrainingArguments):
    r"""
    Arguments of [`DrafterTrainer`], on top of [`~transformers.TrainingArguments`].

    Parameters:
        num_anchors (`int`): blocks drafted per sequence per step (one forward with a block-sparse mask).
        loss_decay_gamma (`float` or `None`): position weights `exp(-(k-1)/gamma)` of block position k;
            `None` weighs every position equally.
        max_length (`int`): sequences are truncated to this many tokens.
        eval_seed (`int`): seed of the anchors of the evaluation set (fixed, so eval metrics are comparable).
        reveal_prob (`float`): prefix-revealed training for multi-step drafting: this share of training blocks shows
            a random prefix of its labels (1..B-2 tokens) in place of masks and learns the rest of the block given
            it; the others are all-mask blocks. Evaluation always uses all-mask blocks.
        soft_label_weight (`float`): weight `alpha` of the soft labels: the loss is `(1 - alpha) * CE(hard labels) +
            alpha * KL(target || drafter)`, the KL taken to the target's recorded top-k next-token distribution
            (renormalised over the tokens the drafter can draft). Needs datasets recorded with top-k logits.
        replay_eval (`bool`): evaluation also reports `replay_tau` (per domain too): the tau drafter-only greedy
            serving gets on the eval responses, replayed from one teacher-forced pass (`training/replay.py`), beside
            `tau_proxy`'s uniform anchors.
    """

    num_anchors: int = field(default=32, metadata={"help": "Blocks drafted per sequence per step."})
    loss_decay_gamma: float | None = field(default=4.0, metadata={"help": "Position decay exp(-(k-1)/gamma)."})
    max_length: int = field(default=640, metadata={"help": "Truncate training sequences to this many tokens."})
    eval_seed: int = field(default=1234, metadata={"help": "Seed of evaluation anchors."})
    reveal_prob: float = field(default=0.0, metadata={"help": "Share of prefix-revealed training blocks."})
    soft_label_weight: float = field(default=0.0, metadata={"help": "Weight of the KL to the target's top-k."})
    replay_eval: bool = field(default=True, metadata={"help": "Also report replayed (served) tau at evaluation."})

    # TrainingArguments defaults that suit drafter training.
    learning_rate: float = field(default=6e-4, metadata={"help": "AdamW learning rate."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    warmup_steps: float = field(default=0.04, metadata={"help": "Warm-up (ratio of steps if < 1)."})
    per_device_train_batch_size: int = field(default=2, metadata={"help": "Sequences per device per step."})
    per_device_eval_batch_size: int = field(default=4, metadata={"help": "Sequences per device per eval step."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the data columns for the collator."})
    prediction_loss_only: bool = field(default=False, metadata={"help": "Eval also reports the acceptance proxy."})
    label_names: list[str] | None = field(default_factory=lambda: ["labels"], metadata={"help": "Label keys."})
    logging_steps: float = field(default=25, metadata={"help": "Log every N steps."})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Integrations to report to."})

    def __post_init__(self):
        if not 0.0 <= self.reveal_prob <= 1.0:
            raise ValueError(f"reveal_prob must be in [0, 1], got {self.reveal_prob}")
        if not 0.0 <= self.soft_label_weight <= 1.0:
            raise ValueError(f"soft_label_weight must be in [0, 1], got {self.soft_label_weight}")
        super().__post_init__()
