# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Which proposal to verify this round: the block drafter, n-gram prompt lookup, or nothing.

Each option ("arm") is scored by its expected committed tokens per second of round time,
`(E[accepted] + 1) / E[round seconds]`, both tracked as exponential moving averages of what the arm actually
achieved on the rounds it was chosen (a round's time covers drafting, the verification forward and the loop's
bookkeeping, measured between consecutive `get_candidates` calls). Lookup is only an option when the n-gram
index found a match; "none" (verify no draft: plain decoding) is the fallback that keeps a weak drafter from
making generation slower than plain `generate`. An arm not chosen for `explore_every` rounds is tried once, so
estimates follow the traffic.

Nothing here can change the output: every proposal is verified by the target.
"""

from dataclasses import dataclass, field


ARMS = ("drafter", "lookup", "none")


@dataclass
class ArmEstimate:
    accepted: float
    seconds: float | None = None
    last_round: int = -1

    def score(self) -> float:
        if self.seconds is None:
            return float("inf")  # untried: optimistic
        return (self.accepted + 1.0) / max(self.seconds, 1e-9)


@dataclass
class ProposalPolicy:
    """EMA bandit over proposal arms (see the module docstring).

    Args:
        decay: weight of the newest observation in the moving averages.
        explore_every: try an arm again after this many rounds without it.
        arms: estimates per arm (kept across `generate` calls when the policy is stored on the drafter).
    """

    decay: float = 0.2
    explore_every: int = 24
    round: int = 0
    arms: dict = field(default_factory=lambda: {
        "drafter": ArmEstimate(accepted=2.0),
        "lookup": ArmEstimate(accepted=2.0),
        "none": ArmEstimate(accepted=0.0),
    })

    def choose(self, lookup_available: bool, allow_none: bool = True) -> str:
        options = [a for a in ARMS if (a != "lookup" or lookup_available) and (a != "none" or allow_none)]
        if len(options) == 1:
            return options[0]
        self.round += 1
        for arm in options:  # exploration: an arm unseen for a while gets one round
            if self.round - self.arms[arm].last_round > self.explore_every:
                return arm
        return max(options, key=lambda a: self.arms[a].score())

    def record(self, arm: str, accepted: int, seconds: float) -> None:
        est = self.arms[arm]
        if est.seconds is None:
            est.accepted, est.seconds = float(accepted), seconds
        else:
            est.accepted += self.decay * (accepted - est.accepted)
            est.seconds += self.decay * (seconds - est.seconds)
        est.last_round = self.round


__all__ = ["ARMS", "ArmEstimate", "ProposalPolicy"]
