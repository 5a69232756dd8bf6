"""OnlineSpec's draft-vocabulary growth: tokens the target keeps committing outside the drafter's draft vocabulary
become draftable, decoding stays exact, `detach` restores the vocabulary, and a saved adapter resumes with it."""

import pytest
import torch

from adaflash_hf.online import OnlineSpecAdapter, OnlineSpecConfig
from adaflash_hf.online.vocab import VocabGrowth

from .conftest import VOCAB, build_drafter, make_tiny_target


def _drafter_with_vocab(k: int = 24):
    target = make_tiny_target(seed=5)
    drafter = build_drafter(target, seed=5)
    drafter.set_draft_vocab(torch.arange(k))
    return target, drafter


def test_growth_counts_outside_tokens_and_appends_them_at_min_count_in_order():
    _, drafter = _drafter_with_vocab(8)
    growth = VocabGrowth(limit=3, min_count=2)
    assert growth.observe(drafter, torch.tensor([1, 50, 40, 50, 2])) == [50]  # 50 twice; 40 once; 1, 2 inside
    assert drafter.draft_vocab.tolist() == [*range(8), 50] and drafter.config.draft_vocab_size == 9
    assert growth.observe(drafter, torch.tensor([60, 40, 50, 60, 70, 70])) == [40, 60]  # 50 is inside now
    assert growth.observe(drafter, torch.tensor([70, 80, 80])) == []  # the limit (3) is reached
    assert growth.added == [50, 40, 60] and growth.counts[70] == 2
    restored = VocabGrowth(limit=3, min_count=2)
    _, other = _drafter_with_vocab(8)
    restored.load_state_dict(growth.state_dict(), other)
    assert torch.equal(other.draft_vocab, drafter.draft_vocab) and restored.counts == growth.counts
    growth.restore(drafter)
    assert drafter.draft_vocab.tolist() == list(range(8)) and drafter.config.draft_vocab_size == 8


def test_growth_never_touches_a_full_vocabulary_drafter():
    target = make_tiny_target(seed=5)
    drafter = build_drafter(target, seed=5)
    assert VocabGrowth(limit=4, min_count=1).observe(drafter, torch.tensor([3, 4])) == []
    assert drafter.draft_vocab is None
    with pytest.raises(ValueError, match="vocab_growth must be >= 0"):
        OnlineSpecConfig(vocab_growth=-1)
    with pytest.raises(ValueError, match="vocab_min_count must be >= 1"):
        OnlineSpecConfig(vocab_min_count=0)


@pytest.mark.parametrize("mode", ["request", "background"])
def test_served_requests_grow_the_vocabulary_and_stay_exact(mode, tmp_path):
    target, drafter = _drafter_with_vocab(24)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode=mode, learning_rate=0.01,
                                                                 learn_while_paying=False, vocab_min_count=1))
    prompts = [torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    for i, ids in enumerate(prompts):
        out = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
        plain = target.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(out, plain)
        committed = set(out[0, ids.shape[1]:].tolist())
        assert committed <= set(drafter.draft_vocab.tolist())  # min_count 1: every committed token is draftable
        if i == 1:
            adapter.save_pretrained(tmp_path / "adapter")
            saved_vocab = drafter.draft_vocab.clone()
    adapter.finish()
    assert adapter.stats.vocab_added == len(adapter.vocab.added) > 0
    if mode == "background":  # the worker's shadow drafts from the same vocabulary
        assert torch.equal(adapter.trainee.draft_vocab, drafter.draft_vocab)
    _, fresh = _drafter_with_vocab(24)
    loaded = OnlineSpecAdapter.from_pretrained(fresh, tmp_path / "adapter")
    assert torch.equal(fresh.draft_vocab, saved_vocab) and loaded.vocab.counts
    adapter.detach()
    assert drafter.draft_vocab.tolist() == list(range(24))


def test_a_resumed_adapter_continues_exactly_with_its_grown_vocabulary(tmp_path):
    """Save after 2 requests, load into a fresh drafter in this process, serve requests 2-3 on both (sampled, with
    a seed per request): same outputs, same vocabulary, same LoRA weights."""
    config = dict(learning_rate=0.05, learn_while_paying=False, vocab_min_count=1)
    target, drafter = _drafter_with_vocab(24)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(**config))

    def serve(model, i):
        torch.manual_seed(100 + i)
        ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(i))
        return target.generate(ids, max_new_tokens=12, do_sample=True, assistant_model=model)

    for i in range(2):
        serve(drafter, i)
    adapter.save_pretrained(tmp_path / "adapter")
    _, fresh = _drafter_with_vocab(24)
    loaded = OnlineSpecAdapter.from_pretrained(fresh, tmp_path / "adapter")
    for i in (2, 3):
        assert torch.equal(serve(drafter, i), serve(fresh, i))
        assert torch.equal(drafter.draft_vocab, fresh.draft_vocab)
    lora = lambda m: {n: p for n, p in m.named_parameters() if "lora_" in n}  # noqa: E731
    assert all(torch.allclose(p, lora(fresh)[n], atol=1e-6) for n, p in lora(drafter).items())
    assert loaded.vocab.added == adapter.vocab.added
