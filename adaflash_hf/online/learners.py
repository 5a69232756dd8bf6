# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Online update rules for one adapter's parameters, and Hedge weights over an ensemble of adapters.

Written by hand rather than with `torch.optim`: torch has no optimistic optimizer, and one small class lets the
safety rollback snapshot and restore parameters and optimizer state together (`state_dict` / `load_state_dict`).

* `ogd`: `theta <- theta - lr * d_t`, with `d_t = g_t` (sgd) or Adam's `m_t / (sqrt(v_t) + eps)` (bias-corrected).
* `optimistic`: the previous direction is the hint for the next gradient:
  `theta <- theta - lr * (2 d_t - d_{t-1})` (Rakhlin & Sridharan's optimistic OGD for sgd; Optimistic Adam of
  Daskalakis et al. 2018 for adam).
"""

import math

import torch


class OnlineLearner:
    """Updates `params` in place from one gradient per step.

    Args:
        params: the adapter's trainable tensors (LoRA A/B matrices).
        rule: `"ogd"` or `"optimistic"`; optimizer: `"sgd"` or `"adam"`; lr: step size (`0` freezes the adapter).
    """

    def __init__(self, params: list[torch.Tensor], rule: str = "ogd", optimizer: str = "adam", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        if rule not in ("ogd", "optimistic") or optimizer not in ("sgd", "adam"):
            raise ValueError(f"unknown rule/optimizer {rule!r}/{optimizer!r}")
        self.params = list(params)
        self.rule, self.optimizer, self.lr, self.betas, self.eps = rule, optimizer, lr, betas, eps
        self.steps = 0
        buffers = self.buffers_of(rule, optimizer)
        self.m, self.v, self.previous = ([torch.zeros_like(p) for p in self.params] if name in buffers else None
                                         for name in ("m", "v", "previous"))

    @staticmethod
    def buffers_of(rule: str, optimizer: str) -> tuple[str, ...]:
        """Per-parameter state a rule keeps besides the parameters: Adam's moments `m`, `v`; the optimistic hint
        `previous` (the last direction)."""
        return (("m", "v") if optimizer == "adam" else ()) + (("previous",) if rule == "optimistic" else ())

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return self.buffers_of(self.rule, self.optimizer)

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor]) -> None:
        if self.lr == 0:
            return
        self.steps += 1
        if self.optimizer == "adam":
            b1, b2 = self.betas
            c1, c2 = 1 - b1**self.steps, 1 - b2**self.steps
            directions = []
            for g, m, v in zip(grads, self.m, self.v):
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                directions.append((m / c1) / ((v / c2).sqrt() + self.eps))
        else:
            directions = [g.clone() for g in grads]
        for i, (p, d) in enumerate(zip(self.params, directions)):
            if self.previous is not None:
                p.add_(2 * d - self.previous[i], alpha=-self.lr)
                self.previous[i].copy_(d)
            else:
                p.add_(d, alpha=-self.lr)

    def state_dict(self) -> dict:
        """Copies of parameters and optimizer state (what a rollback restores, and what is saved to resume)."""
        clone = lambda ts: [t.detach().clone() for t in ts] if ts is not None else None  # noqa: E731
        return {"params": clone(self.params), "m": clone(self.m), "v": clone(self.v),
                "previous": clone(self.previous), "steps": self.steps}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for name in ("params", "m", "v", "previous"):
            mine, saved = getattr(self, name), state[name]
            if mine is not None:
                for t, s in zip(mine, saved):
                    t.copy_(s)
        self.steps = state["steps"]


class Hedge:
    """Exponential weights over `n` experts from their per-round losses (Freund & Schapire)."""

    def __init__(self, n: int, eta: float = 1.0):
        self.eta = eta
        self.cumulative = [0.0] * n

    def update(self, losses: list[float]) -> None:
        self.cumulative = [c + float(x) for c, x in zip(self.cumulative, losses)]

    @property
    def weights(self) -> list[float]:
        best = min(self.cumulative)
        w = [math.exp(-self.eta * (c - best)) for c in self.cumulative]
        total = sum(w)
        return [x / total for x in w]

    @property
    def leader(self) -> int:
        return min(range(len(self.cumulative)), key=self.cumulative.__getitem__)


__all__ = ["Hedge", "OnlineLearner"]
