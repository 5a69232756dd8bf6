"""OnlineSpec: update rules, Hedge, the LoRA adapter's learning, safety, persistence and its place in generate."""

import math

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers.cache_utils import DFlashCache

from adaflash_hf.online import (
    Hedge,
    OnlineLearner,
    OnlineSpecAdapter,
    OnlineSpecConfig,
    RoundFeedback,
    hindsight_loss,
    regret,
)

from .conftest import VOCAB, build_drafter, make_tiny_target


def _drafter(target, seed=1, block_size=4, **kwargs):
    return build_drafter(target, block_size=block_size, seed=seed, **kwargs)


def _prompt(seed=0, length=8):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _feedback(drafter, target, seed=0, n=3, accepted=1, context_len=6):
    """A synthetic round: random context states, the target's logits as feedback."""
    g = torch.Generator().manual_seed(seed)
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    ids = torch.randint(0, VOCAB, (1, drafter.config.block_size), generator=g)
    embeds = target.get_input_embeddings()(ids)
    positions = torch.arange(context_len + drafter.config.block_size)[None]
    logits = torch.randn(n, VOCAB, generator=g) * 3
    return RoundFeedback.from_round(drafter, embeds, torch.randn(1, context_len, width, generator=g), positions,
                                    logits, accepted)


# ------------------------------------------------------------------------------------------------ config, rules


def test_config_rejects_bad_values_and_cache_breaking_modules():
    with pytest.raises(ValueError, match="algorithm"):
        OnlineSpecConfig(algorithm="sgd")
    with pytest.raises(ValueError, match="k_proj"):
        OnlineSpecConfig(target_modules=("q_proj", "k_proj"))
    with pytest.raises(ValueError, match="at least two"):
        OnlineSpecConfig(algorithm="ensemble", ensemble_lr_factors=(1.0,))
    assert OnlineSpecConfig(algorithm="ensemble", ensemble_lr_factors=(0, 1, 2)).adapter_names == [
        "online_0", "online_1", "online_2"]


def test_ogd_sgd_and_optimistic_steps_match_hand_computation():
    p = torch.tensor([1.0, -2.0])
    OnlineLearner([p], "ogd", "sgd", lr=0.5).step([torch.tensor([2.0, 4.0])])
    assert torch.allclose(p, torch.tensor([0.0, -4.0]))

    q = torch.tensor([0.0])
    learner = OnlineLearner([q], "optimistic", "sgd", lr=0.1)
    learner.step([torch.tensor([1.0])])  # 0 - 0.1 * (2 * 1 - 0) = -0.2
    assert torch.allclose(q, torch.tensor([-0.2]))
    learner.step([torch.tensor([3.0])])  # -0.2 - 0.1 * (2 * 3 - 1) = -0.7
    assert torch.allclose(q, torch.tensor([-0.7]))


def test_adam_first_step_is_lr_times_sign_and_rollback_state_restores():
    p = torch.tensor([1.0, 1.0])
    learner = OnlineLearner([p], "ogd", "adam", lr=0.1)
    saved = learner.state_dict()
    learner.step([torch.tensor([5.0, -0.01])])
    assert torch.allclose(p, torch.tensor([0.9, 1.1]), atol=1e-5)
    learner.load_state_dict(saved)
    assert torch.equal(p, torch.tensor([1.0, 1.0])) and learner.steps == 0 and learner.m[0].abs().sum() == 0


def test_hedge_weights_follow_exponential_of_cumulative_loss():
    hedge = Hedge(3, eta=0.5)
    hedge.update([1.0, 2.0, 4.0])
    hedge.update([1.5, 0.0, 0.0])
    expected = torch.softmax(-0.5 * torch.tensor([2.5, 2.0, 4.0]), dim=0)
    assert torch.allclose(torch.tensor(hedge.weights), expected)
    assert hedge.leader == 1  # the least cumulative loss, though not the least loss in the first round


# ------------------------------------------------------------------------------------------------ the adapter


