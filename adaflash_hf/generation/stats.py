# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Per-call statistics of speculative decoding: `SpeculationStats` (bs=1 `generate`) and `BatchStats` (batched).

They are returned with the call (`generate(..., return_dict_in_generate=True).speculation_stats`,
`generate_batch(..., return_stats=True)`), never left on the drafter.
"""

import time
from dataclasses import dataclass, field

from ..utils.speculation import tau as tau_of
from .cost_model import synchronize


@dataclass
class SpeculationStats:
    """Statistics of one bs=1 speculative `generate` call.

    `accepted[i]` drafted tokens were accepted out of `drafted[i]` proposed in verification round `i` (prefill
    excluded); every round also commits one token of the target's (the correction or bonus token), so
    tau = mean(accepted) + 1. `proposers[i]` is `"drafter"`, `"lookup"` or `"none"`; `survival[i]` the length head's
    survival of a drafter round that used it; `draft_seconds` the time spent proposing (drafting, length choice).
    """

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposers: list[str] = field(default_factory=list)
    survival: list[list[float]] = field(default_factory=list)
    draft_seconds: float = 0.0
    online_seconds: float = 0.0

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Tokens committed per verification forward (accepted drafts + the target's own token), prefill excluded."""
        return tau_of(self.accepted)

    def acceptance_by_position(self, max_positions: int) -> list[float]:
        """P(draft position k is accepted | it was proposed), k = 1..max_positions."""
        rates = []
        for k in range(1, max_positions + 1):
            proposed = sum(1 for d in self.drafted if d >= k)
            accepted = sum(1 for a, d in zip(self.accepted, self.drafted) if d >= k and a >= k)
            rates.append(accepted / proposed if proposed else 0.0)
        return rates


@dataclass
class BatchStats:
    """Statistics of one batched run. Per-prompt lists (`verified`, `accepted`, `committed`) are in input order.

    `seconds` holds the wall time of the run (`total`) and of its OnlineSpec updates (`online`); with per-round
    profiling on (`generate(..., profile=True)`, which synchronizes the device at every phase) also its split into
    `prefill` (target prefill forwards), `draft` (drafter forwards, draft logits and the length choice), `verify`
    (target verification forwards, plain rounds included), `accept` (acceptance and bookkeeping, incl. cache
    compaction) and `lookup` (n-gram lookup of the hybrid proposals and the policy's choice).
    `sources` (per prompt, per round): what the row verified, `"drafter"`, `"lookup"` or `"none"`.
    Every round is a speculative round (`drafter_forwards`), a `lookup_rounds` or a `plain_rounds` one.
    """

    rounds: int = 0
    prefill_forwards: int = 0
    prefill_joins: int = 0  # prefills whose rows joined a running batch (continuous mode)
    drafter_forwards: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # active rows per round
    verify_widths: list[int] = field(default_factory=list)  # tokens per row per verify forward (M + 1; tree: 1 + k M)
    candidates: list[int] = field(default_factory=list)  # candidate blocks per row of each tree round (`candidates.py`)
    verified: list[list[int]] = field(default_factory=list)  # per prompt: drafted tokens verified per round
    accepted: list[list[int]] = field(default_factory=list)  # per prompt: drafted tokens accepted per round
    committed: list[list[int]] = field(default_factory=list)  # per prompt: new tokens per round (prefill first)
    sources: list[list[str]] = field(default_factory=list)  # per prompt: "drafter" / "lookup" / "none" per round
    compactions: int = 0
    plain_rounds: int = 0  # rounds without a drafter forward (the switch chose plain decoding, or no budget left)
    lookup_rounds: int = 0  # rounds without a drafter forward that verified n-gram lookup proposals (hybrid)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("prefill", "draft", "verify", "accept", "lookup", "online", "total"), 0.0))

    @classmethod
    def for_prompts(cls, n: int) -> "BatchStats":
        return cls(verified=[[] for _ in range(n)], accepted=[[] for _ in range(n)], committed=[[] for _ in range(n)],
                   sources=[[] for _ in range(n)])

    @property
    def ms_per_round(self) -> dict[str, float]:
        """Milliseconds per decoding round (prefill excluded) spent drafting, verifying, on bookkeeping, ..."""
        return {k: 1e3 * v / max(self.rounds, 1) for k, v in self.seconds.items() if k not in ("prefill", "total")}

    @property
    def tokens_verified(self) -> int:
        """Real tokens fed to verification forwards (anchor + verified drafts, summed over rows and rounds)."""
        return sum(v + 1 for row in self.verified for v in row)

    @property
    def tokens_computed(self) -> int:
        """Token slots the verification forwards computed, padding included."""
        return sum(b * w for b, w in zip(self.batch_sizes, self.verify_widths))

    @property
    def tokens_committed(self) -> int:
        return sum(sum(row) for row in self.committed)

    @property
    def tau(self) -> float:
        """Tokens per row per verification round (accepted drafts + the target's own token), prefill excluded,
        pooled over every row's rounds: `utils.speculation.tau`, as `SpeculationStats.tau` at bs=1."""
        return tau_of(a for row in self.accepted for a in row)


class PhaseTimer:
    """Opt-in per-phase timing of the batched engine's rounds into `BatchStats.seconds`.

    Disabled (the default), `lap` does nothing: the engine then synchronizes the device only where it reads a value.
    Enabled, every `lap` synchronizes the device first, so each phase is charged the device time it took, not the
    time its kernels took to launch.
    """

    def __init__(self, seconds: dict[str, float], device, enabled: bool = False):
        self.seconds, self.device, self.enabled = seconds, device, enabled
        self._last = 0.0

    def start(self) -> None:
        if self.enabled:
            synchronize(self.device)
            self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last `start` / `lap` to `phase`."""
        if self.enabled:
            synchronize(self.device)
            now = time.perf_counter()
            self.seconds[phase] += now - self._last
            self._last = now


__all__ = ["BatchStats", "PhaseTimer", "SpeculationStats"]
