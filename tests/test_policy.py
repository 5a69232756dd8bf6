"""The one proposal policy of both engines (drafter block / prompt lookup / plain round) and the bs=1 generator on it."""

import random
import time

import torch

from adaflash_hf.generation import SpeculationRuntime
from adaflash_hf.generation.policy import ProposalPolicy

from .conftest import build_drafter, device_cost, make_oracle, make_tiny_target, speculate


# verify(n tokens, 1 row): 1.0 s for 1 token, 1.2 s for 5; a drafting step costs 0.3 s.
CHEAP_DRAFT = device_cost({1: {1: 1.0, 5: 1.2}}, draft=0.3)
DEAR_DRAFT = device_cost({1: {1: 1.0, 5: 1.2}}, draft=2.0)


def test_policy_tries_every_arm_then_picks_the_most_tokens_per_predicted_second():
    policy = ProposalPolicy(explore_every=1000)
    rows, lookups, budgets = [0], [4], [4]
    assert policy.choose(rows, lookups, budgets, CHEAP_DRAFT) == "draft"  # untried arms first, in order
    policy.record(rows, ["drafter"], [1], [4])
    assert policy.choose(rows, lookups, budgets, CHEAP_DRAFT) == "lookup"
    policy.record(rows, ["lookup"], [4], [4])
    assert policy.choose(rows, lookups, budgets, CHEAP_DRAFT) == "plain"
    # lookup: (1 + 4) / 1.2 s = 4.2 tok/s > draft: (1 + 1) / (0.3 + 1.2) s = 1.3 > plain: 1 / 1.0 s
    assert policy.choose(rows, lookups, budgets, CHEAP_DRAFT) == "lookup"
    assert policy.choose(rows, [0], budgets, CHEAP_DRAFT) == "draft"  # no lookup match: drafting still pays
    assert policy.choose(rows, [0], budgets, DEAR_DRAFT) == "plain"  # (1 + 1) / 3.2 s < 1 / 1.0 s
    assert policy.choose(rows, [0], budgets, DEAR_DRAFT, allow_no_draft=False) == "draft"
    assert policy.choose(rows, [4], [0], CHEAP_DRAFT) == "lookup"  # a row that may not draft can still look up


def test_policy_moving_averages_and_count_based_exploration():
    policy = ProposalPolicy(decay=0.5, explore_every=3)
    policy.record([0], ["drafter"], [3], [4])
    policy.record([0], ["drafter"], [1], [2])
    assert policy.accepted["drafter"] == 2.0 and policy.width == 3.0  # 3 + 0.5 * (1 - 3); 4 + 0.5 * (2 - 4)
    for arm in ("draft", "plain"):  # both tried at round 0
        policy.arms[arm].tried, policy.arms[arm].last_round = True, 0
    chosen = [policy.choose([0], [0], [4], DEAR_DRAFT) for _ in range(12)]
    # plain wins on predictions; draft is retried after 3 rounds, then after 6 (the gap doubles while it loses)
    assert chosen == ["plain"] * 3 + ["draft"] + ["plain"] * 6 + ["draft"] + ["plain"]


def test_a_probe_or_retry_that_could_not_pay_even_if_every_token_were_accepted_is_not_made():
    """64 rows on a CPU (measured): a round of 2 tokens a row costs 4.6x a plain one, so a drafted retry at the
    curve's width + 1 loses even at full acceptance; on a flat-cost device the same retry is made on schedule."""
    cpu = device_cost({64: {1: 0.317, 2: 1.472, 8: 2.016}}, draft=0.162)
    flat = device_cost({64: {1: 0.020, 2: 0.020, 8: 0.021}}, draft=0.002)
    rows, budgets = list(range(64)), [7] * 64
    chosen = {}
    for name, cost in (("cpu", cpu), ("flat", flat)):
        policy = ProposalPolicy(explore_every=4)
        policy.curves["drafter"] = [0.05]  # a drafter that misses: plain is the best prediction on both devices
        for arm in ("draft", "plain"):
            policy.arms[arm].tried, policy.arms[arm].last_round = True, 0
        chosen[name] = [policy.choose(rows, [0] * 64, budgets, cost) for _ in range(40)]
        for arm in chosen[name]:
            if arm == "draft":
                policy.record(rows, ["drafter"] * 64, [0] * 64, [policy.cut("draft")] * 64)
    assert chosen["cpu"] == ["plain"] * 40
    assert 2 <= chosen["flat"].count("draft") <= 4 and chosen["flat"][:4] == ["plain"] * 4
    # nothing tried yet: the probe (1 drafted token a row) is skipped where it cannot pay, tried first where it can
    assert ProposalPolicy().choose(rows, [0] * 64, budgets, cpu) == "plain"
    assert ProposalPolicy().choose(rows, [0] * 64, budgets, flat) == "draft"
    assert ProposalPolicy().choose([0], [0], [7], device_cost({1: {1: 0.058, 2: 0.097}}, draft=0.008)) == "draft"