def test_attach_leaves_base_weights_and_detach_restores_modules():
    target = make_tiny_target()
    drafter = _drafter(target)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    trainable = {n: p.requires_grad for n, p in drafter.named_parameters()}
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", learning_rate=0.05))
    assert drafter.runtime.online_adapter is adapter
    for seed in range(5):
        adapter.observe(_feedback(drafter, target, seed=seed), target.lm_head)
    assert adapter.stats.updates == 5
    lora_b = [m.lora_B["online"].weight for m in drafter.modules() if isinstance(m, BaseTunerLayer)]
    assert any(b.abs().sum() > 0 for b in lora_b)  # LoRA moved
    assert {n for n, p in drafter.named_parameters() if p.requires_grad} == {
        n for n, _ in drafter.named_parameters() if "lora_" in n}
    adapter.detach()
    after = drafter.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert {n: p.requires_grad for n, p in drafter.named_parameters()} == trainable
    assert drafter.runtime.online_adapter is None


def test_cache_stays_exact_after_an_update():
    """LoRA is not on k/v/fc: context keys/values cached before an update equal the ones computed after it."""
    target = make_tiny_target()
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", learning_rate=0.2, optimizer="sgd"))
    width = len(drafter.config.target_layer_ids) * target.config.hidden_size
    context, block = torch.randn(1, 7, width), target.get_input_embeddings()(torch.randint(0, VOCAB, (1, 4)))
    positions = torch.arange(11)[None]
    cache = DFlashCache(config=drafter.config)
    with torch.no_grad():
        drafter(noise_embeds=block, context_hidden_states=context, position_ids=positions, cache=cache)
        cache.crop(-4)  # keep the context only, as the candidate generator does
    for seed in range(3):  # updates after the context was cached
        adapter.observe(_feedback(drafter, target, seed=seed, accepted=2), target.lm_head)
    with torch.no_grad():
        cached = drafter(noise_embeds=block, context_hidden_states=None, position_ids=positions[:, 7:],
                         cache=cache).last_hidden_state
        fresh = drafter(noise_embeds=block, context_hidden_states=context, position_ids=positions).last_hidden_state
    assert torch.allclose(cached, fresh, atol=1e-5)


def test_loss_masks_positions_after_the_first_rejection():
    target = make_tiny_target()
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter(drafter, OnlineSpecConfig(update_mode="round", loss_decay_gamma=None))
    fb = _feedback(drafter, target, n=3, accepted=0)
    only_first = adapter.round_loss(fb, target.lm_head)
    fb.target_tokens[1:] = (fb.target_tokens[1:] + 1) % VOCAB  # positions after the rejection: no effect
    assert torch.allclose(adapter.round_loss(fb, target.lm_head), only_first)
    fb.target_tokens[0] = (fb.target_tokens[0] + 1) % VOCAB
    assert not torch.allclose(adapter.round_loss(fb, target.lm_head), only_first)


@pytest.mark.parametrize("loss", ["ce", "reverse_kl"])
@pytest.mark.parametrize("algorithm", ["ogd", "optimistic", "ensemble"])
def test_repeated_feedback_lowers_the_loss(algorithm, loss):
    target = make_tiny_target()
    drafter = _drafter(target)
    config = OnlineSpecConfig(update_mode="round", algorithm=algorithm, loss=loss, learning_rate=0.01, ensemble_base="optimistic",
                              learn_after_rejection=True, rollback_window=1000)
    adapter = OnlineSpecAdapter.attach(drafter, config)
    rounds = [_feedback(drafter, target, seed=s % 4, accepted=3) for s in range(60)]
    for fb in rounds:
        adapter.observe(fb, target.lm_head)
    first, last = sum(adapter.stats.losses[:8]), sum(adapter.stats.losses[-8:])
    assert last < 0.8 * first, (first, last)
    if algorithm == "ensemble":
        weights = adapter.stats.weights[-1]
        assert math.isclose(sum(weights), 1.0, rel_tol=1e-6)
        assert weights[0] < max(weights)  # the static (lr 0) member lost weight to a learning one
        static_b = [m.lora_B["online_0"].weight for m in drafter.modules() if isinstance(m, BaseTunerLayer)]
        assert all(b.abs().sum() == 0 for b in static_b)


