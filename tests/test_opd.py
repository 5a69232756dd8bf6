"""On-policy distillation with reverse KL: the loss, where gradients go, on-policy sampling, training."""

import pytest
import torch

from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.training import OPDConfig, OPDTrainer, reverse_kl_per_token

from .conftest import make_tiny_target, record_tiny_dataset


def test_reverse_kl_matches_a_hand_computation():
    torch.manual_seed(0)
    weight = torch.randn(11, 4)
    student = torch.randn(5, 4, requires_grad=True)
    teacher = torch.randn(5, 4)
    kl = reverse_kl_per_token(student, teacher, weight, beta=1.0)
    q = torch.softmax(student @ weight.T, dim=-1)
    p = torch.softmax(teacher @ weight.T, dim=-1)
    by_hand = (q * (q.log() - p.log())).sum(dim=-1)  # KL(q || p), q = the drafter
    assert torch.allclose(kl, by_hand, atol=1e-5)
    kl.sum().backward()
    grad = student.grad.clone()
    student.grad = None
    by_hand.sum().backward()
    assert torch.allclose(grad, student.grad, atol=1e-5)
    # beta=0 is the forward KL(p || q): a different, also exact value.
    forward = reverse_kl_per_token(student.detach(), teacher, weight, beta=0.0)
    assert torch.allclose(forward, (p * (p.log() - q.log())).sum(-1).detach(), atol=1e-5)


@pytest.fixture(scope="module")
def opd_setup(tmp_path_factory):
    target = make_tiny_target(num_layers=4)
    torch.manual_seed(0)
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4)
    dataset = record_tiny_dataset(target, drafter.config.target_layer_ids, n_sequences=16)
    return target, drafter, dataset, tmp_path_factory.mktemp("opd")


def _trainer(opd_setup, **overrides):
    target, drafter, dataset, out = opd_setup
    kwargs = dict(output_dir=str(out), max_steps=40, num_anchors=8, learning_rate=3e-3, logging_steps=5,
                  save_strategy="no", disable_tqdm=True, use_cpu=True, report_to="none", seed=0)
    kwargs.update(overrides)
    return OPDTrainer(drafter, OPDConfig(**kwargs), target, train_dataset=dataset, eval_dataset=dataset.select(range(4)))


def test_gradients_reach_only_the_drafter(opd_setup):
    trainer = _trainer(opd_setup)
    batch = trainer._prepare_inputs(trainer.data_collator([opd_setup[2][i] for i in range(2)]))
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    target, drafter = opd_setup[0], opd_setup[1]
    assert all(p.grad is None for p in target.parameters())
    assert not any(p.requires_grad for p in target.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    drafter.zero_grad(set_to_none=True)


def test_on_policy_blocks_are_sampled_from_the_drafter_distribution(opd_setup):
    trainer = _trainer(opd_setup, temperature=0.7)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    torch.manual_seed(0)
    samples = trainer.sample_blocks(logits)
    freq = torch.bincount(samples, minlength=4).float() / samples.numel()
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.015)
    greedy = _trainer(opd_setup, temperature=0.0).sample_blocks(logits[:3])
    assert greedy.tolist() == [0, 0, 0]


def test_opd_loss_decreases_on_a_tiny_model(opd_setup):
    trainer = _trainer(opd_setup, max_steps=40)
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) >= 4 and losses[-1] < losses[0]
    assert result.training_loss > 0


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(beta=1.5), dict(beta=-0.1), dict(alpha=-1.0),
                                 dict(kl_clip=0.0), dict(lmbda=1.2), dict(rkl_weight=-0.5)])
def test_opd_config_range_checks(tmp_path, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        OPDConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **bad)


def test_preset_fills_only_fields_left_at_default(tmp_path):
    config = OPDConfig(output_dir=str(tmp_path), preset="adaflash_reference", alpha=0.5, temperature=0.7,
                       use_cpu=True, report_to="none")
    assert (config.alpha, config.temperature) == (0.5, 0.7)  # the user's values
    assert (config.lmbda, config.rkl_weight, config.beta) == (1.0, 0.2, 1.0)  # the preset's
    assert OPDConfig(output_dir=str(tmp_path), kl_clip=None, use_cpu=True, report_to="none").kl_clip is None


