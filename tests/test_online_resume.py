"""OnlineSpec persistence: a saved adapter resumes exactly (learner state included), a failed load leaves the
drafter as it was, and the safety window is checked once per window of measured rounds."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file

from adaflash_hf.online import OnlineSpecAdapter, OnlineSpecConfig, SequenceFeedback

from .conftest import VOCAB, build_drafter, make_tiny_target


REPO_ROOT = Path(__file__).resolve().parents[1]
TIMING = ("update_seconds", "critical_seconds")  # wall-clock stats: the only state allowed to differ


def _prompt(i: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(i))


def _serve(target, drafter, i: int) -> torch.Tensor:
    """Request `i`, sampled with a seed of its own: the same weights give the same output."""
    torch.manual_seed(1000 + i)
    return target.generate(_prompt(i), max_new_tokens=16, do_sample=True, assistant_model=drafter)


def _setup(**config):
    target = make_tiny_target(seed=4)
    drafter = build_drafter(target, seed=4)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(learning_rate=0.05, **config))
    return target, drafter, adapter


def _lora(adapter) -> dict:
    """Every member's LoRA matrices in the live drafter (after any background update is copied in)."""
    adapter.finish()
    return {n: p.detach().clone() for n, p in adapter.drafter.named_parameters() if "lora_" in n}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_same_state(a, b) -> None:
    (sa, ta), (sb, tb) = a.training_state(), b.training_state()
    for s in (sa, sb):
        for key in TIMING:
            s["stats"].pop(key)
    assert json.dumps(sa, sort_keys=True) == json.dumps(sb, sort_keys=True)
    assert ta.keys() == tb.keys() and all(torch.allclose(ta[k], tb[k], atol=1e-6, rtol=0) for k in ta)


# ------------------------------------------------------------------------------------------------ exact resume


@pytest.mark.parametrize("algorithm, mode", [("ogd", "request"), ("optimistic", "request"), ("ensemble", "request"),
                                             ("ogd", "background"), ("optimistic", "background"),
                                             ("ensemble", "background"), ("optimistic", "round")])
def test_resume_mid_stream_continues_exactly(tmp_path, algorithm, mode):
    """Save after 2 requests, load into a fresh drafter, serve request 3 on both: same LoRA weights (<= 1e-6), same
    learner state, and the same sampled outputs for requests 3 and 4."""
    target, drafter, adapter = _setup(algorithm=algorithm, update_mode=mode, ensemble_base="optimistic")
    for i in range(2):
        _serve(target, drafter, i)
    adapter.save_pretrained(tmp_path / "adapter")
    fresh = build_drafter(target, seed=4)
    loaded = OnlineSpecAdapter.from_pretrained(fresh, tmp_path / "adapter")
    assert loaded.requests_seen == adapter.requests_seen == (0 if mode == "round" else 2)  # round: counts rounds
    assert all(lrn.steps == adapter.learners[n].steps > 0 for n, lrn in loaded.learners.items() if lrn.lr > 0)
    _assert_same_state(adapter, loaded)
    before = _lora(loaded)

    assert torch.equal(_serve(target, drafter, 2), _serve(target, fresh, 2))
    assert _max_diff(_lora(adapter), _lora(loaded)) <= 1e-6
    assert _max_diff(_lora(loaded), before) > 1e-4  # request 3 did move the weights: the comparison is not vacuous
    _assert_same_state(adapter, loaded)
    assert torch.equal(_serve(target, drafter, 3), _serve(target, fresh, 3))  # drafted with the updated weights
    assert _max_diff(_lora(adapter), _lora(loaded)) <= 1e-6
    if mode != "background":  # saving itself changes nothing (background: it copies the pending update in early)
        _, again, uninterrupted = _setup(algorithm=algorithm, update_mode=mode, ensemble_base="optimistic")
        for i in range(4):
            _serve(target, again, i)
        assert _max_diff(_lora(uninterrupted), _lora(adapter)) <= 1e-6


