"""Lossless speculative generation on tiny random targets, through both generate paths."""

import pytest
import torch
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    DFlashTokenCandidateGenerator,
    PromptLookupCandidateGenerator,
)
from transformers.generation.utils import GenerationMixin

from adaflash_hf import AdaFlashCandidateGenerator, AdaFlashDrafterModel

from .conftest import VOCAB, build_drafter, make_oracle, make_tiny_target, speculate


PATHS = [None, "dflash"]  # None: our generator through plain generate; "dflash": transformers' native generator


def _prompts(n, seed=0, min_len=3, max_len=24):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len, (n,), generator=g)
    return [torch.randint(0, VOCAB, (1, int(length)), generator=g) for length in lengths]


@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("path", PATHS)
def test_greedy_equals_plain_on_many_prompts(block_size, path):
    target = make_tiny_target(seed=block_size)
    prompts = _prompts(20, seed=block_size)  # 3 block sizes x 20 = 60 prompts per path
    accepted = 0
    for i, prompt in enumerate(prompts):
        max_new = 10 + (i % 3) * 9
        reference = target.generate(prompt, max_new_tokens=max_new + block_size, do_sample=False)
        drafter = make_oracle(target, reference, block_size=block_size, error_rate=0.35, seed=i)
        expected = reference[:, : prompt.shape[1] + max_new]
        out, stats = speculate(target, prompt, drafter, max_new_tokens=max_new, do_sample=False,
                               speculation_type=path)
        assert torch.equal(out, expected), f"prompt {i}: speculative output differs from plain greedy"
        if path is None:
            accepted += sum(stats.accepted)
        else:
            assert stats is None  # transformers' native path: no statistics of ours
    if path is None:
        assert accepted > 0  # the oracle's drafts were (partly) accepted: the acceptance path ran


@pytest.mark.parametrize("path", PATHS)
def test_random_drafter_is_lossless(tiny_target, tiny_drafter, path):
    for prompt in _prompts(10, seed=7):
        expected = tiny_target.generate(prompt, max_new_tokens=15, do_sample=False)
        out = tiny_target.generate(prompt, max_new_tokens=15, assistant_model=tiny_drafter, speculation_type=path)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("path", PATHS)
def test_eos_inside_an_accepted_block_stops_there(path):
    target = make_tiny_target(seed=3)
    prompt = _prompts(1, seed=3)[0]
    reference = target.generate(prompt, max_new_tokens=30, do_sample=False)
    eos = int(reference[0, prompt.shape[1] + 9])  # a token the target emits mid-stream
    target.generation_config.eos_token_id = eos
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False)
    assert expected.shape[1] < reference.shape[1] and int(expected[0, -1]) == eos
    drafter = make_oracle(target, reference, block_size=8, error_rate=0.0)
    out = target.generate(prompt, max_new_tokens=30, assistant_model=drafter, speculation_type=path)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 8, 9])
def test_max_length_inside_a_block(max_new):
    target = make_tiny_target(seed=4)
    prompt = _prompts(1, seed=4)[0]
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    drafter = make_oracle(target, reference, block_size=8, error_rate=0.0)  # every draft accepted
    out, stats = speculate(target, prompt, drafter, max_new_tokens=max_new)
    assert torch.equal(out, reference[:, : prompt.shape[1] + max_new])
    # Our generator never proposes tokens past max_length (the native one does and discards them).
    assert all(d <= max_new for d in stats.drafted) and (len(stats.drafted) > 0 or max_new == 1)


def test_stats_count_rounds_and_tau():
    target = make_tiny_target(seed=5)
    prompt = _prompts(1, seed=5)[0]
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    drafter = make_oracle(target, reference, block_size=6, error_rate=0.0)
    _, stats = speculate(target, prompt, drafter, max_new_tokens=25)
    # The prefill commits the first token; then every round commits its accepted drafts + 1 target token.
    assert 1 + sum(a + 1 for a in stats.accepted) == 25
    assert stats.tau > 4.0 and stats.rounds == len(stats.drafted)
    assert stats.acceptance_by_position(5)[0] == 1.0


def test_plain_generate_routes_to_our_generator_and_dflash_flag_to_native(tiny_target, tiny_drafter, monkeypatch):
    seen = []
    original = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        generator = original(self, *args, **kwargs)
        seen.append(type(generator))
        return generator

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    prompt = _prompts(1)[0]
    tiny_target.generate(prompt, max_new_tokens=5, assistant_model=tiny_drafter)
    tiny_target.generate(prompt, max_new_tokens=5, assistant_model=tiny_drafter, speculation_type="dflash")
    assert seen == [AdaFlashCandidateGenerator, DFlashTokenCandidateGenerator]


