"""Length-grouped prefill (`adaflash_hf.generation.prefill`): the split is optimal, the device decides, rows unchanged."""

import itertools
import math
import random

import pytest
import torch

from adaflash_hf.generation.batch import generate_batch
from adaflash_hf.generation.cost_model import shipped_cost_model
from adaflash_hf.generation.prefill import CPU_OVERHEAD_TOKENS, forward_overhead_tokens, prefill_groups

from .conftest import VOCAB, build_drafter, device_cost, make_tiny_target


def _cost(lengths, groups, overhead):
    return sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)


def _partitions(items):
    """Every set partition of `items` (brute force, small n)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first, *part[k]]] + part[k + 1:]
        yield [[first], *part]


def test_a_hand_split_two_short_and_two_long_prompts():
    # one forward: 32 + 4 x 100 = 432 positions; two: 2 x 32 + 2 x 10 + 2 x 100 = 284
    assert prefill_groups([100, 10, 100, 10], 32) == [[1, 3], [0, 2]]
    # a forward dearer than the padding it saves: one group
    assert prefill_groups([100, 10, 100, 10], 200) == [[1, 3, 0, 2]]
    assert prefill_groups([100, 10, 100, 10], None) == [[1, 3, 0, 2]]
    assert prefill_groups([100, 10], math.inf) == [[1, 0]]
    assert prefill_groups([], 32) == [] and prefill_groups([7], 32) == [[0]]


@pytest.mark.parametrize("seed", range(12))
def test_the_split_is_the_cheapest_of_every_partition(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 60) for _ in range(rng.randint(2, 7))]
    overhead = rng.choice([0, 5, 20, 80])
    groups = prefill_groups(lengths, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    best = min(_cost(lengths, p, overhead) for p in _partitions(list(range(len(lengths)))))
    assert _cost(lengths, groups, overhead) == best


def test_bad_lengths_are_refused():
    with pytest.raises(ValueError, match="at least one token"):
        prefill_groups([3, 0], 32)


def test_the_devices_costs_decide_the_overhead():
    # flat forwards (the H200 reference): never split
    assert forward_overhead_tokens(shipped_cost_model("h200-smollm2-135m"), "cuda") is None
    # a CPU-like model: a 1x1 forward of 50 ms, 64 rows x 8 tokens 2,097 ms -> 4 ms a position -> 12.5 positions
    cpu = device_cost({1: {1: 0.05, 8: 0.09}, 64: {1: 0.3, 8: 0.05 + 511 * 0.004}})
    assert forward_overhead_tokens(cpu, "cpu") == pytest.approx(0.05 / 0.004)
    # no cost model: a CPU splits at a default overhead, an accelerator keeps one padded forward
    assert forward_overhead_tokens(None, "cpu") == CPU_OVERHEAD_TOKENS
    assert forward_overhead_tokens(None, torch.device("cuda")) is None


def _mixed_prompts(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 60, 4, 58, 5, 62, 2, 3]
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("continuous", [False, True])
def test_grouped_prefill_rows_equal_plain_greedy(continuous):
    target = make_tiny_target(seed=3)
    drafter = build_drafter(target, block_size=4, seed=2)
    prompts = _mixed_prompts()
    out, stats = generate_batch(target, drafter, prompts, 12, eos_token_id=[], max_batch_size=8 if not continuous
                                else 5, continuous=continuous, return_stats=True)
    for prompt, row in zip(prompts, out):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
        assert row == ref
    if not continuous:  # short and long prompts went in separate forwards
        assert stats.prefill_forwards == len(prefill_groups([len(p) for p in prompts], CPU_OVERHEAD_TOKENS)) == 2


def test_flat_costs_prefill_everything_in_one_forward():
    target = make_tiny_target(seed=3)
    drafter = build_drafter(target, block_size=4, seed=2, allow_no_draft=True)  # the policy decides: a cost model
    flat = device_cost({1: {1: 0.02, 8: 0.02}, 8: {1: 0.02, 8: 0.02}}, draft=0.003)
    from adaflash_hf.generation.runtime import SpeculationRuntime

    _, stats = generate_batch(target, drafter, _mixed_prompts(), 6, eos_token_id=[], return_stats=True,
                              runtime=SpeculationRuntime(cost_model=flat))
    assert stats.prefill_forwards == 1


def test_a_plain_engine_given_the_devices_costs_prefills_as_they_say():
    from adaflash_hf.generation.runtime import SpeculationRuntime

    target = make_tiny_target(seed=3)
    flat = device_cost({1: {1: 0.02, 8: 0.02}, 8: {1: 0.02, 8: 0.02}})
    _, grouped = generate_batch(target, None, _mixed_prompts(), 4, eos_token_id=[], return_stats=True)
    _, one = generate_batch(target, None, _mixed_prompts(), 4, eos_token_id=[], return_stats=True,
                            runtime=SpeculationRuntime(cost_model=flat))
    assert grouped.prefill_forwards == 2 and one.prefill_forwards == 1
