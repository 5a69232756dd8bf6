"""Interop with other DFlash checkpoints: z-lab / AdaFlash / muse layouts, the converter and loading safety.

The foreign checkpoints are written here by hand (json + safetensors) in the layouts of the public sources cited in
`adaflash_hf/interop/dflash.py`, independently of our exporter, so the importer is checked against the layout.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.cache_utils import DFlashCache

from adaflash_hf import AdaFlashDrafterConfig, AdaFlashDrafterModel
from adaflash_hf.generation.cost_model import TargetCostModel
from adaflash_hf.interop import (
    CheckpointError,
    build_target_layer_ids,
    detect_layout,
    export_dflash_checkpoint,
    load_dflash_checkpoint,
    save_drafter_folder,
)
from adaflash_hf.interop.__main__ import main as cli
from adaflash_hf.models import AdaFlashLengthHead, AdaFlashLengthHeadConfig


H, V = 32, 50


def make_config(**overrides):
    kwargs = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, block_size=4, mask_token_id=49, target_layer_ids=[0, 2], num_target_layers=4,
                  rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return AdaFlashDrafterConfig(**{**kwargs, **overrides})


@pytest.fixture
def drafter():
    torch.manual_seed(0)
    model = AdaFlashDrafterModel(make_config()).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def outputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    noise, context = torch.randn(1, 4, H, generator=g), torch.randn(1, 5, 2 * H, generator=g)
    pos = torch.arange(3, 12)[None]
    cache = DFlashCache(config=model.config)
    out = model(noise_embeds=noise.to(model.dtype), context_hidden_states=context.to(model.dtype), position_ids=pos,
                cache=cache)
    return out.last_hidden_state


def write_zlab(folder, model, dtype=torch.float32, legacy_rope=False, nested_block_size=True, config=None,
               tensors=None):
    """A z-lab DFlash checkpoint: `dflash/model.py` names, config as in the dflash2 fixture / SpecForge config."""
    c = model.config
    cfg = {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "block_size": c.block_size,
        "bos_token_id": 1, "eos_token_id": 2, "dtype": str(dtype).removeprefix("torch."), "head_dim": c.head_dim,
        "hidden_act": "silu", "hidden_size": H, "initializer_range": 0.02, "intermediate_size": 64,
        "layer_types": ["full_attention"] * 2, "max_position_embeddings": 4096, "max_window_layers": 2,
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": 4,
        "rms_norm_eps": 1e-6, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": V, "transformers_version": "4.57.1",
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids)},
    }
    if nested_block_size:
        cfg["dflash_config"]["block_size"] = c.block_size
    if legacy_rope:
        cfg.update(rope_theta=1000000, rope_scaling=None)
    else:
        cfg["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    cfg.update(config or {})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {k: v.to(dtype).contiguous() for k, v in model.state_dict().items()}
    state.update(tensors or {})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("legacy_rope, nested_block_size", [(False, True), (True, False)])
def test_zlab_checkpoint_loads_with_the_source_outputs(tmp_path, drafter, legacy_rope, nested_block_size):
    src = write_zlab(tmp_path / "zlab", drafter, legacy_rope=legacy_rope, nested_block_size=nested_block_size)
    assert detect_layout(src) == "zlab"
    loaded = load_dflash_checkpoint(src)
    c = loaded.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.num_target_layers) == (4, 49, [0, 2], 4)
    assert c.rope_parameters == {"rope_type": "default", "rope_theta": 1e6} and c.head_dim == 8
    assert torch.equal(outputs(loaded), outputs(drafter))


def _config_keys(path):
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta"), "rope_type": "default"}
    d = cfg.get("dflash_config", {})
    keys = ["architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "vocab_size",
            "max_position_embeddings", "attention_bias", "layer_types", "num_target_layers", "tie_word_embeddings",
            "bos_token_id", "eos_token_id"]
    return ({k: cfg.get(k) for k in keys}, float(rope["rope_theta"]), rope["rope_type"],
            d.get("block_size", cfg.get("block_size")), d["mask_token_id"], d["target_layer_ids"], cfg["dtype"])


def test_converter_round_trips_a_zlab_checkpoint_bit_exactly(tmp_path, drafter):
    src = write_zlab(tmp_path / "src", drafter, dtype=torch.bfloat16, legacy_rope=True)
    assert cli(["convert", str(src), str(tmp_path / "ours"), "--to", "adaflash"]) == 0
    assert detect_layout(tmp_path / "ours") == "adaflash"
    assert cli(["convert", str(tmp_path / "ours"), str(tmp_path / "back"), "--to", "zlab"]) == 0
    with safe_open(str(src / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "back" / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype == torch.bfloat16 and torch.equal(x, y), name
    assert _config_keys(src) == _config_keys(tmp_path / "back")
    assert not list((tmp_path / "back").glob("*.bin"))


def test_exported_zlab_config_parses_as_the_qwen3_config_the_servers_read(tmp_path, drafter):
    from transformers import AutoConfig

    out = export_dflash_checkpoint(drafter, tmp_path / "z", layout="zlab")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    parsed = AutoConfig.from_pretrained(out)
    assert type(parsed).__name__ == "Qwen3Config" and parsed.head_dim == 8 and parsed.block_size == 4
    assert parsed.dflash_config == {"block_size": 4, "mask_token_id": 49, "target_layer_ids": [0, 2]}
    assert parsed.layer_types == ["full_attention"] * 2 and parsed.rope_parameters["rope_theta"] == 1e6
    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the names of z-lab's dflash2 header fixture
        assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= set(f.keys())
        assert not any("embed" in k or "lm_head" in k for k in f.keys())


def test_specforge_config_without_dflash_config_uses_the_specforge_layer_rule(tmp_path, drafter):
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # = ZinYY/AdaFlash qwen3-8b config's ids
    assert build_target_layer_ids(36, 1) == [18]
    src = write_zlab(tmp_path / "sf", drafter, config={"dflash_config": {"mask_token_id": 49},
                                                          "num_target_layers": 6})
    with pytest.raises(CheckpointError, match="fc.weight has shape"):  # rule gives 2 layers [1, 3]: fc fits
        load_dflash_checkpoint(src, target_layer_ids=[0])  # ... but an override to 1 layer does not
    assert load_dflash_checkpoint(src).config.target_layer_ids == [1, 3]


def _thresh_head_tensors(bottleneck=16):
    g = torch.Generator().manual_seed(1)
    shapes = {"down.weight": (bottleneck, 2 * H), "down.bias": (bottleneck,), "res.0.weight": (bottleneck, bottleneck),
              "res.0.bias": (bottleneck,), "out.weight": (1, bottleneck), "out.bias": (1,)}
    return {f"thresh_head_two_model.{k}": torch.randn(*s, generator=g) for k, s in shapes.items()}


def test_adaflash_threshold_head_is_refused_by_name_or_dropped(tmp_path, drafter):
    src = write_zlab(tmp_path / "ada", drafter, tensors=_thresh_head_tensors(), config={"dflash_config": {
        "mask_token_id": 49, "target_layer_ids": [0, 2], "thresh_head_bottleneck_dim": 16,
        "use_thresh_head_two_model": True, "thresh_head_direct_len": True}})
    assert detect_layout(src) == "adaflash-zlab"
    with pytest.raises(CheckpointError, match=r"ThreshHeadTwoModel.*drop_unsupported_heads=True"):
        load_dflash_checkpoint(src)
    loaded = load_dflash_checkpoint(src, drop_unsupported_heads=True)
    assert torch.equal(outputs(loaded), outputs(drafter)) and loaded.runtime is None  # nothing attached
    # The same tensors without the config flag are simply unexpected.
    stray = write_zlab(tmp_path / "stray", drafter, tensors=_thresh_head_tensors())
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['thresh_head_two_model"):
        load_dflash_checkpoint(stray)


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash2DraftModel"),
    ({"layer_types": ["sliding_attention"] * 2, "sliding_window": 8}, "sliding_attention"),
    ({"dflash_config": {"mask_token_id": 49, "target_layer_ids": [0, 2], "output_multiplier": 0.2}},
     "output_multiplier=0.2"),
    ({"dflash_config": {"mask_token_id": 49, "target_layer_ids": [0, 2], "input_embedding_scale": 2.0}},
     "input_embedding_scale=2.0"),
    ({"is_causal": True}, "is_causal=True"),
    ({"dflash_config": {"mask_token_id": 49, "target_layer_ids": [0, 2], "mystery": 1}}, "unknown dflash_config"),
    ({"dflash_config": {"target_layer_ids": [0, 2]}}, "no mask_token_id"),
])
def test_unsupported_zlab_features_are_refused_by_name(tmp_path, drafter, change, message):
    src = write_zlab(tmp_path / "bad", drafter, config=change)
    with pytest.raises(CheckpointError, match=message):
        load_dflash_checkpoint(src)


def _muse_model(drafter):
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    c = drafter.config
    ref = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(
        hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, rms_norm_eps=c.rms_norm_eps, layer_types=["full_attention"] * 2, block_size=4, mask_token_id=49,
        target_layer_ids=[0, 2], rope_parameters=dict(c.rope_parameters))).eval()
    renamed = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    ref.load_state_dict({renamed.get(k, k): v for k, v in drafter.state_dict().items()})
    return ref


def test_transformers_muse_checkpoint_imports(tmp_path, drafter):
    _muse_model(drafter).save_pretrained(tmp_path / "muse")
    assert detect_layout(tmp_path / "muse") == "muse"
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_dflash_checkpoint(tmp_path / "muse")
    loaded = load_dflash_checkpoint(tmp_path / "muse", vocab_size=V)
    assert torch.equal(outputs(loaded), outputs(drafter))
    assert {k: torch.equal(v, drafter.state_dict()[k]) for k, v in loaded.state_dict().items()} == \
        {k: True for k in drafter.state_dict()}


def test_muse_export_loads_in_transformers_and_round_trips(tmp_path, drafter):
    from transformers import MuseGlimmerAssistantModel

    out = export_dflash_checkpoint(drafter, tmp_path / "m", layout="muse")
    ref = MuseGlimmerAssistantModel.from_pretrained(out).eval()
    assert torch.allclose(outputs(ref), outputs(drafter), atol=1e-5)
    assert cli(["convert", str(out), str(tmp_path / "z"), "--to", "zlab"]) == 0
    back = load_dflash_checkpoint(tmp_path / "z")
    assert torch.equal(outputs(back), outputs(drafter))
    with pytest.raises(CheckpointError, match="no attention/MLP biases"):
        export_dflash_checkpoint(AdaFlashDrafterModel(make_config(attention_bias=True)), tmp_path / "mb", "muse")


def test_our_layout_loads_with_its_length_head(tmp_path, drafter):
    head = AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=H, block_size=4, head_dim=8))
    cost = TargetCostModel(points={1: {1: 0.05, 4: 0.07}})
    save_drafter_folder(drafter, tmp_path / "a", length_head=head, cost_model=cost)
    loaded = load_dflash_checkpoint(tmp_path / "a")
    assert torch.equal(outputs(loaded), outputs(drafter))
    assert isinstance(loaded.runtime.length_head, AdaFlashLengthHead)
    assert loaded.runtime.cost_model.points == cost.points


def test_draft_vocabulary_is_dropped_by_default_with_a_warning_of_its_cost(tmp_path, drafter, caplog):
    drafter.set_draft_vocab(torch.arange(10))
    with caplog.at_level("WARNING", logger="adaflash_hf.interop.convert"):
        out = export_dflash_checkpoint(drafter, tmp_path / "z", layout="zlab")
    warning = " ".join(r.getMessage() for r in caplog.records)
    for fragment in ("10-token draft vocabulary", f"full {V}-token vocabulary", f"whole LM head ({V} rows) instead "
                     "of 10", "never trained to be improbable", "acceptance may drop", "Outputs stay exact"):
        assert fragment in warning, warning
    loaded = load_dflash_checkpoint(out)
    assert loaded.draft_vocab is None and torch.equal(outputs(loaded), outputs(drafter))
    with pytest.raises(CheckpointError, match="drop_draft_vocab=False.*--keep-draft-vocab"):
        export_dflash_checkpoint(drafter, tmp_path / "z2", layout="zlab", drop_draft_vocab=False)
    with pytest.raises(CheckpointError, match="not empty"):
        export_dflash_checkpoint(drafter, out, layout="zlab")


def test_readme_convert_command_exports_a_drafter_with_a_draft_vocabulary(tmp_path, drafter, capsys, caplog):
    """`python -m adaflash_hf.interop convert DRAFTER OUT --to zlab`, as the README shows it, on our layout."""
    drafter.set_draft_vocab(torch.arange(5, 25))
    drafter.save_pretrained(tmp_path / "ours")
    with caplog.at_level("WARNING", logger="adaflash_hf.interop.convert"):
        assert cli(["convert", str(tmp_path / "ours"), str(tmp_path / "zlab"), "--to", "zlab"]) == 0
    assert "wrote zlab checkpoint" in capsys.readouterr().out
    assert "20-token draft vocabulary" in caplog.text and "acceptance may drop" in caplog.text
    assert detect_layout(tmp_path / "zlab") == "zlab" and load_dflash_checkpoint(tmp_path / "zlab").draft_vocab is None
    assert cli(["convert", str(tmp_path / "ours"), str(tmp_path / "muse"), "--to", "muse", "--drop-draft-vocab"]) == 0
    assert cli(["convert", str(tmp_path / "ours"), str(tmp_path / "strict"), "--to", "zlab",
                "--keep-draft-vocab"]) == 2
    assert "--keep-draft-vocab" in capsys.readouterr().err and not (tmp_path / "strict").exists()


def test_non_finite_weights_are_refused_in_every_layout(tmp_path, drafter, capsys):
    bad = drafter.fc.weight.detach().clone()
    bad[1, 1] = float("nan")
    src = write_zlab(tmp_path / "z", drafter, tensors={"fc.weight": bad})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'fc\.weight' has non-finite values"):
        load_dflash_checkpoint(src)
    with torch.no_grad():
        drafter.fc.weight.copy_(bad)
    drafter.save_pretrained(tmp_path / "ours")
    assert cli(["inspect", str(tmp_path / "ours")]) == 2
    assert "tensor 'fc.weight' has non-finite values" in capsys.readouterr().err


def test_truncated_corrupt_and_mismatched_files_fail_clearly(tmp_path, drafter):
    src = write_zlab(tmp_path / "t", drafter)
    weights = src / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated file: tensor"):
        load_dflash_checkpoint(src)
    weights.write_bytes(data[:6])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        load_dflash_checkpoint(src)
    weights.write_bytes((2 ** 20).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
        load_dflash_checkpoint(src)

    bad_shape = {"fc.weight": torch.zeros(H, 3 * H)}
    wrong = write_zlab(tmp_path / "w", drafter, tensors=bad_shape)
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \[32, 96\] in .*model.safetensors, the config "
                                              r"implies \[32, 64\]"):
        load_dflash_checkpoint(wrong)
    quantized = write_zlab(tmp_path / "q", drafter, tensors={"norm.weight": torch.ones(H, dtype=torch.int32)})
    with pytest.raises(CheckpointError, match=r"non-float16/32/bf16 dtypes .*norm.weight \(I32"):
        load_dflash_checkpoint(quantized)
    missing = write_zlab(tmp_path / "m", drafter)
    state = {k: v for k, v in drafter.state_dict().items() if k != "norm.weight"}
    save_file(state, str(missing / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors \['norm.weight'\]"):
        load_dflash_checkpoint(missing)


def test_pickle_weights_are_refused(tmp_path, drafter):
    src = write_zlab(tmp_path / "p", drafter)
    (src / "model.safetensors").unlink()
    (src / "pytorch_model.bin").write_bytes(b"not even opened")
    with pytest.raises(CheckpointError, match=r"refusing to load pickle-based weights .*pytorch_model.bin"):
        load_dflash_checkpoint(src)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_dflash_checkpoint(tmp_path)


def test_cli_inspect_and_errors(tmp_path, drafter, capsys):
    src = write_zlab(tmp_path / "z", drafter)
    assert cli(["inspect", str(src)]) == 0
    assert "layout: zlab" in capsys.readouterr().out
    assert cli(["convert", str(tmp_path / "nope"), str(tmp_path / "o"), "--to", "zlab"]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err
