"""Anchors, the block-sparse mask, labels and weights of the DFlash training recipe."""

import torch
from transformers.cache_utils import DFlashCache

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.training.blocks import (
    block_attention_mask,
    block_labels,
    block_position_ids,
    draft_blocks,
    gather_context,
    position_weights,
    sample_anchors,
)

from .conftest import make_tiny_target


def test_anchors_lie_in_the_allowed_range_and_are_distinct():
    g = torch.Generator().manual_seed(0)
    lens, starts = torch.tensor([20, 9, 3, 2]), torch.tensor([5, 0, 1, 0])
    anchors, valid = sample_anchors(lens, starts, num_anchors=6, block_size=4, generator=g)
    assert anchors.shape == valid.shape == (4, 6)
    assert valid[0].all() and ((anchors[0] >= 5) & (anchors[0] <= 18)).all() and len(set(anchors[0].tolist())) == 6
    assert valid[1].all() and ((anchors[1] >= 1) & (anchors[1] <= 7)).all()  # anchors need one context token
    assert valid[2].sum() == 1 and anchors[2, 0] == 1  # only position 1 fits in a length-3 sequence
    assert not valid[3].any()  # too short for any block
    again, _ = sample_anchors(lens, starts, 6, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, anchors)


def test_block_mask_sees_context_before_anchor_and_own_block_only():
    anchors = torch.tensor([[2, 5]])
    mask = block_attention_mask(anchors, context_len=7, block_size=3)
    visible = mask[0, 0] == 0
    assert visible.shape == (6, 7 + 6)
    # Block 0 (anchor 2): context 0..1, its own 3 queries.
    assert visible[0, :7].tolist() == [True, True, False, False, False, False, False]
    assert visible[2, 7:].tolist() == [True, True, True, False, False, False]
    # Block 1 (anchor 5): context 0..4, its own block, not block 0.
    assert visible[4, :7].tolist() == [True] * 5 + [False] * 2
    assert visible[4, 7:].tolist() == [False, False, False, True, True, True]
    assert block_position_ids(anchors, 7, 3).tolist() == [[0, 1, 2, 3, 4, 5, 6, 2, 3, 4, 5, 6, 7]]


def test_labels_follow_the_greedy_path_and_stop_at_the_first_disagreement():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    argmax = torch.tensor([[11, 12, 99, 14, 15, 16, 17, 0]])  # the sequence leaves the greedy path at x[3]
    anchors, anchor_valid = torch.tensor([[1, 4]]), torch.tensor([[True, True]])
    labels, valid = block_labels(input_ids, argmax, torch.tensor([8]), anchors, anchor_valid, block_size=4)
    # Anchor 1: k=1 -> a[1]=12 valid; k=2 -> a[2]=99 valid (x[2]=12 agreed); k=3 needs x[3]==a[2]: no.
    assert labels[0, 0].tolist()[:2] == [12, 99] and valid[0, 0].tolist() == [True, True, False]
    # Anchor 4: labels a[4..6] = 15, 16, 17, all on the path and inside the sequence.
    assert labels[0, 1].tolist() == [15, 16, 17] and valid[0, 1].all()
    # Past the end of the sequence nothing is valid.
    _, valid_end = block_labels(input_ids, argmax, torch.tensor([6]), anchors, anchor_valid, block_size=4)
    assert valid_end[0, 1].tolist() == [True, False, False]


def test_position_weights_decay():
    w = position_weights(5, gamma=2.0)
    assert torch.allclose(w, torch.exp(-torch.arange(4) / 2.0))
    assert torch.equal(position_weights(5, None), torch.ones(4))


def test_training_blocks_match_the_generation_path():
    """A block drafted in training (many anchors, one forward) equals the one drafted at inference."""
    target = make_tiny_target(num_layers=4)
    torch.manual_seed(0)
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=2, block_size=4).eval()
    input_ids = torch.randint(0, 96, (1, 16))
    with torch.no_grad():
        hidden = target(input_ids, output_hidden_states=True).hidden_states
        context = gather_context(hidden, drafter.config.target_layer_ids)
        anchors = torch.tensor([[3, 8, 12]])
        train_states = draft_blocks(drafter, target.get_input_embeddings(), input_ids, context, anchors)
        for j, anchor in enumerate(anchors[0].tolist()):
            noise_ids = torch.tensor([[int(input_ids[0, anchor])] + [drafter.config.mask_token_id] * 3])
            cache = DFlashCache(config=drafter.config)
            inference = drafter(
                noise_embeds=target.get_input_embeddings()(noise_ids),
                context_hidden_states=context[:, :anchor],
                position_ids=torch.arange(anchor + 4)[None],
                cache=cache,
            ).last_hidden_state
            assert torch.allclose(train_states[0, j], inference[0], atol=1e-5)


def test_score_blocks_equals_running_the_target_on_each_drafted_prefix():
    from adaflash_hf.training.blocks import score_blocks

    target = make_tiny_target(num_layers=2)
    input_ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 7], [5, 10]])
    drafted = torch.randint(0, 96, (2, 2, 4), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        states = score_blocks(target, input_ids, anchors, drafted)
        assert states.shape == (2, 2, 4, 64)
        for b in range(2):
            for j in range(2):
                i = int(anchors[b, j])
                seq = torch.cat([input_ids[b, : i + 1], drafted[b, j, :-1]])[None]
                ref = target.base_model(input_ids=seq).last_hidden_state[0, i:]
                assert torch.allclose(states[b, j], ref, atol=1e-4)
