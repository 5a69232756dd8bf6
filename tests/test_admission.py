"""Serving simulation out of the batched engine: request admission through a driver (`Admission`), token timing in
the bench's `ArrivalSchedule`, and per-phase profiling only on request (`profile=True`)."""

import pytest

from adaflash_hf.bench.serving import ArrivalSchedule
from adaflash_hf.generation import SpeculationRuntime, stats as stats_module
from adaflash_hf.generation.batch import generate_batch

from .conftest import build_drafter, make_tiny_target
from .test_batch import COST, _prompts, _reference


class Staged:
    """Prompt `i` may join once `i * every` tokens have been committed in all (a deterministic request stream)."""

    def __init__(self, every: int):
        self.every, self.total, self.calls, self.counts = every, 0, [], {}

    def ready(self, i, idle):
        self.calls.append((i, idle))
        return self.total >= i * self.every or idle

    def committed(self, i, count):
        self.total += count
        self.counts[i] = self.counts.get(i, 0) + count


def test_admission_driver_decides_when_prompts_join():
    target = make_tiny_target(seed=50)
    drafter = build_drafter(target, block_size=4, seed=50)
    prompts = _prompts(5, seed=50)
    staged = Staged(every=6)
    out, stats = generate_batch(target, drafter, prompts, 12, max_batch_size=3, continuous=True, admission=staged,
                                return_stats=True)
    assert out == [_reference(target, p, 12) for p in prompts]
    assert staged.counts == {i: len(o) for i, o in enumerate(out)}  # every committed token was reported
    assert stats.prefill_forwards > 2 and stats.prefill_joins > 0  # prompts joined one by one, mid-run
    assert any(not idle for _, idle in staged.calls)


def test_profiling_is_opt_in(monkeypatch):
    """Without `profile` the engine never synchronizes the device for timing; with it every phase is timed."""
    syncs = []
    monkeypatch.setattr(stats_module, "synchronize", lambda device: syncs.append(device))
    target = make_tiny_target(seed=51)
    drafter = build_drafter(target, block_size=4, seed=51)
    SpeculationRuntime(cost_model=COST).attach(drafter)
    prompts = _prompts(3, seed=51)
    out, stats = generate_batch(target, drafter, prompts, 8, return_stats=True)
    assert syncs == [] and stats.seconds["total"] > 0
    assert all(stats.seconds[k] == 0 for k in ("prefill", "draft", "verify", "accept", "lookup"))
    profiled, stats = generate_batch(target, drafter, prompts, 8, return_stats=True, profile=True)
    assert profiled == out and len(syncs) >= 5 * stats.rounds
    assert all(stats.seconds[k] > 0 for k in ("prefill", "draft", "verify", "accept"))


def test_arrival_schedule_admits_requests_when_they_arrive():
    target = make_tiny_target(seed=52)
    drafter = build_drafter(target, block_size=4, seed=52)
    prompts = _prompts(3, seed=52)
    schedule = ArrivalSchedule([0.0, 0.0, 0.2])
    out = generate_batch(target, drafter, prompts, 6, max_batch_size=2, continuous=True, admission=schedule)
    assert out == [_reference(target, p, 6) for p in prompts]
    assert [len(t) for t in schedule.token_times] == [len(o) for o in out]
    assert schedule.token_times[2][0] >= 0.2 > schedule.token_times[0][0]
    assert all(a <= b for times in schedule.token_times for a, b in zip(times, times[1:]))
    with pytest.raises(ValueError, match="nondecreasing"):
        ArrivalSchedule([0.5, 0.1])
