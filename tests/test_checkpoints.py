"""The shipped checkpoints: code copies kept in sync (`auto_map`), architecture-only configs, generation configs."""

import json

from adaflash_hf import AdaFlashDrafterModel, AdaFlashGenerationConfig
from adaflash_hf.checkpoints import (HERE, LENGTH_HEAD, OFFLINE_DRAFTER, OPD_DRAFTER, OPD_PARENT_DRAFTER, REPO_CHECKPOINTS,
                                     checkpoint_dir, code_copies, stale_copies)
from adaflash_hf.models.drafter.configuration_adaflash_drafter import LEGACY_GENERATION_KEYS


def test_code_copies_equal_their_source():
    # three drafters (one shipped, two repository-level) and one length head, three files each (config, modeling,
    # checkpoint_checks), and the length head's package copy of checkpoint_checks.py
    assert len(code_copies()) == 13
    assert sum(copy.is_relative_to(REPO_CHECKPOINTS) for _, copy in code_copies()) == 6
    assert stale_copies() == [], "run `python -m adaflash_hf.checkpoints --fix-copies`"


def test_fix_copies_repairs_a_drifted_copy(tmp_path, monkeypatch):
    import adaflash_hf.checkpoints as checkpoints

    source, copy = code_copies()[0]
    fake_here = tmp_path / "checkpoints"
    (fake_here / copy.parent.name).mkdir(parents=True)
    drifted = fake_here / copy.parent.name / copy.name
    drifted.write_text(source.read_text() + "\n# drift\n")
    monkeypatch.setattr(checkpoints, "HERE", fake_here)
    monkeypatch.setattr(checkpoints, "code_copies", lambda: [(source, drifted)])
    assert checkpoints.stale_copies() == [drifted]
    assert checkpoints.stale_copies(fix=True) == [] and drifted.read_text() == source.read_text()


def test_the_check_command_passes_when_clean():
    # `python -m adaflash_hf.checkpoints`, in-process (a subprocess would spend its time importing torch)
    from adaflash_hf.checkpoints.__main__ import main

    assert main([]) == 0


def test_shipped_drafter_configs_hold_architecture_only():
    for name in (OFFLINE_DRAFTER, OPD_PARENT_DRAFTER, OPD_DRAFTER):
        folder = checkpoint_dir(name)
        config = json.loads((folder / "config.json").read_text())
        assert not set(LEGACY_GENERATION_KEYS) & set(config), name
        knobs = AdaFlashGenerationConfig.from_pretrained(folder)
        assert knobs.hybrid_lookup and knobs.allow_no_draft and knobs.prompt_lookup_num_tokens == 10
        drafter = AdaFlashDrafterModel.from_pretrained(folder)
        assert drafter.generation_config.to_dict() == knobs.to_dict() and drafter.runtime is None


def test_legacy_decoding_keys_in_config_json_migrate_to_the_generation_config(tmp_path, tiny_target):
    drafter = AdaFlashDrafterModel.from_target(tiny_target, num_layers=1, block_size=4)
    drafter.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(hybrid_lookup=False, allow_no_draft=False, lookup_num_tokens=4, lookup_max_ngram=3)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AdaFlashDrafterModel.from_pretrained(tmp_path)
    knobs = loaded.generation_config
    assert (knobs.hybrid_lookup, knobs.allow_no_draft, knobs.prompt_lookup_num_tokens,
            knobs.max_matching_ngram_size) == (False, False, 4, 3)
    assert "hybrid_lookup" not in loaded.config.to_dict()
    loaded.save_pretrained(tmp_path / "resaved")
    assert "hybrid_lookup" not in json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert json.loads((tmp_path / "resaved" / "generation_config.json").read_text())["hybrid_lookup"] is False


def test_only_the_default_drafter_and_the_length_head_live_in_the_package():
    """The wheel carries what the demo and the documented default use; `-v1` and `-opd` stay in the repository."""
    assert sorted(p.name for p in HERE.iterdir() if p.is_dir() and not p.name.startswith("__")) == sorted(
        [OFFLINE_DRAFTER, LENGTH_HEAD])
    for name in (OPD_PARENT_DRAFTER, OPD_DRAFTER):
        assert checkpoint_dir(name) == REPO_CHECKPOINTS / name and (checkpoint_dir(name) / "config.json").is_file()