def test_nan_feedback_rolls_back_to_the_last_good_state():
    target = make_tiny_target()
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", loss="reverse_kl", learning_rate=0.05,
                                                                 rollback_window=2))
    for seed in range(4):
        adapter.observe(_feedback(drafter, target, seed=seed, accepted=2), target.lm_head)
    good = [p.clone() for p in adapter._params("online")]
    bad = _feedback(drafter, target, seed=9, accepted=2)
    bad.target_logits[0, 0] = float("nan")
    result = adapter.observe(bad, target.lm_head)
    assert result["rolled_back"] and adapter.stats.rollbacks
    assert all(torch.equal(p, g) for p, g in zip(adapter._params("online"), good))


def test_sustained_acceptance_drop_rolls_back():
    target = make_tiny_target()
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", learning_rate=0.05, rollback_window=4,
                                                                 rollback_drop=0.5))
    for seed in range(4):  # a good window: everything accepted
        adapter.observe(_feedback(drafter, target, seed=seed, n=3, accepted=3), target.lm_head)
    snapshot = [p.clone() for p in adapter._params("online")]
    for seed in range(4):  # acceptance collapses
        adapter.observe(_feedback(drafter, target, seed=10 + seed, n=3, accepted=0), target.lm_head)
    assert adapter.stats.rollbacks == [8]
    assert all(torch.equal(p, s) for p, s in zip(adapter._params("online"), snapshot))


# ------------------------------------------------------------------------------------------------ persistence


@pytest.mark.parametrize("algorithm", ["ogd", "ensemble"])
def test_save_load_round_trip(tmp_path, algorithm):
    target = make_tiny_target()
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", algorithm=algorithm, learning_rate=0.05))
    for seed in range(4):
        adapter.observe(_feedback(drafter, target, seed=seed, accepted=2), target.lm_head)
    adapter.save_pretrained(tmp_path / "adapter")
    fresh = _drafter(target)
    loaded = OnlineSpecAdapter.from_pretrained(fresh, tmp_path / "adapter")
    assert fresh.runtime.online_adapter is loaded and loaded.config == adapter.config
    for name in adapter.config.adapter_names:
        assert all(torch.equal(a, b) for a, b in zip(adapter._params(name), loaded._params(name)))
    fb = _feedback(drafter, target, seed=42)
    with torch.no_grad():
        assert torch.allclose(adapter.round_loss(fb, target.lm_head), loaded.round_loss(fb, target.lm_head))


def test_crash_mid_save_keeps_the_previous_adapter(tmp_path, monkeypatch):
    import adaflash_hf.online.persistence as module

    target = make_tiny_target()
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", learning_rate=0.05))
    adapter.observe(_feedback(drafter, target), target.lm_head)
    adapter.save_pretrained(tmp_path / "adapter")
    saved = [p.clone() for p in adapter._params("online")]
    adapter.observe(_feedback(drafter, target, seed=3, accepted=2), target.lm_head)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(module, "save_file", crash)
    with pytest.raises(OSError):
        adapter.save_pretrained(tmp_path / "adapter")
    monkeypatch.undo()
    loaded = OnlineSpecAdapter.from_pretrained(_drafter(target), tmp_path / "adapter")
    assert all(torch.equal(a, b) for a, b in zip(loaded._params("online"), saved))


def _saved_then_moved(tmp_path, target):
    """An adapter saved once (its parameters returned), then updated: the next save has different weights."""
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", learning_rate=0.05))
    adapter.observe(_feedback(drafter, target), target.lm_head)
    adapter.save_pretrained(tmp_path / "adapter")
    old = [p.clone() for p in adapter._params("online")]
    adapter.observe(_feedback(drafter, target, seed=3, accepted=2), target.lm_head)
    new = [p.clone() for p in adapter._params("online")]
    assert not all(torch.equal(a, b) for a, b in zip(old, new))
    return adapter, old, new


