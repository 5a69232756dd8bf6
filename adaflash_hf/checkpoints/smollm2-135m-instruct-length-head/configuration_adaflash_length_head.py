# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Configuration of the AdaFlash adaptive length head (imports only transformers: copied next to checkpoints)."""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig


# config.json fields `AdaFlashLengthHead.from_pretrained` requires: the weights' shapes and meaning depend on them (a
# class default standing in for a missing one would load the weights wrongly, e.g. the drafter's hidden size).
REQUIRED_CONFIG_FIELDS = ("hidden_size", "block_size", "head_dim", "num_prob_features", "rms_norm_eps")


@strict
class AdaFlashLengthHeadConfig(PreTrainedConfig):
    r"""
    Configuration of [`AdaFlashLengthHead`], which predicts from a drafted block how much of it will be accepted.

    Args:
        hidden_size (`int`): hidden size of the drafter whose block states the head reads.
        block_size (`int`): the drafter's block size (the head scores positions 1..block_size-1).
        head_dim (`int`): width of the head's hidden layer.
        num_prob_features (`int`): per-position features taken from the drafter's token distribution
            (max probability, entropy, margin between the two best tokens); 0 disables them.
        drafter_model_type (`str`): the drafter family the head was trained for (informational).

    `save_pretrained` writes every field; `AdaFlashLengthHead.from_pretrained` refuses a `config.json` that lacks
    one of `REQUIRED_CONFIG_FIELDS` (all but `drafter_model_type` and `initializer_range`).
    """

    model_type = "adaflash_length_head"

    hidden_size: int = 576
    block_size: int = 8
    head_dim: int = 128
    num_prob_features: int = 3
    rms_norm_eps: float = 1e-5
    drafter_model_type: str = "adaflash_drafter"
    initializer_range: float = 0.02

    def validate_architecture(self):
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}.")
        if not 0 <= self.num_prob_features <= 3:
            raise ValueError(f"num_prob_features must be in [0, 3], got {self.num_prob_features}.")


__all__ = ["REQUIRED_CONFIG_FIELDS", "AdaFlashLengthHeadConfig"]
