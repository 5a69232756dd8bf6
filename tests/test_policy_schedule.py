"""Reproducible decoding: the `policy_schedule` knob, a frozen policy, and the runtime of a freshly loaded drafter."""

import copy

import pytest
import torch

from adaflash_hf import AdaFlashDrafterModel, AdaFlashGenerationConfig, SpeculationRuntime, generate_batch
from adaflash_hf.generation.policy import ProposalPolicy

from .conftest import build_drafter, device_cost, make_tiny_target


COST = device_cost({1: {1: 1.0, 5: 1.2}, 4: {1: 1.5, 5: 1.9}}, draft=0.3)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3, 1, 2, 3], [9, 9, 4]]


def _pair(schedule=None, seed=40):
    target = make_tiny_target(seed=seed)
    knobs = {} if schedule is None else {"policy_schedule": schedule}
    drafter = build_drafter(target, block_size=4, seed=2, hybrid_lookup=True, allow_no_draft=True, **knobs)
    SpeculationRuntime(cost_model=COST).attach(drafter)
    return target, drafter


def _decode(engine, target, drafter, do_sample):
    """`(text, per-round choices)` of one call after `torch.manual_seed(0)`."""
    torch.manual_seed(0)
    if engine == "generate":
        out = target.generate(torch.tensor([PROMPTS[0]]), assistant_model=drafter, do_sample=do_sample,
                              max_new_tokens=24, return_dict_in_generate=True)
        return out.sequences[0].tolist(), out.speculation_stats.proposers
    rows, stats = generate_batch(target, drafter, PROMPTS, 24, do_sample=do_sample, return_stats=True)
    return rows, stats.sources


@pytest.mark.parametrize("engine", ["generate", "generate_batch"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_transient_schedule_gives_the_same_text_for_the_same_seed(engine, do_sample):
    target, drafter = _pair()  # default "persistent": the second call starts where the first left off
    first, second = _decode(engine, target, drafter, do_sample), _decode(engine, target, drafter, do_sample)
    assert first[1] != second[1]
    if do_sample:
        assert first[0] != second[0]
    assert drafter.runtime.policy.round > 0

    target, drafter = _pair("transient")
    before = copy.deepcopy(drafter.runtime.policy)
    first, second = _decode(engine, target, drafter, do_sample), _decode(engine, target, drafter, do_sample)
    assert first == second  # same text, same choices every round
    assert drafter.runtime.policy == before  # the runtime's policy is left as it was


def test_transient_calls_start_from_the_runtimes_policy_as_it_is():
    """A "transient" call starts from the runtime's current state (e.g. learned in earlier persistent calls)."""
    target, drafter = _pair()
    _decode("generate", target, drafter, True)  # persistent: the policy learns
    learned = copy.deepcopy(drafter.runtime.policy)
    drafter.generation_config.policy_schedule = "transient"
    first, second = _decode("generate", target, drafter, True), _decode("generate", target, drafter, True)
    assert first == second and drafter.runtime.policy == learned
    fresh_target, fresh = _pair("transient")
    assert _decode("generate", fresh_target, fresh, True)[1] != first[1]  # a fresh state chooses otherwise


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="policy_schedule"):
        AdaFlashGenerationConfig(policy_schedule="sometimes")
    target, drafter = _pair()
    drafter.generation_config.policy_schedule = "sometimes"
    with pytest.raises(ValueError, match="policy_schedule"):
        generate_batch(target, drafter, PROMPTS, 4)


def test_frozen_freezes_the_whole_schedule():
    policy = ProposalPolicy(decay=0.5, explore_every=2, max_interval=4)
    for arm, accepted in (("drafter", 1), ("lookup", 3)):
        policy.record([0], [arm], [accepted], [4])
    policy.choose([0], [4], [4], COST)
    policy.frozen = True
    frozen = copy.deepcopy(policy)
    cases = [([0], [4], [4]), ([0], [0], [4]), ([0], [2], [1]), ([0, 1], [0, 3], [4, 4])]
    for k in range(60):  # unfrozen, explore_every=2 would retry the losing arms every few rounds
        rows, lookups, budgets = cases[k % len(cases)]
        arm = policy.choose(rows, lookups, budgets, COST)
        options = ["draft", "lookup", "plain"] if max(lookups) else ["draft", "plain"]
        assert arm == max(options, key=lambda a: policy._score(a, rows, lookups, budgets, COST, len(rows)))
        policy.record(rows, ["drafter"] * len(rows), [0] * len(rows), budgets)
    assert policy == frozen  # estimates, round counter, tried arms and retry intervals unchanged

    unfrozen = copy.deepcopy(frozen)
    unfrozen.frozen = False
    assert len({unfrozen.choose([0], [4], [4], COST) for _ in range(12)}) > 1  # explores when not frozen


def test_a_frozen_policy_decodes_reproducibly_on_both_engines():
    for engine in ("generate", "generate_batch"):
        target, drafter = _pair()
        _decode(engine, target, drafter, True)  # learn something first
        drafter.runtime.policy.frozen = True
        state = copy.deepcopy(drafter.runtime.policy)
        assert _decode(engine, target, drafter, True) == _decode(engine, target, drafter, True)
        state.start_run()  # per-run rows are cleared at the start of every call
        assert drafter.runtime.policy == state


def test_readme_policy_line_works_on_a_freshly_loaded_drafter(tmp_path):
    target = make_tiny_target(seed=41)
    AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4).save_pretrained(tmp_path)
    drafter = AdaFlashDrafterModel.from_pretrained(tmp_path).eval()
    assert drafter.runtime is None
    SpeculationRuntime.of(drafter).policy.frozen = True  # the README's line
    SpeculationRuntime.of(drafter).policy.reset()
    policy = drafter.runtime.policy
    assert policy.frozen and policy.round == 0
    SpeculationRuntime.of(drafter).cost_model = COST
    out = target.generate(torch.tensor([PROMPTS[1]]), assistant_model=drafter, max_new_tokens=8, do_sample=False)
    assert torch.equal(out, target.generate(torch.tensor([PROMPTS[1]]), max_new_tokens=8, do_sample=False))
    assert drafter.runtime.policy is policy and policy.round == 0 and not any(a.tried for a in policy.arms.values())


def test_a_later_change_of_a_policy_knob_takes_effect():
    target, drafter = _pair()
    _decode("generate_batch", target, drafter, False)
    policy = drafter.runtime.policy
    assert (policy.decay, policy.explore_every) == (0.3, 16)
    learned = copy.deepcopy(policy.accepted)
    drafter.generation_config.policy_explore_every = 3
    drafter.generation_config.policy_decay = 1.0
    runtime = drafter.runtime
    assert runtime.policy_for_call(drafter.generation_config) is policy  # the same state, new knobs
    assert (policy.decay, policy.explore_every) == (1.0, 3) and policy.accepted == learned
    policy.record([0], ["drafter"], [2], [3])
    assert policy.accepted["drafter"] == 2.0  # decay 1.0: the newest round is the whole average
    _decode("generate", target, drafter, False)
    assert drafter.runtime.policy.explore_every == 3
