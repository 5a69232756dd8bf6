# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""AdaFlash adaptive length head: how much of a drafted block will the target accept?

For drafted positions k = 1..B-1 the head reads the drafter's block state (and a few features of the drafter's
token distribution at that position) and predicts the conditional acceptance `P(k accepted | 1..k-1 accepted)`.
Their running product is the survival `S(k) = P(the first k drafted tokens are all accepted)`, from which the
generator picks how many tokens to verify (`generation/cost_model.py`). Trained with binary cross-entropy on
each position whose predecessors were accepted (the standard discrete-time survival loss).

Copied next to checkpoints (`auto_map`): imports only torch, transformers and its config.
"""

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.utils import ModelOutput

from .configuration_adaflash_length_head import AdaFlashLengthHeadConfig


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
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """`PreTrainedModel.from_pretrained`, safetensors only (pickle weights are refused: unpickling can run
        arbitrary code), and every floating-point weight must be finite (else a `ValueError` names file and tensor).
        """
        if kwargs.get("use_safetensors") is False:
            raise ValueError(_pickle_refusal("use_safetensors=False"))
        kwargs["use_safetensors"] = True
        subfolder = kwargs.get("subfolder") or ""
        folder = os.path.join(str(pretrained_model_name_or_path), subfolder)
        folder = folder if os.path.isdir(folder) else None
        _refuse_explicit_pickle_file(folder, kwargs.get("config"))
        try:
            loaded = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        except OSError as error:
            files = sorted(os.listdir(folder)) if folder is not None else []
            pickles = [os.path.join(folder, f) for f in files if f.endswith(_PICKLE_SUFFIXES)]
            if pickles and not any(f.endswith((".safetensors", ".safetensors.index.json")) for f in files):
                raise OSError(_pickle_refusal(", ".join(pickles))) from error
            if folder is None and "safetensors" in str(error):
                raise OSError(f"{error} Only safetensors weights are loaded: "
                              + _pickle_refusal(str(pretrained_model_name_or_path))) from error
            raise
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        where = os.path.join(folder, "model.safetensors") if folder is not None else str(pretrained_model_name_or_path)
        problems = []
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor is None or not tensor.is_floating_point() or tensor.device.type == "meta":
                continue
            finite = torch.isfinite(tensor.detach())
            if not bool(finite.all()):
                problems.append(f"{where}: tensor {name!r} has non-finite values ({int((~finite).sum())} of "
                                f"{tensor.numel()})")
        if problems:
            raise ValueError(f"corrupt {type(model).__name__} checkpoint: " + "; ".join(problems) + ".")
        return loaded


_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def _pickle_refusal(what) -> str:
    return (
        f"refusing to load pickle-based weights ({what}): unpickling can run arbitrary code. Only safetensors "
        "checkpoints are loaded; convert them first in a trusted environment, e.g. "
        "`safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')`."
    )


def _refuse_explicit_pickle_file(folder, config) -> None:
    """A config's `transformers_weights` names the weights file and bypasses `use_safetensors`: refuse pickle."""
    name = None
    if config is not None and not isinstance(config, (str, os.PathLike)):
        name = getattr(config, "transformers_weights", None)
    if name is None and folder is not None and os.path.isfile(os.path.join(folder, "config.json")):
        try:
            with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError):
            raw = None  # transformers reports a broken config itself
        name = raw.get("transformers_weights") if isinstance(raw, dict) else None
    if name is not None and not str(name).endswith((".safetensors", ".safetensors.index.json")):
        raise OSError(_pickle_refusal(os.path.join(folder or "", str(name))))


__all__ = ["AdaFlashLengthHead", "LengthHeadOutput", "probability_features"]
