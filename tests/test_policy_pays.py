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


def test_the_same_acceptance_pays_on_a_flat_device_whole_and_on_this_cpu_one_token_deep():
    """0.7 accepted drafted tokens per round (first position right 70% of the time, the second never): on the CPU
    the whole block (1.8 s for 1.7 tokens) loses to plain rounds (1 s per token) but one drafted token (1.29 s for
    1.7 tokens) wins; on a launch-bound device every width costs 1.15 s: the whole block. Lookup with 2 accepted of 7
    wins on both."""
    assert (1 + 0.7) / CPU.round_seconds(7, 1) < 1 / CPU.round_seconds(0, 1, drafts=False)  # whole block: loses
    for cost, width in ((CPU, 1), (FLAT, 7)):
        policy = ProposalPolicy(explore_every=1000)
        policy.choose([0], [0], [7], cost)
        policy.record([0], ["drafter"], [1], [7])
        policy.record([0], ["drafter"], [0], [7])  # EMA 1 + 0.3 * (0 - 1) = 0.7
        policy.choose([0], [0], [7], cost)
        assert policy.choose([0], [0], [7], cost) == "draft" and policy.cut("draft") == width
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


def _lookup_policy(cost, rounds=8) -> ProposalPolicy:
    """Lookup matches of 7 tokens whose first 2 are right and the rest wrong, round after round."""
    policy = ProposalPolicy(explore_every=1000)
    for _ in range(rounds):
        arm = policy.choose([0], [7], [0], cost)
        if arm == "lookup":
            width = policy.cut("lookup") or 7
            policy.record([0], ["lookup"], [min(2, width)], [width])
    return policy


def test_a_lookup_match_right_for_two_tokens_is_verified_two_deep_on_the_cpu_and_whole_on_a_flat_device():
    """CPU: the whole match, (1 + 2) / 1.6 s = 1.9 tok/s; 2 deep: (1 + 2) / 1.17 s = 2.6 tok/s; plain 1.0: the
    lookup arm wins at width 2. Before the widths, the arm was scored at its whole length only. On the flat device
    every width costs the same: the whole match is verified (the extra positions are free)."""
    cpu = _lookup_policy(CPU)
    assert cpu.curves["lookup"][:3] == [1.0, 1.0, 0.0]
    assert cpu.choose([0], [7], [0], CPU) == "lookup" and cpu.cut("lookup") == 2
    assert cpu.expected_at("lookup", 2) == 2.0 and cpu.expected_at("lookup", 7) == 2.0
    flat = _lookup_policy(FLAT)
    assert flat.choose([0], [7], [0], FLAT) == "lookup" and flat.cut("lookup") == 7


def test_a_short_block_pays_on_the_cpu_where_the_whole_block_does_not():
    """Drafted positions accepted 0.6, 0.3, 0.1, 0 of the time (each given the previous): the whole block of 7
    expects 0.6 + 0.18 + 0.018 = 0.798 tokens for 1.8 s (1.0 tok/s, no better than plain); two drafted tokens expect
    0.78 for 1.37 s (1.30 tok/s): the draft arm wins at width 2, and the engine verifies two drafted tokens."""
    policy = ProposalPolicy(frozen=True)  # predictions only: nothing recorded between the choices
    policy.curves["drafter"] = [0.6, 0.3, 0.1, 0.0]
    assert policy.choose([0], [0], [7], CPU) == "draft" and policy.cut("draft") == 2
    policy.curves["drafter"] = [0.4, 0.3, 0.1, 0.0]  # 1.52 / 1.37 s = 1.11 tok/s at width 2: still pays
    assert policy.choose([0], [0], [7], CPU) == "draft" and policy.cut("draft") == 2
    policy.curves["drafter"] = [0.2, 0.3, 0.1, 0.0]  # 1.2 / 1.29 s at width 1: below plain's 1.0
    assert policy.choose([0], [0], [7], CPU) == "plain"
    policy.curves["drafter"] = [0.6, 0.3, 0.1, 0.0]
    policy.accepted["drafter"] = 0.798  # the old score, whole block only: (1 + 0.798) / 1.8 s < 1 tok/s
    assert policy._score("draft", [0], [0], [7], CPU, 1) > 1.0 > (1 + 0.798) / CPU.round_seconds(7, 1)


def test_exploration_rounds_verify_one_position_deeper_so_the_next_position_stays_measured():
    policy = _lookup_policy(CPU)
    policy.explore_every = 4
    cuts = []
    for _ in range(8):
        arm = policy.choose([0], [7], [0], CPU)
        cuts.append((arm, policy.cut(arm)))
    assert ("lookup", 3) in cuts and ("lookup", 2) in cuts and all(c is not None for _, c in cuts if _ == "lookup")
    fresh = ProposalPolicy()
    assert fresh.choose([0], [7], [0], CPU) == "lookup" and fresh.cut("lookup") == 1  # no curve yet: a probe
    assert fresh.choose([0], [0], [7], CPU, allow_no_draft=False) == "draft" and fresh.cut("draft") is None