def test_resume_in_a_fresh_process(tmp_path):
    """The same in a new Python process (nothing shared with the saving one but the folder): one child process
    resumes two saved adapters (its cost is mostly importing torch)."""
    cases = {"ogd-request": {}, "ensemble-background": {"algorithm": "ensemble", "update_mode": "background"}}
    originals, outputs = {}, {}
    for name, config in cases.items():
        target, drafter, originals[name] = _setup(**config)
        for i in range(2):
            _serve(target, drafter, i)
        originals[name].save_pretrained(tmp_path / name)
        outputs[name] = _serve(target, drafter, 2)
    script = f"""
from safetensors.torch import save_file
from adaflash_hf.online import OnlineSpecAdapter
from tests.conftest import build_drafter, make_tiny_target
from tests.test_online_resume import _lora, _serve
for name in {list(cases)!r}:
    target = make_tiny_target(seed=4)
    drafter = build_drafter(target, seed=4)
    adapter = OnlineSpecAdapter.from_pretrained(drafter, {str(tmp_path)!r} + "/" + name)
    out = _serve(target, drafter, 2)
    save_file({{**_lora(adapter), "output": out}}, {str(tmp_path)!r} + f"/{{name}}.safetensors")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": str(torch.get_num_threads())}
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for name, adapter in originals.items():
        child = load_file(str(tmp_path / f"{name}.safetensors"))
        assert torch.equal(child.pop("output"), outputs[name]), name
        assert _max_diff(_lora(adapter), child) <= 1e-6, name


def test_resume_keeps_the_gate_and_the_request_counter(tmp_path, monkeypatch):
    """While learning does not pay, the adapter learns from every 2nd, then 4th request: a resumed adapter skips the
    same requests (a fresh gate would learn from the next one) and seeds the same anchors."""
    monkeypatch.setattr(OnlineSpecAdapter, "_gate", lambda self, fb, head, online: self._learn_interval(-1.0))
    target, drafter, adapter = _setup(gate_window=2)
    for i in range(3):  # 0 learns (then every 2nd), 1 is skipped, 2 learns (then every 4th)
        _serve(target, drafter, i)
    assert (adapter.stats.updates, adapter.stats.skipped) == (2, 1)
    adapter.save_pretrained(tmp_path / "adapter")
    fresh = build_drafter(target, seed=4)
    loaded = OnlineSpecAdapter.from_pretrained(fresh, tmp_path / "adapter")
    for i in (3, 4):  # 3 is skipped, 4 learns
        assert torch.equal(_serve(target, drafter, i), _serve(target, fresh, i))
    for a in (adapter, loaded):
        assert (a.stats.updates, a.stats.skipped, a.requests_seen) == (3, 2, 5)
    assert _max_diff(_lora(adapter), _lora(loaded)) <= 1e-6


def test_resume_keeps_pending_replayed_and_recorded_feedback(tmp_path):
    """update_every=2 with a replay window: the request saved before its update and the replayed one come back, and
    so does the recorded stream (regret after a resume covers the whole stream)."""
    from adaflash_hf.online.regret import stream_loss

    target, drafter, adapter = _setup(update_every=2, replay_window=1, record_stream=True, learn_while_paying=False)
    for i in range(3):  # requests 0+1 -> one update; request 2 waits for request 3
        _serve(target, drafter, i)
    assert adapter.stats.updates == 1
    adapter.save_pretrained(tmp_path / "adapter")
    fresh = build_drafter(target, seed=4)
    loaded = OnlineSpecAdapter.from_pretrained(fresh, tmp_path / "adapter")
    assert len(loaded.stream) == 3
    for i in (3, 4, 5):
        assert torch.equal(_serve(target, drafter, i), _serve(target, fresh, i))
    assert adapter.stats.updates == loaded.stats.updates == 3
    assert _max_diff(_lora(adapter), _lora(loaded)) <= 1e-6
    assert math.isclose(stream_loss(adapter, ["online"], target.lm_head, adapter.stream),
                        stream_loss(loaded, ["online"], target.lm_head, loaded.stream), rel_tol=1e-6)


def test_state_without_learner_state_warns_and_is_not_exact(tmp_path):
    """A folder saved before the learner state was (LoRA + Hedge only): loading says so out loud; it cannot resume
    exactly (the Adam moments are gone), which is what the exact tests above would catch."""
    target, drafter, adapter = _setup()
    for i in range(2):
        _serve(target, drafter, i)
    folder = adapter.save_pretrained(tmp_path / "adapter")
    (folder / "online_state.json").write_text(json.dumps({
        "rounds": 2, "updates": 2, "rollbacks": [], "hedge_cumulative": [0.0], "learner_steps": {"online": 2}}))
    (folder / "online_optimizer.safetensors").unlink()
    fresh = build_drafter(target, seed=4)
    with pytest.warns(UserWarning, match="holds no Adam moments"):
        loaded = OnlineSpecAdapter.from_pretrained(fresh, folder)
    assert _max_diff(_lora(adapter), _lora(loaded)) == 0  # the weights themselves did load
    _serve(target, drafter, 2), _serve(target, fresh, 2)
    assert _max_diff(_lora(adapter), _lora(loaded)) > 1e-4


def test_a_crash_while_writing_the_learner_state_keeps_the_previous_save_whole(tmp_path, monkeypatch):
    import adaflash_hf.online.persistence as persistence

    target, drafter, adapter = _setup()
    _serve(target, drafter, 0)
    adapter.save_pretrained(tmp_path / "adapter")
    saved_lora, saved_steps = _lora(adapter), adapter.learners["online"].steps
    _serve(target, drafter, 1)
    real = persistence.save_file

    def crash_on_the_optimizer_file(tensors, path, *args, **kwargs):
        if path.endswith("online_optimizer.safetensors"):
            raise OSError("disk full")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(persistence, "save_file", crash_on_the_optimizer_file)
    with pytest.raises(OSError, match="disk full"):
        adapter.save_pretrained(tmp_path / "adapter")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # the half-written save is gone
    loaded = OnlineSpecAdapter.from_pretrained(build_drafter(target, seed=4), tmp_path / "adapter")
    assert _max_diff(_lora(loaded), saved_lora) == 0 and loaded.learners["online"].steps == saved_steps


# ------------------------------------------------------------------------------------------------ failed loads


def _drafter_snapshot(drafter) -> dict:
    return {"modules": [(n, type(m)) for n, m in drafter.named_modules()],
            "requires_grad": {n: p.requires_grad for n, p in drafter.named_parameters()},
            "weights": {k: v.clone() for k, v in drafter.state_dict().items()},
            "attributes": sorted(vars(drafter)), "runtime_adapter": getattr(drafter.runtime, "online_adapter", None)}


def _assert_unchanged(drafter, snapshot) -> None:
    now = _drafter_snapshot(drafter)
    assert now["modules"] == snapshot["modules"]
    assert now["requires_grad"] == snapshot["requires_grad"]
    assert now["weights"].keys() == snapshot["weights"].keys()
    assert all(torch.equal(now["weights"][k], v) for k, v in snapshot["weights"].items())
    assert now["attributes"] == snapshot["attributes"] and now["runtime_adapter"] is snapshot["runtime_adapter"]


def _rewrite_safetensors(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _first_moment(tensors: dict) -> str:
    return next(k for k in sorted(tensors) if k.startswith("learner/online/m/"))


CORRUPTIONS = {
    "state not JSON": (lambda f, other: (f / "online_state.json").write_text('{"version": 2, "requests_'),
                       ValueError, r"online_state\.json: corrupt file, not valid JSON"),
    "config not JSON": (lambda f, other: (f / "online_config.json").write_text("{"),
                        ValueError, r"online_config\.json: corrupt OnlineSpec config, not valid JSON"),
    "state key missing": (lambda f, other: (f / "online_state.json").write_text(json.dumps(
        {k: v for k, v in json.loads((f / "online_state.json").read_text()).items() if k != "requests_seen"})),
        ValueError, r"online_state\.json: corrupt learner state: missing keys \['requests_seen'\]"),
    "state value wrong": (lambda f, other: (f / "online_state.json").write_text(json.dumps(
        {**json.loads((f / "online_state.json").read_text()), "hedge_cumulative": [0.0, 1.0]})),
        ValueError, r"online_state\.json: corrupt learner state: hedge_cumulative must be a list of 1 numbers"),
    "state missing": (lambda f, other: (f / "online_state.json").unlink(),
                      FileNotFoundError, r"online_state\.json missing: incomplete"),
    "optimizer file missing": (lambda f, other: (f / "online_optimizer.safetensors").unlink(),
                               FileNotFoundError, r"online_optimizer\.safetensors missing"),
    "moment of a wrong shape": (lambda f, other: _rewrite_safetensors(
        f / "online_optimizer.safetensors", lambda t: t.update({_first_moment(t): torch.zeros(3, 3)})),
        ValueError, r"online_optimizer\.safetensors: corrupt adapter: wrong shapes \['learner/online/m/"),
    "moment missing": (lambda f, other: _rewrite_safetensors(
        f / "online_optimizer.safetensors", lambda t: t.pop(_first_moment(t))),
        ValueError, r"online_optimizer\.safetensors: corrupt adapter: missing tensors \['learner/online/m/"),
    "weights truncated": (lambda f, other: (f / "adapter_model.safetensors").write_bytes(
        (f / "adapter_model.safetensors").read_bytes()[:100]),
        ValueError, r"adapter_model\.safetensors: corrupt safetensors file"),
    "weights of another save": (lambda f, other: (f / "adapter_model.safetensors").write_bytes(
        (other / "adapter_model.safetensors").read_bytes()),
        ValueError, r"adapter_model\.safetensors does not match .*online_state\.json \(checksum differs\)"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_failed_load_leaves_the_drafter_as_it_was(tmp_path, corruption):
    target, drafter, adapter = _setup()
    _serve(target, drafter, 0)
    other = adapter.save_pretrained(tmp_path / "other")
    _serve(target, drafter, 1)
    folder = adapter.save_pretrained(tmp_path / "adapter")
    corrupt, error, message = CORRUPTIONS[corruption]
    corrupt(folder, other)
    fresh = build_drafter(target, seed=4)
    fresh.layers[0].mlp.up_proj.weight.requires_grad_(False)  # a caller's own freezing must survive too
    snapshot = _drafter_snapshot(fresh)
    with pytest.raises(error, match=message):
        OnlineSpecAdapter.from_pretrained(fresh, folder)
    _assert_unchanged(fresh, snapshot)
    OnlineSpecAdapter.from_pretrained(fresh, other).detach()  # and the drafter still takes a good adapter
    _assert_unchanged(fresh, snapshot)


def test_a_failure_after_the_drafter_changed_is_undone(tmp_path, monkeypatch):
    """Belt and braces: an error past validation (here injected) detaches again."""
    target, drafter, adapter = _setup(algorithm="ensemble", update_mode="background")
    _serve(target, drafter, 0)
    folder = adapter.save_pretrained(tmp_path / "adapter")
    fresh = build_drafter(target, seed=4)
    snapshot = _drafter_snapshot(fresh)

    def fail(self, state, tensors):
        assert any(isinstance(m, BaseTunerLayer) for m in self.drafter.modules())  # the drafter did change
        raise RuntimeError("out of memory")

    monkeypatch.setattr(OnlineSpecAdapter, "load_training_state", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        OnlineSpecAdapter.from_pretrained(fresh, folder)
    _assert_unchanged(fresh, snapshot)


# ------------------------------------------------------------------------------------------------ safety window


def _sequence_feedback(drafter, target, seed: int, drafted: int, accepted: int) -> SequenceFeedback:
    """A served request of 24 tokens with random context states, `accepted` of `drafted` drafted tokens accepted."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (24,), generator=g)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    return SequenceFeedback.from_sequence(drafter, target.get_input_embeddings(), ids, torch.randn(23, width,
                                          generator=g), 6, accepted, drafted, 8, torch.Generator().manual_seed(seed))


