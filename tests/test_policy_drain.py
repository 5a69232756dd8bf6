"""When no request waits for a slot, the policy minimises the time until the batch's last row is done."""

import pytest

from adaflash_hf.generation.policy import ProposalPolicy, drain_seconds

from .conftest import device_cost


# rows cost: 1 s per round at 1 row, 2 s at 2 rows and more (a CPU: a round's cost grows with its rows)
ROWS = device_cost({1: {1: 1.0, 8: 1.0}, 2: {1: 2.0, 8: 2.0}, 4: {1: 2.0, 8: 2.0}})
# 4 rows; verifying 2 tokens a row costs 1.5x one, 3 tokens 1.6x (lookup rounds: no drafting step)
WIDE = device_cost({1: {1: 1.0, 2: 1.5, 8: 2.2}, 4: {1: 1.0, 2: 1.5, 8: 2.2}})


def test_drain_seconds_by_hand():
    # flat costs: the slowest row sets the time (10 rounds of 1 s)
    flat = device_cost({1: {1: 1.0, 8: 1.0}, 4: {1: 1.0, 8: 1.0}})
    assert drain_seconds([2.0, 1.0], [10, 10], 0, flat, drafts=False) == pytest.approx(10.0)
    # costs by rows: 5 rounds of both rows (2 s each), then 5 rounds of the slow row alone (1 s each)
    assert drain_seconds([2.0, 1.0], [10, 10], 0, ROWS, drafts=False) == pytest.approx(5 * 2.0 + 5 * 1.0)
    # a row with fewer tokens left finishes first, whatever its rate
    assert drain_seconds([1.0, 1.0], [4, 10], 0, ROWS, drafts=False) == pytest.approx(4 * 2.0 + 6 * 1.0)


def test_a_draining_round_is_valued_by_its_seconds_plus_the_plain_drain_it_leaves():
    policy = ProposalPolicy()
    policy.remaining = [10, 10]
    # a round of 2 rows (2 s) leaves 8 and 9 tokens: 8 plain rounds of 2 rows + 1 of 1 row = 17 s; 20 tokens / 19 s
    assert policy._value([2.0, 1.0], 0, ROWS, drafts=False) == pytest.approx(20 / 19)
    policy.remaining = None  # requests wait: this round's 3 tokens / 2 s
    assert policy._value([2.0, 1.0], 0, ROWS, drafts=False) == pytest.approx(3 / 2)


def _lookup_policy() -> ProposalPolicy:
    """Rows 0 and 1 have lookup continuations that are always right; rows 2 and 3 never have one."""
    policy = ProposalPolicy(explore_every=1000)
    for _ in range(6):
        policy.record([0, 1], ["lookup", "lookup"], [2, 2], [2, 2])
    policy.arms["lookup"].tried = policy.arms["plain"].tried = True
    return policy


def test_a_lookup_round_that_speeds_up_rows_the_batch_does_not_wait_for_loses_when_it_drains():
    lookup_lens, budgets = [2, 2, 0, 0], [0, 0, 0, 0]
    # requests wait (throughput): rows 0, 1 commit 3 tokens, rows 2, 3 one, in a round of ~1.6 s: 8 / 1.6 > 4 / 1
    assert _lookup_policy().choose([0, 1, 2, 3], lookup_lens, budgets, WIDE) == "lookup"
    # nothing waits: rows 2 and 3 need 20 rounds either way, at 1.6 s each instead of 1 s
    assert _lookup_policy().choose([0, 1, 2, 3], lookup_lens, budgets, WIDE, remaining=[20] * 4) == "plain"
    # ... unless it is the lookup rows that have the most left
    assert _lookup_policy().choose([0, 1, 2, 3], lookup_lens, budgets, WIDE, remaining=[60, 60, 5, 5]) == "lookup"


def test_one_row_is_scored_as_before():
    policy, again = _lookup_policy(), _lookup_policy()
    assert policy.choose([0], [2], [0], WIDE) == again.choose([0], [2], [0], WIDE, remaining=[20])
    assert again.remaining is None
