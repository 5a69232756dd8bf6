"""Calibrating the target's cost model: bounded points, interpolation, one calibration per cache file, the CLI."""

import json
import threading

import pytest
import torch

from adaflash_hf import SpeculationRuntime, generate_batch
from adaflash_hf.generation import cost_model as cost_module
from adaflash_hf.generation.cost_model import TargetCostModel, cache_path, cost_model_for

from .conftest import build_drafter, device_cost, make_tiny_target, speculate


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_HF_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _pair(block_size=5, **knobs):
    target = make_tiny_target(seed=50, num_layers=1)
    return target, build_drafter(target, block_size=block_size, **knobs)


def _fake_model(points, target, drafter):
    return TargetCostModel(points=points, draft={b: 0.01 * b for b in points}, device=cost_module.device_name("cpu"),
                           dtype="float32", threads=torch.get_num_threads(), key=cost_module.cost_key(target, drafter))


def test_calibration_measures_rows_1_and_b_and_widths_1_2_and_the_block():
    target, drafter = _pair(block_size=5)
    forwards = []
    target.register_forward_pre_hook(lambda m, args, kwargs: forwards.append(tuple(kwargs["input_ids"].shape)),
                                     with_kwargs=True)
    cost = TargetCostModel.calibrate(target, drafter, batch_sizes=(1, 8), context_length=16, repeats=3,
                                     budget_s=0.0, progress=False, attempts=1)
    assert {b: sorted(row) for b, row in cost.points.items()} == {1: [1, 2, 5], 8: [1, 2, 5]} and sorted(cost.draft) == [1, 8]
    # budget 0: every point is a warm-up and MIN_TIMED_RUNS (2) timed runs; each batch size prefills ONE row of
    # context (then repeated to b rows)
    assert forwards == [(1, 16), (1, 1), (1, 1), (1, 1), (1, 2), (1, 2), (1, 2), (1, 5), (1, 5), (1, 5),
                        (1, 16), (8, 1), (8, 1), (8, 1), (8, 2), (8, 2), (8, 2), (8, 5), (8, 5), (8, 5)]


def test_a_slow_first_call_of_a_shape_is_never_the_measurement():
    """The first forward of a new shape pays for allocations: a slow point is still timed after its warm-up."""
    import time

    target, _ = _pair(block_size=5)
    seen = set()

    def slow_first_call(module, args, kwargs):
        shape = tuple(kwargs["input_ids"].shape)
        if shape not in seen:
            seen.add(shape)
            time.sleep(0.3)

    target.register_forward_pre_hook(slow_first_call, with_kwargs=True)
    cost = TargetCostModel.calibrate(target, None, num_tokens=(1, 5), batch_sizes=(1, 4), context_length=16,
                                     repeats=3, budget_s=0.1, progress=False, attempts=1)
    assert all(t < 0.3 for row in cost.points.values() for t in row.values())


def test_a_point_disturbed_once_is_measured_at_its_fastest_run():
    """Interference only adds time: a point whose first timed run was disturbed (a noisy machine read 64 rows x 1
    token at 666 ms against 364 ms quiet) is timed again, however long that run took, and the fastest run counts."""
    import time

    target, _ = _pair(block_size=5)
    calls = {}

    def disturbed_first_timed_run(module, args, kwargs):
        shape = tuple(kwargs["input_ids"].shape)
        calls[shape] = calls.get(shape, 0) + 1
        if calls[shape] == 2:  # the warm-up is call 1
            time.sleep(0.3)

    target.register_forward_pre_hook(disturbed_first_timed_run, with_kwargs=True)
    cost = TargetCostModel.calibrate(target, None, num_tokens=(1, 5), batch_sizes=(1, 4), context_length=16,
                                     repeats=3, budget_s=0.1, progress=False, attempts=1)
    assert all(t < 0.3 for row in cost.points.values() for t in row.values())