def test_a_request_without_drafter_rounds_does_not_re_snapshot_the_good_state():
    """The safety check runs once per `rollback_window` measured rounds. A request served without drafter rounds
    measures none: it used to re-run the check on the same window and take the state after its update as the new
    "good" snapshot, so a later rollback restored that state instead of the last one checked."""
    target = make_tiny_target(seed=4)
    drafter = build_drafter(target, seed=4)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(learning_rate=0.05, learn_while_paying=False,
                                                                 rollback_window=2, rollback_drop=0.5))
    params = lambda: [p.detach().clone() for p in adapter.lora_parameters("online")]  # noqa: E731
    for seed in (0, 1):  # a checked window, everything accepted: the good snapshot
        adapter.observe_sequence(_sequence_feedback(drafter, target, seed, drafted=4, accepted=4), target.lm_head)
    checked = params()
    result = adapter.observe_sequence(_sequence_feedback(drafter, target, 2, drafted=0, accepted=0), target.lm_head)
    assert result["updated"] and not result["rolled_back"]  # it still teaches
    unchecked = params()
    assert any(not torch.equal(a, b) for a, b in zip(checked, unchecked))
    for seed in (3, 4):  # acceptance collapses over the next window: roll back to the last CHECKED state
        result = adapter.observe_sequence(_sequence_feedback(drafter, target, seed, drafted=4, accepted=0),
                                          target.lm_head)
    assert result["rolled_back"] and adapter.stats.rollbacks == [4]
    assert all(torch.equal(a, b) for a, b in zip(params(), checked))
