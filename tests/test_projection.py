"""A simulated device: an explicitly passed cost model decides (any device); projections of the forwards run here."""

import json
import logging

import pytest
import torch

from adaflash_hf import SpeculationRuntime, generate_batch
from adaflash_hf.bench.projection import ForwardLog, ForwardProbe, project_bench, projected_seconds
from adaflash_hf.bench.runner import Measurement
from adaflash_hf.generation import cost_model as cost_module
from adaflash_hf.generation.cost_model import TargetCostModel, cost_model_for, shipped_cost_model

from .conftest import build_drafter, make_oracle, make_tiny_target, speculate


def foreign(points, draft, implicit=False):
    """A cost model measured on another device (never this CPU)."""
    return TargetCostModel(points=points, draft=draft, device="cuda:Simulated GPU", dtype="float32", threads=0,
                           implicit=implicit)


SYNTHETIC = foreign({1: {1: 0.010, 4: 0.016}, 4: {1: 0.020, 4: 0.032}}, {1: 0.002, 4: 0.004})


def test_projection_equals_a_hand_computation():
    log = ForwardLog(target=[(1, 30), (1, 1), (1, 4), (4, 2)], drafter=[1, 4], target_seconds=0.5,
                     drafter_seconds=0.1, wall_seconds=0.8)
    # host 0.8 - 0.5 - 0.1 = 0.2; prefill (30 tokens) as the widest measured width (4): 0.016; (1, 1): 0.010;
    # (1, 4): 0.016; (4 rows, 2 tokens): 0.020 + (0.032 - 0.020) / 3 = 0.024; drafting: 0.002 + 0.004.
    assert projected_seconds(log, SYNTHETIC) == pytest.approx(0.2 + 0.016 + 0.010 + 0.016 + 0.024 + 0.006)
    assert projected_seconds(ForwardLog(target=[(1, 1)], partial=1), SYNTHETIC) is None  # early exit: not projected


def test_projected_block_is_per_method_and_apart_from_measurements():
    def m(method, seconds, log):
        log.wall_seconds = seconds
        return Measurement(method=method, domain="code", new_tokens=10, seconds=seconds, identical=True,
                           target_forwards=len(log.target), forwards=log)

    plain = ForwardLog(target=[(1, 1)] * 10, target_seconds=0.9)  # host 0.1 + 10 x 0.010 = 0.2 s
    spec = ForwardLog(target=[(1, 1)] + [(1, 4)] * 3, drafter=[1] * 3, target_seconds=0.6, drafter_seconds=0.3)
    block = project_bench([m("plain", 1.0, plain), m("adaflash", 1.0, spec)], SYNTHETIC, "x.json")
    assert block["device"] == "cuda:Simulated GPU" and block["file"] == "x.json" and "not measured" in block["note"]
    assert block["methods"]["plain"]["overall"]["tokens_per_s"] == pytest.approx(10 / 0.2)
    spec_s = 0.1 + 0.010 + 3 * 0.016 + 3 * 0.002
    assert block["methods"]["adaflash"]["overall"]["tokens_per_s"] == pytest.approx(10 / spec_s)
    assert block["methods"]["adaflash"]["domains"]["code"]["speedup"] == pytest.approx(0.2 / spec_s)
    split = block["methods"]["adaflash"]["overall"]["seconds_split"]
    assert split == pytest.approx({"host": 0.1, "target": 0.010 + 3 * 0.016, "drafter": 3 * 0.002, "ops": 0.0})
    json.dumps(block)


def test_tensor_ops_outside_the_forwards_are_projected_at_the_devices_price_per_op():
    # 4 target forwards, 0.052 s on the device, made of 400 counted ops: 0.13 ms an op there. 50 ops outside the
    # forwards took 0.2 s here: they leave host time (0.5 - 0.3 - 0.2 = 0) and cost 50 x 0.13 ms projected.
    log = ForwardLog(target=[(1, 4)] * 2 + [(4, 1)] * 2, target_seconds=0.3, wall_seconds=0.5, ops=50,
                     ops_seconds=0.2, target_ops=400)
    per_op = (2 * 0.016 + 2 * 0.020) / 400
    assert log.host_seconds == pytest.approx(0.0)
    assert projected_seconds(log, SYNTHETIC) == pytest.approx(2 * 0.016 + 2 * 0.020 + 50 * per_op)
    assert ForwardLog(target=[(1, 1)], ops=10, target_ops=0).copy().ops == 10  # copy keeps every field
    # the counter's own Python (1,000 ops it saw outside the forwards at 20 us each here) is not the run's host time
    counted = ForwardLog(target=[(1, 4)], target_seconds=0.3, wall_seconds=0.5, ops=50, ops_seconds=0.1,
                         target_ops=100, dispatched=1000, dispatch_overhead=20e-6)
    assert counted.counter_seconds == pytest.approx(0.02) and counted.host_seconds == pytest.approx(0.08)


