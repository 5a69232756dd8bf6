"""A round's work outside the forwards (host + small kernels) is priced by the cost model and decides rounds."""

import pytest

from adaflash_hf.bench.overhead import measure_round_overhead
from adaflash_hf.generation.cost_model import TargetCostModel
from adaflash_hf.generation.policy import ProposalPolicy

from .conftest import build_drafter, device_cost, make_tiny_target

FLAT = device_cost({1: {1: 1.0, 8: 1.0}, 64: {1: 1.0, 8: 1.0}}, draft=0.1)  # launch-bound: flat in rows x tokens


def test_round_seconds_add_the_overhead_of_the_rounds_kind():
    cost = FLAT.with_overhead({"plain": {1: 0.02, 64: 0.04}, "spec": {1: 0.2, 64: 0.8}})
    assert cost.round_seconds(0, 1, drafts=False) == pytest.approx(1.0 + 0.02)  # plain round
    assert cost.round_seconds(3, 64, drafts=False) == pytest.approx(1.0 + 0.8)  # lookup round: a verified proposal
    assert cost.round_seconds(3, 64) == pytest.approx(1.0 + 0.1 + 0.8)  # drafted round
    assert cost.overhead_seconds("spec", 32) == pytest.approx(0.2 + 0.6 * 31 / 63)  # interpolated in rows
    assert FLAT.round_seconds(3, 64) == pytest.approx(1.1) and FLAT.overhead_seconds("spec", 64) == 0.0  # unknown
    assert FLAT.with_overhead({"plain": {1: -0.01}}).overhead_seconds("plain") == 0.0  # noise never pays


def test_overhead_survives_save_and_load(tmp_path):
    cost = FLAT.with_overhead({"plain": {4: 0.001}, "spec": {4: 0.01}})
    cost.save(tmp_path / "c.json")
    loaded = TargetCostModel.load(tmp_path / "c.json")
    assert loaded.overhead == {"plain": {4: 0.001}, "spec": {4: 0.01}}
    assert loaded.round_seconds(2, 4) == pytest.approx(cost.round_seconds(2, 4))


def _drafting_policy() -> ProposalPolicy:
    """Every row's drafted block has its first token accepted, never the second."""
    policy = ProposalPolicy(explore_every=1000)
    for _ in range(6):
        policy.record([0], ["drafter"], [1], [2])
    policy.arms["draft"].tried = policy.arms["plain"].tried = True
    return policy


def test_a_round_that_pays_in_forwards_loses_when_its_overhead_is_priced():
    # 2 tokens per drafted round at 1.1 s against 1 token per plain round at 1 s: drafting pays ...
    assert _drafting_policy().choose([0], [0], [4], FLAT) == "draft"
    # ... until the drafted round's host + ops work is priced: 2 tokens / 2.3 s < 1 token / 1.05 s
    dear = FLAT.with_overhead({"plain": {1: 0.05}, "spec": {1: 1.2}})
    assert _drafting_policy().choose([0], [0], [4], dear) == "plain"


def test_measured_overhead_is_per_kind_and_rows():
    target = make_tiny_target(seed=63, num_layers=2)
    target.generation_config.eos_token_id = None
    drafter = build_drafter(target, block_size=4, seed=0, hybrid_lookup=True, allow_no_draft=True)
    prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    table = measure_round_overhead(target, drafter, prompts, [2, 1], FLAT, new_tokens=(2, 10), repeats=1,
                                   progress=False)
    assert set(table) == {"plain", "spec"} and all(set(rows) == {1, 2} for rows in table.values())
    # a drafted round does more outside the forwards (drafting inputs, acceptance, lookup) than a plain one
    assert all(table["spec"][b] > table["plain"][b] >= 0 for b in (1, 2))
    with pytest.raises(ValueError, match="short < long"):
        measure_round_overhead(target, drafter, prompts, [1], FLAT, new_tokens=(4, 4))
    with pytest.raises(ValueError, match="prompts and batch sizes"):
        measure_round_overhead(target, drafter, [], [1], FLAT)