@pytest.mark.parametrize("crash_at", [1, 2, 3])
def test_crash_at_any_rename_of_a_save_leaves_a_loadable_adapter(tmp_path, monkeypatch, crash_at):
    """Kill the save at its 1st, 2nd, 3rd rename: loading must give the old adapter or the new one."""
    import os

    target = make_tiny_target()
    adapter, old, new = _saved_then_moved(tmp_path, target)
    calls = []

    def crashing(real):
        def rename(*args, **kwargs):
            calls.append(args)
            if len(calls) == crash_at:
                raise OSError("killed")
            return real(*args, **kwargs)
        return rename

    monkeypatch.setattr(os, "rename", crashing(os.rename))
    monkeypatch.setattr(os, "replace", crashing(os.replace))
    try:
        adapter.save_pretrained(tmp_path / "adapter")
    except OSError as error:
        assert str(error) == "killed"
    monkeypatch.undo()
    loaded = [p.clone() for p in OnlineSpecAdapter.from_pretrained(_drafter(target), tmp_path / "adapter")._params(
        "online")]
    assert any(all(torch.equal(a, b) for a, b in zip(loaded, params)) for params in (old, new)), crash_at
    # The next save repairs the folder and clears the leftovers of the crashed one.
    adapter.save_pretrained(tmp_path / "adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    loaded = OnlineSpecAdapter.from_pretrained(_drafter(target), tmp_path / "adapter")._params("online")
    assert all(torch.equal(a, b) for a, b in zip(loaded, new))


def test_adapter_loading_refuses_pickle_and_incomplete_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    target = make_tiny_target()
    _saved_then_moved(tmp_path, target)
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    state = load_file(str(weights))
    torch.save(state, weights.with_suffix(".bin"))  # what PEFT writes with safe_serialization=False
    weights.unlink()
    with pytest.raises(ValueError, match=r"(?s)refusing to load pickle-based weights .*adapter_model\.bin.*"
                                         r"safetensors\.torch\.save_file\(torch\.load"):
        OnlineSpecAdapter.from_pretrained(_drafter(target), tmp_path / "adapter")
    weights.with_suffix(".bin").unlink()
    dropped = sorted(k for k in state if "lora_B" in k)
    save_file({k: v for k, v in state.items() if k not in dropped}, str(weights))
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors: incomplete adapter, missing "
                                         rf"{len(dropped)} of {len(state)} LoRA tensors: \[.{dropped[0]}"):
        OnlineSpecAdapter.from_pretrained(_drafter(target), tmp_path / "adapter")


def test_missing_files_fail_clearly(tmp_path):
    target = make_tiny_target()
    with pytest.raises(FileNotFoundError, match="online_config.json"):
        OnlineSpecAdapter.from_pretrained(_drafter(target), tmp_path)


# ------------------------------------------------------------------------------------------------ in generate


@pytest.mark.parametrize("algorithm, mode", [("ogd", "round"), ("optimistic", "round"), ("ensemble", "round"),
                                             ("ogd", "request"), ("optimistic", "request"), ("ensemble", "request"),
                                             ("ogd", "background"), ("ensemble", "background")])
def test_generate_with_online_adapter_is_lossless_and_learns_across_calls(algorithm, mode):
    target = make_tiny_target(seed=4)
    drafter = _drafter(target, seed=4)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(algorithm=algorithm, learning_rate=0.01,
                                                                 record_stream=True, update_mode=mode))
    rounds = []
    for i in range(6):
        prompt = _prompt(seed=i % 2)
        expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
        out = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, expected), f"call {i}: online adapter changed the output"
        rounds.append(adapter.stats.rounds)
    adapter.finish()
    rounds.append(adapter.stats.rounds)
    assert rounds == sorted(rounds) and rounds[-1] > rounds[0]  # one learner over all calls
    if mode != "round":  # one update per served request, each from every position of it
        assert adapter.stats.rounds == 6 and min(adapter.stats.positions) > 8
    assert adapter.stats.updates == adapter.stats.rounds
    for name in adapter.config.adapter_names:  # the updates reached the LoRA weights (the 0-lr member excepted)
        moved = any(b.abs().sum() > 0 for b in adapter._params(name)[1::2])
        assert moved == (adapter.learners[name].lr > 0), name
    result = regret(adapter, target.lm_head, epochs=2)
    assert result["rounds"] == adapter.stats.rounds
    assert result["fitted"] < result["static"]  # the stream is learnable: a fixed adapter fitted to it does better
    assert [m for m in drafter.modules() if isinstance(m, BaseTunerLayer)][0].lora_A.keys() == set(
        adapter.config.adapter_names)  # the hindsight adapter was removed again
    adapter.detach()  # the comparator's "static" term is the drafter without any LoRA
    with torch.no_grad():
        static = sum(float(adapter.round_loss(fb, target.lm_head)) for fb in adapter.stream)
    assert math.isclose(static, result["static"], rel_tol=1e-4)


