"""Replayed tau (one teacher-forced drafter pass, walked as serving moves) equals served drafter-only tau."""

import pytest
import torch

from adaflash_hf.training.blocks import draft_blocks
from adaflash_hf.training.replay import (draft_every_anchor, greedy_prefix_len, pooled_tau, replay,
                                         uniform_anchor_accepted, walk_rounds)

from .conftest import make_tiny_target


def test_walk_moves_like_the_serving_loop():
    seq = torch.tensor([5, 6, 7, 1, 2, 3, 4, 9, 9, 8])  # prompt of 3, response 1 2 3 4 9 9 8
    drafts = torch.tensor([
        [2, 3, 0],  # anchor 3 (token 1): 2 3 match, miss -> 2 accepted, next anchor 3 + 3 = 6
        [0, 0, 0], [0, 0, 0],
        [9, 0, 0],  # anchor 6 (token 4): 1 accepted, next anchor 8
        [0, 0, 0],
        [8, 7, 7],  # anchor 8: only one token remains and it is the target's own
        [0, 0, 0],
    ])
    result = walk_rounds(drafts, seq, 3, max_length=100)  # ended early (EOS): nothing caps a draft
    assert result.accepted == [2, 1, 0] and result.drafted == [3, 3, 3]
    assert result.tau == pytest.approx((3 + 2 + 1) / 3)
    # the call's max_length (default: the sequence's length) bounds each round's draft as the generator does:
    # budget = max_length - cur_len - 1, and a round with none left is a plain round
    capped = walk_rounds(drafts, seq, 3)
    assert capped.drafted == [3, 2, 0] and capped.accepted == [2, 1, 0]
    assert pooled_tau([result, capped]) == pytest.approx(1 + 6 / 6)


def test_walk_keeps_the_best_candidate_and_honours_the_width():
    seq = torch.tensor([5, 6, 7, 1, 2, 3, 4, 9, 9, 8])  # prompt of 3, response 1 2 3 4 9 9 8
    trees = torch.zeros(7, 2, 3, dtype=torch.long)
    trees[0] = torch.tensor([[0, 3, 4], [2, 3, 4]])  # anchor 3: the drafter's block misses, candidate 1 takes 3
    trees[4, 1] = torch.tensor([9, 9, 8])  # anchor 7: candidate 1 is right, but only 1 token is left to accept
    result = walk_rounds(trees, seq, 3, max_length=100)
    assert result.accepted == [3, 1] and result.drafted == [3, 3]
    assert walk_rounds(trees[:, 0], seq, 3, max_length=100).accepted == [0, 0, 0, 0, 0, 0]  # the block alone
    cut = walk_rounds(trees, seq, 3, max_length=100, width=2)  # verify 2 deep: 2 accepted, a miss at anchor 6
    assert cut.accepted == [2, 0, 1] and set(cut.drafted) == {2}


def _tiny_drafter_and_context(length: int):
    """`(target, drafter, ids [length], context [length, L*H])`: a tiny target, a random block-4 drafter and the
    target's hidden states at the drafter's layers over random ids."""
    from adaflash_hf import AdaFlashDrafterModel

    target = make_tiny_target()
    torch.manual_seed(0)
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4).eval()
    ids = torch.randint(0, target.config.vocab_size, (length,))
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=True)
    context = torch.cat([out.hidden_states[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)
    return target, drafter, ids, context


def test_candidate_drafts_share_the_block_after_the_first_token():
    target, drafter, ids, context = _tiny_drafter_and_context(12)
    embed, head = target.get_input_embeddings(), target.lm_head
    one = draft_every_anchor(drafter, embed, head, ids, context, 5)
    trees = draft_every_anchor(drafter, embed, head, ids, context, 5, candidates=3)
    assert trees.shape == (7, 3, 3) and torch.equal(trees[:, 0], one)
    assert torch.equal(trees[:, 1:, 1:], one[:, None, 1:].expand(-1, 2, -1))
    firsts = trees[:, :, 0]
    assert all(len(set(row)) == 3 for row in firsts.tolist())  # three different first tokens per anchor


def test_uniform_anchors_and_greedy_prefix():
    seq = torch.tensor([5, 6, 1, 2, 3])
    argmax = torch.tensor([0, 1, 2, 9, 0])  # the target would say 9 after "1 2": the sequence leaves its path at 4
    assert greedy_prefix_len(seq, argmax, 2) == 4
    drafts = torch.tensor([[1, 2], [2, 9], [9, 0], [0, 0]])  # anchors 1..4 (first anchor = prompt_len - 1)
    # anchor 1: labels (1, 2) both right -> 2; anchor 2: labels (2, 9) (9: the target's token after "1 2", still on
    # its path) both right -> 2; anchor 3: label 9 right, then past the end -> 1
    assert uniform_anchor_accepted(drafts, seq, argmax, 1).tolist() == [2, 2, 1]
    # anchor 1 drafting (1, 3): the second is wrong -> 1
    assert uniform_anchor_accepted(torch.tensor([[1, 3], [0, 0], [0, 0]]), seq, argmax, 1).tolist() == [1, 0, 0]


def test_every_anchor_drafts_equal_one_block_per_anchor():
    from adaflash_hf import AdaFlashDrafterModel

    target = make_tiny_target()
    torch.manual_seed(0)
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4).eval()
    drafter.set_draft_vocab(torch.arange(0, target.config.vocab_size, 2))
    ids = torch.randint(0, target.config.vocab_size, (20,))
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=True)
    context = torch.cat([out.hidden_states[i + 1][0] for i in drafter.config.target_layer_ids], dim=-1)
    drafts = draft_every_anchor(drafter, target.get_input_embeddings(), target.lm_head, ids, context, 5,
                                max_anchors_per_pass=4)  # several passes
    assert drafts.shape == (15, 3) and set(drafts.flatten().tolist()) <= set(range(0, 96, 2))
    for anchor in (5, 11, 19):
        with torch.no_grad():
            one = draft_blocks(drafter, target.get_input_embeddings(), ids[None], context[None],
                               torch.tensor([[anchor]]))[0, 0, 1:]
            logits, vocab = drafter.draft_logits(one, target.lm_head)
        assert drafts[anchor - 5].tolist() == vocab[logits.argmax(-1)].tolist()