def test_the_rest_is_interpolated_as_computed_by_hand(cache):
    target, drafter = _pair(block_size=5)
    cost = TargetCostModel(points={1: {1: 1.0, 5: 3.0}, 8: {1: 8.0, 5: 22.0}}, draft={1: 0.5, 8: 4.0})
    # rows 1: 1.0 + (3.0 - 1.0) * (3 - 1) / (5 - 1) = 2.0; rows 8: 8.0 + 14.0 * 2 / 4 = 15.0
    # rows 4: 2.0 + (15.0 - 2.0) * (4 - 1) / (8 - 1) = 7.571428...
    assert cost.seconds(3, 4) == pytest.approx(2.0 + 13.0 * 3 / 7)
    assert cost.draft_seconds(2) == pytest.approx(0.5 + 3.5 / 7)
    table = cost.interpolated()
    assert sorted(table["points"]) == [1, 2, 4, 8] and sorted(table["draft"]) == [2, 4]
    assert sorted(table["points"][1]) == [2, 3, 4] and sorted(table["points"][4]) == [1, 2, 3, 4, 5]
    assert table["points"][4][3] == pytest.approx(2.0 + 13.0 * 3 / 7)
    assert cost.is_measured(5, 8) and not cost.is_measured(3, 8) and not cost.is_measured(1, 4)
    path = cache / "model.json"
    cost.save(path)
    saved = json.loads(path.read_text())
    assert saved["points"] == {"1": {"1": 1.0, "5": 3.0}, "8": {"1": 8.0, "5": 22.0}}  # measured
    assert saved["interpolated"]["points"]["4"]["3"] == pytest.approx(2.0 + 13.0 * 3 / 7)
    assert TargetCostModel.load(path).points == cost.points  # what is read back: the measured points only


def test_a_call_measures_its_own_batch_size_once_and_others_when_first_needed(cache, monkeypatch):
    target, drafter = _pair(allow_no_draft=True)
    calls = []

    def fake(cls, target, drafter=None, batch_sizes=(1,), num_tokens=None, **kwargs):
        calls.append(list(batch_sizes))
        widths = num_tokens or cost_module.calibration_tokens(drafter)
        return _fake_model({b: {n: 0.01 * b * n for n in widths} for b in batch_sizes}, target, drafter)

    monkeypatch.setattr(TargetCostModel, "calibrate", classmethod(fake))
    prompts = [[1 + i, 2, 3, 4] for i in range(16)]
    assert generate_batch(target, drafter, prompts, 3) == generate_batch(target, None, prompts, 3)
    assert calls == [[1, 4, 16]]  # a factor of 4 apart (costs are not linear in rows), not 1, 2, 4, 8, 16
    generate_batch(target, drafter, prompts[:8], 3)  # within the measured rows: interpolated, nothing measured
    cost_model_for(target, drafter, batch_sizes=(1, 32))  # more rows: only the new size is measured
    assert calls == [[1, 4, 16], [32]]
    saved = TargetCostModel.load(cache_path(target, drafter))
    assert sorted(saved.points) == [1, 4, 16, 32]
    # a cache of rows 1 and 64 only (measured before the grid): the sizes between are measured, once
    _fake_model({b: {n: 0.01 * b * n for n in (1, 2, 5)} for b in (1, 64)}, target, drafter).save(
        cache_path(target, drafter))
    cost_model_for(target, drafter, batch_sizes=(1, 64))
    cost_model_for(target, drafter, batch_sizes=(1, 64))
    assert calls[2:] == [[4, 16]] and sorted(saved.points[32]) == [1, 2, 5]


