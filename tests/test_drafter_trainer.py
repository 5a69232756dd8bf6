"""Offline drafter training on a tiny target: loss goes down, acceptance goes up, checkpoints resume."""

import json

import pytest
import torch
from transformers import TrainerCallback

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.training import DrafterTrainer, DrafterTrainingConfig

from .conftest import make_tiny_target, record_tiny_dataset


@pytest.fixture(scope="module")
def recorded():
    target = make_tiny_target(num_layers=4)
    layer_ids = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4).config.target_layer_ids
    dataset = record_tiny_dataset(target, layer_ids, n_sequences=24, max_new_tokens=40)
    return target, dataset


def _trainer(target, dataset, out, **overrides):
    torch.manual_seed(0)
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4)
    kwargs = dict(output_dir=str(out), max_steps=60, num_anchors=8, learning_rate=3e-3, logging_steps=10,
                  save_strategy="no", disable_tqdm=True, use_cpu=True, seed=0)
    kwargs.update(overrides)
    return DrafterTrainer(drafter, DrafterTrainingConfig(**kwargs), target.get_input_embeddings(), target.lm_head,
                          train_dataset=dataset, eval_dataset=dataset.select(range(8)))


def test_recorded_dataset_has_the_documented_columns(recorded):
    target, dataset = recorded
    row = dataset[0]
    assert set(dataset.column_names) == {"input_ids", "prompt_len", "domain", "target_argmax", "hidden_states"}
    assert len(row["hidden_states"]) == len(row["input_ids"]) == len(row["target_argmax"])
    # The responses are the target's greedy output, so its argmax predicts every next response token.
    ids, argmax, start = row["input_ids"], row["target_argmax"], row["prompt_len"]
    assert all(argmax[t] == ids[t + 1] for t in range(start, len(ids) - 1))


def test_training_reduces_loss_and_raises_tau_proxy(recorded, tmp_path):
    target, dataset = recorded
    trainer = _trainer(target, dataset, tmp_path)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < before["eval_loss"]
    assert after["eval_tau_proxy"] > before["eval_tau_proxy"]


def test_checkpoint_saves_the_drafter_and_training_resumes(recorded, tmp_path):
    target, dataset = recorded
    trainer = _trainer(target, dataset, tmp_path, max_steps=20, save_strategy="steps", save_steps=10)
    trainer.train()
    checkpoint = tmp_path / "checkpoint-10"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "adaflash_drafter" and "auto_map" in config
    assert (checkpoint / "model.safetensors").is_file()
    reloaded = AdaFlashDrafterModel.from_pretrained(checkpoint)
    assert set(reloaded.state_dict()) == set(trainer.model.state_dict())  # no target weights in checkpoints

    class CountSteps(TrainerCallback):
        steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    resumed = _trainer(target, dataset, tmp_path, max_steps=20, save_strategy="no")
    resumed.add_callback(CountSteps)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert CountSteps.steps == list(range(11, 21))  # steps 1-10 came from the checkpoint


def test_draft_vocabulary_training(recorded, tmp_path):
    from adaflash_hf.training.data import frequent_tokens

    target, dataset = recorded
    vocab, coverage = frequent_tokens(dataset, k=24, always=[95])
    assert vocab.numel() == 24 and 95 in vocab.tolist() and 0 < coverage <= 1
    full, full_coverage = frequent_tokens(dataset, k=96)
    assert full_coverage == 1.0 and coverage < 1.0
    trainer = _trainer(target, dataset, tmp_path, max_steps=40)
    trainer.model.set_draft_vocab(vocab)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    assert after["eval_loss"] < before["eval_loss"]
