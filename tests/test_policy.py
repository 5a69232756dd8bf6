"""The proposal policy (drafter / prompt lookup / no draft) and the hybrid generator built on it."""

import torch

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.generation.policy import ProposalPolicy

from .conftest import make_oracle, make_tiny_target


def test_policy_prefers_the_arm_with_more_tokens_per_second():
    policy = ProposalPolicy(explore_every=1000)
    # Untried arms are tried first (optimistic), in order.
    assert policy.choose(lookup_available=True) == "drafter"
    policy.record("drafter", accepted=1, seconds=0.1)  # 20 tok/s
    assert policy.choose(lookup_available=True) == "lookup"
    policy.record("lookup", accepted=4, seconds=0.1)  # 50 tok/s
    assert policy.choose(lookup_available=True) == "none"
    policy.record("none", accepted=0, seconds=0.05)  # 20 tok/s
    assert policy.choose(lookup_available=True) == "lookup"
    assert policy.choose(lookup_available=False) in ("drafter", "none")
    assert policy.choose(lookup_available=False, allow_none=False) == "drafter"


def test_policy_moving_average_and_exploration():
    policy = ProposalPolicy(decay=0.5, explore_every=3)
    for arm, acc in (("drafter", 3), ("none", 0)):
        policy.choose(lookup_available=False)
        policy.record(arm, accepted=acc, seconds=0.1)
    policy.record("drafter", accepted=1, seconds=0.1)
    assert policy.arms["drafter"].accepted == 2.0  # 3 + 0.5 * (1 - 3)
    chosen = []
    for _ in range(8):
        chosen.append(policy.choose(lookup_available=False))
        policy.record(chosen[-1], accepted=3 if chosen[-1] == "drafter" else 0, seconds=0.1)
    assert "none" in chosen and chosen.count("drafter") > chosen.count("none")  # explored, but exploits


def test_hybrid_uses_lookup_on_repetitive_text_and_stays_lossless():
    target = make_tiny_target(seed=8)
    prompt = torch.tensor([[7, 8, 9, 10, 11, 12] * 4])
    reference = target.generate(prompt, max_new_tokens=60, do_sample=False)
    # A drafter that is always wrong: only lookup (or no draft) can win.
    drafter = make_oracle(target, reference, block_size=5, error_rate=1.0, hybrid_lookup=True, allow_no_draft=True)
    out = target.generate(prompt, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, reference[:, : prompt.shape[1] + 40])
    assert "lookup" in drafter.generation_stats.proposers


def test_weak_drafter_falls_back_to_no_draft_and_good_one_keeps_drafting():
    target = make_tiny_target(seed=9)
    prompt = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(9))
    reference = target.generate(prompt, max_new_tokens=80, do_sample=False)
    bad = make_oracle(target, reference, block_size=6, error_rate=1.0, allow_no_draft=True)
    good = make_oracle(target, reference, block_size=6, error_rate=0.0, allow_no_draft=True)
    for drafter in (bad, good):
        out = target.generate(prompt, max_new_tokens=60, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, reference[:, : prompt.shape[1] + 60])
    assert bad.generation_stats.proposers.count("none") > bad.generation_stats.proposers.count("drafter")
    assert good.generation_stats.proposers.count("drafter") > good.generation_stats.proposers.count("none")


def test_policy_state_persists_across_generate_calls(tiny_target):
    drafter = AdaFlashDrafterModel.from_target(tiny_target, num_layers=1, block_size=4).eval()
    tiny_target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=6, assistant_model=drafter)
    policy = drafter.proposal_policy
    rounds = policy.round
    tiny_target.generate(torch.tensor([[4, 5, 6]]), max_new_tokens=6, assistant_model=drafter)
    assert drafter.proposal_policy is policy and policy.round > rounds
