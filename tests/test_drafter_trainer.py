"""Offline drafter training on a tiny target: loss goes down, acceptance goes up, checkpoints resume."""

import copy
import json

import pytest
import torch
from transformers import TrainerCallback

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.training import DrafterDataCollator, DrafterTrainer, DrafterTrainingConfig

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
    assert set(dataset.column_names) == {"input_ids", "prompt_len", "domain", "target_argmax", "hidden_states",
                                         "target_topk_ids", "target_topk_logits"}
    assert len(row["hidden_states"]) == len(row["input_ids"]) == len(row["target_argmax"])
    # The recorded top-k are the target's own next-token logits, best first, the argmax among them.
    with torch.no_grad():
        logits = target(torch.tensor([row["input_ids"]])).logits[0]
    top = logits.topk(len(row["target_topk_ids"][0]), dim=-1)
    assert torch.equal(torch.tensor(row["target_topk_ids"]), top.indices.int())
    torch.testing.assert_close(torch.tensor(row["target_topk_logits"]).float(), top.values, atol=2e-2, rtol=1e-2)
    assert [ids[0] for ids in row["target_topk_ids"]] == list(row["target_argmax"])
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


# ------------------------------------------------------------------------------------------ training from the label store
def _tiny_store(root, n_prompts=24, n_chunks=6):
    from adaflash_hf.training.label_store import LabelStore

    from .conftest import VOCAB, make_tiny_target
    from .test_label_store import FakeTokenizer, prompts, random_chunks

    target = make_tiny_target()
    responses = LabelStore.open("tiny", torch.bfloat16, vocab_size=VOCAB, root=root)
    corpus = LabelStore.open("tiny", torch.float32, vocab_size=VOCAB, root=root)
    responses.add_responses(target, FakeTokenizer(), prompts(n_prompts), max_new_tokens=12, progress=False)
    corpus.add_corpus(target, random_chunks(n_chunks), progress=False)
    return target, responses, corpus


def test_store_holdout_is_fixed_and_never_trained_on(tmp_path):
    from collections import Counter

    from adaflash_hf.training.label_store import select_entries
    from adaflash_hf.training.store_data import is_held_out, split_holdout

    from .test_label_store import FakeTokenizer, prompts

    target, responses, corpus = _tiny_store(tmp_path)
    selection = select_entries(responses, corpus, corpus_ratio=0.5)
    train, val = split_holdout(selection, holdout_permille=300, val_per_domain=2)
    held = {e["key"] for *_, e in selection if is_held_out(e, 300)}
    assert held and len(train) == len(selection) - len(held)
    assert not {e["key"] for *_, e in train} & held
    assert {e["key"] for *_, e in val} <= held and all(kind == "responses" for _, kind, _ in val)
    assert Counter(e["domain"] for *_, e in val) == {"code": 2, "chat": 2}
    # The store grows: the validation set stays the same, and nothing held out is ever trained on.
    responses.add_responses(target, FakeTokenizer(), prompts(16, start=24), max_new_tokens=12, progress=False)
    bigger = select_entries(responses, corpus, corpus_ratio=0.5)
    train2, val2 = split_holdout(bigger, holdout_permille=300, val_per_domain=2)
    assert len(bigger) > len(selection) and len(train2) > len(train)
    assert [e["key"] for *_, e in val2] == [e["key"] for *_, e in val]
    assert not {e["key"] for *_, e in train2} & {e["key"] for *_, e in bigger if is_held_out(e, 300)}
    # Caps on the training data do not move the validation set when it is drawn from the whole store.
    capped = select_entries(responses, corpus, corpus_ratio=0.5, max_responses_per_domain=3)
    everything = [(responses, "responses", e) for e in responses.entries("responses")]
    train3, val3 = split_holdout(capped, holdout_permille=300, val_per_domain=2, candidates=everything)
    assert [e["key"] for *_, e in val3] == [e["key"] for *_, e in val]
    assert len(train3) < len(capped) + 1 and not {e["key"] for *_, e in train3} & held