def test_the_op_counter_times_only_work_outside_the_forwards():
    import time

    target = make_tiny_target(seed=62, num_layers=2)
    drafter = build_drafter(target, block_size=4, seed=0)
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    probe = ForwardProbe(target, drafter, count_ops=True)
    try:
        start = time.perf_counter()
        out, stats = speculate(target, prompt, drafter, max_new_tokens=12, do_sample=False)
        probe.log.wall_seconds = time.perf_counter() - start
        x = torch.randn(64, 9, 512)
        before, seen = probe.log.ops, probe.log.dispatched
        x.argmax(-1), x.view(-1).sum()  # 2 kernels outside any forward (the view launches none)
        assert probe.log.ops == before + 2 and probe.log.dispatched == seen + 3  # the view's Python is the counter's
    finally:
        probe.close()
    log = probe.log
    assert torch.equal(out, target.generate(prompt, max_new_tokens=12, do_sample=False))
    # every full target forward ran many counted ops; the rounds ran some outside (acceptance, argmax, caches)
    assert log.target_ops >= 10 * len(log.target) and log.ops > stats.rounds
    assert log.dispatch_overhead > 0 and log.dispatched > log.ops  # measured when the probe started
    assert 0 < log.ops_seconds < log.wall_seconds and log.host_seconds == pytest.approx(max(0.0,
        log.wall_seconds - log.target_seconds - log.drafter_seconds - log.ops_seconds - log.counter_seconds))
    torch.randn(3).sum()
    assert probe.log.ops == log.ops  # closed: nothing counted any more


def test_the_probe_logs_the_forwards_the_rounds_ran():
    target = make_tiny_target(seed=60, num_layers=2)
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    reference = target.generate(prompt, max_new_tokens=20, do_sample=False)
    drafter = make_oracle(target, reference, block_size=5, error_rate=0.3)
    probe = ForwardProbe(target, drafter)
    try:
        out, stats = speculate(target, prompt, drafter, max_new_tokens=20, do_sample=False)
    finally:
        probe.close()
    assert torch.equal(out, reference)
    log = probe.log
    assert log.target[0] == (1, 5) and len(log.target) == stats.rounds + 1  # the prefill, then one per round
    assert [n for _, n in log.target[1:]] == [d + 1 for d in stats.drafted]
    assert len(log.drafter) == stats.proposers.count("drafter") and set(log.drafter) == {1}
    assert log.partial == 0 and log.target_seconds > 0 and log.drafter_seconds > 0


def test_the_drafters_lm_head_slice_is_drafting_time_not_host_time():
    """The cost model's drafting step covers the drafter's forward AND its `draft_logits` (the LM-head slice, computed
    outside the forward): the probe counts both as the drafter's seconds, so host time does not count it again."""
    import time

    target = make_tiny_target(seed=61, num_layers=2)
    drafter = build_drafter(target, block_size=4, seed=0)
    slow = type(drafter).draft_logits

    def slow_logits(self, states, lm_head):  # a slice that costs 20 ms here (as a big one on a CPU)
        time.sleep(0.02)
        return slow(self, states, lm_head)

    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(drafter), "draft_logits", slow_logits)
        probe = ForwardProbe(target, drafter)
        try:
            start = time.perf_counter()
            out, stats = speculate(target, prompt, drafter, max_new_tokens=12, do_sample=False)
            probe.log.wall_seconds = time.perf_counter() - start
        finally:
            probe.close()
    drafts = stats.proposers.count("drafter")
    assert drafts >= 2 and probe.log.drafter_seconds >= 0.02 * drafts
    assert probe.log.host_seconds < probe.log.wall_seconds - 0.02 * drafts
    assert "draft_logits" not in drafter.__dict__  # close() leaves the drafter as it was
    assert torch.equal(out, target.generate(prompt, max_new_tokens=12, do_sample=False))


