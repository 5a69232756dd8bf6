# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The drafting steps both engines share, written for `b` rows (the bs=1 generator calls them with `b = 1`).

* `noise_embeds`: the block queries `[anchor, mask x (B-1)]`, embedded with the target's embeddings (transformers'
  own `DFlashTokenCandidateGenerator._get_noise_embeds`, which bypasses an embedding norm);
* `draft_logits`: drafted logits through the target's LM head (or the drafter's draft-vocabulary slice of it);
* `finite_prefix` / `to_full_vocab`: how much of a draft is usable (a non-finite position ends it) and drafted
  values on the full vocabulary (drafted tokens themselves come from `sampler.SpeculativeSampler.draft`);
* `LengthChooser`: how many drafted tokens each row verifies, by the generation config's `length_policy`.
"""

from types import SimpleNamespace

import torch
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from .cost_model import verify_lengths


def noise_embeds(embeddings, ids: torch.Tensor) -> torch.Tensor:
    """`ids [b, B]` -> `[b, B, H]` target input embeddings without the optional embedding norm."""
    # transformers' method reads only `main_model_input_embeddings`: reuse it rather than a second copy.
    return DFlashTokenCandidateGenerator._get_noise_embeds(SimpleNamespace(main_model_input_embeddings=embeddings), ids)


def draft_logits(drafter, states: torch.Tensor, lm_head) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafted logits `[b, n, V or K]` of block states `[b, n, H]` and the draft-vocabulary ids (None: full vocab)."""
    if hasattr(drafter, "draft_logits"):
        return drafter.draft_logits(states, lm_head)
    return lm_head(states.to(lm_head.weight.dtype)), None  # e.g. a drafter loaded with trust_remote_code


def finite_prefix(logits: torch.Tensor) -> torch.Tensor:
    """`[b, n, V] -> [b]`: how many leading drafted positions have finite logits everywhere."""
    ok = torch.isfinite(logits).all(dim=-1)
    return ok.long().cumprod(dim=1).sum(dim=1)


def to_full_vocab(values: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int, fill: float) -> torch.Tensor:
    """Scatter `[..., K]` draft-vocabulary values into `[..., V]` (other tokens get `fill`); identity without ids."""
    if vocab_ids is None:
        return values
    full = values.new_full((*values.shape[:-1], vocab_size), fill)
    return full.scatter_(-1, vocab_ids.to(values.device).expand(*values.shape[:-1], -1), values)


class LengthChooser:
    """Verify lengths per row, by `generation_config.length_policy` (see `AdaFlashGenerationConfig`).

    Args:
        policy: `"auto"`, `"full"`, `"head"`, `"confidence"` or `"heuristic"`.
        length_head: the runtime's length head (`"auto"` uses it when present; `"head"` requires it).
        cost: the device's `TargetCostModel` (the head's lengths maximise committed tokens per second with it).
        block_size: the drafter's block size; threshold: the `"confidence"` rule's threshold.
    """

    def __init__(self, policy: str, length_head=None, cost=None, block_size: int = 8, threshold: float = 0.4):
        # "auto" without a head verifies the width the proposal policy scores best (`ProposalPolicy.cut`)
        self.cut_by_policy = policy == "auto" and length_head is None
        if policy == "auto":
            policy = "head" if length_head is not None else "full"
        if policy == "head" and length_head is None:
            raise ValueError("length_policy='head' needs a length head: SpeculationRuntime(length_head=...).attach("
                             "drafter)")
        self.policy, self.head, self.cost, self.threshold = policy, length_head, cost, threshold
        self.heuristic = block_size - 1  # transformers' heuristic schedule starts at (and is capped by) the block
        self.block_size = block_size

    @property
    def uses_head(self) -> bool:
        return self.policy == "head"

    def __call__(self, states: torch.Tensor, logits: torch.Tensor, budgets: torch.Tensor,
                 fixed_seconds: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`states [b, n, H]`, `logits [b, n, K]`, `budgets [b]` -> `(lengths [b], survival [b, n] or None)`."""
        if self.policy == "full":
            return budgets, None
        if self.policy == "confidence":  # cut after the first token below the threshold (still verified)
            top = torch.softmax(torch.nan_to_num(logits.float()), dim=-1).amax(dim=-1)  # [b, n]
            low = top < self.threshold
            first = torch.where(low.any(dim=1), low.float().argmax(dim=1) + 1, torch.full_like(budgets, logits.shape[1]))
            return torch.minimum(budgets, first.to(budgets.device)), None
        if self.policy == "heuristic":
            return budgets.clamp(max=max(1, self.heuristic)), None
        from ..models.length_head import probability_features

        head = self.head
        param = next(head.parameters())
        features = probability_features(logits) if head.config.num_prob_features else None
        survival = head(block_states=states.to(device=param.device, dtype=param.dtype),
                        prob_features=None if features is None else features.to(param.device)).survival
        return verify_lengths(survival, budgets, self.cost, fixed_seconds), survival

    def update(self, verified: list[int], accepted: list[int]) -> None:
        """transformers' heuristic: +2 after a round whose drafts were all accepted (every row), -1 otherwise."""
        if self.policy != "heuristic" or not any(verified):
            return
        full = all(a == v for a, v in zip(accepted, verified) if v)
        self.heuristic = min(self.block_size - 1, self.heuristic + 2) if full else max(1, self.heuristic - 1)


__all__ = ["LengthChooser", "draft_logits", "finite_prefix", "noise_embeds", "to_full_vocab"]
