"""Depth growth of a drafter (training/grow.py): the grown drafter drafts what its parent drafts, and it trains."""

import pytest
import torch

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.training.grow import OUTPUT_PROJECTIONS, grow_drafter

from .conftest import make_tiny_target
from .test_modeling import small_config


def _random_drafter(seed=0):
    torch.manual_seed(seed)
    model = AdaFlashDrafterModel(small_config()).eval()
    with torch.no_grad():  # non-trivial weights everywhere (norms included), so a wrong copy shows
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _outputs(model, noise, context):
    return model(noise_embeds=noise, context_hidden_states=context).last_hidden_state


def test_a_grown_drafter_drafts_exactly_what_its_parent_drafts():
    parent = _random_drafter()
    before = {k: v.clone() for k, v in parent.state_dict().items()}
    grown = grow_drafter(parent, 4)
    assert grown.config.num_hidden_layers == 4 and len(grown.layers) == 4
    assert parent.config.num_hidden_layers == 2  # the parent is left alone
    assert all(torch.equal(before[k], v) for k, v in parent.state_dict().items())
    noise, context = torch.randn(3, 4, 32), torch.randn(3, 9, 64)
    with torch.no_grad():
        assert torch.allclose(_outputs(grown, noise, context), _outputs(parent, noise, context), atol=1e-6)
    # the new layers copy the last trained layer, output projections zeroed (an identity residual layer)
    for i in (2, 3):
        for name, value in grown.layers[i].state_dict().items():
            source = parent.layers[1].state_dict()[name]
            assert torch.equal(value, torch.zeros_like(source) if name in OUTPUT_PROJECTIONS else source), name
    assert grown.layers[3].self_attn.layer_idx == 3  # its own cache slot


def test_a_grown_drafter_trains_its_new_layers_and_round_trips(tmp_path):
    parent = _random_drafter(seed=1)
    grown = grow_drafter(parent, 3).train()
    noise, context = torch.randn(2, 4, 32), torch.randn(2, 7, 64)
    goal = torch.randn(2, 4, 32)
    optimizer = torch.optim.SGD(grown.parameters(), lr=0.5)
    q_before = grown.layers[2].self_attn.q_proj.weight.detach().clone()
    for _ in range(2):  # step 1 moves the zeroed projections, step 2 reaches the copied ones behind them
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(_outputs(grown, noise, context), goal).backward()
        optimizer.step()
    new = grown.layers[2]
    assert new.self_attn.o_proj.weight.abs().sum() > 0 and new.mlp.down_proj.weight.abs().sum() > 0
    assert not torch.equal(new.self_attn.q_proj.weight, q_before)
    grown.eval().save_pretrained(tmp_path)
    loaded = AdaFlashDrafterModel.from_pretrained(tmp_path).eval()
    assert loaded.config.num_hidden_layers == 3
    with torch.no_grad():
        assert torch.allclose(_outputs(loaded, noise, context), _outputs(grown, noise, context), atol=1e-6)


def test_growth_keeps_the_target_pairing_and_refuses_to_shrink():
    target = make_tiny_target()
    parent = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4).eval()
    grown = grow_drafter(parent, 2)
    grown.check_compatible(target)  # same target layers, mask token, vocabulary
    assert grown.config.target_layer_ids == parent.config.target_layer_ids
    with pytest.raises(ValueError, match="only adds layers"):
        grow_drafter(grown, 1)
