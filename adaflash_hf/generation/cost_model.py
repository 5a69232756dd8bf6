# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The target's verification cost, and the verify length that maximises committed tokens per second.

`TargetCostModel` holds measured latencies of one target forward that verifies `n` tokens per sequence for a
batch of `b` sequences, over a cached context, interpolated linearly between measured points (and extrapolated
from the last two). `calibrate` measures it on the machine at hand in a few seconds; `save`/`load` keep it as JSON.

`best_length(survival, ...)` picks `L` in 0..len(survival) maximising
    (E[accepted drafts among the first L] + 1) / (fixed round cost + verify(L + 1 tokens)),
where `E[accepted among the first L] = sum_{k<=L} S(k)` and `S(k)` is the length head's survival.
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class TargetCostModel:
    """Latency (seconds) of a verification forward: `points[batch_size][num_tokens] = seconds`."""

    points: dict[int, dict[int, float]] = field(default_factory=dict)
    context_length: int = 256
    description: str = ""

    def seconds(self, num_tokens: int, batch_size: int = 1) -> float:
        """Interpolated latency of verifying `num_tokens` per row for `batch_size` rows."""
        if not self.points:
            raise ValueError("empty cost model: run TargetCostModel.calibrate(target) or load one.")
        sizes = sorted(self.points)
        b = min(sizes, key=lambda s: (abs(s - batch_size), s))
        per_b = self.points[b]
        scale = batch_size / b  # rough extrapolation across batch sizes not measured
        xs = sorted(per_b)
        if num_tokens <= xs[0]:
            return per_b[xs[0]] * scale
        for lo, hi in zip(xs, xs[1:]):
            if num_tokens <= hi:
                t = (num_tokens - lo) / (hi - lo)
                return (per_b[lo] + t * (per_b[hi] - per_b[lo])) * scale
        lo, hi = xs[-2], xs[-1]
        slope = (per_b[hi] - per_b[lo]) / (hi - lo)
        return (per_b[hi] + slope * (num_tokens - hi)) * scale

    @classmethod
    @torch.inference_mode()
    def calibrate(cls, target, num_tokens=(1, 2, 4, 8, 16), batch_sizes=(1,), context_length: int = 256,
                  repeats: int = 3) -> "TargetCostModel":
        """Time target forwards of `n` new tokens over a `context_length`-token cache (median of `repeats`)."""
        from transformers import DynamicCache

        vocab = target.config.get_text_config().vocab_size
        points: dict[int, dict[int, float]] = {}
        for b in batch_sizes:
            ctx = torch.randint(0, vocab, (b, context_length), device=target.device)
            cache = DynamicCache(config=target.config)
            target(input_ids=ctx, cache=cache, use_cache=True, logits_to_keep=1)
            points[b] = {}
            for n in num_tokens:
                times = []
                for _ in range(repeats + 1):
                    new = torch.randint(0, vocab, (b, n), device=target.device)
                    start = time.perf_counter()
                    target(input_ids=new, cache=cache, use_cache=True, logits_to_keep=n)
                    times.append(time.perf_counter() - start)
                    cache.crop(-n)
                points[b][n] = sorted(times[1:])[len(times[1:]) // 2]
        return cls(points=points, context_length=context_length,
                   description=f"{type(target).__name__} {target.dtype} threads={torch.get_num_threads()}")

    def save(self, path) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps({"points": self.points, "context_length": self.context_length,
                                   "description": self.description}, indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path) -> "TargetCostModel":
        data = json.loads(Path(path).read_text())
        points = {int(b): {int(n): float(s) for n, s in row.items()} for b, row in data["points"].items()}
        return cls(points=points, context_length=data.get("context_length", 256),
                   description=data.get("description", ""))


def best_length(survival: torch.Tensor, cost: TargetCostModel | None, fixed_seconds: float = 0.0,
                batch_size: int = 1) -> int:
    """Verify length `L` (0..len(survival)) maximising expected committed tokens per second (module docstring).

    Without a cost model every length costs the same, and the whole block is kept (the fixed-block behaviour).
    """
    n = int(survival.shape[-1])
    if cost is None:
        return n
    expected = torch.cat([torch.zeros(1), torch.cumsum(survival.float().cpu(), dim=0)]) + 1.0  # [n+1]
    seconds = torch.tensor([fixed_seconds + cost.seconds(L + 1, batch_size) for L in range(n + 1)])
    return int(torch.argmax(expected / seconds))


__all__ = ["TargetCostModel", "best_length"]
