# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Regret of an online adapter: its cumulative online loss minus that of the best FIXED adapter in hindsight.

A "round" of the online game is one update's feedback (a drafter round, or a served request in the sequence modes).
The best fixed adapter is approximated the way one would pick it offline: a fresh LoRA adapter of the same shape is
fitted to the recorded stream (all rounds, several epochs of Adam) and the lowest total loss it reaches over the
stream is taken, compared with the zero adapter (the static drafter), which is also a fixed adapter. Because the
fit is approximate, the reported regret is an upper bound on the regret against that comparator class' optimum
only up to the fit's own optimisation gap; it is what the bench reports, with both terms.
"""

import torch

from .adapter import OnlineSpecAdapter
from .learners import OnlineLearner


HINDSIGHT = "hindsight"


def stream_loss(adapter: OnlineSpecAdapter, names: list[str], lm_head, rounds) -> float:
    """Total loss over `rounds` with adapters `names` active (at base scaling), no gradients."""
    adapter.activate(names)
    with torch.no_grad():
        return float(sum(float(adapter.round_loss(fb, lm_head)) for fb in rounds))


def hindsight_loss(adapter: OnlineSpecAdapter, lm_head, epochs: int = 8, lr: float = 3e-3,
                   batch_rounds: int = 16, seed: int = 0) -> dict:
    """Fit a fixed adapter to `adapter.stream` (needs `record_stream=True`) and return the comparator's losses.

    Returns `{"static": loss of the zero adapter, "fitted": best total loss of the fitted adapter over epochs,
    "best_fixed": min of the two, "rounds": n}`. The online adapter's own state is left untouched.
    """
    adapter.finish()  # a background update still running belongs to the online run
    rounds = adapter.stream
    if not rounds:
        raise ValueError("no recorded rounds: attach the adapter with OnlineSpecConfig(record_stream=True).")
    # The zero adapter: the online adapter's members have base-scaled deltas; a freshly injected adapter has B = 0.
    with adapter.scratch_adapter(HINDSIGHT, seed=seed) as params:
        static = stream_loss(adapter, [HINDSIGHT], lm_head, rounds)
        learner = OnlineLearner(params, "ogd", "adam", lr)
        generator = torch.Generator().manual_seed(seed)
        best = static
        for _ in range(epochs):
            order = torch.randperm(len(rounds), generator=generator).tolist()
            for start in range(0, len(order), batch_rounds):
                batch = [rounds[i] for i in order[start : start + batch_rounds]]
                adapter.activate([HINDSIGHT])
                with torch.enable_grad():
                    loss = torch.stack([adapter.round_loss(fb, lm_head) for fb in batch]).mean()
                    grads = torch.autograd.grad(loss, params, allow_unused=True)
                learner.step([torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)])
            best = min(best, stream_loss(adapter, [HINDSIGHT], lm_head, rounds))
    return {"static": static, "fitted": best, "best_fixed": min(static, best), "rounds": len(rounds)}


def regret(adapter: OnlineSpecAdapter, lm_head, **kwargs) -> dict:
    """`{"online": cumulative online loss, **hindsight_loss(...), "regret": online - best_fixed}`."""
    comparator = hindsight_loss(adapter, lm_head, **kwargs)
    online = adapter.stats.cumulative_loss
    return {"online": online, **comparator, "regret": online - comparator["best_fixed"]}


__all__ = ["hindsight_loss", "regret", "stream_loss"]