def test_one_calibration_at_a_time_per_cache_file(cache, monkeypatch):
    """Two threads calibrate the same cache file: one measures, the other waits and reads what it wrote."""
    target, drafter = _pair()
    entered, calls = [], []
    real_lock = cost_module.file_lock

    def spy_lock(path, *args):
        entered.append(threading.current_thread().name)  # before the lock is taken
        return real_lock(path, *args)

    def fake(cls, target, drafter=None, batch_sizes=(1,), **kwargs):
        calls.append(threading.current_thread().name)
        for _ in range(500):  # until the other thread is at the lock (10 s at most): then both overlap
            if len(entered) >= 2:
                break
            threading.Event().wait(0.02)
        return _fake_model({b: {1: 0.1 * b, 2: 0.15 * b, 5: 0.2 * b} for b in batch_sizes}, target, drafter)

    monkeypatch.setattr(cost_module, "file_lock", spy_lock)
    monkeypatch.setattr(TargetCostModel, "calibrate", classmethod(fake))
    results = {}

    def work(name):
        results[name] = cost_model_for(target, drafter, batch_sizes=(1, 4), progress=False)

    threads = [threading.Thread(target=work, args=(name,), name=name) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(entered) == 2 and len(calls) == 1
    assert results["a"].to_dict() == results["b"].to_dict()
    assert TargetCostModel.load(cache_path(target, drafter)).points == results["a"].points


def test_calibrating_leaves_the_global_rng_alone(cache):
    target, drafter = _pair()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    cost_model_for(target, drafter, batch_sizes=(1, 2), progress=False)
    assert torch.equal(torch.rand(3), expected)


COSTS = {
    "cheap drafting": device_cost({1: {1: 1.0, 5: 1.1}, 4: {1: 1.2, 5: 1.3}}, draft=0.05),
    "dear drafting": device_cost({1: {1: 1.0, 5: 1.1}, 4: {1: 1.2, 5: 1.3}}, draft=50.0),
    "width-bound": device_cost({1: {1: 1.0, 5: 9.0}, 4: {1: 4.0, 5: 36.0}}, draft=0.3),
    "flat (GPU-like)": device_cost({1: {1: 0.02, 16: 0.02}, 64: {1: 0.02, 16: 0.021}}, draft=0.001),
}


def test_outputs_equal_plain_greedy_whatever_the_cost_model():
    target = make_tiny_target(seed=51)
    prompts = [[5, 6, 7, 5, 6, 7, 5], [1, 2, 3], [9, 8, 9, 8, 9, 8], [4, 4, 4, 4]]
    plain = generate_batch(target, None, prompts, 12)
    choices = {}
    for name, cost in COSTS.items():
        drafter = build_drafter(target, block_size=5, seed=3, hybrid_lookup=True, allow_no_draft=True)
        SpeculationRuntime(cost_model=cost).attach(drafter)
        rows, stats = generate_batch(target, drafter, prompts, 12, return_stats=True)
        assert rows == plain, name
        drafter.runtime.policy.reset()
        for p, expected in zip(prompts, plain):
            out, bs1 = speculate(target, torch.tensor([p]), drafter, max_new_tokens=12, do_sample=False)
            assert out[0, len(p):].tolist() == expected, name
        choices[name] = (str(stats.sources), str(bs1.proposers))
    assert len(set(choices.values())) > 1  # the cost models did change the choices


def test_calibrate_command_on_a_tiny_model(cache, tmp_path, monkeypatch, capsys):
    from adaflash_hf import AdaFlashDrafterModel, cli

    from .test_examples import save_tiny_target

    folder = save_tiny_target(tmp_path / "target", seed=52)
    target = make_tiny_target(seed=52)
    build_drafter(target, block_size=4).save_pretrained(tmp_path / "drafter")
    argv = ["calibrate", "--target", str(folder), "--drafter", str(tmp_path / "drafter"), "--device", "cpu",
            "--max-batch", "4", "--quiet"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("measured:") and "* measured" in out
    drafter = AdaFlashDrafterModel.from_pretrained(tmp_path / "drafter").eval()
    path = cache_path(target, drafter)
    saved = json.loads(path.read_text())
    assert sorted(saved["points"]) == ["1", "4"] and sorted(saved["points"]["4"]) == ["1", "2", "4"]
    assert sorted(saved["interpolated"]["points"]) == ["1", "2", "4"]
    lines = out.splitlines()
    row2 = next(line for line in lines if line.split() and line.split()[0] == "2")
    assert "*" not in row2  # 2 rows: interpolated between 1 and 4
    # the CLI measured what generate_batch needs: serving does not measure again
    monkeypatch.setattr(TargetCostModel, "calibrate", classmethod(lambda *a, **k: pytest.fail("recalibrated")))
    assert cli.main(argv) == 0 and capsys.readouterr().out.startswith("already cached:")
    generate_batch(target, drafter, [[1, 2, 3]] * 4, 4)
    # --overhead: each round kind's work outside the forwards, at the calibrated rows, in the same cached model
    assert cli.main(argv + ["--overhead"]) == 0 and "round overhead" in capsys.readouterr().out
    cached = TargetCostModel.load(path)
    assert set(cached.overhead) == {"plain", "spec"} and all(sorted(r) == [1, 4] for r in cached.overhead.values())
    assert cached.round_seconds(2, 4) > cached.seconds(3, 4) + cached.draft_seconds(4)  # a drafted round prices it


def test_library_code_never_imports_the_testbed():
    import ast
    from pathlib import Path

    from adaflash_hf.testbed import cache as testbed_cache
    from adaflash_hf.utils import cache as library_cache

    generation = Path(cost_module.__file__).parent
    imported = {(f.name, node.module or "") for f in generation.glob("*.py")
                for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, ast.ImportFrom)}
    assert not [(f, m) for f, m in imported if "testbed" in m]
    assert testbed_cache.cache_dir is library_cache.cache_dir  # the testbed builds on the library's helper


# A measurement taken while the machine was busy (found in a real cache: one row, 1 token slower than 8 tokens and
# than 16 rows): a forward never gets cheaper with more tokens or more rows.
DISTURBED = {1: {1: 1.350, 2: 1.200, 8: 1.019}, 16: {1: 0.141, 2: 0.250, 8: 0.351}}
CLEAN = {1: {1: 0.050, 2: 0.070, 8: 0.091}, 4: {1: 0.080, 2: 0.120, 8: 0.160}, 16: {1: 0.141, 2: 0.250, 8: 0.351}}


def test_inconsistencies_name_the_points_that_contradict_the_shape_of_a_forward():
    disturbed = TargetCostModel(points=DISTURBED, draft={1: 0.129, 16: 0.041})
    found = disturbed.inconsistencies()
    assert any(p.startswith("1x8 ") for p in found) and any(p.startswith("16x1 ") for p in found)
    assert any(p.startswith("drafting 16 rows") for p in found)
    assert TargetCostModel(points=CLEAN, draft={1: 0.005, 16: 0.041}).inconsistencies() == []
    # flat costs (an accelerator: 1-16 tokens x 1-64 rows cost about the same) and sub-millisecond noise are fine
    assert TargetCostModel(points={1: {1: 0.0200, 16: 0.0195}, 64: {1: 0.0199, 16: 0.0210}}).inconsistencies() == []
    assert TargetCostModel(points={1: {1: 0.0015, 8: 0.0004}}).inconsistencies() == []
    # the busy 64-row point of a real cache: a one-token forward 2.1x dearer per row than at 16 rows
    busy = {1: {1: 0.058, 2: 0.097, 8: 0.081}, 16: {1: 0.106, 2: 0.189, 8: 0.391}, 64: {1: 0.888, 2: 1.599, 8: 2.168}}
    assert [p.split()[0] for p in TargetCostModel(points=busy).inconsistencies()] == ["64x1"]
    quiet = {**busy, 64: {1: 0.317, 2: 1.472, 8: 2.016}}  # measured quiet: 2 tokens do cost 2x per row at 64
    assert TargetCostModel(points=quiet).inconsistencies() == []


def test_a_disturbed_calibration_is_measured_again_keeping_each_points_fastest_time(monkeypatch, caplog):
    target, drafter = _pair()
    runs = [DISTURBED, {1: {1: 0.060, 2: 0.070, 8: 0.090}, 16: {1: 0.500, 2: 0.300, 8: 0.340}}]  # disturbed elsewhere

    def fake(cls, target, drafter, num_tokens, batch_sizes, *args, seed):
        return _fake_model(runs.pop(0), target, drafter)

    monkeypatch.setattr(TargetCostModel, "_measure", classmethod(fake))
    with caplog.at_level("WARNING", logger=cost_module.__name__):
        cost = TargetCostModel.calibrate(target, drafter, batch_sizes=(1, 16), progress=False)
    assert runs == [] and "disturbed" in caplog.text
    assert cost.points == {1: {1: 0.060, 2: 0.070, 8: 0.090}, 16: {1: 0.141, 2: 0.250, 8: 0.340}}
    assert cost.inconsistencies() == []
    assert cost.measurements == 2


def test_an_inconsistent_cached_model_is_measured_again(cache, monkeypatch):
    target, drafter = _pair(block_size=8)
    _fake_model(DISTURBED, target, drafter).save(cache_path(target, drafter))
    calls = []

    def fake(cls, target, drafter=None, batch_sizes=(1,), **kwargs):
        calls.append(list(batch_sizes))
        return _fake_model({b: CLEAN[b] for b in batch_sizes}, target, drafter)

    monkeypatch.setattr(TargetCostModel, "calibrate", classmethod(fake))
    assert cost_model_for(target, drafter, batch_sizes=(1, 16), calibrate=False) is None  # never used as it is
    cost = cost_model_for(target, drafter, batch_sizes=(1, 16), progress=False)
    assert calls == [[1, 4, 16]] and cost.points == CLEAN
    assert TargetCostModel.load(cache_path(target, drafter)).points == CLEAN
    # rows added later that contradict the cached ones: every size is measured again
    _fake_model({1: {1: 0.5, 2: 0.7, 8: 0.9}}, target, drafter).save(cache_path(target, drafter))
    cost = cost_model_for(target, drafter, batch_sizes=(1, 16), progress=False)
    assert calls == [[1, 4, 16], [4, 16], [1, 4, 16]] and cost.points == CLEAN
    # still inconsistent after every attempt (a jittery device): used as measured, not measured on every load
    jittery = _fake_model({**DISTURBED, 4: CLEAN[4]}, target, drafter)
    jittery.measurements = cost_module.CALIBRATION_ATTEMPTS
    jittery.save(cache_path(target, drafter))
    assert cost_model_for(target, drafter, batch_sizes=(1, 16), progress=False).points == {**DISTURBED, 4: CLEAN[4]}
    assert len(calls) == 3


def test_a_cached_model_without_every_calibration_width_is_measured_again(cache, monkeypatch):
    """A cache written before width 2 was calibrated (1 and the block only) would interpolate the dearest step of a
    CPU forward (one token per row to two) as a straight line: every size it holds is measured again."""
    target, drafter = _pair(block_size=8)
    _fake_model({1: {1: 0.05, 8: 0.09}, 16: {1: 0.11, 8: 0.42}}, target, drafter).save(cache_path(target, drafter))
    calls = []

    def fake(cls, target, drafter=None, batch_sizes=(1,), num_tokens=None, **kwargs):
        calls.append(list(batch_sizes))
        return _fake_model({b: CLEAN.get(b, CLEAN[16]) for b in batch_sizes}, target, drafter)

    monkeypatch.setattr(TargetCostModel, "calibrate", classmethod(fake))
    cost = cost_model_for(target, drafter, batch_sizes=(1, 4), progress=False)
    assert calls == [[1, 4, 16]]  # the sizes it held, and the call's own
    assert all(2 in row for row in cost.points.values())
    assert cost_model_for(target, drafter, batch_sizes=(1, 16), progress=False).points == cost.points  # cached now
    assert len(calls) == 1
