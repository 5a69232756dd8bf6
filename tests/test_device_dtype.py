"""Device and dtype correctness on every path, and faults that must not crash decoding."""

import logging

import pytest
import torch

from adaflash_hf import generate_batch
from adaflash_hf.generation import cost_model as cost_module
from adaflash_hf.generation.cost_model import TargetCostModel, cost_model_for, device_name
from adaflash_hf.online import OnlineSpecAdapter, OnlineSpecConfig

from .conftest import build_drafter, device_cost, make_oracle, make_tiny_target, speculate


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (int(k),), generator=g).tolist() for k in torch.randint(3, 12, (n,), generator=g)]


# ------------------------------------------------------------------------------------------------ dtype


@pytest.mark.parametrize("algorithm", [None, "ogd", "ensemble"])
def test_bf16_drafter_beside_an_fp32_target_on_every_path(algorithm):
    target = make_tiny_target(seed=30)
    prompt = torch.tensor([_prompts(1, seed=30)[0]])
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    drafter = make_oracle(target, reference, block_size=4, error_rate=0.3).to(torch.bfloat16)
    if algorithm:
        OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(algorithm=algorithm, learning_rate=0.01))
    out, stats = speculate(target, prompt, drafter, max_new_tokens=20, do_sample=False)
    assert torch.equal(out, reference) and sum(stats.accepted) > 0
    native = target.generate(prompt, assistant_model=drafter, max_new_tokens=20, speculation_type="dflash")
    assert torch.equal(native, reference)
    if algorithm:
        assert drafter.runtime.online_adapter.stats.updates > 0
    prompts = _prompts(3, seed=31)
    rows = generate_batch(target, build_drafter(target).to(torch.bfloat16), prompts, 10)
    assert rows == [target.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]


# ------------------------------------------------------------------------------------------------ faults


def _nan_drafter(target, **knobs):
    drafter = build_drafter(target, block_size=4, **knobs)
    with torch.no_grad():
        for p in drafter.parameters():
            p.fill_(float("nan"))
    return drafter


@pytest.mark.parametrize("do_sample", [False, True])
def test_non_finite_drafts_are_rejected_drafts_not_a_crash(do_sample):
    target = make_tiny_target(seed=32)
    prompt = torch.tensor([[5, 6, 7, 8]])
    drafter = _nan_drafter(target)
    torch.manual_seed(0)
    out, stats = speculate(target, prompt, drafter, max_new_tokens=12, do_sample=do_sample)
    assert out.shape[1] == prompt.shape[1] + 12 and set(stats.drafted) == {0}  # every round: no usable draft
    if not do_sample:
        assert torch.equal(out, target.generate(prompt, max_new_tokens=12, do_sample=False))
    rows, batch_stats = generate_batch(target, drafter, _prompts(3, seed=32), 8, do_sample=do_sample,
                                       return_stats=True)
    assert all(len(r) == 8 for r in rows) and all(v == 0 for row in batch_stats.verified for v in row)


def test_generate_batch_refuses_a_mismatched_pair_before_any_compute():
    target = make_tiny_target(seed=33)
    other = make_tiny_target(seed=33, hidden_size=32, vocab_size=80)
    drafter = build_drafter(other)
    calls = []
    target.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"(?s)hidden size: target 64 vs drafter 32.*vocabulary size"):
        generate_batch(target, drafter, [[1, 2, 3]], 4)
    assert calls == []


# ------------------------------------------------------------------------------------------------ cost model


def test_calibration_synchronizes_before_every_clock_read(monkeypatch):
    target = make_tiny_target(num_layers=1)
    events = []
    real_sync, real_clock = cost_module.synchronize, cost_module.time.perf_counter
    monkeypatch.setattr(cost_module, "synchronize", lambda device: events.append("sync") or real_sync(device))
    monkeypatch.setattr(cost_module.time, "perf_counter", lambda: events.append("clock") or real_clock())
    cost = TargetCostModel.calibrate(target, build_drafter(target), num_tokens=(1, 2), repeats=1,
                                     context_length=8, attempts=1)  # one measurement: a busy machine adds none
    clocks = [i for i, e in enumerate(events) if e == "clock"]
    # (2 widths + 1 drafting step) x (1 warm-up + MIN_TIMED_RUNS timed) x (start, stop)
    assert len(clocks) == 3 * (1 + cost_module.MIN_TIMED_RUNS) * 2
    assert all(events[i - 1] == "sync" for i in clocks)
    assert (cost.device, cost.dtype, cost.threads) == ("cpu", "float32", torch.get_num_threads())
    assert set(cost.points[1]) == {1, 2} and cost.draft[1] > 0 and cost.key


def test_a_cost_model_from_another_device_is_never_applied_silently(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ADAFLASH_HF_CACHE", str(tmp_path))
    target = make_tiny_target(num_layers=1)
    drafter = build_drafter(target)
    gpu = TargetCostModel(points={1: {1: 0.02, 16: 0.02}}, draft={1: 0.001}, device="cuda:NVIDIA H200",
                          dtype="float32", threads=16, implicit=True)  # e.g. beside a length head (explicit: applied)
    with caplog.at_level(logging.WARNING, logger=cost_module.__name__):
        here = cost_model_for(target, drafter, batch_sizes=(1, 4), candidate=gpu)
    assert here is not gpu and here.device == device_name("cpu") and here.covers(4, drafts=True)
    assert "does not describe" in caplog.text and "calibrated the target's cost model" in caplog.text
    cached = list((tmp_path / "cost_models").glob("*.json"))
    assert len(cached) == 1
    monkeypatch.setattr(TargetCostModel, "calibrate", classmethod(lambda *a, **k: pytest.fail("recalibrated")))
    again = cost_model_for(target, drafter, batch_sizes=(1, 4), candidate=gpu)  # measured once per device
    assert again.points == here.points
    matching = device_cost({1: {1: 1.0, 4: 1.1}, 8: {1: 2.0}}, draft=0.1)
    assert cost_model_for(target, drafter, batch_sizes=(1, 8), candidate=matching) is matching


def test_a_shipped_cost_model_records_what_it_was_measured_on():
    from adaflash_hf.checkpoints import length_head_dir

    folder = length_head_dir()
    if folder is None:
        pytest.skip("no shipped length head")
    cost = TargetCostModel.load(folder / "cost_model.json")
    assert cost.device and cost.dtype and cost.threads > 0


# ------------------------------------------------------------------------------------------------ CLI / CUDA


def test_device_flag_without_an_accelerator_fails_clearly(monkeypatch):
    from adaflash_hf.bench.models import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(SystemExit, match="no CUDA device"):
        resolve_device("cuda")


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_paths_keep_every_tensor_on_the_device(dtype):
    target = make_tiny_target(seed=34).to("cuda", dtype)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6]], device="cuda")
    reference = target.generate(prompt, max_new_tokens=16, do_sample=False)
    drafter = build_drafter(target, block_size=4, hybrid_lookup=True, allow_no_draft=True).to("cuda", dtype)
    out, stats = speculate(target, prompt, drafter, max_new_tokens=16, do_sample=False)
    if dtype == torch.float32:
        assert torch.equal(out, reference)
    assert stats.rounds > 0
    rows = generate_batch(target, drafter, [[1, 2, 3], [4, 5, 6, 7]], 8)
    assert all(len(r) == 8 for r in rows)
    cost = cost_model_for(target, drafter)
    assert cost.device.startswith("cuda:")
