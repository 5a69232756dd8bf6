# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`OnlineStats`: what an OnlineSpec adapter saw of the stream (kept by the adapter, saved by `persistence`)."""

from dataclasses import dataclass, field


@dataclass
class OnlineStats:
    """The stream as the learner saw it: one entry per round it learned from."""

    losses: list[float] = field(default_factory=list)  # online loss l_t(theta_t), before learning from round t
    acceptance: list[float] = field(default_factory=list)  # accepted / drafted of round t
    accepted: list[int] = field(default_factory=list)
    update_seconds: float = 0.0  # all learning compute (serving thread and background worker)
    critical_seconds: float = 0.0  # the part the serving thread spent (sync updates, waiting for the worker, swaps)
    updates: int = 0
    positions: list[int] = field(default_factory=list)  # drafted positions each update learned from
    gains: list[float] = field(default_factory=list)  # static loss - adapter loss on each new request (gated modes)
    static_requests: int = 0  # served requests drafted by the static drafter (`fallback_window`)
    skipped: int = 0  # served requests not learned from (learning was not paying)
    vocab_added: int = 0  # tokens appended to the draft vocabulary (`online/vocab.py`)
    rollbacks: list[int] = field(default_factory=list)  # rounds at which a rollback happened
    weights: list[list[float]] = field(default_factory=list)  # Hedge weights after each round (ensemble)

    @property
    def rounds(self) -> int:
        return len(self.losses)

    @property
    def cumulative_loss(self) -> float:
        return float(sum(self.losses))


__all__ = ["OnlineStats"]