def test_an_explicit_foreign_cost_model_is_applied_an_implicit_one_never(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ADAFLASH_HF_CACHE", str(tmp_path))
    target = make_tiny_target(num_layers=1)
    drafter = build_drafter(target)
    monkeypatch.setattr(TargetCostModel, "calibrate", classmethod(lambda *a, **k: pytest.fail("calibrated")))
    gpu = foreign(SYNTHETIC.points, SYNTHETIC.draft)
    with caplog.at_level(logging.WARNING, logger=cost_module.__name__):
        assert cost_model_for(target, drafter, batch_sizes=(1, 4), candidate=gpu) is gpu
        assert cost_model_for(target, drafter, batch_sizes=(1, 4), candidate=gpu) is gpu
    assert caplog.text.count("simulated device") == 1  # said once per cost model
    implicit = foreign(SYNTHETIC.points, SYNTHETIC.draft, implicit=True)
    assert cost_model_for(target, drafter, candidate=implicit, calibrate=False) is None  # nothing cached here
    SYNTHETIC.save(tmp_path / "c.json")
    assert not TargetCostModel.load(tmp_path / "c.json").implicit
    assert TargetCostModel.load(tmp_path / "c.json", implicit=True).implicit
    assert "implicit" not in json.loads((tmp_path / "c.json").read_text())


def test_a_length_head_folders_cost_model_is_implicit(tmp_path):
    from adaflash_hf.checkpoints import length_head_dir
    from adaflash_hf.interop import load_length_head_folder

    folder = length_head_dir()
    if folder is None:
        pytest.skip("no shipped length head")
    _, cost = load_length_head_folder(folder)
    assert cost is not None and cost.implicit


def test_the_shipped_h200_cost_model_states_its_assumptions():
    cost = shipped_cost_model("h200-smollm2-135m")
    assert cost.device == "cuda:NVIDIA H200" and cost.dtype == "float32" and not cost.implicit
    assert cost.draft_seconds(1) == pytest.approx(0.003) and "NOT measured" in cost.assumptions
    assert 0.015 < cost.seconds(16, 64) < 0.025 and 0.015 < cost.seconds(1, 1) < 0.025  # flat, launch-bound
    assert shipped_cost_model("h200-smollm2-135m-bf16").dtype == "bfloat16"
    with pytest.raises(FileNotFoundError, match="h200-smollm2-135m"):
        shipped_cost_model("nope")


def test_outputs_equal_plain_greedy_whatever_foreign_cost_model_decides():
    target = make_tiny_target(seed=61)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [1, 2, 3], [9, 8, 9, 8, 9, 8]]
    plain = generate_batch(target, None, prompts, 10)
    costs = {"h200": shipped_cost_model("h200-smollm2-135m"),
             "dear drafting": foreign({1: {1: 1.0, 5: 1.1}, 4: {1: 1.2, 5: 1.3}}, {1: 50.0, 4: 50.0}),
             "free drafting": foreign({1: {1: 1.0, 5: 1.0}, 4: {1: 1.0, 5: 1.0}}, {1: 1e-6, 4: 1e-6})}
    sources = {}
    for name, cost in costs.items():
        drafter = build_drafter(target, block_size=5, seed=3, hybrid_lookup=True, allow_no_draft=True)
        SpeculationRuntime(cost_model=cost).attach(drafter)
        rows, stats = generate_batch(target, drafter, prompts, 10, return_stats=True)
        assert rows == plain, name
        drafter.runtime.policy.reset()
        for p, expected in zip(prompts, plain):
            out, bs1 = speculate(target, torch.tensor([p]), drafter, max_new_tokens=10, do_sample=False)
            assert out[0, len(p):].tolist() == expected, name
        sources[name] = (str(stats.sources), str(bs1.proposers))
    assert len(set(sources.values())) > 1  # the foreign costs did decide


def test_cost_model_flag_takes_a_file_or_a_shipped_name(tmp_path, capsys):
    from adaflash_hf.bench.args import cost_model_file

    assert cost_model_file("h200-smollm2-135m").name == "h200-smollm2-135m.json"
    with pytest.raises(SystemExit) as exit_info:
        cost_model_file(str(tmp_path / "missing.json"))
    assert exit_info.value.code == 2 and "shipped cost models: h200-smollm2-135m" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"points": {}}')
    with pytest.raises(SystemExit):
        cost_model_file(str(bad))
    assert "not a cost model JSON" in capsys.readouterr().err


