# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""AdaFlash adaptive length head: how much of a drafted block will the target accept?

For drafted positions k = 1..B-1 the head reads the drafter's block state (and a few features of the drafter's
token distribution at that position) and predicts the conditional acceptance `P(k accepted | 1..k-1 accepted)`.
Their running product is the survival `S(k) = P(the first k drafted tokens are all accepted)`, from which the
generator picks how many tokens to verify (`generation/cost_model.py`). Trained with binary cross-entropy on
each position whose predecessors were accepted (the standard discrete-time survival loss).

Copied next to checkpoints (`auto_map`): imports only torch, transformers, its config and `checkpoint_checks.py`
(the loading checks, a byte copy of the drafter's), copied with it.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.utils import ModelOutput

from .checkpoint_checks import (
    CheckpointError,
    check_tensors,
    loaded_weight_problems,
    local_folder,
    pickle_message,
    read_pretrained_folder,
    refuse_explicit_pickle_file,
    safetensors_only_error,
    weights_file,
)
from .configuration_adaflash_length_head import REQUIRED_CONFIG_FIELDS, AdaFlashLengthHeadConfig


def probability_features(logits: torch.Tensor) -> torch.Tensor:
    """`[..., V] -> [..., 3]`: max probability, margin between the two best tokens, normalised entropy."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    top2 = p.topk(2, dim=-1).values
    entropy = -(p * logp).sum(dim=-1) / torch.log(torch.tensor(float(logits.shape[-1])))
    return torch.stack([top2[..., 0], top2[..., 0] - top2[..., 1], entropy], dim=-1)


@dataclass
class LengthHeadOutput(ModelOutput):
    """loss: scalar BCE (when labels are given); logits: `[b, B-1]` conditional-acceptance logits;
    survival: `[b, B-1]` P(first k drafted tokens all accepted)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    survival: torch.Tensor | None = None


class AdaFlashLengthHead(PreTrainedModel):
    config: AdaFlashLengthHeadConfig
    config_class = AdaFlashLengthHeadConfig
    base_model_prefix = ""
    main_input_name = "block_states"

    def __init__(self, config: AdaFlashLengthHeadConfig):
        super().__init__(config)
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.proj = nn.Linear(config.hidden_size + config.num_prob_features, config.head_dim)
        self.position = nn.Embedding(config.block_size - 1, config.head_dim)
        self.out = nn.Linear(config.head_dim, 1)
        self.post_init()

    def forward(
        self,
        block_states: torch.Tensor,
        prob_features: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        label_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> LengthHeadOutput:
        r"""
        Args:
            block_states: `[batch, n, hidden]` drafter output states of drafted positions 1..n (n <= block_size-1).
            prob_features: `[batch, n, num_prob_features]` from `probability_features(draft logits)`.
            labels: `[batch, n]` 1 where the drafted token was accepted by the target (greedy: it equals the
                target's token given the accepted prefix), 0 otherwise; positions after the first rejection are
                ignored by the loss.
            label_mask: `[batch, n]` positions that exist (e.g. inside the sequence).
        """
        n = block_states.shape[1]
        x = self.norm(block_states.to(self.proj.weight.dtype))
        if self.config.num_prob_features:
            if prob_features is None:
                raise ValueError("this length head needs `prob_features` (see `probability_features`).")
            x = torch.cat([x, prob_features.to(x.dtype)], dim=-1)
        h = F.silu(self.proj(x) + self.position.weight[:n])
        logits = self.out(h).squeeze(-1)
        survival = torch.exp(torch.cumsum(F.logsigmoid(logits.float()), dim=-1))
        loss = None
        if labels is not None:
            labels = labels.float()
            reached = torch.cat([torch.ones_like(labels[:, :1]), labels[:, :-1]], dim=1).cumprod(dim=1)
            mask = reached if label_mask is None else reached * label_mask.float()
            bce = F.binary_cross_entropy_with_logits(logits.float(), labels, reduction="none")
            loss = (bce * mask).sum() / mask.sum().clamp_min(1.0)
        return LengthHeadOutput(loss=loss, logits=logits, survival=survival)

    @classmethod
    def check_pretrained(cls, folder, config=None) -> AdaFlashLengthHeadConfig:
        """Check a local checkpoint folder without loading a weight; returns its config.

        `config.json` must exist, have `model_type` "adaflash_length_head" and every field of
        `REQUIRED_CONFIG_FIELDS`; the weights must be safetensors, not truncated or corrupt, and hold exactly the
        tensors the config implies. Else one `CheckpointError` (a `ValueError`; pickle weights: also an `OSError`)
        names the file and the field or tensor (the drafter's checks, `checkpoint_checks.py`).
        """
        config, found, expected = read_pretrained_folder(cls, folder, REQUIRED_CONFIG_FIELDS, config)
        check_tensors(found, expected, os.path.join(str(folder), "config.json"))
        return config

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, safetensors only, refusing any checkpoint it would load half.

        A local folder is checked first (`check_pretrained`); pickle weights are refused (unpickling can run
        arbitrary code); after loading, every tensor must have been loaded and every floating-point weight be
        finite, else a `ValueError` names the file and tensor.
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError(pickle_message(["use_safetensors=False"]))
        kwargs["use_safetensors"] = True
        subfolder = kwargs.get("subfolder") or ""
        refuse_explicit_pickle_file(pretrained_model_name_or_path, subfolder, kwargs.get("config"))
        folder = local_folder(pretrained_model_name_or_path, subfolder)
        if folder is not None:
            cls.check_pretrained(folder, kwargs.get("config"))
        wants_info = kwargs.pop("output_loading_info", False)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *model_args, output_loading_info=True, **kwargs
            )
        except OSError as error:
            clearer = safetensors_only_error(pretrained_model_name_or_path, subfolder, error)
            if clearer is error:
                raise
            raise clearer from error
        where = lambda name: weights_file(pretrained_model_name_or_path, subfolder, name)  # noqa: E731
        problems = loaded_weight_problems(model, info, where)
        if problems:
            raise CheckpointError(f"corrupt {type(model).__name__} checkpoint: " + "; ".join(problems) + ".")
        return (model, info) if wants_info else model


__all__ = ["AdaFlashLengthHead", "LengthHeadOutput", "probability_features"]