def test_logits_processors_defer_learning_to_raw_logits():
    target = make_tiny_target(seed=5)
    drafter = _drafter(target, seed=5)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", learning_rate=0.01))
    prompt = _prompt(seed=5)
    expected = target.generate(prompt, max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
    out = target.generate(prompt, max_new_tokens=20, do_sample=False, repetition_penalty=1.3,
                          assistant_model=drafter)
    assert torch.equal(out, expected)
    assert adapter.stats.updates > 0


def test_hindsight_needs_a_recorded_stream():
    target = make_tiny_target()
    adapter = OnlineSpecAdapter.attach(_drafter(target), OnlineSpecConfig())
    with pytest.raises(ValueError, match="record_stream"):
        hindsight_loss(adapter, target.lm_head)


@pytest.mark.parametrize("module", ["regret", "persistence"])
def test_helper_modules_use_only_the_adapters_public_api(module):
    """regret.py used to reach into the adapter's private members (`_activate`, `_train_layers`, `_base_scaling`)."""
    import ast
    import importlib
    import inspect

    tree = ast.parse(inspect.getsource(importlib.import_module(f"adaflash_hf.online.{module}")))
    private = sorted({node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                      and isinstance(node.value, ast.Name) and node.value.id == "adapter" and node.attr.startswith("_")})
    assert private == []


def test_scratch_adapter_is_removed_again_even_after_an_error():
    target = make_tiny_target()
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(algorithm="ensemble", ensemble_lr_factors=(0, 1)))
    layer = next(m for m in drafter.modules() if isinstance(m, BaseTunerLayer))
    scaling = dict(layer.scaling)
    with pytest.raises(RuntimeError, match="boom"), adapter.scratch_adapter("probe") as params:
        assert set(layer.lora_A) == {"online_0", "online_1", "probe"} and all(b.abs().sum() == 0 for b in params[1::2])
        adapter.activate(["probe"])
        raise RuntimeError("boom")
    assert set(layer.lora_A) == {"online_0", "online_1"} and layer.scaling == scaling
    assert sorted(layer.active_adapters) == ["online_0", "online_1"]  # drafting set-up restored


def test_learning_works_under_inference_mode():
    target = make_tiny_target()
    drafter = _drafter(target)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="round", learning_rate=0.05))
    with torch.inference_mode():
        fb = _feedback(drafter, target, accepted=2)
        drafter.draft_logits(torch.zeros(1, 1, target.config.hidden_size), target.lm_head)  # an inference-mode slice
        result = adapter.observe(fb, target.lm_head)
    assert result["updated"] and math.isfinite(result["loss"])


# ------------------------------------------------------------------------------------------------ the bench


