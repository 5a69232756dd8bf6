"""Loading drafters and length heads: refuse or restore, never half (issue 29, item 1).

Every broken checkpoint below is refused at load by ONE line naming the file and the field or tensor, by the same
check in `from_pretrained`, `python -m adaflash_hf.interop inspect` and the `adaflash-hf` flags (exit status 2).
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from adaflash_hf import AdaFlashDrafterModel, AdaFlashLengthHead, AdaFlashLengthHeadConfig
from adaflash_hf.bench.args import fail_on_load_error
from adaflash_hf.checkpoints import HERE, LENGTH_HEAD, OFFLINE_DRAFTER, OPD_DRAFTER, OPD_PARENT_DRAFTER, checkpoint_dir
from adaflash_hf.cli import main as cli
from adaflash_hf.interop import CheckpointError
from adaflash_hf.interop.__main__ import main as interop_cli
from adaflash_hf.models.drafter.configuration_adaflash_drafter import REQUIRED_CONFIG_FIELDS as DRAFTER_REQUIRED
from adaflash_hf.models.length_head.configuration_adaflash_length_head import REQUIRED_CONFIG_FIELDS as HEAD_REQUIRED

from .conftest import build_drafter, make_tiny_target


# Keys a loader never reads: save metadata, and the target's token ids the drafter carries but never decodes with.
NOT_READ = {"architectures", "auto_map", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny drafter (2 layers, block 8, a draft vocabulary, a tokenizer fingerprint) and a length head, saved."""
    root = tmp_path_factory.mktemp("saved")
    target = make_tiny_target(eos=2)
    drafter = build_drafter(target, num_layers=2, block_size=8, seed=1)
    drafter.set_draft_vocab(torch.arange(10, 40))
    drafter.config.tokenizer_fingerprint = "0123456789abcdef"
    drafter.save_pretrained(root / "drafter")
    torch.manual_seed(0)
    head = AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=64, block_size=8, head_dim=16, rms_norm_eps=1e-6))
    head.save_pretrained(root / "head")
    return {"drafter": root / "drafter", "head": root / "head", "target": target}


def _copy(saved, kind, tmp_path):
    return shutil.copytree(saved[kind], tmp_path / kind)


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


_DROP = object()


def _refused(load, folder, *fragments):
    """`load(folder)` raises a one-line `ValueError` naming every fragment; returns the message."""
    with pytest.raises(ValueError) as info:
        load(folder)
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert str(fragment) in message, (fragment, message)
    return message


# ------------------------------------------------------------------------------------------------ config.json


@pytest.mark.parametrize("kind, model_cls, required", [
    ("drafter", AdaFlashDrafterModel, DRAFTER_REQUIRED),
    ("head", AdaFlashLengthHead, HEAD_REQUIRED),
])
def test_each_config_field_dropped_is_refused_by_name_or_loads_the_saved_value(saved, tmp_path, kind, model_cls,
                                                                              required):
    written = json.loads((saved[kind] / "config.json").read_text())
    assert set(required) <= set(written)
    refused = set()
    for key in written:
        folder = shutil.copytree(saved[kind], tmp_path / key)
        _edit_config(folder, **{key: _DROP})
        try:
            loaded = model_cls.from_pretrained(folder)
        except ValueError as error:
            message = str(error)
            assert "\n" not in message and f"{folder / 'config.json'}" in message and repr(key) in message, message
            refused.add(key)
            continue
        if key not in NOT_READ:
            assert loaded.config.to_dict()[key] == written[key], key
    assert refused == set(required) | {"model_type"}


def test_save_pretrained_writes_required_fields_even_at_their_defaults(tmp_path):
    """transformers' `to_diff_dict` drops values equal to the base config's defaults: ours must all be written."""
    from adaflash_hf import AdaFlashDrafterConfig

    config = AdaFlashDrafterConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2)  # every other field at its class default
    AdaFlashDrafterModel(config).save_pretrained(tmp_path / "d")
    AdaFlashLengthHead(AdaFlashLengthHeadConfig()).save_pretrained(tmp_path / "h")
    drafter_json = json.loads((tmp_path / "d" / "config.json").read_text())
    head_json = json.loads((tmp_path / "h" / "config.json").read_text())
    assert set(DRAFTER_REQUIRED) <= set(drafter_json) and set(HEAD_REQUIRED) <= set(head_json)
    assert (drafter_json["block_size"], drafter_json["mask_token_id"], drafter_json["draft_vocab_size"]) == (16, 0, None)
    assert AdaFlashDrafterModel.from_pretrained(tmp_path / "d").config.block_size == 16