def test_with_a_length_head_lookup_rows_count_by_their_hindsight_curve_at_the_rounds_width():
    """64 rows, a head that cut every drafted block to nothing, lookup never verified: the rows' continuations must
    not count at their whole length (7 tokens each) in the draft arm's score, or every round drafts for nothing."""
    cpu = device_cost({64: {1: 0.317, 2: 1.472, 8: 2.016}}, draft=0.162)
    policy = ProposalPolicy(explore_every=1000)
    for arm in ("draft", "plain"):
        policy.arms[arm].tried, policy.arms[arm].last_round = True, 0
    policy.accepted["drafter"], policy.width = 0.0, 0.0
    policy.curves["lookup"] = [0.3]  # from hindsight: a lookup round was never chosen
    rows, lookups = list(range(64)), [7] * 43 + [0] * 21
    # the draft arm: 21 + 43 x (1 + 0.3) tokens / (1.472 + 0.162) s = 46 tok/s < 64 / 0.317 s; lookup's probe: even
    # at full acceptance (64 + 43 tokens / 1.472 s) 0.36x plain, so it is not tried
    assert [policy.choose(rows, lookups, [7] * 64, cpu, draft_cut=False) for _ in range(5)] == ["plain"] * 5


def test_with_a_length_head_the_draft_arm_is_scored_at_the_widths_the_head_verified():
    """A head picks each row's length (the forward runs at their max): the curves, extrapolated to a width the head
    never verifies, must not decide. Here the rounds verified 1 drafted token and accepted 0.5 on average, while
    the curve measured so far (0.6, then 0.9 repeated) promises 3+ tokens at the whole block."""
    cost = device_cost({4: {1: 1.0, 2: 1.8, 8: 4.0}}, draft=0.1)  # 4 rows; the first drafted token is the dearest
    policy = ProposalPolicy(frozen=True)  # the best prediction, nothing recorded between the choices below
    rows, budgets = [0, 1, 2, 3], [7] * 4
    policy.curves["drafter"] = [0.6, 0.9]
    policy.accepted["drafter"], policy.width = 0.5, 1.0
    # the curves at width 7: 4 x (1 + 0.6 x (1 + 0.9 + ... + 0.9^6)) = 16.5 tokens / 4.1 s beat 4 tokens / 1.0 s
    assert policy.choose(rows, [0] * 4, budgets, cost) == "draft"
    # the head's rounds: 4 x (1 + 0.5) tokens / (1.8 + 0.1) s = 3.2 tok/s < 4 x 1 / 1.0 s
    assert policy.choose(rows, [0] * 4, budgets, cost, draft_cut=False) == "plain"
    policy.accepted["drafter"] = 1.5  # rounds that paid: 4 x 2.5 / 1.9 s = 5.3 tok/s
    assert policy.choose(rows, [0] * 4, budgets, cost, draft_cut=False) == "draft"


def test_policy_choices_are_a_function_of_counts_and_costs_only():
    def run(seed):
        rng = random.Random(seed)
        policy, chosen = ProposalPolicy(explore_every=5), []
        for i in range(200):
            lookups = [rng.choice([0, 0, 3]) for _ in range(4)]
            arm = policy.choose(list(range(4)), lookups, [5, 5, 2, 0], CHEAP_DRAFT)
            chosen.append(arm)
            sources = {"draft": "drafter", "lookup": "lookup", "plain": "none"}[arm]
            policy.record(list(range(4)), [sources] * 4, [rng.randint(0, 3) for _ in range(4)], [5, 5, 2, 0])
        return chosen

    assert run(0) == run(0) and run(0) != run(1) and len(set(run(0))) == 3


