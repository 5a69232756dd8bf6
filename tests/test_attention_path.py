"""Masked GQA on a CPU (`adaflash_hf.generation.attention`): the switch, and outputs unchanged by it."""

import pytest
import torch
from transformers import DynamicCache

from adaflash_hf.generation.attention import FORCE_GQA, masked_gqa, prefer_masked_gqa, supports_masked_gqa
from adaflash_hf.generation.batch import generate_batch
from adaflash_hf.generation.cost_model import cache_path

from .conftest import VOCAB, build_drafter, make_tiny_target


def test_the_switch_is_turned_on_for_a_cpu_only_and_never_over_the_users_choice(monkeypatch):
    monkeypatch.delenv(FORCE_GQA, raising=False)
    assert prefer_masked_gqa("cuda") is False and FORCE_GQA not in __import__("os").environ  # math kernel there
    assert supports_masked_gqa("cpu") and prefer_masked_gqa("cpu") is True and masked_gqa()
    monkeypatch.setenv(FORCE_GQA, "0")  # the user said no
    assert prefer_masked_gqa("cpu") is False and not masked_gqa()


def _masked_forward(target, monkeypatch, on: bool):
    monkeypatch.setenv(FORCE_GQA, "1" if on else "0")
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, VOCAB, (3, 12), generator=g)
    mask = torch.ones(3, 17, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, 7] = 0  # a rejected slot
    cache = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=context, attention_mask=mask[:, :12], cache=cache, use_cache=True)
        return target(input_ids=torch.randint(0, VOCAB, (3, 5), generator=g), attention_mask=mask, cache=cache,
                      use_cache=True).logits


def test_a_masked_multi_token_forward_is_the_same_with_and_without_it(monkeypatch):
    target = make_tiny_target(seed=4)  # 4 query heads, 2 KV heads
    with_copy, without = _masked_forward(target, monkeypatch, False), _masked_forward(target, monkeypatch, True)
    torch.testing.assert_close(without, with_copy, rtol=0, atol=1e-5)
    assert torch.equal(without.argmax(-1), with_copy.argmax(-1))


def test_rows_equal_plain_greedy_with_it_and_the_cost_cache_tells_the_paths_apart(monkeypatch):
    target = make_tiny_target(seed=5)
    drafter = build_drafter(target, block_size=4, seed=1)
    monkeypatch.setenv(FORCE_GQA, "0")
    copy_path = cache_path(target, drafter)
    monkeypatch.setenv(FORCE_GQA, "1")
    assert cache_path(target, drafter) != copy_path
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 5, 14)]
    out = generate_batch(target, drafter, prompts, 10, eos_token_id=[])
    for prompt, row in zip(prompts, out):
        ids = torch.tensor([prompt])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
        assert row == ref