def test_adaflash_reference_preset_mixes_ce_and_reverse_kl(opd_setup):
    config = OPDConfig(output_dir=str(opd_setup[3]), preset="adaflash_reference", use_cpu=True, report_to="none")
    assert (config.temperature, config.lmbda, config.alpha, config.rkl_weight, config.beta) == (0.0, 1.0, 0.8, 0.2, 1.0)
    with pytest.raises(ValueError, match="preset"):
        OPDConfig(output_dir=str(opd_setup[3]), preset="nope", use_cpu=True)
    # the loss is rkl_weight * divergence + alpha * CE: with the divergence weighted 0 it is the CE term alone
    batch_of = lambda t: t._prepare_inputs(t.data_collator([opd_setup[2][i] for i in range(2)]))  # noqa: E731
    with torch.no_grad():
        torch.manual_seed(0)
        ce_only = _trainer(opd_setup, temperature=0.0, alpha=1.0, rkl_weight=0.0)
        ce = float(ce_only.compute_loss(ce_only.model, batch_of(ce_only)))
        torch.manual_seed(0)
        both = _trainer(opd_setup, temperature=0.0, alpha=1.0, rkl_weight=1.0)
        mixed = float(both.compute_loss(both.model, batch_of(both)))
        torch.manual_seed(0)
        rkl_only = _trainer(opd_setup, temperature=0.0, alpha=0.0, rkl_weight=1.0)
        rkl = float(rkl_only.compute_loss(rkl_only.model, batch_of(rkl_only)))
    assert ce > 0 and rkl > 0 and mixed == pytest.approx(ce + rkl, rel=1e-4)


def test_reverse_kl_on_the_draft_support_has_the_full_support_gradient():
    """KL(q || p_K) on the draft vocabulary K differs from KL(q || p) by log p(K), a constant for the drafter."""
    torch.manual_seed(1)
    weight, vocab = torch.randn(13, 4), torch.tensor([0, 3, 4, 8, 12])
    student = torch.randn(6, 4, requires_grad=True)
    teacher = torch.randn(6, 4)
    on_support = reverse_kl_per_token(student, teacher, weight[vocab])
    q = torch.softmax(student @ weight[vocab].T, dim=-1)
    p_full = torch.softmax(teacher @ weight.T, dim=-1)
    p_k = p_full[:, vocab] / p_full[:, vocab].sum(-1, keepdim=True)
    assert torch.allclose(on_support, (q * (q.log() - p_k.log())).sum(-1), atol=1e-5)
    full = (q * (q.log() - p_full[:, vocab].log())).sum(-1)  # q is zero outside K
    assert torch.allclose(full - on_support, -p_full[:, vocab].sum(-1).log(), atol=1e-5)
    grad_k = torch.autograd.grad(on_support.sum(), student, retain_graph=True)[0]
    grad_full = torch.autograd.grad(full.sum(), student)[0]
    assert torch.allclose(grad_k, grad_full, atol=1e-5)


def test_opd_samples_and_scores_the_draft_vocabulary_the_drafter_serves(opd_setup, monkeypatch):
    import copy

    import torch.nn.functional as F

    import adaflash_hf.training.opd_trainer as opd
    from adaflash_hf.training.blocks import draft_blocks

    target, drafter, dataset, _ = opd_setup
    served = copy.deepcopy(drafter)
    vocab = torch.arange(1, target.config.vocab_size, 3)
    served.set_draft_vocab(vocab)
    seen = {}

    def spy(target_, ids, anchors, drafted):
        seen["drafted"] = drafted.clone()
        seen["teacher"] = opd.score_blocks.__wrapped__(target_, ids, anchors, drafted)
        return seen["teacher"]

    spy.__wrapped__ = opd.score_blocks
    monkeypatch.setattr(opd, "score_blocks", spy)
    trainer = OPDTrainer(served, OPDConfig(output_dir=str(opd_setup[3]), num_anchors=8, temperature=1.0, alpha=0.0,
                                           kl_clip=None, use_cpu=True, report_to="none", seed=0), target,
                         train_dataset=dataset)
    batch = trainer._prepare_inputs(trainer.data_collator([dataset[i] for i in range(2)]))
    with torch.no_grad():
        loss = trainer.compute_loss(served, batch)
        assert set(seen["drafted"].flatten().tolist()) <= set(vocab.tolist())  # on-policy = what it can serve
        hidden = draft_blocks(served, target.get_input_embeddings(), batch["input_ids"], batch["context"],
                              batch["anchors"])[:, :, 1:]
        k = torch.arange(1, hidden.shape[2] + 1)
        mask = batch["anchor_valid"][:, :, None] & ((batch["anchors"][:, :, None] + k) < batch["seq_lens"][:, None, None])
        rows = mask.nonzero(as_tuple=True)
        head = target.lm_head.weight[vocab]
        q = F.softmax(hidden[rows] @ head.T, -1)
        p = F.softmax(seen["teacher"][rows] @ head.T, -1)  # the target renormalised on the draft vocabulary
        w = trainer.position_weights[rows[2]]
        by_hand = ((q * (q.log() - p.log())).sum(-1) * w).sum() / w.sum()
    assert float(loss) == pytest.approx(float(by_hand), rel=1e-4)
    # the served drafter's own logits are exactly those of the head slice OPD trains
    logits, ids = served.draft_logits(hidden[rows], target.lm_head)
    assert torch.equal(ids, vocab) and torch.allclose(logits, hidden[rows] @ head.T, atol=1e-5)
