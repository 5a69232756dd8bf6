# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`OPDConfig`: on-policy distillation of a drafter with reverse KL (AdaFlash, part i), TRL style."""

from dataclasses import dataclass, field, fields

from .drafter_config import DrafterTrainingConfig


@dataclass
class OPDConfig(DrafterTrainingConfig):
    r"""
    Arguments of [`OPDTrainer`], on top of [`DrafterTrainingConfig`] (names follow TRL's `GKDConfig`).

    Parameters:
        temperature (`float`): temperature at which the drafter samples its on-policy blocks; `0` drafts greedily.
        beta (`float`): divergence between drafter q and target p per drafted position, as in TRL: `1.0` is the
            reverse KL `KL(q || p)` (mode-seeking, AdaFlash's choice), `0.0` the forward KL, in between the
            generalized JSD.
        alpha (`float`): weight of an extra cross-entropy term on the target's argmax token at each position.
        kl_clip (`float` or `None`): per-token divergence is clamped at this value (no gradient above it), so a
            few hopeless positions do not dominate a step.
        lmbda (`float`): fraction of blocks whose drafted prefix is on-policy (sampled from the drafter); the
            others are teacher-forced (the prefix is the recorded target response).
        rkl_weight (`float`): weight of the divergence term (the loss is `rkl_weight * divergence + alpha * CE`).
        preset (`str`, *optional*): `"adaflash_reference"` runs OPD as the AdaFlash reference does: along the
            target's own path (anchors on the target's responses), every block drafted greedily by the current
            drafter (`temperature=0`, `lmbda=1`: the blocks verification would see), loss `0.8 * CE + 0.2 * reverse
            KL` with the per-token clip (`alpha=0.8`, `rkl_weight=0.2`, `beta=1`). Retrain the length head on the
            result (`examples/train_length_head.py`), as the reference trains it with the drafter. A preset fills
            only the fields left at their defaults: `OPDConfig(preset=..., alpha=0.5)` keeps `alpha=0.5` (a field
            set explicitly to its default value cannot be told apart and takes the preset's value).

    Out-of-range values raise `ValueError`: `temperature >= 0`, `0 <= beta <= 1`, `alpha >= 0`, `kl_clip > 0` (or
    None), `0 <= lmbda <= 1`, `rkl_weight >= 0`.
    """

    temperature: float = field(default=1.0, metadata={"help": "Drafter sampling temperature (0 = greedy)."})
    beta: float = field(default=1.0, metadata={"help": "1 = reverse KL, 0 = forward KL, else generalized JSD."})
    alpha: float = field(default=0.1, metadata={"help": "Weight of CE on the target's argmax."})
    kl_clip: float | None = field(default=10.0, metadata={"help": "Per-token divergence clip."})
    lmbda: float = field(default=1.0, metadata={"help": "Fraction of on-policy blocks."})
    num_anchors: int = field(default=12, metadata={"help": "Blocks per sequence per step (the target scores each)."})
    max_length: int = field(default=448, metadata={"help": "Truncate sequences (the target re-reads them)."})
    learning_rate: float = field(default=1e-4, metadata={"help": "Fine-tuning learning rate."})
    rkl_weight: float = field(default=1.0, metadata={"help": "Weight of the divergence term."})
    preset: str | None = field(default=None, metadata={"help": "adaflash_reference: 0.8 CE + 0.2 reverse KL on "
                                                                 "greedy blocks of the current drafter."})

    PRESETS = {"adaflash_reference": {"temperature": 0.0, "lmbda": 1.0, "alpha": 0.8, "rkl_weight": 0.2, "beta": 1.0}}

    def __post_init__(self):
        if self.preset is not None:
            if self.preset not in self.PRESETS:
                raise ValueError(f"preset must be one of {sorted(self.PRESETS)}, got {self.preset!r}")
            defaults = {f.name: f.default for f in fields(OPDConfig)}
            for key, value in self.PRESETS[self.preset].items():  # only what the user left at its default
                if getattr(self, key) == defaults[key]:
                    setattr(self, key, value)
        checks = {"temperature": self.temperature >= 0, "beta": 0 <= self.beta <= 1, "alpha": self.alpha >= 0,
                  "kl_clip": self.kl_clip is None or self.kl_clip > 0, "lmbda": 0 <= self.lmbda <= 1,
                  "rkl_weight": self.rkl_weight >= 0}
        ranges = {"temperature": ">= 0", "beta": "in [0, 1]", "alpha": ">= 0", "kl_clip": "> 0 or None",
                  "lmbda": "in [0, 1]", "rkl_weight": ">= 0"}
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} must be {ranges[name]}, got {getattr(self, name)!r}")
        super().__post_init__()