@pytest.mark.parametrize("mode", ["request", "background"])
def test_online_bench_reports_learning_cost_over_time_and_stays_lossless(mode):
    from adaflash_hf.bench.online import markdown_online, print_online, run_online_bench

    from .test_bench import RECORDS, CharTokenizer

    target = make_tiny_target(seed=7)
    target.generation_config.eos_token_id = None
    drafter = _drafter(target, seed=7)
    stream = RECORDS * 3  # 9 requests, the domains shifting every request
    result = run_online_bench(target, CharTokenizer(), drafter, algorithms=("static", "ogd"), records=stream,
                              max_new_tokens=12, update_mode=mode, hindsight_epochs=1, window=3, progress=False)
    assert result["stream"]["requests"] == 9 and result["stream"]["update_mode"] == mode
    static, ogd = result["algorithms"]["static"], result["algorithms"]["ogd"]
    for entry in (static, ogd):
        assert entry["identical"] == entry["total"] == 9  # learning never changes the output
        assert len(entry["over_time"]) == 3 and entry["tokens_per_s"] > 0
    assert ogd["updates"] == 9 and ogd["learner_rounds"] == 9 and ogd["positions_per_update"] > 8
    learn = ogd["learning_ms_per_request"]
    assert learn["total"] > 0 and 0 <= learn["critical_path"]
    if mode == "request":  # on the serving thread, everything the learner does is on the critical path
        assert learn["critical_path"] >= learn["total"] * 0.99
    assert ogd["regret"] is not None and static["regret"] is None
    assert ogd["speed_vs_static"] > 0 and static["tau_vs_static"] == 1.0
    assert drafter.runtime is None  # the bench served copies: the drafter it was given is untouched
    print_online(result)
    table = markdown_online(result)
    assert len(ogd["segments"]) == 9  # the domain changes every request: 9 blocks of one request, pooled in the
    mixed = [line for line in table if line.startswith("| ogd | mixed: ")]  # tables as one mixed stretch
    assert sum(line.startswith("| ogd | ") for line in table) == 2 and len(mixed) == 1 and "| 0-9 |" in mixed[0]
    assert sum(line.startswith(f"| {w['requests'][0]}-") for w in ogd["over_time"] for line in table) == 3


def test_online_plot(tmp_path):
    from adaflash_hf.bench.online import plot_online

    entry = {"tau": 1.5, "tau_over_time": [1.4, 1.6], "domains_over_time": ["code", "math"],
             "over_time": [{"requests": [0, 1], "tau": 1.4, "tokens_per_s": 10.0},
                           {"requests": [1, 2], "tau": 1.6, "tokens_per_s": 11.0}]}
    plot_online({"algorithms": {"static": entry, "ogd": entry}}, tmp_path / "o.png")
    assert (tmp_path / "o.png").stat().st_size > 1000


def test_shift_stream_blocks_domains_in_order():
    from adaflash_hf.bench.online import SHIFT_ORDER, shift_stream

    stream = shift_stream(per_block=3, cycles=2)
    assert [r["domain"] for r in stream] == [d for _ in range(2) for d in SHIFT_ORDER for _ in range(3)]
    assert len({r["prompt"] for r in stream}) == len(stream) == 24  # distinct prompts, both cycles


def test_background_updates_land_one_request_later_and_keep_sampling_reproducible():
    def serve(n):
        target = make_tiny_target(seed=9)
        drafter = _drafter(target, seed=9)
        adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(update_mode="background", learning_rate=0.05))
        live_b = [m.lora_B["online"].weight for m in drafter.modules() if isinstance(m, BaseTunerLayer)]
        moved, outs = [], []
        torch.manual_seed(3)
        for i in range(n):
            outs.append(target.generate(_prompt(seed=i), max_new_tokens=16, do_sample=True, assistant_model=drafter))
            moved.append(any(b.abs().sum() > 0 for b in live_b))
        adapter.finish()
        return outs, moved, adapter

    outs, moved, adapter = serve(4)
    # request 0's update runs while request 1 is served and lands when request 1 ends: the live drafter drafted
    # requests 0 and 1 with the initial weights (B = 0), request 2 onwards with learned ones
    assert moved == [False, True, True, True] and adapter.stats.updates == 4
    assert adapter.trainee is not adapter.drafter and adapter.stats.critical_seconds < adapter.stats.update_seconds
    again, _, _ = serve(4)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))  # same seed, same stream: same samples