def test_store_training_data_and_a_response_only_draft_vocabulary(tmp_path):
    from adaflash_hf.training.data import frequent_tokens
    from adaflash_hf.training.store_data import response_tokens, store_training_data

    target, *_ = _tiny_store(tmp_path)
    data = store_training_data(target, "tiny", [0, 2], corpus_ratio=1.0, holdout_permille=300, val_per_domain=2,
                               root=tmp_path, progress=False)
    assert len(data.train) == len(data.train_selection) and len(data.val) == len(data.val_selection) == 4
    assert {row["domain"] for row in data.val} == {"code", "chat"}
    kinds = {kind for _, kind, _ in data.train_selection}
    assert kinds == {"responses", "corpus"} and data.info["train"]["corpus"]
    assert data.info["train_tokens"] == sum(len(row["input_ids"]) for row in data.train)
    vocab, coverage = data.draft_vocab(8)
    tokens = response_tokens(data.train_selection)
    assert torch.equal(vocab, frequent_tokens(tokens, 8)[0]) and 0 < coverage <= 1
    seen = {int(t) for ids, start in zip(tokens["input_ids"], tokens["prompt_len"]) for t in ids[start:]}
    assert set(vocab.tolist()) <= seen  # corpus text does not enter the draft vocabulary
    with pytest.raises(FileNotFoundError, match="label_data"):
        store_training_data(target, "no-such-target", [0, 2], root=tmp_path, progress=False)


def test_hidden_states_recorded_by_a_bf16_copy_are_cached_apart_and_close_to_fp32(tmp_path):
    from adaflash_hf.training.label_hidden import hidden_cache_dir
    from adaflash_hf.training.store_data import store_training_data

    target, *_ = _tiny_store(tmp_path)
    kwargs = dict(corpus_ratio=0.0, holdout_permille=300, val_per_domain=2, root=tmp_path, progress=False)
    fp32 = store_training_data(target, "tiny", [0, 2], **kwargs)
    bf16 = store_training_data(target, "tiny", [0, 2], record_dtype=torch.bfloat16, **kwargs)
    assert target.dtype == torch.float32  # the caller's target is not converted
    folders = [hidden_cache_dir("tiny", target, [0, 2], tmp_path),
               hidden_cache_dir("tiny", copy.deepcopy(target).to(torch.bfloat16), [0, 2], tmp_path)]
    assert folders[0] != folders[1] and all(any(f.glob("shard-*.arrow")) for f in folders)
    assert [r["input_ids"].tolist() for r in bf16.train.with_format("numpy")] == \
        [r["input_ids"].tolist() for r in fp32.train.with_format("numpy")]
    a = torch.cat([torch.as_tensor(r["hidden_states"]) for r in fp32.train.with_format("numpy")]).float()
    b = torch.cat([torch.as_tensor(r["hidden_states"]) for r in bf16.train.with_format("numpy")]).float()
    assert not torch.equal(a, b)  # really recorded in bf16 ...
    assert (a - b).norm() < 0.05 * a.norm()  # ... and close to the fp32 recording
    with pytest.raises(ValueError, match="corpus store"):  # corpus labels are checked in the labelling dtype
        store_training_data(target, "tiny", [0, 2], **{**kwargs, "corpus_ratio": 1.0}, record_dtype=torch.bfloat16)


def test_eval_reports_tau_proxy_per_domain(recorded, tmp_path):
    target, dataset = recorded
    two = dataset.map(lambda row, i: {"domain": "ab"[i % 2]}, with_indices=True)
    trainer = _trainer(target, two, tmp_path, max_steps=10)
    trainer.eval_dataset = two.select(range(8)).with_format("numpy")
    trainer.eval_domains = trainer.eval_collator.domains = ["a", "b"]
    trainer.train()
    metrics = trainer.evaluate()
    a, b = metrics["eval_tau_proxy_a"], metrics["eval_tau_proxy_b"]
    assert min(a, b) <= metrics["eval_tau_proxy"] <= max(a, b) and a >= 1 and b >= 1


