# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""What a round costs OUTSIDE the two models' forwards, measured here, so the policy decides with it.

A `TargetCostModel` prices the forwards of a round. A round also pays work no forward does: the host (Python, the
generate loop, the policy, lookup, acceptance) and tensor ops outside the forwards (argmax over the verified logits,
KV-cache selects, gathering the drafter's context), kernels on an accelerator. A speculative round does more of it
than a plain one, and at many rows the difference is not small: projected on the H200 reference at 64 rows, a
drafted round of our engine paid ~8 ms of host and ~5 ms of ops beyond its 23 ms of forwards, a plain round ~2 ms,
so rounds the policy priced at 1.1x a plain round cost 1.6x, and the hybrid engine ran at 0.76x of its own plain
rounds. `measure_round_overhead` measures those seconds per round kind and rows (`TargetCostModel.overhead`),
the way the projection splits a run (`bench/projection.py`): host seconds measured here, plus the ops outside the
forwards, counted and priced at the cost model's device (launch-bound kernels; on the device itself, their seconds
here). So the policy and the projection price a round the same way.

Measured differentially: each kind runs the same prompts (cut to `prompt_tokens`) for a short and a longer
generation, and the overhead of a round is the difference of the two runs' non-forward seconds over the difference
of their rounds (prefill, admission and setup cancel); the median of `repeats` such pairs is kept. Kinds: `"plain"` is our engine without a drafter (the plain
alternative); `"spec"` is the default hybrid engine made to draft every round it can (drafting, the length head,
lookup swaps, acceptance, cache bookkeeping). A lookup round is priced as a speculative one (an upper bound: it
skips the drafter's part). Cheap: ~1 minute for 1-64 rows on a 2-core CPU, milliseconds on an accelerator.
"""

import statistics
import time

import torch

from ..generation.batch import generate_batch, run_knobs
from ..generation.cost_model import synchronize
from ..generation.runtime import SpeculationRuntime, runtime_of
from .projection import ForwardProbe, projected_split

KINDS = ("plain", "spec")


def _non_forward_seconds(target, drafter, prompts, new_tokens: int, cost, head) -> tuple[float, int]:
    """`(host + ops seconds, rounds)` of one engine run on `cost`'s device (`drafter` None: the plain engine)."""
    knobs = run_knobs(drafter, allow_no_draft=False) if drafter is not None else None
    runtime = SpeculationRuntime(length_head=head if drafter is not None else None, cost_model=cost)
    probe = ForwardProbe(target, drafter, count_ops=True)
    try:
        synchronize(target.device)
        start = time.perf_counter()
        _, stats = generate_batch(target, drafter, prompts, new_tokens, generation_config=knobs, runtime=runtime,
                                  max_batch_size=len(prompts), return_stats=True)
        synchronize(target.device)
        probe.log.wall_seconds = time.perf_counter() - start
        split = projected_split(probe.log, cost)
    finally:
        probe.close()
    return split["host"] + split["ops"], stats.rounds


@torch.inference_mode()
def measure_round_overhead(target, drafter, prompts: list[list[int]], batch_sizes, cost, prompt_tokens: int = 32,
                           new_tokens: tuple[int, int] = (4, 16), repeats: int = 3,
                           progress: bool = True) -> dict[str, dict[int, float]]:
    """`{"plain": {rows: seconds}, "spec": {rows: seconds}}`: a round's seconds outside the forwards (module
    docstring), on `cost`'s device, for each of `batch_sizes` rows.

    Args:
        prompts: token lists (cycled to fill the rows; each cut to its first `prompt_tokens`).
        cost: the `TargetCostModel` the rounds are priced on (this device's, or a simulated one).
        new_tokens: the short and the long generation whose difference is measured.
        repeats: pairs measured per kind and rows; the median is kept (one pair at 64 rows on a 2-core CPU read 0,
            14 and 35 ms for the same drafted round: host time there includes freeing 100 MB logits).
    """
    if not prompts or not batch_sizes:
        raise ValueError("measure_round_overhead needs prompts and batch sizes")
    short, long = new_tokens
    if not 0 < short < long:
        raise ValueError(f"new_tokens must be (short, long) with 0 < short < long, got {new_tokens}")
    head = runtime_of(drafter).length_head
    table: dict[str, dict[int, float]] = {kind: {} for kind in KINDS}
    for b in sorted(set(int(b) for b in batch_sizes)):
        rows = [list(prompts[i % len(prompts)][:prompt_tokens]) for i in range(b)]
        for kind in KINDS:
            model = drafter if kind == "spec" else None
            _non_forward_seconds(target, model, rows, short, cost, head)  # warm: allocations at this shape
            estimates = []
            for _ in range(repeats):
                s0, r0 = _non_forward_seconds(target, model, rows, short, cost, head)
                s1, r1 = _non_forward_seconds(target, model, rows, long, cost, head)
                estimates.append(max(s1 - s0, 0.0) / max(r1 - r0, 1))
            table[kind][b] = statistics.median(estimates)
        if progress:
            print(f"round overhead at {b} rows: plain {1e3 * table['plain'][b]:.2f} ms, "
                  f"speculative {1e3 * table['spec'][b]:.2f} ms (host measured here + ops on {cost.device})")
    return table


__all__ = ["KINDS", "measure_round_overhead"]