@pytest.mark.parametrize("kind, model_cls", [("drafter", AdaFlashDrafterModel), ("head", AdaFlashLengthHead)])
@pytest.mark.parametrize("content, fragment", [
    (None, "config.json: no such file"),
    ("", "config.json: empty file"),
    ("{}", "config.json: no 'model_type' field"),
    ("[1, 2]", "config.json: not a JSON object"),
    ('{"model_type": ', "config.json: not valid JSON"),
])
def test_missing_empty_or_broken_config_json_is_refused(saved, tmp_path, kind, model_cls, content, fragment):
    folder = _copy(saved, kind, tmp_path)
    if content is None:
        (folder / "config.json").unlink()
    else:
        (folder / "config.json").write_text(content)
    _refused(model_cls.from_pretrained, folder, folder / "config.json", fragment)


@pytest.mark.parametrize("kind, model_cls", [("drafter", AdaFlashDrafterModel), ("head", AdaFlashLengthHead)])
def test_unknown_model_type_is_refused(saved, tmp_path, kind, model_cls):
    folder = _copy(saved, kind, tmp_path)
    _edit_config(folder, model_type="foo_unknown")
    _refused(model_cls.from_pretrained, folder, "config.json", "model_type 'foo_unknown'", model_cls.config_class.model_type)


def test_a_null_or_mistyped_required_field_is_refused_naming_it(saved, tmp_path):
    folder = _copy(saved, "drafter", tmp_path)
    _edit_config(folder, block_size=None)
    _refused(AdaFlashDrafterModel.from_pretrained, folder, "config.json", "invalid config", "block_size")
    _edit_config(folder, block_size=8, mask_token_id="16")
    _refused(AdaFlashDrafterModel.from_pretrained, folder, "config.json", "invalid config", "mask_token_id")


def test_nullable_fields_load_exactly_the_saved_value(saved):
    loaded = AdaFlashDrafterModel.from_pretrained(saved["drafter"])
    assert (loaded.config.block_size, loaded.config.draft_vocab_size, loaded.config.tokenizer_fingerprint) == \
        (8, 30, "0123456789abcdef")
    assert torch.equal(loaded.draft_vocab, torch.arange(10, 40))


# ------------------------------------------------------------------------------------------------ weights


def _truncate(folder):
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def _drop_tensor(folder, name):
    state = load_file(str(folder / "model.safetensors"))
    del state[name]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("kind, model_cls", [("drafter", AdaFlashDrafterModel), ("head", AdaFlashLengthHead)])
def test_truncated_weights_are_refused_naming_file_and_tensor(saved, tmp_path, kind, model_cls):
    folder = _copy(saved, kind, tmp_path)
    _truncate(folder)
    _refused(model_cls.from_pretrained, folder, folder / "model.safetensors", "truncated file: tensor '")


@pytest.mark.parametrize("kind, model_cls, tensor", [
    ("drafter", AdaFlashDrafterModel, "fc.weight"),
    ("drafter", AdaFlashDrafterModel, "layers.1.self_attn.k_norm.weight"),
    ("head", AdaFlashLengthHead, "position.weight"),
])
def test_a_tensor_missing_from_the_file_is_refused_not_randomly_initialised(saved, tmp_path, kind, model_cls, tensor):
    folder = _copy(saved, kind, tmp_path)
    _drop_tensor(folder, tensor)
    _refused(model_cls.from_pretrained, folder, f"missing tensors ['{tensor}']", folder / "model.safetensors",
             folder / "config.json")