def test_eval_curve_best_drafter_budget_and_resume(recorded, tmp_path):
    from adaflash_hf.training.callbacks import ComputeBudgetCallback, EvalCurveCallback, resolve_checkpoint

    target, dataset = recorded
    assert resolve_checkpoint("last", tmp_path / "nothing") is None and resolve_checkpoint(None, tmp_path) is None
    budget = ComputeBudgetCallback()
    curve = EvalCurveCallback(tmp_path, budget=budget, extra={"shape": "1L/b4"})
    trainer = _trainer(target, dataset, tmp_path, max_steps=20, eval_strategy="steps", eval_steps=5,
                       save_strategy="steps", save_steps=10)
    for callback in (budget, curve):
        trainer.add_callback(callback)
    trainer.train()
    stored = json.loads((tmp_path / "eval_curve.json").read_text())
    assert [p["step"] for p in stored["points"]] == [5, 10, 15, 20]
    assert all("eval_tau_proxy" in p and p["train_cpu_seconds"] > 0 for p in stored["points"])
    assert [p["step"] for p in stored["points"] if "train_loss" in p] == [10, 20]  # logged every 10 steps
    assert stored["best"]["eval_tau_proxy"] == max(p["eval_tau_proxy"] for p in stored["points"])
    best = json.loads((tmp_path / "best" / "best_metrics.json").read_text())
    assert best["eval_tau_proxy"] == stored["best"]["eval_tau_proxy"]
    assert AdaFlashDrafterModel.from_pretrained(tmp_path / "best").config.block_size == 4
    assert budget.steps == 20 and budget.seconds_per_step() > 0
    assert resolve_checkpoint("last", tmp_path).endswith("checkpoint-20")

    # Resumed from step 10: the points past it are dropped, then evaluated again.
    resumed = _trainer(target, dataset, tmp_path, max_steps=20, eval_strategy="steps", eval_steps=5,
                       save_strategy="no")
    resumed.add_callback(EvalCurveCallback(tmp_path))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-10"))
    stored = json.loads((tmp_path / "eval_curve.json").read_text())
    assert [p["step"] for p in stored["points"]] == [5, 10, 15, 20]
    assert [r["from_step"] for r in stored["runs"]] == [0, 10]

    # A CPU budget stops training early.
    stopper = ComputeBudgetCallback(max_cpu_seconds=1e-9)
    short = _trainer(target, dataset, tmp_path / "short", max_steps=20)
    short.add_callback(stopper)
    short.train()
    assert short.state.global_step == 1 and stopper.steps == 1
    # With checkpoints on, a run stopped by its budget saves where it stopped (the next leg resumes there).
    leg = _trainer(target, dataset, tmp_path / "leg", max_steps=20, save_strategy="steps", save_steps=10)
    leg.add_callback(ComputeBudgetCallback(max_cpu_seconds=1e-9))
    leg.train()
    assert resolve_checkpoint("last", tmp_path / "leg").endswith("checkpoint-1")


def test_eval_reports_replayed_tau_of_serving(recorded, tmp_path):
    """`eval_replay_tau` is the walk of `training/replay.py` over each eval response, pooled over rounds."""
    from adaflash_hf.training.replay import pooled_tau, replay

    target, dataset = recorded
    trainer = _trainer(target, dataset, tmp_path, max_steps=30)
    trainer.train()
    metrics = trainer.evaluate()
    drafter = trainer.model.eval()
    by_hand = []
    for row in dataset.select(range(8)):
        ids = torch.tensor(row["input_ids"])
        context = torch.tensor(row["hidden_states"], dtype=torch.float32)
        by_hand.append(replay(drafter, target, ids, row["prompt_len"], context=context))
    assert metrics["eval_replay_tau"] == pytest.approx(pooled_tau(by_hand))
    assert metrics["eval_replay_tau"] > 1.0  # trained on these very responses: some drafts are accepted
    off = _trainer(target, dataset, tmp_path / "off", max_steps=1, replay_eval=False).evaluate()
    assert "eval_replay_tau" not in off and "eval_tau_proxy" in off


def test_prefix_revealed_training_learns_the_rest_of_the_block(recorded, tmp_path):
    """reveal_prob: training blocks show a label prefix and learn the rest; the revealed labels are not predicted
    (they leave the loss), evaluation stays all-mask, and the loss still goes down."""
    target, dataset = recorded
    trainer = _trainer(target, dataset, tmp_path, max_steps=40, reveal_prob=0.5)
    batch = trainer.data_collator([dataset[i] for i in range(4)])
    assert "reveal_len" in batch and batch["reveal_len"].max() > 0
    assert "reveal_len" not in trainer.eval_collator([dataset[i] for i in range(4)])
    full = dict(batch)
    full["reveal_len"] = torch.full_like(batch["reveal_len"], 2)  # 3 drafted positions: 2 shown, 1 predicted
    with torch.no_grad():
        _, (predicted, rows) = trainer.compute_loss(trainer.model, full, return_outputs=True)
    assert (rows[2] == 2).all()  # only block position 3 (index 2) is scored
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="reveal_prob"):
        DrafterTrainingConfig(output_dir=str(tmp_path), reveal_prob=1.5, use_cpu=True)


