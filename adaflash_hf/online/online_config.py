# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`OnlineSpecConfig`: how the drafter's online LoRA adapter learns from verification feedback (OnlineSpec)."""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


ALGORITHMS = ("ogd", "optimistic", "ensemble")
UPDATE_MODES = ("round", "request", "background")
OPTIMIZERS = ("sgd", "adam")
LOSSES = ("ce", "reverse_kl")

CONFIG_NAME = "online_config.json"


@dataclass
class OnlineSpecConfig:
    r"""
    Configuration of an [`OnlineSpecAdapter`].

    Parameters:
        algorithm (`str`): `"ogd"` (online gradient descent), `"optimistic"` (optimistic online gradient: the
            previous gradient is the hint, `theta_{t+1} = theta_t - lr * (2 g_t - g_{t-1})`; with `optimizer="adam"`
            the Optimistic Adam of Daskalakis et al. 2018), or `"ensemble"` (one adapter per entry of
            `ensemble_lr_factors`, Hedge weights from their per-round losses).
        optimizer (`str`): `"sgd"` or `"adam"` preconditioning of the update (ogd, optimistic, ensemble members).
        learning_rate (`float`): step size (of the `1.0` ensemble member).
        ensemble_lr_factors (`tuple[float]`): learning-rate multipliers of the ensemble members. A `0.0` member never
            moves: it is the static drafter, so Hedge can always fall back to it.
        ensemble_base (`str`): update rule of each ensemble member, `"ogd"` or `"optimistic"`.
        hedge_eta (`float`): Hedge learning rate; member weights are `softmax(-hedge_eta * cumulative loss)`.
        ensemble_mode (`str`): `"mixture"` drafts with every member active, each LoRA delta scaled by its Hedge
            weight (one drafting forward, degrades gracefully); `"leader"` drafts with the best member only.
        loss (`str`): `"ce"`: cross-entropy of the drafted positions against the target's greedy token (what greedy
            verification checks), or `"reverse_kl"`: `KL(q_drafter || p_target)` over the draft vocabulary. Both on
            the target's RAW logits, never on processed scores.
        kl_clip (`float`): per-position clip of the loss (one hopeless position cannot dominate an update).
        loss_decay_gamma (`float` or `None`): DFlash position decay `exp(-(k-1)/gamma)` of the per-position weights.
        learn_after_rejection (`bool`): also learn from positions after the first rejected one (their target
            distribution is conditioned on a wrong prefix); by default positions up to and including the first
            rejected one are used.
        update_mode (`str`): when and from what the adapter learns (`online/feedback.py`). `"request"` (default):
            after each served request, from the whole request (every committed position is a training anchor, as in
            offline DFlash training: `anchors_per_update` blocks per update), on the serving thread between
            requests; `"background"`: the same update in a worker thread on a shadow copy of the drafter, copied into
            the live drafter one request later (`online/background.py`: off the critical path, deterministic);
            `"round"`: after every drafter round, from that round's verification (`update_every`, `replay_window`,
            `loss="reverse_kl"` apply), on the critical path.
        anchors_per_update (`int`): blocks drafted from a served request per update (sequence modes).
        learn_while_paying (`bool`): sequence modes: learning must pay for itself. Each update also measures the
            static drafter's loss on the new request (before the adapter learns from it); while the adapter's loss
            has not been lower on average over the last `gate_window` updates, it learns from every 2nd, 4th, ...
            request (at most every `gate_max_interval`-th), and from every request again as soon as it pays.
        gate_window (`int`), gate_max_interval (`int`): see `learn_while_paying`.
        fallback_window (`int`): sequence modes with `learn_while_paying`: draft with the static drafter (every LoRA
            delta off) while the adapter's loss on the last `fallback_window` served requests, each measured before
            learning from it, was higher on average than the static drafter's; learning goes on meanwhile, and the
            adapter drafts again as soon as it pays. What was learnt on one kind of traffic then costs nothing when
            another kind comes back (0: always draft with the adapter).
        update_every (`int`): update every n feedbacks (rounds, or requests in the sequence modes; the gradients of
            the feedbacks in between are averaged).
        replay_window (`int`): also replay this many most recent rounds in every update (0: the current round only).
        context_window (`int`): target-context tokens the learning forward reads before the anchor (the drafting
            forward reads the whole cached context; the learning forward is a truncated, cache-free replica).
        lora_r, lora_alpha, lora_dropout (`int`, `float`, `float`): LoRA shape (PEFT `LoraConfig`).
        target_modules (`tuple[str]`): drafter linears that get LoRA. The default excludes `k_proj`, `v_proj` and
            `fc`: the drafter's cached context keys/values are computed by those alone, so an update never makes
            the `DFlashCache` stale (it stays exact without re-projecting the context).
        grad_clip (`float`): clip of the global gradient norm of one update.
        rollback_window (`int`): rounds per acceptance window of the safety check.
        rollback_drop (`float`): roll back when a window's mean acceptance falls this fraction below the reference
            window's (the window at the last good snapshot).
        vocab_growth (`int`): sequence modes, drafters with a draft vocabulary: append up to this many tokens the
            target commits outside the draft vocabulary to it (`online/vocab.py`; 0: never). On unseen traffic the
            missing tokens cap acceptance whatever the adapter learns.
        vocab_min_count (`int`): commits of one outside token before it is appended.
        record_stream (`bool`): keep every round's feedback (for regret in hindsight; memory grows with the stream).
        seed (`int`): initialisation seed of the LoRA matrices.
    """

    algorithm: str = "ogd"
    optimizer: str = "adam"
    learning_rate: float = 1e-3
    ensemble_lr_factors: tuple[float, ...] = (0.0, 0.3, 1.0, 3.0)
    ensemble_base: str = "ogd"
    hedge_eta: float = 1.0
    ensemble_mode: str = "mixture"
    loss: str = "ce"
    kl_clip: float = 10.0
    loss_decay_gamma: float | None = 4.0
    learn_after_rejection: bool = False
    update_mode: str = "request"
    anchors_per_update: int = 32
    learn_while_paying: bool = True
    gate_window: int = 8
    gate_max_interval: int = 16
    fallback_window: int = 4
    update_every: int = 1
    replay_window: int = 0
    context_window: int = 64
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    grad_clip: float = 1.0
    rollback_window: int = 32
    rollback_drop: float = 0.25
    record_stream: bool = False
    vocab_growth: int = 1024
    vocab_min_count: int = 2
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.ensemble_lr_factors = tuple(float(f) for f in self.ensemble_lr_factors)
        self.target_modules = tuple(self.target_modules)
        errors = []
        if self.update_mode not in UPDATE_MODES:
            errors.append(f"update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")
        if self.update_mode != "round" and self.loss != "ce":
            errors.append("loss='reverse_kl' needs the target's logits at drafted positions: update_mode='round' only")
        if self.algorithm not in ALGORITHMS:
            errors.append(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.optimizer not in OPTIMIZERS:
            errors.append(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.loss not in LOSSES:
            errors.append(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.ensemble_base not in ("ogd", "optimistic"):
            errors.append(f"ensemble_base must be 'ogd' or 'optimistic', got {self.ensemble_base!r}")
        if self.ensemble_mode not in ("mixture", "leader"):
            errors.append(f"ensemble_mode must be 'mixture' or 'leader', got {self.ensemble_mode!r}")
        if self.algorithm == "ensemble" and len(self.ensemble_lr_factors) < 2:
            errors.append("an ensemble needs at least two ensemble_lr_factors")
        if any(f < 0 for f in self.ensemble_lr_factors):
            errors.append("ensemble_lr_factors must be >= 0")
        if self.fallback_window < 0:
            errors.append(f"fallback_window must be >= 0, got {self.fallback_window}")
        if self.vocab_growth < 0:
            errors.append(f"vocab_growth must be >= 0, got {self.vocab_growth}")
        for name in ("update_every", "context_window", "lora_r", "rollback_window", "anchors_per_update",
                     "gate_window", "gate_max_interval", "vocab_min_count"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replay_window < 0 or self.learning_rate < 0 or self.hedge_eta < 0:
            errors.append("replay_window, learning_rate and hedge_eta must be >= 0")
        if not 0 < self.rollback_drop < 1:
            errors.append(f"rollback_drop must be in (0, 1), got {self.rollback_drop}")
        forbidden = {"k_proj", "v_proj", "fc"} & set(self.target_modules)
        if forbidden:
            errors.append(f"target_modules must not include {sorted(forbidden)}: they compute the cached context "
                          "keys/values, which an update would make stale")
        if errors:
            raise ValueError("Invalid OnlineSpecConfig: " + "; ".join(errors))

    @property
    def adapter_names(self) -> list[str]:
        """PEFT adapter names: one for ogd/optimistic, one per member for an ensemble."""
        if self.algorithm == "ensemble":
            return [f"online_{i}" for i in range(len(self.ensemble_lr_factors))]
        return ["online"]

    def lora_config(self):
        """The PEFT `LoraConfig` of every adapter (ensemble member)."""
        from peft import LoraConfig

        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=list(self.target_modules))

    def to_dict(self) -> dict:
        return asdict(self)

    def save_pretrained(self, folder) -> None:
        Path(folder, CONFIG_NAME).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, folder) -> "OnlineSpecConfig":
        path = Path(folder, CONFIG_NAME)
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not an OnlineSpec adapter folder.")
        try:
            data = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: corrupt OnlineSpec config, not valid JSON ({error}).") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: corrupt OnlineSpec config, not a JSON object.")
        try:
            return cls(**data)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None


__all__ = ["OnlineSpecConfig", "CONFIG_NAME"]
