"""The one speculative sampler (`adaflash_hf.generation.sampler`): logits processors on both distributions, the
accept rule equal to transformers' `_speculative_sampling`, and sampled distributions of both engines equal to plain
sampling with the same processors (top-k, top-p, repetition penalty)."""

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
)
from transformers.generation.utils import _speculative_sampling

from adaflash_hf.generation.batch import generate_batch
from adaflash_hf.generation.sampler import SpeculativeSampler, rejection_sample

from .conftest import build_drafter, make_tiny_target

SETTINGS = {
    "top_k": dict(top_k=4),
    "top_p": dict(top_k=0, top_p=0.6, temperature=0.8),
    "repetition_penalty": dict(top_k=0, temperature=0.5, repetition_penalty=3.0),
}


def _flat_target():
    # A tiny vocabulary and a flat-ish target so that drafts are accepted and rejected often.
    target = make_tiny_target(seed=11, vocab_size=8, hidden_size=32, num_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.4)
    return target


def _histograms(tokens: torch.Tensor, positions, vocab=8) -> torch.Tensor:
    return torch.stack([torch.bincount(tokens[:, p], minlength=vocab).float() / tokens.shape[0] for p in positions])


def _plain(target, prompt, n, new, seed, **kwargs):
    torch.manual_seed(seed)
    out = target.generate(torch.tensor([prompt] * n), max_new_tokens=new, do_sample=True, **kwargs)
    return out[:, len(prompt):]


@pytest.mark.parametrize("processed", [False, True])
def test_rejection_sample_decides_like_transformers_speculative_sampling(processed):
    torch.manual_seed(0)
    v, m = 12, 4
    processors = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5), TopKLogitsWarper(6)]) if processed \
        else LogitsProcessorList()
    sampler = SpeculativeSampler(processors, do_sample=True)
    prefix = torch.tensor([[3, 1, 4]])
    agree = accepted_total = 0
    for trial in range(200):
        target_logits = torch.randn(1, m + 1, v) * 1.5
        draft_logits = target_logits[:, :m] + torch.randn(1, m, v)
        drafts, q_scores = sampler.draft_scores(draft_logits, [prefix[0]])
        candidates = torch.cat([prefix, drafts], dim=1)
        contexts = [prefix[0]]
        # transformers' loop processes the target's logits position by position with the candidate prefix
        p_scores = torch.stack([processors(candidates[:, : prefix.shape[1] + j], target_logits[:, j].clone())
                                for j in range(m + 1)], dim=1)
        ours = sampler.process(target_logits[0], [torch.cat([prefix[0], drafts[0, :j]]) for j in range(m + 1)])
        torch.testing.assert_close(p_scores, ours[None])
        torch.manual_seed(1000 + trial)
        theirs, n_matches = _speculative_sampling(candidates, q_scores, m, p_scores)
        torch.manual_seed(1000 + trial)
        accepted, token = sampler.accept(target_logits, drafts, torch.tensor([m]), q_scores.softmax(-1),
                                         contexts=contexts)
        agree += int(int(accepted) == int(n_matches) and int(token) == int(theirs[0, -1]))
        accepted_total += int(accepted)
    assert agree == 200
    assert 0 < accepted_total < 200 * m  # both acceptances and rejections happened