@pytest.mark.slow
def test_replayed_tau_equals_served_tau_on_the_real_model(real_target):
    """The shipped drafter alone, greedy fp32, on held-out prompts: replay and serving take the same rounds."""
    from adaflash_hf import AdaFlashDrafterModel
    from adaflash_hf.bench.models import bench_records
    from adaflash_hf.bench.runner import method_setup
    from adaflash_hf.checkpoints import default_drafter_dir
    from adaflash_hf.generation.runtime import decoding_setup
    from adaflash_hf.testbed.prompts import encode_prompt

    # what `bench.models.load_models(device="cpu")` loads: the testbed target (shared, loaded once per session) and
    # the shipped drafter, both fp32
    target, tokenizer = real_target
    drafter = AdaFlashDrafterModel.from_pretrained(default_drafter_dir(), dtype=torch.float32).eval()
    drafter.check_compatible(target, tokenizer)
    knobs, runtime = method_setup(drafter, "drafter_only")
    served, replayed, same = [], [], 0
    records = bench_records(max_per_domain=2)
    for record in records:
        ids = torch.tensor([encode_prompt(tokenizer, record["prompt"])])
        with torch.inference_mode(), decoding_setup(drafter, knobs, runtime):
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                  assistant_model=drafter, return_dict_in_generate=True)
        stats = out.speculation_stats
        result = replay(drafter, target, out.sequences[0], ids.shape[1], max_new_tokens=32)
        served.append(stats.tau)
        replayed.append(result.tau)
        same += result.accepted == stats.accepted and result.drafted == stats.drafted
    assert abs(sum(served) / len(served) - sum(replayed) / len(replayed)) <= 0.02
    # per prompt, only a near-tied argmax may flip a round between the batched pass and serving's forwards
    assert same >= len(records) - 1, list(zip(served, replayed))
    assert all(abs(s - r) <= 0.25 for s, r in zip(served, replayed))


def test_multi_step_drafting_feeds_the_first_drafts_back():
    """steps=2: position 1 keeps step 1's draft; the rest is re-predicted from a block that shows it."""
    target, drafter, ids, context = _tiny_drafter_and_context(16)
    embed, head = target.get_input_embeddings(), target.lm_head
    one = draft_every_anchor(drafter, embed, head, ids, context, 6)
    two = draft_every_anchor(drafter, embed, head, ids, context, 6, steps=2)
    assert torch.equal(two[:, 0], one[:, 0])
    anchor = 9
    with torch.no_grad():
        shown = draft_blocks(drafter, embed, ids[None], context[None], torch.tensor([[anchor]]),
                             revealed=one[anchor - 6][None, None], reveal_len=torch.tensor([[1]]))[0, 0, 1:]
        masked = draft_blocks(drafter, embed, ids[None], context[None], torch.tensor([[anchor]]))[0, 0, 1:]
    assert two[anchor - 6, 1:].tolist() == head(shown).argmax(-1)[1:].tolist()
    assert not torch.allclose(shown[1:], masked[1:])  # the revealed token changes what the block computes


def test_sample_reveal_shows_only_labelled_leading_positions():
    from adaflash_hf.training.blocks import sample_reveal

    mask = torch.tensor([[[1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]]], dtype=torch.bool)
    mask = mask.expand(500, 3, 7)
    reveal = sample_reveal(mask, 0.5, torch.Generator().manual_seed(0))
    assert reveal[:, 0].max() <= 6 and reveal[:, 1].max() <= 1 and reveal[:, 2].max() == 0
    assert 0.4 < (reveal[:, 0] > 0).float().mean() < 0.6  # half the blocks, lengths 1..B-2
    assert set(reveal[:, 0].tolist()) == set(range(7))
    assert sample_reveal(mask, 0.0).abs().sum() == 0


def test_greedy_responses_are_generated_once_and_cached(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import adaflash_hf.training.label_store as label_store
    from adaflash_hf.training.replay import cached_greedy_responses

    target = make_tiny_target()
    tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=None)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7]]
    cache = tmp_path / "responses.jsonl"
    first = cached_greedy_responses(target, tokenizer, prompts, 6, cache, batch_size=2, progress=False)
    with torch.no_grad():
        plain = target.generate(torch.tensor([[8, 9]]), max_new_tokens=6, do_sample=False)
    assert first[1] == plain[0].tolist() and first[0] == first[2] and first[0][:3] == [5, 6, 7]
    monkeypatch.setattr(label_store, "generate_greedy", lambda *a, **k: pytest.fail("regenerated"))
    assert cached_greedy_responses(target, tokenizer, prompts, 6, cache, progress=False) == first