def test_reset_and_frozen():
    policy = ProposalPolicy()
    policy.record([0], ["drafter"], [3], [4])
    policy.choose([0], [0], [4], CHEAP_DRAFT)
    policy.frozen = True
    policy.record([0], ["drafter"], [0], [4])
    assert policy.accepted["drafter"] == 3.0  # frozen: the estimates do not move
    policy.reset()
    assert policy.accepted["drafter"] is None and policy.round == 0 and policy.frozen
    assert not any(a.tried for a in policy.arms.values())


def test_hybrid_uses_lookup_on_repetitive_text_and_stays_lossless():
    target = make_tiny_target(seed=8)
    prompt = torch.tensor([[7, 8, 9, 10, 11, 12] * 4])
    reference = target.generate(prompt, max_new_tokens=60, do_sample=False)
    # A drafter that is always wrong: only lookup (or no draft) can win.
    drafter = make_oracle(target, reference, block_size=5, error_rate=1.0, hybrid_lookup=True, allow_no_draft=True)
    SpeculationRuntime(cost_model=CHEAP_DRAFT).attach(drafter)
    out, stats = speculate(target, prompt, drafter, max_new_tokens=40, do_sample=False)
    assert torch.equal(out, reference[:, : prompt.shape[1] + 40])
    assert stats.proposers.count("lookup") > stats.proposers.count("drafter")


def test_weak_drafter_falls_back_to_plain_rounds_and_good_one_keeps_drafting():
    target = make_tiny_target(seed=9)
    prompt = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(9))
    reference = target.generate(prompt, max_new_tokens=80, do_sample=False)
    bad = make_oracle(target, reference, block_size=6, error_rate=1.0, allow_no_draft=True)
    good = make_oracle(target, reference, block_size=6, error_rate=0.0, allow_no_draft=True)
    proposers = {}
    for name, drafter in (("bad", bad), ("good", good)):
        SpeculationRuntime(cost_model=CHEAP_DRAFT).attach(drafter)
        out, stats = speculate(target, prompt, drafter, max_new_tokens=60, do_sample=False)
        assert torch.equal(out, reference[:, : prompt.shape[1] + 60])
        proposers[name] = stats.proposers
    assert proposers["bad"].count("none") > 3 * proposers["bad"].count("drafter")
    assert proposers["good"].count("drafter") > 3 * proposers["good"].count("none")


def test_policy_adapts_across_generate_calls_and_can_be_reset(tiny_target):
    drafter = build_drafter(tiny_target, hybrid_lookup=True, allow_no_draft=True)
    SpeculationRuntime(cost_model=CHEAP_DRAFT).attach(drafter)
    tiny_target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, assistant_model=drafter)
    policy = drafter.runtime.policy
    rounds = policy.round
    tiny_target.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=6, assistant_model=drafter)
    assert drafter.runtime.policy is policy and policy.round > rounds
    policy.reset()
    assert policy.round == 0


def test_seeded_sampling_is_reproducible_under_any_clock(tiny_target, monkeypatch):
    """Same seed + same starting policy state -> same output, whatever the wall clock says (the policy never
    reads it); the three proposal kinds all occur."""
    prompt = torch.tensor([[3, 4, 5, 3, 4, 5, 3, 4]])
    drafter = build_drafter(tiny_target, block_size=4, hybrid_lookup=True, allow_no_draft=True)
    rng = random.Random(0)
    real = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real() + rng.uniform(0, 100))  # a wildly loaded machine
    outputs, proposers = [], []
    for _ in range(3):
        SpeculationRuntime(cost_model=CHEAP_DRAFT).attach(drafter)  # the same starting state
        torch.manual_seed(1234)
        out, stats = speculate(tiny_target, prompt, drafter, max_new_tokens=30, do_sample=True)
        outputs.append(out)
        proposers.append(stats.proposers)
    assert all(torch.equal(o, outputs[0]) for o in outputs) and proposers[0] == proposers[1] == proposers[2]
    assert {"drafter", "none"} <= set(proposers[0])