@pytest.mark.parametrize("processor", [RepetitionPenaltyLogitsProcessor(2.0), NoRepeatNGramLogitsProcessor(2)])
def test_process_sees_each_rows_own_sequence(processor):
    processors = LogitsProcessorList([processor, TopKLogitsWarper(5)])
    sampler = SpeculativeSampler(processors, do_sample=True)
    assert sampler.set_only == isinstance(processor, RepetitionPenaltyLogitsProcessor)
    scores = torch.randn(3, 10)
    seqs = [torch.tensor([1, 2, 1]), torch.tensor([3, 4, 5, 3, 4]), torch.tensor([6])]
    out = sampler.process(scores, seqs)
    for r, seq in enumerate(seqs):
        torch.testing.assert_close(out[r:r + 1], processors(seq[None], scores[r:r + 1].clone()))
    # accept: every (row, position) processed with its own sequence, in one call (set-only) or grouped by length
    logits, drafts = torch.randn(3, 4, 10), torch.randint(0, 10, (3, 3))
    grouped = SpeculativeSampler(processors, do_sample=True)
    grouped.set_only = False
    for seed in range(20):
        torch.manual_seed(seed)
        a = sampler.accept(logits, drafts, torch.tensor([3, 1, 2]), torch.rand(3, 3, 10).softmax(-1), contexts=seqs)
        torch.manual_seed(seed)
        b = grouped.accept(logits, drafts, torch.tensor([3, 1, 2]), torch.rand(3, 3, 10).softmax(-1), contexts=seqs)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_generate_batch_takes_generate_sampling_knobs():
    target = _flat_target()
    out = generate_batch(target, None, [[1, 2]], 3, do_sample=True, top_p=0.9, top_k=4, repetition_penalty=1.1)
    assert len(out[0]) == 3
    with pytest.raises(TypeError, match="unexpected keyword"):
        generate_batch(target, None, [[1, 2]], 3, not_an_option=1)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_batched_sampling_with_processors_matches_plain(setting):
    kwargs = SETTINGS[setting]
    target = _flat_target()
    drafter = build_drafter(target, block_size=4, seed=2)
    prompt, n, positions = [5, 1, 2], 1500, [1, 2, 3]
    torch.manual_seed(0)
    out, stats = generate_batch(target, drafter, [prompt] * n, 4, do_sample=True, return_stats=True, **kwargs)
    accepted, verified = sum(map(sum, stats.accepted)), sum(map(sum, stats.verified))
    assert 0 < accepted < verified  # drafts were both accepted and rejected: rejection sampling ran
    ours = _histograms(torch.tensor(out), positions)
    plain = _histograms(_plain(target, prompt, 4000, 4, seed=1, **kwargs), positions)
    without = {"top_k": 0, **({"temperature": kwargs["temperature"]} if "temperature" in kwargs else {})}
    raw = _histograms(_plain(target, prompt, 4000, 4, seed=2, **without), positions)
    tv = 0.5 * (ours - plain).abs().sum(dim=-1)
    assert (tv < 0.07).all(), f"{setting}: TV={tv.tolist()}"
    assert (0.5 * (raw - plain).abs().sum(dim=-1)).max() > 0.1  # the processor under test matters


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_assisted_sampling_with_processors_matches_plain(setting):
    kwargs = SETTINGS[setting]
    target = _flat_target()
    drafter = build_drafter(target, block_size=4, seed=2)
    prompt, n, positions = [5, 1, 2], 300, [1, 2]
    torch.manual_seed(0)
    rows, accepted, drafted = [], 0, 0
    for _ in range(n):
        out = target.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=True, assistant_model=drafter,
                              return_dict_in_generate=True, **kwargs)
        rows.append(out.sequences[0, len(prompt):])
        accepted += sum(out.speculation_stats.accepted)
        drafted += sum(out.speculation_stats.drafted)
    assert 0 < accepted < drafted
    ours = _histograms(torch.stack(rows), positions)
    plain = _histograms(_plain(target, prompt, 4000, 3, seed=1, **kwargs), positions)
    tv = 0.5 * (ours - plain).abs().sum(dim=-1)
    assert (tv < 0.12).all(), f"{setting}: TV={tv.tolist()}"


def test_greedy_repetition_penalty_equals_plain_on_both_engines():
    target = make_tiny_target(seed=3)
    prompts = [[1, 2, 3, 1, 2], [7, 7, 9], [4, 5, 6, 7, 8, 9, 10]]
    plain = [target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                             repetition_penalty=1.4)[0, len(p):].tolist() for p in prompts]
    drafter = build_drafter(target, block_size=4, seed=2)
    assert generate_batch(target, drafter, prompts, 12, repetition_penalty=1.4) == plain
    for p, ref in zip(prompts, plain):
        out = target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, repetition_penalty=1.4,
                              assistant_model=drafter)
        assert out[0, len(p):].tolist() == ref


def test_draft_positions_and_tau_are_defined_once():
    from adaflash_hf.utils.speculation import draft_positions, tau

    vocab = torch.tensor([7, 2, 9])
    assert draft_positions(torch.tensor([[2, 9], [7, 5]]), vocab).tolist() == [[1, 2], [0, -1]]
    assert draft_positions(torch.tensor([5]), vocab, fill=-100).tolist() == [-100]
    assert draft_positions(torch.tensor([4, 1]), None).tolist() == [4, 1]
    assert tau([0, 2, 1]) == 2.0 and tau([]) == 0.0


def test_pooled_tau_pools_rounds_not_requests():
    """Per-request counts pool over rounds: the same number as `tau` over the concatenated rounds, which a mean of
    per-request taus is not (the bench tables and report (c) both read this one helper)."""
    from adaflash_hf.utils.speculation import pooled_tau, tau

    rounds = [[0, 2, 1], [3], [0, 0, 0, 0]]
    rows = [{"accepted": sum(r), "rounds": len(r)} for r in rounds]
    assert pooled_tau(rows) == tau([a for r in rounds for a in r]) == 1.75
    assert pooled_tau(rows) != sum(tau(r) for r in rounds) / len(rounds)
    assert pooled_tau([]) == 0.0 and pooled_tau([{"accepted": 0, "rounds": 0}]) == 0.0
