"""Adaptive length head: survival math, cost-aware length choice, data collection, training, generation."""

import pytest
import torch
from transformers import AutoModel, TrainingArguments

from adaflash_hf import AdaFlashDrafterModel, SpeculationRuntime
from adaflash_hf.generation.cost_model import TargetCostModel, best_length
from adaflash_hf.models import AdaFlashLengthHead, AdaFlashLengthHeadConfig
from adaflash_hf.training.length_head import (
    LengthHeadTrainer,
    collect_length_data,
    expected_acceptance,
    length_metrics,
)

from .conftest import device_cost, make_oracle, make_tiny_target, record_tiny_dataset, speculate


def _head(hidden=64, block=6, bias=0.0):
    torch.manual_seed(0)
    head = AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=hidden, block_size=block, head_dim=16)).eval()
    with torch.no_grad():
        head.out.bias.fill_(bias)
    return head


def test_survival_is_the_running_product_and_loss_ignores_positions_after_a_rejection():
    head = _head()
    states, feats = torch.randn(2, 5, 64), torch.rand(2, 5, 3)
    out = head(states, feats, labels=torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 0, 0]]))
    assert torch.allclose(out.survival, torch.sigmoid(out.logits).cumprod(dim=-1), atol=1e-6)
    assert (out.survival[:, 1:] <= out.survival[:, :-1] + 1e-7).all()
    # Changing labels after the first rejection does not change the loss.
    other = head(states, feats, labels=torch.tensor([[1, 0, 0, 0, 0], [1, 1, 1, 0, 1]]))
    assert torch.allclose(out.loss, other.loss)
    assert sum(p.numel() for p in head.parameters()) < 300_000


def test_best_length_trades_expected_acceptance_against_cost():
    cost = TargetCostModel(points={1: {1: 0.050, 2: 0.052, 8: 0.080, 16: 0.120}})
    assert cost.seconds(4) == pytest.approx(0.052 + 2 / 6 * 0.028)
    assert best_length(torch.full((7,), 0.99), cost) == 7
    assert best_length(torch.tensor([0.02, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0]), cost) == 0  # 1.02/0.052 < 1/0.05
    assert 0 < best_length(torch.tensor([0.9, 0.8, 0.2, 0.05, 0.01, 0.0, 0.0]), cost) < 7
    assert best_length(torch.full((7,), 0.01), None) == 7  # no cost model: fixed block


def test_cost_model_calibrates_and_round_trips(tmp_path):
    target = make_tiny_target(num_layers=2)
    cost = TargetCostModel.calibrate(target, num_tokens=(1, 4), context_length=16, repeats=1)
    assert set(cost.points[1]) == {1, 4} and all(v > 0 for v in cost.points[1].values())
    cost.save(tmp_path / "cost.json")
    assert TargetCostModel.load(tmp_path / "cost.json").points == cost.points


@pytest.mark.parametrize("bias, expect_drafts", [(-20.0, False), (20.0, True)])
def test_generation_with_a_length_head_is_lossless_and_truncates(bias, expect_drafts):
    target = make_tiny_target(seed=2)
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    reference = target.generate(prompt, max_new_tokens=40, do_sample=False)
    drafter = make_oracle(target, reference, block_size=6, error_rate=0.2)
    SpeculationRuntime(length_head=_head(bias=bias), cost_model=device_cost({1: {1: 0.05, 8: 0.09}})).attach(drafter)
    out, stats = speculate(target, prompt, drafter, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, reference[:, : prompt.shape[1] + 30])
    assert (max(stats.drafted) > 0) == expect_drafts
    # the head ran in every round that could draft (all but the last, which has no tokens left to draft)
    assert len(stats.survival) == len(stats.drafted) - 1 > 0


def test_collect_train_and_save_a_length_head(tmp_path):
    target = make_tiny_target(num_layers=4)
    torch.manual_seed(0)
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4).eval()
    recorded = record_tiny_dataset(target, drafter.config.target_layer_ids, n_sequences=12)
    data = collect_length_data(drafter, target, recorded, num_anchors=8, progress=False)
    assert data.labels.shape[1] == 3 and len(data) > 50
    assert torch.equal(expected_acceptance(torch.tensor([[1, 1, 0], [0, 1, 1]])), torch.tensor([2, 0]))

    head = AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=64, block_size=4, head_dim=16))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=40, learning_rate=1e-2, per_device_train_batch_size=32,
                             logging_steps=10, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = LengthHeadTrainer(model=head, args=args, train_dataset=data, eval_dataset=data,
                                compute_metrics=length_metrics)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < before["eval_loss"]
    assert after["eval_mae_accepted"] < before["eval_mae_accepted"] + 1e-6
    head.save_pretrained(tmp_path / "head")
    loaded = AutoModel.from_pretrained(tmp_path / "head")
    assert isinstance(loaded, AdaFlashLengthHead)


def test_length_head_loading_refuses_pickle_and_non_finite_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    _head(hidden=64, block=6).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    assert isinstance(AdaFlashLengthHead.from_pretrained(tmp_path), AdaFlashLengthHead)

    torch.save(state, tmp_path / "pytorch_model.bin")  # pickle only
    weights.unlink()
    for load in (AdaFlashLengthHead.from_pretrained, AutoModel.from_pretrained):
        with pytest.raises(OSError, match=r"(?s)refusing to load pickle-based weights .*pytorch_model\.bin.*"
                                          r"safetensors\.torch\.save_file\(torch\.load"):
            load(tmp_path)
    with pytest.raises(ValueError, match="use_safetensors=False"):
        AdaFlashLengthHead.from_pretrained(tmp_path, use_safetensors=False)

    (tmp_path / "pytorch_model.bin").unlink()
    state["out.weight"][0, 2] = float("inf")
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'out\.weight' has non-finite values \(1 of 16\)"):
        AdaFlashLengthHead.from_pretrained(tmp_path)