def test_one_layer_more_in_the_config_than_in_the_file_is_refused(saved, tmp_path):
    folder = _copy(saved, "drafter", tmp_path)
    _edit_config(folder, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    _refused(AdaFlashDrafterModel.from_pretrained, folder, "config.json", "missing tensors ['layers.2.",
             "(+", "model.safetensors")
    _edit_config(folder, num_hidden_layers=1, layer_types=["full_attention"])
    _refused(AdaFlashDrafterModel.from_pretrained, folder, "unexpected tensors ['layers.1.")


def test_a_tensor_of_another_shape_is_refused_before_transformers_loads_it(saved, tmp_path):
    folder = _copy(saved, "drafter", tmp_path)
    _edit_config(folder, intermediate_size=96)
    _refused(AdaFlashDrafterModel.from_pretrained, folder, "layers.0.mlp.down_proj.weight has shape [64, 128] in",
             "model.safetensors, the config implies [64, 96]")


def test_config_overrides_that_leave_tensors_unloaded_are_refused_after_loading(saved):
    """An explicit config is used as given; a tensor it implies that the file lacks is refused after the load."""
    config = AdaFlashDrafterModel.check_pretrained(saved["drafter"])
    config.num_hidden_layers, config.layer_types = 3, ["full_attention"] * 3
    with pytest.raises(ValueError, match=r"missing tensors \['layers\.2\."):
        AdaFlashDrafterModel.from_pretrained(saved["drafter"], config=config)


def test_non_finite_weights_fail_after_loading_in_one_line_through_the_cli_helper(saved, tmp_path, capsys):
    folder = _copy(saved, "drafter", tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    state["fc.weight"][0, 0] = float("nan")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    AdaFlashDrafterModel.check_pretrained(folder)  # the header check cannot see values
    with pytest.raises(SystemExit) as info:
        fail_on_load_error(AdaFlashDrafterModel.from_pretrained, folder)
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # after the load's progress bar
    assert len(errors) == 1 and errors[0].startswith("adaflash-hf: error: corrupt AdaFlashDrafterModel checkpoint: ")
    assert "model.safetensors: tensor 'fc.weight' has non-finite values (1 of" in errors[0]


# ------------------------------------------------------------------------------------------------ pairs


def test_target_model_type_is_validated_against_the_target(saved, tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    drafter = AdaFlashDrafterModel.from_pretrained(saved["drafter"])
    assert drafter.config.target_model_type == "llama"
    drafter.check_compatible(saved["target"])
    tc = saved["target"].config
    other = MistralForCausalLM(MistralConfig(vocab_size=tc.vocab_size, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"built for a 'llama' target \(config.target_model_type\), this one is "
                                         r"'mistral'"):
        drafter.check_compatible(other)
    drafter.config.target_model_type = None  # unknown: not checked
    drafter.check_compatible(other)


# ------------------------------------------------------------------------------------------------ one checker


def test_interop_inspect_refuses_with_the_same_message(saved, tmp_path, capsys):
    for name, breaks in (("trunc", _truncate), ("field", lambda f: _edit_config(f, block_size=_DROP)),
                         ("tensor", lambda f: _drop_tensor(f, "fc.weight"))):
        folder = shutil.copytree(saved["drafter"], tmp_path / name)
        breaks(folder)
        with pytest.raises(CheckpointError) as info:
            AdaFlashDrafterModel.check_pretrained(folder)
        assert interop_cli(["inspect", str(folder)]) == 2
        assert capsys.readouterr().err == f"error: {info.value}\n"


@pytest.mark.parametrize("argv, flag", [
    (["bench", "--drafter"], "--drafter"),
    (["bench", "--length-head"], "--length-head"),
    (["compare", "--drafters"], "--drafters"),
    (["bench-serving", "--drafter"], "--drafter"),
    (["bench-online", "--drafter"], "--drafter"),
    (["calibrate", "--drafter"], "--drafter"),
])
def test_cli_flags_refuse_a_broken_checkpoint_in_one_line_with_status_2(saved, tmp_path, capsys, argv, flag):
    kind = "head" if flag == "--length-head" else "drafter"
    folder = _copy(saved, kind, tmp_path)
    _truncate(folder)
    with pytest.raises(SystemExit) as info:
        cli([*argv, str(folder)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"adaflash-hf: error: {flag} '{folder}': {folder / 'model.safetensors'}: truncated file")


def test_cli_bench_with_a_truncated_drafter_prints_one_line_and_exits_2(saved, tmp_path):
    """The reported case, end to end in a fresh process: no traceback, exit status 2."""
    folder = _copy(saved, "drafter", tmp_path)
    _truncate(folder)
    result = subprocess.run([sys.executable, "-m", "adaflash_hf.cli", "bench", "--drafter", str(folder)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert f"{folder / 'model.safetensors'}: truncated file: tensor '" in result.stderr and not result.stdout


# ------------------------------------------------------------------------------------------------ shipped


def test_shipped_checkpoints_pass_the_checks_and_load():
    for name in (OFFLINE_DRAFTER, OPD_PARENT_DRAFTER, OPD_DRAFTER):
        written = json.loads((checkpoint_dir(name) / "config.json").read_text())
        assert set(DRAFTER_REQUIRED) <= set(written), name
        config = AdaFlashDrafterModel.check_pretrained(checkpoint_dir(name))
        assert (config.block_size, config.mask_token_id, config.num_hidden_layers) == (8, 16, 2)
    head = AdaFlashLengthHead.from_pretrained(HERE / LENGTH_HEAD)
    assert set(HEAD_REQUIRED) <= set(json.loads((HERE / LENGTH_HEAD / "config.json").read_text()))
    assert (head.config.hidden_size, head.config.block_size) == (576, 8)