def test_soft_label_kl_matches_a_hand_computation():
    """KL(p || q) with p the top-k renormalised over the draft vocabulary: tokens outside it leave p, and a row
    none of whose top-k is draftable is not usable (and not NaN)."""
    from adaflash_hf.training.drafter_trainer import soft_label_kl

    vocab = torch.tensor([3, 5, 7])
    logits = torch.tensor([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]], requires_grad=True)
    soft_ids = torch.tensor([[5, 9, 3], [1, 2, 4]])  # row 0: 9 is not draftable; row 1: nothing is
    soft_logits = torch.tensor([[2.0, 9.0, 1.0], [1.0, 2.0, 3.0]])
    kl, usable = soft_label_kl(logits, vocab, soft_ids, soft_logits)
    p = torch.softmax(torch.tensor([2.0, 1.0]), dim=0)  # over tokens 5, 3
    q = torch.softmax(logits[0].detach(), dim=0)[[1, 0]]
    torch.testing.assert_close(kl[0], (p * (p.log() - q.log())).sum())
    assert usable.tolist() == [True, False]
    (kl * usable).sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[1].abs().sum() == 0


def test_soft_labels_train_toward_the_target_distribution(recorded, tmp_path):
    """soft_label_weight: batches carry the recorded top-k at each block position, the loss mixes in the KL, and
    training lowers the KL to the target's distribution (a hard-label run of the same length lowers it less)."""
    from adaflash_hf.training.drafter_trainer import soft_label_kl

    target, dataset = recorded

    def mean_kl(trainer, batch):
        with torch.no_grad():
            hidden = trainer._block_hidden(trainer.model, batch)
            rows = batch["label_mask"].nonzero(as_tuple=True)
            logits, vocab = trainer.model.draft_logits(hidden[rows], target.lm_head)
            kl, usable = soft_label_kl(logits.float(), vocab, batch["soft_ids"][rows], batch["soft_logits"][rows])
        return float(kl[usable].mean())

    after = {}
    for weight in (0.0, 0.9):
        trainer = _trainer(target, dataset, tmp_path / str(weight), max_steps=40, soft_label_weight=weight)
        probe = DrafterDataCollator(4, 8, 640, seed=5, soft_labels=True)([dataset[i] for i in range(6)])
        # block position k of anchor a is labelled by a[a + k - 1]: its soft labels are that position's top-k
        a = int(probe["anchors"][0, 0])
        assert probe["soft_ids"][0, 0, 0, 0] == dataset[0]["target_argmax"][a] == probe["labels"][0, 0, 0] or \
            not probe["label_mask"][0, 0, 0]
        if weight:
            assert "soft_ids" in trainer.data_collator([dataset[i] for i in range(2)])
            assert "soft_ids" not in trainer.eval_collator([dataset[i] for i in range(2)])
        before = mean_kl(trainer, probe)
        trainer.train()
        after[weight] = mean_kl(trainer, probe)
        assert after[weight] < before
    assert after[0.9] < after[0.0]
    with pytest.raises(ValueError, match="soft_label_weight"):
        DrafterTrainingConfig(output_dir=str(tmp_path), soft_label_weight=2.0, use_cpu=True)


def test_best_drafter_is_picked_by_replayed_tau_when_it_is_measured(tmp_path):
    from adaflash_hf.training.callbacks import EvalCurveCallback, best_metric

    assert best_metric(DrafterTrainingConfig(output_dir=str(tmp_path), use_cpu=True)) == "replay_tau"
    off = DrafterTrainingConfig(output_dir=str(tmp_path), use_cpu=True, replay_eval=False)
    assert best_metric(off) == "tau_proxy"
    assert EvalCurveCallback(tmp_path, metric=best_metric(off)).metric == "eval_tau_proxy"
