"""The drafter as a transformers model: forward contract, weight layout, save/load, Auto and remote code."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoConfig, AutoModel
from transformers.cache_utils import DFlashCache

from adaflash_hf import AdaFlashDrafterConfig, AdaFlashDrafterModel
from adaflash_hf.models.drafter.modeling_adaflash_drafter import spread_layer_ids

from .conftest import make_tiny_target


DFLASH_LAYER_KEYS = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
}


def small_config(**overrides):
    kwargs = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, block_size=4, mask_token_id=49, target_layer_ids=[0, 2], num_target_layers=4)
    kwargs.update(overrides)
    return AdaFlashDrafterConfig(**kwargs)


def test_weight_names_follow_the_public_dflash_layout():
    model = AdaFlashDrafterModel(small_config())
    names = set(model.state_dict())
    expected = {f"layers.{i}.{key}" for i in range(2) for key in DFLASH_LAYER_KEYS}
    expected |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    assert names == expected
    assert model.fc.weight.shape == (32, 2 * 32)  # [H, len(target_layer_ids) * H]
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_forward_shapes_with_and_without_cache():
    torch.manual_seed(0)
    model = AdaFlashDrafterModel(small_config()).eval()
    noise, context = torch.randn(2, 4, 32), torch.randn(2, 7, 64)
    out = model(noise_embeds=noise, context_hidden_states=context)
    assert out.last_hidden_state.shape == (2, 4, 32)

    cache = DFlashCache(config=model.config)
    cached = model(noise_embeds=noise, context_hidden_states=context, position_ids=torch.arange(11)[None], cache=cache)
    assert torch.allclose(cached.last_hidden_state, out.last_hidden_state, atol=1e-5)
    assert cache.get_seq_length() == 11  # context + block; the caller crops the block afterwards
    # A 2D all-ones mask is the same as no mask.
    masked = model(noise_embeds=noise, context_hidden_states=context, attention_mask=torch.ones(2, 11))
    assert torch.allclose(masked.last_hidden_state, out.last_hidden_state, atol=1e-5)


def test_cached_context_equals_full_context():
    """Feeding the context in two rounds through the cache equals feeding it at once."""
    torch.manual_seed(0)
    model = AdaFlashDrafterModel(small_config()).eval()
    context, noise = torch.randn(1, 9, 64), torch.randn(1, 4, 32)
    full = model(noise_embeds=noise, context_hidden_states=context, position_ids=torch.arange(13)[None])
    cache = DFlashCache(config=model.config)
    model(noise_embeds=torch.randn(1, 4, 32), context_hidden_states=context[:, :5],
          position_ids=torch.arange(9)[None], cache=cache)
    cache.crop(-4)
    two_rounds = model(noise_embeds=noise, context_hidden_states=context[:, 5:],
                       position_ids=torch.arange(5, 13)[None], cache=cache)
    assert torch.allclose(two_rounds.last_hidden_state, full.last_hidden_state, atol=1e-5)


def test_matches_transformers_reference_dflash_drafter():
    """Same weights in transformers' own DFlash-style drafter (muse_glimmer_assistant) give the same states."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    torch.manual_seed(0)
    ours = AdaFlashDrafterModel(small_config()).eval()
    ref_config = MuseGlimmerAssistantConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, rms_norm_eps=ours.config.rms_norm_eps, layer_types=["full_attention"] * 2, block_size=4,
        mask_token_id=49, target_layer_ids=[0, 2], rope_parameters=dict(ours.config.rope_parameters),
    )
    ref = MuseGlimmerAssistantModel(ref_config).eval()
    renamed = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    ref.load_state_dict({renamed.get(k, k): v for k, v in ours.state_dict().items()})
    noise, context, pos = torch.randn(1, 4, 32), torch.randn(1, 6, 64), torch.arange(3, 13)[None]
    a = ours(noise_embeds=noise, context_hidden_states=context, position_ids=pos, cache=DFlashCache(config=ours.config))
    b = ref(noise_embeds=noise, context_hidden_states=context, position_ids=pos, cache=DFlashCache(config=ref_config))
    assert torch.allclose(a.last_hidden_state, b.last_hidden_state, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    model = AdaFlashDrafterModel(small_config())
    with pytest.raises(ValueError, match="feature size"):
        model(noise_embeds=torch.randn(1, 4, 32), context_hidden_states=torch.randn(1, 3, 32))
    with pytest.raises(ValueError, match="position_ids"):
        model(noise_embeds=torch.randn(1, 4, 32), context_hidden_states=torch.randn(1, 3, 64),
              position_ids=torch.arange(4)[None])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(block_size=1), "block_size"),
        (dict(num_key_value_heads=3), "multiple"),
        (dict(target_layer_ids=[0, 4]), "target_layer_ids"),
        (dict(mask_token_id=50), "mask_token_id"),
        (dict(layer_types=["sliding_attention"] * 2), "full_attention"),
    ],
)
def test_config_validation(overrides, message):
    # transformers' strict configs wrap validator errors (as for LlamaConfig) in this error type.
    with pytest.raises(StrictDataclassClassValidationError, match=message):
        small_config(**overrides)


