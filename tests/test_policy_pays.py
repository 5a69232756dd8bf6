"""Within a request the policy notices which proposer pays, from counts and the device's costs (no clock)."""

from adaflash_hf.generation.policy import ProposalPolicy

from .conftest import device_cost


# CPU-like: a forward over 8 tokens costs 1.6x a one-token forward; a drafting step 0.2 of it.
CPU = device_cost({1: {1: 1.0, 8: 1.6}}, draft=0.2)
FLAT = device_cost({1: {1: 1.0, 8: 1.0}}, draft=0.15)  # GPU-like: launch-bound


def _primed(accepted: float) -> ProposalPolicy:
    policy = ProposalPolicy(explore_every=1000)
    assert policy.choose([0], [0], [7], CPU) == "draft"
    policy.record([0], ["drafter"], [accepted], [7])
    assert policy.choose([0], [0], [7], CPU) == "plain"  # untried arms first
    return policy


def test_draft_rounds_whose_block_was_cut_to_nothing_count_as_zero_accepted():
    policy = _primed(3)
    assert policy.choose([0], [0], [7], CPU) == "draft"  # (1 + 3) / (1.6 + 0.2) > 1 / 1.0
    arms = []
    for _ in range(12):  # the length rule keeps verifying 0 drafted tokens: the engine records nothing
        arms.append(policy.choose([0], [0], [7], CPU))
    assert "plain" in arms[:8] and arms[-4:] == ["plain"] * 4
    assert policy.accepted["drafter"] < 0.5


def test_without_a_cut_the_same_counts_keep_drafting():
    policy = _primed(3)
    for _ in range(12):
        assert policy.choose([0], [0], [7], CPU) == "draft"
        policy.record([0], ["drafter"], [3], [7])


def test_a_none_row_of_a_draft_round_is_a_drafter_miss_of_a_plain_round_nothing():
    policy = ProposalPolicy(explore_every=1000)
    assert policy.choose([0, 1], [0, 0], [7, 7], CPU) == "draft"
    policy.record([0, 1], ["drafter", "none"], [4, 0], [7, 0])
    assert policy.rows[0]["drafter"] == 4 and policy.rows[1]["drafter"] == 0
    assert policy.choose([0, 1], [0, 0], [7, 7], CPU) == "plain"
    policy.record([0, 1], ["none", "none"], [0, 0], [0, 0])  # a plain round teaches nothing
    assert policy.rows[1]["drafter"] == 0 and policy.accepted["drafter"] == 4 + 0.3 * (0 - 4)


def test_the_same_acceptance_pays_on_a_flat_device_and_not_on_this_cpu():
    """0.7 accepted drafted tokens per round: on the CPU a draft round (1.8 s for 1.7 tokens) loses to plain rounds
    (1 s per token); on a launch-bound device (1.15 s for 1.7 tokens) it wins. Lookup with 2 accepted of 7 wins on
    both."""
    for cost, expected in ((CPU, "plain"), (FLAT, "draft")):
        policy = ProposalPolicy(explore_every=1000)
        policy.choose([0], [0], [7], cost)
        policy.record([0], ["drafter"], [1], [7])
        policy.record([0], ["drafter"], [0], [7])  # EMA 1 + 0.3 * (0 - 1) = 0.7
        policy.choose([0], [0], [7], cost)
        assert policy.choose([0], [0], [7], cost) == expected
        policy.choose([0], [7], [7], cost)  # untried lookup
        policy.record([0], ["lookup"], [2], [7])
        assert policy.choose([0], [7], [7], cost) == "lookup"


def test_frozen_and_new_runs_settle_nothing():
    policy = _primed(3)
    policy.choose([0], [0], [7], CPU)
    policy.start_run()  # the last round of a run may verify nothing because no budget was left
    policy.choose([0], [0], [7], CPU)
    assert policy.accepted["drafter"] == 3
    policy.frozen = True
    for _ in range(5):
        policy.choose([0], [0], [7], CPU)
    assert policy.accepted["drafter"] == 3