def test_each_row_is_scored_by_its_own_curve_within_a_run():
    """Row 1 is repetitive prose (its lookup matches hold 6 deep), row 0 is chat (they fail at once): within the run
    each row's own curve decides its expected tokens; a new run starts from the batch's curve again."""
    policy = ProposalPolicy(explore_every=1000)
    policy.record([0, 1], ["lookup", "lookup"], [0, 6], [7, 7])
    assert policy.row_curves[0]["lookup"] == [0.0] and policy.row_curves[1]["lookup"][:7] == [1.0] * 6 + [0.0]
    assert policy.expected_at("lookup", 7, row=1) == 6.0 and policy.expected_at("lookup", 7, row=0) == 0.0
    assert 0.0 < policy.expected_at("lookup", 7) < 6.0  # the batch's curve mixes both
    for arm in ("lookup", "plain"):
        policy.arms[arm].tried = True
    assert policy.choose([1], [7], [0], CPU) == "lookup" and policy.cut("lookup") == 6
    assert policy.choose([0], [7], [0], CPU) == "plain"
    policy.start_run()
    assert policy.row_curves == {} and policy.expected_at("lookup", 7, row=1) == policy.expected_at("lookup", 7)


def test_one_missed_round_at_the_start_of_a_request_does_not_leave_it_to_plain_rounds():
    """A row's curve starts from the batch's (a prior): after a drafter that paid on earlier requests misses the
    first round of a new one, the row still drafts; a row that keeps missing falls back to plain rounds."""
    policy = ProposalPolicy(explore_every=1000)
    assert policy.choose([0], [0], [7], CPU) == "draft"
    policy.record([0], ["drafter"], [2], [7])
    assert policy.choose([0], [0], [7], CPU) == "plain"  # both arms tried
    for _ in range(6):  # earlier requests: the first two drafted tokens are usually right
        assert policy.choose([0], [0], [7], CPU) == "draft"
        policy.record([0], ["drafter"], [2], [policy.cut("draft") or 7])
    policy.start_run()
    assert policy.choose([1], [0], [7], CPU) == "draft"
    policy.record([1], ["drafter"], [0], [policy.cut("draft") or 7])  # the new request's first block misses
    assert policy.choose([1], [0], [7], CPU) == "draft"
    arms = []
    for _ in range(8):
        arms.append(policy.choose([1], [0], [7], CPU))
        if arms[-1] == "draft":
            policy.record([1], ["drafter"], [0], [policy.cut("draft") or 7])
    assert arms[-3:] == ["plain"] * 3


def test_an_unverified_lookup_is_scored_in_hindsight_on_what_the_round_committed():
    """Only committed positions are known: a plain round tells position 1, a draft round with 2 accepted tells
    positions 1-3; a continuation already verified (length 0 here) or absent teaches nothing."""
    policy = ProposalPolicy(decay=0.5)
    policy.record_hindsight([0], [1], [1], [10])  # plain round: the continuation's first token was right
    assert policy.curves["lookup"] == [1.0] and policy.row_curves[0]["lookup"] == [1.0]
    policy.record_hindsight([0], [3], [3], [10])  # all 3 committed tokens matched: positions 1-3 right, 4+ unknown
    assert policy.curves["lookup"] == [1.0, 1.0, 1.0]
    policy.record_hindsight([0, 1], [1, 0], [3, 1], [2, 0])  # row 0: 2nd token wrong; row 1: no continuation
    assert policy.curves["lookup"] == [1.0, 0.5, 1.0] and 1 not in policy.row_curves
    policy.frozen = True
    policy.record_hindsight([0], [0], [1], [5])
    assert policy.curves["lookup"] == [1.0, 0.5, 1.0]


def test_while_plain_rounds_run_a_lookup_that_would_pay_is_noticed_without_a_retry():
    """A long-lived policy has seen lookups fail (its lookup arm retried rarely); on a request where every lookup
    continuation is right, hindsight over the plain rounds raises the row's curve until lookup is chosen."""
    policy = ProposalPolicy(explore_every=1000)
    for _ in range(3):
        policy.choose([0], [5], [0], CPU)
        policy.record([0], ["lookup"], [0], [5])
    policy.start_run()
    arms = []
    for _ in range(6):
        arm = policy.choose([1], [5], [0], CPU)
        arms.append(arm)
        if arm == "plain":
            policy.record_hindsight([1], [1], [1], [5])  # the continuation's first token was what plain committed
        else:
            break
    assert arms[0] == "plain" and arms[-1] == "lookup"