def test_learning_backs_off_while_it_does_not_pay(monkeypatch):
    """With `learn_while_paying`, an adapter whose loss on new requests is not below the static drafter's learns
    from ever fewer requests; once it pays again, from every request."""
    target = make_tiny_target(seed=6)
    drafter = _drafter(target, seed=6)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(learning_rate=0.01, gate_window=2,
                                                                 gate_max_interval=4))
    gains = iter([-1.0, -1.0, 5.0] + [1.0] * 20)  # what learning is worth on each new request, scripted
    monkeypatch.setattr(OnlineSpecAdapter, "_gate", lambda self, fb, head, online: self._learn_interval(next(gains)))
    learned = []
    for i in range(9):
        before = adapter.stats.updates
        target.generate(_prompt(seed=i), max_new_tokens=10, do_sample=False, assistant_model=drafter)
        learned.append(adapter.stats.updates > before)
    # request 0 learns (no gain: every 2nd request), 2 learns (no gain: every 4th), 4 learns and pays: every request
    assert learned == [True, False, True, False, True, True, True, True, True]
    assert adapter.stats.skipped == 2


def test_the_gate_measures_the_static_drafter_on_the_new_request():
    target = make_tiny_target(seed=6)
    drafter = _drafter(target, seed=6)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(learning_rate=0.05, record_stream=True))
    for i in range(3):
        target.generate(_prompt(seed=i), max_new_tokens=16, do_sample=False, assistant_model=drafter)
    # the first update starts from B = 0 (the adapter IS the static drafter): no gain, exactly
    assert adapter.stats.gains[0] == pytest.approx(0.0, abs=1e-6) and len(adapter.stats.gains) == adapter.stats.updates
    # later gains are the static loss minus the online loss, both on the request before learning from it
    assert any(abs(g) > 1e-6 for g in adapter.stats.gains[1:])


@pytest.mark.parametrize("algorithm", ["ogd", "ensemble"])
def test_the_static_drafter_drafts_while_the_adapter_does_not_pay(monkeypatch, algorithm):
    """`fallback_window`: after requests on which the adapter's loss was above the static drafter's, the live drafter
    drafts with every LoRA delta off (exactly the drafter without adapter), learning goes on, and the adapter drafts
    again once its recent gains are positive. Outputs stay those of plain greedy throughout."""
    target = make_tiny_target(seed=6)
    drafter = _drafter(target, seed=6)
    adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(algorithm=algorithm, learning_rate=0.05,
                                                                 fallback_window=2, gate_window=100))
    gains = iter([1.0, -5.0, -5.0, 1.0, 1.0, 1.0, 1.0])  # what the adapter is worth on each new request, scripted
    monkeypatch.setattr(OnlineSpecAdapter, "_gate", lambda self, fb, head, online: self._learn_interval(next(gains)))
    layers = [m for m in drafter.modules() if isinstance(m, BaseTunerLayer)]
    probe = (target.get_input_embeddings()(_prompt(seed=99, length=4)), torch.randn(1, 5, len(drafter.config.target_layer_ids) * target.config.hidden_size),
             torch.arange(9)[None])
    static_states, live = [], []
    for i in range(7):
        prompt = _prompt(seed=i)
        out = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, target.generate(prompt, max_new_tokens=12, do_sample=False))
        live.append(adapter.drafts_static)  # how the next request is drafted
        if adapter.drafts_static:
            assert all(layer.scaling[name] == 0 for layer in layers for name in adapter.config.adapter_names)
            with torch.no_grad():
                static_states.append(drafter(noise_embeds=probe[0], context_hidden_states=probe[1],
                                             position_ids=probe[2]).last_hidden_state)
    # gains 1 | -5 -5 1 | 1: the sum of the last two is negative after requests 1, 2 and 3
    assert live == [False, True, True, True, False, False, False]
    assert adapter.stats.updates == 7 and adapter.stats.static_requests == 3  # requests 2, 3, 4 were drafted static
    assert any(b.abs().sum() > 0 for b in adapter._params(adapter.config.adapter_names[-1])[1::2])  # it learned on
    adapter.detach()
    with torch.no_grad():
        base = drafter(noise_embeds=probe[0], context_hidden_states=probe[1], position_ids=probe[2]).last_hidden_state
    assert all(torch.equal(s, base) for s in static_states)