def test_other_generation_modes_are_unaffected(tiny_target, monkeypatch):
    seen = []
    original = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kwargs):
        generator = original(self, *args, **kwargs)
        seen.append(type(generator))
        return generator

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", spy)
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])
    plain = tiny_target.generate(prompt, max_new_tokens=12, do_sample=False)
    lookup = tiny_target.generate(prompt, max_new_tokens=12, do_sample=False, prompt_lookup_num_tokens=3)
    assistant = make_tiny_target(seed=9, num_layers=1)
    assisted = tiny_target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=assistant)
    assert torch.equal(lookup, plain) and torch.equal(assisted, plain)
    assert seen == [PromptLookupCandidateGenerator, AssistedCandidateGenerator]


def _token_histograms(target, drafter, n_samples, positions, seed):
    counts = torch.zeros(len(positions), target.config.vocab_size)
    prompt = torch.tensor([[5, 1, 2]])
    torch.manual_seed(seed)
    accepted = 0
    for _ in range(n_samples):
        out = target.generate(prompt, max_new_tokens=max(positions) + 1, do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, assistant_model=drafter, return_dict_in_generate=True)
        accepted += sum(out.speculation_stats.accepted) if drafter is not None else 0
        for row, pos in enumerate(positions):
            counts[row, out.sequences[0, prompt.shape[1] + pos]] += 1
    return counts / n_samples, accepted


def test_sampling_uses_rejection_sampling_and_matches_target_distribution(monkeypatch):
    # A tiny vocabulary and a flat-ish target so that drafts are accepted and rejected often.
    target = make_tiny_target(seed=11, vocab_size=8, hidden_size=32, num_layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.4)
    drafter = build_drafter(target, block_size=4, seed=2)

    import transformers.generation.utils as gen_utils

    calls = []
    original = gen_utils._speculative_sampling

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(gen_utils, "_speculative_sampling", spy)
    speculative, accepted = _token_histograms(target, drafter, 600, positions=[1, 2], seed=0)
    assert calls, "do_sample=True must go through transformers' speculative (rejection) sampling"
    assert accepted > 0
    plain, _ = _token_histograms(target, None, 600, positions=[1, 2], seed=1)
    total_variation = 0.5 * (speculative - plain).abs().sum(dim=-1)
    assert (total_variation < 0.12).all(), f"sampled distributions differ: TV={total_variation.tolist()}"


@pytest.mark.parametrize("do_sample", [False, True])
def test_draft_vocabulary_restricts_proposals_and_stays_lossless(do_sample):
    target = make_tiny_target(seed=6)
    prompt = _prompts(1, seed=6)[0]
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    drafter = make_oracle(target, reference, block_size=6, error_rate=0.1)
    allowed = torch.arange(0, VOCAB, 2)  # even ids only: odd reference tokens can never be drafted
    drafter.set_draft_vocab(allowed)
    proposed = []
    original = drafter.draft_logits

    def spy(states, head):
        logits, ids = original(states, head)
        proposed.extend(ids[logits.argmax(-1)].flatten().tolist())
        return logits, ids

    drafter.draft_logits = spy
    out, stats = speculate(target, prompt, drafter, max_new_tokens=30, do_sample=do_sample)
    assert proposed and all(t % 2 == 0 for t in proposed)
    if not do_sample:
        assert torch.equal(out, reference[:, : prompt.shape[1] + 30])
        assert sum(stats.accepted) > 0


def test_draft_vocabulary_is_saved_and_loaded(tmp_path, tiny_target, tiny_drafter):
    tiny_drafter.set_draft_vocab(torch.tensor([5, 7, 11]))
    tiny_drafter.save_pretrained(tmp_path)
    loaded = AdaFlashDrafterModel.from_pretrained(tmp_path)
    assert loaded.config.draft_vocab_size == 3 and loaded.draft_vocab.tolist() == [5, 7, 11]
    with pytest.raises(ValueError, match="draft vocabulary"):
        loaded.set_draft_vocab(torch.tensor([VOCAB]))


def test_custom_generate_route_works_without_the_global_hook(tiny_target, tiny_drafter):
    """transformers' `custom_generate` route gives our decoding for one call; the hook is not left installed."""
    from adaflash_hf import speculative_decoding
    from adaflash_hf.generation import install, is_installed, uninstall

    prompt = _prompts(1, seed=12)[0]
    expected = tiny_target.generate(prompt, max_new_tokens=10, do_sample=False)
    uninstall()
    try:
        assert not is_installed()
        out = tiny_target.generate(prompt, max_new_tokens=10, do_sample=False, custom_generate=speculative_decoding,
                                   drafter=tiny_drafter, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected) and out.speculation_stats.rounds > 0
        assert not is_installed()
        with pytest.raises(TypeError, match="speculation_type='dflash'"):  # without the hook: refused, clearly
            tiny_target.generate(prompt, max_new_tokens=4, assistant_model=tiny_drafter)
    finally:
        install()
    assert is_installed()