def test_spread_layer_ids():
    assert spread_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert spread_layer_ids(4, 5) == [1]
    assert spread_layer_ids(1, 5) == [0]
    assert all(0 <= i < 12 for i in spread_layer_ids(12, 3))


def test_from_target_matches_shapes_and_copies_layers():
    target = make_tiny_target(num_layers=6)
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=2, block_size=8, num_context_layers=3)
    cfg = drafter.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_target_layers, cfg.block_size) == (64, 96, 6, 8)
    assert cfg.target_layer_ids == [1, 2, 3] and cfg.rope_parameters == target.config.rope_parameters
    # The last two target layers are copied into the drafter.
    assert torch.equal(drafter.layers[1].mlp.up_proj.weight, target.model.layers[5].mlp.up_proj.weight)
    assert torch.equal(drafter.layers[0].self_attn.q_proj.weight, target.model.layers[4].self_attn.q_proj.weight)
    assert torch.equal(drafter.norm.weight, target.model.norm.weight)
    assert drafter.compatibility_errors(target) == []


def test_save_load_with_auto_classes(tmp_path):
    torch.manual_seed(0)
    model = AdaFlashDrafterModel(small_config()).eval()
    model.save_pretrained(tmp_path)
    files = {p.name for p in tmp_path.iterdir()}
    assert {"model.safetensors", "config.json", "configuration_adaflash_drafter.py",
            "modeling_adaflash_drafter.py"} <= files
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_adaflash_drafter.AdaFlashDrafterConfig",
        "AutoModel": "modeling_adaflash_drafter.AdaFlashDrafterModel",
    }
    assert isinstance(AutoConfig.from_pretrained(tmp_path), AdaFlashDrafterConfig)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, AdaFlashDrafterModel)
    noise, context = torch.randn(1, 4, 32), torch.randn(1, 5, 64)
    assert torch.equal(model(noise, context).last_hidden_state, loaded(noise, context).last_hidden_state)


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.modules["adaflash_hf"] = None  # make `import adaflash_hf` fail: only transformers is available
    from transformers import AutoModel, AutoModelForCausalLM
    drafter = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    target = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()
    prompt = torch.tensor([[3, 14, 15, 9, 26, 5]])
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)
    spec = target.generate(prompt, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                           speculation_type="dflash")
    assert torch.equal(plain, spec), (plain, spec)
    # Without `speculation_type`, transformers treats it as an ordinary assistant: refused, clearly, before any
    # forward of the target.
    calls = []
    target.register_forward_hook(lambda *a: calls.append(1))
    try:
        target.generate(prompt, max_new_tokens=4, assistant_model=drafter)
        raise SystemExit("a block drafter was accepted as an ordinary assistant model")
    except TypeError as e:
        assert "speculation_type='dflash'" in str(e) and not calls, (e, calls)
    print("REMOTE_OK", drafter.dtype, spec.tolist())
    """
)


def test_trust_remote_code_load_in_a_fresh_process_without_adaflash(tmp_path, tiny_target, tiny_drafter):
    # Stored in bf16 beside an fp32 target, as the shipped drafter is: the remote code casts what it receives.
    tiny_drafter.to(torch.bfloat16).save_pretrained(tmp_path / "drafter")
    tiny_target.save_pretrained(tmp_path / "target")
    script = tmp_path / "remote.py"
    script.write_text(REMOTE_SCRIPT)
    env_cmd = [sys.executable, str(script), str(tmp_path / "drafter"), str(tmp_path / "target")]
    result = subprocess.run(env_cmd, capture_output=True, text=True, timeout=300,
                            env={"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules"),
                                 "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    plain = tiny_target.generate(torch.tensor([[3, 14, 15, 9, 26, 5]]), max_new_tokens=12, do_sample=False)
    assert f"REMOTE_OK torch.bfloat16 {plain.tolist()}" in result.stdout


# ------------------------------------------------------------------------------------- loading refuses bad files


def _pickle_only(folder):
    """Turn a saved checkpoint into a pickle-only one (`pytorch_model.bin`, what older exporters write)."""
    from safetensors.torch import load_file

    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()


def test_from_pretrained_refuses_pickle_weights(tmp_path, tiny_target):
    torch.manual_seed(0)
    AdaFlashDrafterModel.from_target(tiny_target, num_layers=1, block_size=4).save_pretrained(tmp_path)
    _pickle_only(tmp_path)
    for load in (AdaFlashDrafterModel.from_pretrained, AutoModel.from_pretrained):
        with pytest.raises(OSError, match=r"(?s)refusing to load pickle-based weights .*pytorch_model\.bin.*"
                                          r"safetensors\.torch\.save_file\(torch\.load"):
            load(tmp_path)
    with pytest.raises(ValueError, match="use_safetensors=False"):
        AdaFlashDrafterModel.from_pretrained(tmp_path, use_safetensors=False)
    # A config's `transformers_weights` picks the file and would bypass `use_safetensors=True`.
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").rename(tmp_path / "adapter_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({**config, "transformers_weights": "adapter_model.bin"}))
    with pytest.raises(OSError, match=r"refusing to load pickle-based weights .*adapter_model\.bin"):
        AdaFlashDrafterModel.from_pretrained(tmp_path)


def _drafter_with_vocab(tmp_path, target):
    torch.manual_seed(0)
    drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=4)
    drafter.set_draft_vocab(torch.arange(10, 20))
    drafter.save_pretrained(tmp_path)
    return tmp_path / "model.safetensors"


def _rewrite(path, **changes):
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    state.update(changes)
    save_file(state, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("bad, message", [
    (torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, 9 * 10**18]), r"draft_vocab.*ids outside \[0, 96\)"),
    (torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, -1]), r"draft_vocab.*ids outside \[0, 96\)"),
    (torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, 10]), r"draft_vocab.*repeats ids \[10\]"),
])
def test_corrupt_draft_vocab_is_refused_at_load(tmp_path, tiny_target, bad, message):
    weights = _drafter_with_vocab(tmp_path, tiny_target)
    assert torch.equal(AdaFlashDrafterModel.from_pretrained(tmp_path).draft_vocab, torch.arange(10, 20))
    _rewrite(weights, draft_vocab=bad)
    with pytest.raises(ValueError, match=rf"model\.safetensors.*{message}"):
        AdaFlashDrafterModel.from_pretrained(tmp_path)


def test_draft_vocab_length_must_match_the_config(tmp_path, tiny_target):
    _drafter_with_vocab(tmp_path, tiny_target)
    config = json.loads((tmp_path / "config.json").read_text())
    config["draft_vocab_size"] = None  # a config edited by hand: the checkpoint still has a 10-id vocabulary
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .draft_vocab. is stored but "
                                         r"config\.draft_vocab_size is None"):
        AdaFlashDrafterModel.from_pretrained(tmp_path)
    config["draft_vocab_size"] = 10  # and the other way round: transformers would leave the buffer uninitialised
    (tmp_path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp_path / "model.safetensors"))
    del state["draft_vocab"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="draft_vocab_size is 10 but the checkpoint holds no 'draft_vocab'"):
        AdaFlashDrafterModel.from_pretrained(tmp_path)


def test_non_finite_weights_are_refused_at_load(tmp_path, tiny_target):
    weights = _drafter_with_vocab(tmp_path, tiny_target)
    fc = AdaFlashDrafterModel.from_pretrained(tmp_path).fc.weight.detach().clone()
    fc[0, 3] = float("nan")
    _rewrite(weights, **{"fc.weight": fc})
    with pytest.raises(ValueError, match=r"model\.safetensors.*fc\.weight.*non-finite values \(1 of"):
        AdaFlashDrafterModel.from_pretrained(tmp_path)