def test_report_prints_the_projection_apart_and_verdicts_ignore_it(tmp_path):
    from adaflash_hf.bench import report
    from adaflash_hf.cli import build_parser

    from .test_report import HEADER, concurrency_data, ok, speedup_data

    def methods(rate, speedup):
        return {"overall": {"tokens_per_s": rate, "speedup": speedup}, "domains": {}}

    d = speedup_data(1.24)
    before = report.VERDICTS["d"](d)
    d["projected"] = {"device": "cuda:NVIDIA H200", "dtype": "float32", "note": "projected, not measured",
                      "assumptions": "draft: NOT measured", "methods": {"plain": methods(45.0, 1.0),
                                                                        "adaflash": methods(70.0, 1.56)}}
    b = concurrency_data([20, 30], [25, 29])
    b["projected"] = {"device": "cuda:NVIDIA H200", "dtype": "float32", "note": "projected, not measured",
                      "concurrency": {"4": {"fixed_block": 300.0, "transformers_cb": None}}}
    assert report.VERDICTS["d"](d) == before
    text = report.write_report({"b": ok(b), "d": ok(d)}, HEADER, tmp_path).read_text()
    for needle in ("Projected on cuda:NVIDIA H200 (float32): **not measured**", "| adaflash | 70.0 | 1.56x |",
                   "| 4 | 300.0 | - |", "Assumes: draft: NOT measured"):
        assert needle in text, needle
    args = build_parser().parse_args(["report", "--cost-model", "h200-smollm2-135m"])
    assert args.cost_model.name == "h200-smollm2-135m.json"
    assert report.command_line(args).endswith(f"--cost-model {args.cost_model}")
    args = build_parser().parse_args(["bench", "--cost-model", "h200-smollm2-135m-bf16"])
    assert args.cost_model.name == "h200-smollm2-135m-bf16.json"
    assert build_parser().parse_args(["bench-serving", "--cost-model", "h200-smollm2-135m"]).cost_model


def test_benches_project_what_they_ran_with_the_cost_model_that_decided(tmp_path, capsys):
    from adaflash_hf.bench.runner import run_benchmark
    from adaflash_hf.bench.serving import print_serving, run_serving
    from adaflash_hf.generation.runtime import runtime_of

    from .test_bench import RECORDS, CharTokenizer

    target = make_tiny_target()
    target.generation_config.eos_token_id = None
    drafter = build_drafter(target, block_size=4, seed=0, hybrid_lookup=True, allow_no_draft=True)
    path = tmp_path / "gpu.json"
    SYNTHETIC.save(path)
    result = run_serving(target, CharTokenizer(), drafter, RECORDS[:2], levels=(1, 2), max_new_tokens=4, requests=2,
                         methods=["transformers_cb", "plain_batched", "engine_plain", "hybrid"], raw=True,
                         progress=False, cost_model_path=path)
    assert runtime_of(drafter).cost_model.device == "cuda:Simulated GPU"  # it decided
    projected = result["projected"]
    assert projected["file"] == str(path) and set(projected["concurrency"]) == {"1", "2"}
    # the policy priced each round's work outside the forwards, measured first at the levels served
    assert projected["round_overhead"] == runtime_of(drafter).cost_model.overhead
    assert all(set(rows) == {1, 2} for rows in projected["round_overhead"].values())
    for level, rates in projected["concurrency"].items():
        assert rates["transformers_cb"] is None  # packed rows: not projected
        assert all(rates[m] > 0 for m in ("plain_batched", "engine_plain", "hybrid"))
        assert all(d["identical"] == d["total"] for d in result["detail"][level].values())
        for method, split in projected["seconds_split"][level].items():  # the rate is what its split adds up to
            tokens = 2 * 4  # 2 requests x 4 new tokens (no EOS)
            assert set(split) == {"host", "target", "drafter", "ops"}
            assert tokens / sum(split.values()) == pytest.approx(rates[method], rel=1e-3)
        assert projected["seconds_split"][level]["engine_plain"]["drafter"] == 0
    print_serving(result)  # the projected block prints each method's split and its ratio to engine_plain
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("   2 hybrid")]
    ratio = projected["concurrency"]["2"]["hybrid"] / projected["concurrency"]["2"]["engine_plain"]
    assert len(lines) == 2 and f"{ratio:.2f}x" in lines[-1]  # the measured row, then the projected one
    results = run_benchmark(target, CharTokenizer(), drafter, RECORDS, methods=("plain", "adaflash"),
                            max_new_tokens=6, raw=True, progress=False)
    for m in results:
        assert m.identical and len(m.forwards.target) == m.target_forwards and m.forwards.wall_seconds == m.seconds
        if m.method == "plain":
            assert m.forwards.target[1:] == [(1, 1)] * 5 and not m.forwards.drafter
    block = project_bench(results, SYNTHETIC)
    assert block["methods"]["plain"]["overall"]["speedup"] == pytest.approx(1.0)
