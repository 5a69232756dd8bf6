"""Hub uploads up to the HTTP boundary: staged files, card contents (numbers from the bench JSON), API calls.

The only stand-in is `FakeApi`, passed as `api=`: it records `create_repo` / `upload_folder` calls and snapshots
the folder being uploaded (the staging folder is temporary).
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from adaflash_hf import AdaFlashDrafterConfig, AdaFlashDrafterModel, SpeculationRuntime
from adaflash_hf.generation.cost_model import TargetCostModel
from adaflash_hf.hub import (
    load_bench_summary,
    push_drafter,
    push_training_data,
    render_drafter_card,
    stage_drafter_repo,
    target_model_from_bench,
)
from adaflash_hf.interop import CheckpointError
from adaflash_hf.models import AdaFlashLengthHead, AdaFlashLengthHeadConfig


REPO = "someone/tiny-adaflash-drafter"
TARGET = "HuggingFaceTB/SmolLM2-135M-Instruct"
BENCH = {
    "overall": {"tau": 3.1416, "speedup": 1.2345, "identical": 7, "total": 8},
    "domains": {"code": {"tau": 4.0625, "speedup": 1.5555, "identical": 4, "total": 4},
                "math": {"tau": 2.2207, "speedup": 0.9137, "identical": 3, "total": 4}},
    "tau_cross_domain_std": 0.92,
    "methods": {},
    "config": {"target": "testbed:SmolLM2-135M-Instruct", "n_prompts": 8, "max_new_tokens": 64, "dtype": "float32",
               "threads": 2},
}
DRAFTER_FILES = {"README.md", "bench.json", "config.json", "generation_config.json", "model.safetensors",
                 "configuration_adaflash_drafter.py", "modeling_adaflash_drafter.py", "checkpoint_checks.py"}
HEAD_FILES = {f"length_head/{f}" for f in ("README.md", "config.json", "model.safetensors", "cost_model.json",
                                           "configuration_adaflash_length_head.py",
                                           "modeling_adaflash_length_head.py", "checkpoint_checks.py")}


class FakeApi:
    """Stand-in for `huggingface_hub.HfApi`: records calls, snapshots the uploaded folder."""

    def __init__(self):
        self.calls, self.files = [], {}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs["repo_id"], {k: v for k, v in kwargs.items()
                                                                  if k not in ("repo_id", "folder_path")}))
        root = Path(kwargs["folder_path"])
        self.files = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        return "commit-url"


@pytest.fixture
def drafter():
    torch.manual_seed(0)
    config = AdaFlashDrafterConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, block_size=4, mask_token_id=49,
                                   target_layer_ids=[0, 2], num_target_layers=4)
    return AdaFlashDrafterModel(config).eval()


@pytest.fixture
def head():
    torch.manual_seed(1)
    return AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=32, block_size=4, head_dim=8)).eval()


COST = TargetCostModel(points={1: {1: 0.0500, 4: 0.0731}}, context_length=128, description="on a test box")


def make_adapters(root: Path) -> Path:
    for name in ("code", "math"):
        (root / name).mkdir(parents=True)
        (root / name / "adapter_config.json").write_text(json.dumps({"r": 4, "name": name}))
        save_file({"w": torch.ones(2)}, str(root / name / "adapter_model.safetensors"))
    return root


def listing(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def test_staged_repository_layout_and_cards(tmp_path, drafter, head):
    folder = stage_drafter_repo(
        drafter, tmp_path / "repo", BENCH, repo_id=REPO, length_head=head, cost_model=COST,
        adapter_dir=make_adapters(tmp_path / "adapters"), training_method="KL distillation, 3 epochs",
        training_data="3000 target responses.", length_head_metrics={"eval_loss": 0.41234, "eval_mae_accepted": 0.5},
        length_head_metrics_source="held-out split")
    assert listing(folder) == DRAFTER_FILES | HEAD_FILES | {
        f"adapters/{n}/{f}" for n in ("code", "math") for f in ("adapter_config.json", "adapter_model.safetensors")}
    assert json.loads((folder / "bench.json").read_text()) == BENCH
    assert json.loads((folder / "config.json").read_text())["auto_map"]["AutoModel"] == \
        "modeling_adaflash_drafter.AdaFlashDrafterModel"
    assert TargetCostModel.load(folder / "length_head" / "cost_model.json").points == COST.points

    card = (folder / "README.md").read_text()
    assert f"base_model: {TARGET}" in card and "library_name: adaflash_hf" in card
    for row in ("| overall | 3.14 | 1.23x | 7/8 |", "| code | 4.06 | 1.56x | 4/4 |", "| math | 2.22 | 0.91x | 3/4 |"):
        assert row in card
    assert "on 8 held-out prompts, 64 new tokens, float32, batch size 1, 2 CPU threads" in card
    assert "Training: KL distillation, 3 epochs. 3000 target responses." in card
    assert "Command: `adaflash-hf bench --max-new-tokens 64 --dtype float32 --threads 2 --json bench.json`" in card
    assert "Everything lives in this one repository, each part in its own subfolder" in card
    for path in ("`length_head/`", "`adapters/code/`", "`adapters/math/`", "`bench.json`"):
        assert f"| {path} |" in card
    assert 'subfolder="length_head"' in card and "length_head/cost_model.json" in card

    head_card = (folder / "length_head" / "README.md").read_text()
    assert f"[`{REPO}`](https://huggingface.co/{REPO})" in head_card
    assert "| 1 | 1: 0.0500 s, 4: 0.0731 s |" in head_card and "on a test box" in head_card
    assert "| eval_loss | 0.4123 |" in head_card and "held-out split" in head_card
    assert f"{sum(p.numel() for p in head.parameters()):,} parameters" in head_card


def test_push_drafter_stages_then_calls_the_api(tmp_path, drafter, head):
    bench_file = tmp_path / "bench.json"
    bench_file.write_text(json.dumps(BENCH))
    SpeculationRuntime(length_head=head, cost_model=COST).attach(drafter)  # the attached head is pushed by default
    api = FakeApi()
    result = push_drafter(drafter, REPO, bench_file, private=True, token="hf_x", api=api,
                          training_method="KL distillation")
    assert result == "commit-url"
    assert api.calls == [
        ("create_repo", REPO, {"repo_type": "model", "private": True, "exist_ok": True, "token": "hf_x"}),
        ("upload_folder", REPO, {"repo_type": "model", "commit_message": "Upload AdaFlash drafter", "token": "hf_x"}),
    ]
    assert set(api.files) == DRAFTER_FILES | HEAD_FILES
    assert b"| overall | 3.14 | 1.23x | 7/8 |" in api.files["README.md"]


def test_drafter_only_card_and_bench_validation(tmp_path, drafter):
    folder = stage_drafter_repo(drafter, tmp_path / "r", BENCH, repo_id=REPO, target_model="me/target")
    assert listing(folder) == DRAFTER_FILES
    card = (folder / "README.md").read_text()
    assert "base_model: me/target" in card and "length_head" not in card
    # The original call (no layout, no head) still renders.
    plain = str(render_drafter_card(drafter, BENCH, target_model=TARGET, repo_id=REPO, training_method="m",
                                    training_data="d", bench_command="adaflash-hf bench"))
    assert "| overall | 3.14 | 1.23x | 7/8 |" in plain and "Files in this repository" not in plain
    with pytest.raises(ValueError, match="missing 'overall'"):
        load_bench_summary({"domains": {}})
    with pytest.raises(ValueError, match=r"lacks the measured \['speedup'\]"):
        load_bench_summary({"overall": {"tau": 1.0, "identical": 1, "total": 1}, "domains": {}})
    assert target_model_from_bench(BENCH) == TARGET
    with pytest.raises(ValueError, match="pass target_model"):
        target_model_from_bench({"config": {"target": "/some/local/folder"}})


def test_pickle_adapters_are_not_uploaded(tmp_path, drafter):
    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="pickle-based adapter weights"):
        stage_drafter_repo(drafter, tmp_path / "r", BENCH, repo_id=REPO, adapter_dir=tmp_path / "ad")


def test_push_training_data_with_a_dataset_card(tmp_path):
    import datasets
    import pyarrow.parquet as pq

    data = datasets.Dataset.from_dict({
        "input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "prompt_len": [1, 1, 2], "domain": ["code", "math", "code"],
        "hidden_states": [[[0.5] * 4] * 3, [[0.1] * 4] * 2, [[0.2] * 4] * 4],
    })
    api = FakeApi()
    push_training_data(data, "someone/data", target_model=TARGET, api=api, drafter_repo=REPO,
                       target_layer_ids=[1, 3], description="Greedy responses to the testbed prompts.")
    assert [c[0] for c in api.calls] == ["create_repo", "upload_folder"]
    assert api.calls[0][2]["repo_type"] == api.calls[1][2]["repo_type"] == "dataset"
    assert set(api.files) == {"README.md", "data/train-00000-of-00001.parquet"}
    card = api.files["README.md"].decode()
    for text in ("| train | 3 |", "code: 2, math: 1", "`hidden_states` (list of list of float", "layers [1, 3]",
                 f"[`{REPO}`]", "size_categories:", "path: data/train-*.parquet", "Greedy responses"):
        assert text in card, text
    staged = tmp_path / "t.parquet"
    staged.write_bytes(api.files["data/train-00000-of-00001.parquet"])
    assert pq.read_table(staged).num_rows == 3


def _example():
    path = Path(__file__).resolve().parent.parent / "examples" / "push_to_hub.py"
    spec = importlib.util.spec_from_file_location("push_to_hub_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_help_and_dry_run(tmp_path, drafter, head, capsys):
    example = _example()
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--help"])
    assert exit_info.value.code == 0 and "--dry-run" in capsys.readouterr().out
    drafter.save_pretrained(tmp_path / "drafter")
    head.save_pretrained(tmp_path / "head")
    COST.save(tmp_path / "head" / "cost_model.json")
    (tmp_path / "head" / "training_summary.json").write_text(json.dumps({"blocks": 120, "eval": {"eval_loss": 0.3}}))
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    assert example.main(["--drafter", str(tmp_path / "drafter"), "--repo-id", REPO, "--bench-json",
                         str(tmp_path / "bench.json"), "--length-head", str(tmp_path / "head"),
                         "--dry-run", str(tmp_path / "staged")]) == 0
    assert listing(tmp_path / "staged") == DRAFTER_FILES | HEAD_FILES
    head_card = (tmp_path / "staged" / "length_head" / "README.md").read_text()
    assert "| eval_loss | 0.3000 |" in head_card and "120 blocks" in head_card
    assert "nothing uploaded" in capsys.readouterr().out


def test_staging_refuses_a_folder_that_already_holds_files(tmp_path, drafter, head, capsys):
    """Strays in DIR (an old pickle, a `.env`) must never be staged, listed or uploaded."""
    dirty = tmp_path / "staged"
    dirty.mkdir()
    (dirty / "pytorch_model.bin").write_bytes(b"old pickle")
    (dirty / ".env").write_text("HF_TOKEN=hf_secret\n")
    with pytest.raises(FileExistsError, match=r"staged is not empty \(\.env, pytorch_model\.bin\)"):
        stage_drafter_repo(drafter, dirty, BENCH, repo_id=REPO)
    assert listing(dirty) == {"pytorch_model.bin", ".env"}  # untouched, nothing staged next to them

    drafter.save_pretrained(tmp_path / "drafter")
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    argv = ["--drafter", str(tmp_path / "drafter"), "--repo-id", REPO, "--bench-json", str(tmp_path / "bench.json")]
    capsys.readouterr()
    assert _example().main([*argv, "--dry-run", str(dirty)]) == 2
    captured = capsys.readouterr()
    assert "nothing uploaded" not in captured.out and "pytorch_model.bin" not in captured.out
    assert len(captured.err.strip().splitlines()) == 1 and "is not empty" in captured.err
    assert listing(dirty) == {"pytorch_model.bin", ".env"}
    (tmp_path / "empty").mkdir()  # an existing empty folder is fine
    assert _example().main([*argv, "--dry-run", str(tmp_path / "empty")]) == 0
    assert listing(tmp_path / "empty") == DRAFTER_FILES


def _section(card: str, title: str) -> str:
    return card.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0].strip()


def test_shipped_length_head_card_keeps_its_held_out_metrics(tmp_path, drafter, capsys):
    """Staging the shipped length head renders the held-out metrics (and training) its own card reports."""
    from adaflash_hf.checkpoints import length_head_dir

    shipped = length_head_dir()
    drafter.save_pretrained(tmp_path / "drafter")
    (tmp_path / "bench.json").write_text(json.dumps(BENCH))
    assert _example().main(["--drafter", str(tmp_path / "drafter"), "--repo-id", REPO, "--bench-json",
                            str(tmp_path / "bench.json"), "--length-head", str(shipped),
                            "--dry-run", str(tmp_path / "staged")]) == 0
    staged = (tmp_path / "staged" / "length_head" / "README.md").read_text()
    card = (shipped / "README.md").read_text()
    assert "No held-out metrics" not in staged
    measured = json.loads((shipped / "training_summary.json").read_text())["eval"]
    for key in ("eval_mae_accepted", "eval_mean_actual_accepted"):
        assert f"| {key} | {measured[key]:.4f} |" in staged
    assert _section(staged, "Measured results") == _section(card, "Measured results")
    training = next(line for line in card.splitlines() if line.startswith("- Training: "))
    assert training in staged


# ------------------------------------------------------------------------------------- templates as package data
TEMPLATE_NAMES = ("drafter", "length_head", "training_data")
REPO_ROOT = Path(__file__).resolve().parents[1]


def test_templates_resolve_through_the_package():
    """The card templates are package data: `importlib.resources` finds them inside `adaflash_hf/model_cards/`."""
    import importlib.resources

    import adaflash_hf
    from adaflash_hf.hub import template_path

    package_dir = Path(adaflash_hf.__file__).resolve().parent
    for name in TEMPLATE_NAMES:
        path = template_path(name)
        assert path.is_file() and path.resolve().parent == package_dir / "model_cards"
        assert (importlib.resources.files("adaflash_hf") / "model_cards" / f"{name}.md").read_text() == path.read_text()
    with pytest.raises(FileNotFoundError, match="available"):
        template_path("no_such_card")
    # The repository root's `model_cards` (a link, for older references) shows the same files.
    root = REPO_ROOT / "model_cards"
    if root.exists():
        assert {p.name for p in root.glob("*.md")} == {f"{n}.md" for n in TEMPLATE_NAMES}


def test_templates_ship_in_the_wheel(tmp_path):
    """Build a non-editable wheel from a copy of the sources, install it by unpacking, render a card from it."""
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    shutil.copytree(REPO_ROOT / "adaflash_hf", src / "adaflash_hf",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path / "wheel")], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("adaflash_hf-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    # The wheel carries what the demo and the documented default use, and nothing else that is not code: the
    # default drafter and the length head (OPD's `-v1` parent and `-opd` stay in the repository's checkpoints/).
    assert wheel.stat().st_size < 25e6, f"wheel is {wheel.stat().st_size / 1e6:.1f} MB"
    drafter, head = "adaflash_hf/checkpoints/smollm2-135m-instruct-drafter/", \
        "adaflash_hf/checkpoints/smollm2-135m-instruct-length-head/"
    data = {n for n in names if not n.endswith(".py") and ".dist-info/" not in n}
    cost_models = {n for n in data if n.startswith("adaflash_hf/cost_models/")}  # small measured cost models (JSON)
    with zipfile.ZipFile(wheel) as archive:
        assert all(archive.getinfo(n).file_size < 1e6 for n in cost_models)
    assert data - cost_models == {
        *(drafter + f for f in ("README.md", "config.json", "generation_config.json", "model.safetensors",
                                "training_summary.json")),
        *(head + f for f in ("README.md", "config.json", "cost_model.json", "model.safetensors",
                             "training_summary.json")),
        *(f"adaflash_hf/model_cards/{n}.md" for n in TEMPLATE_NAMES),
        "adaflash_hf/testbed/data/eval_prompts.jsonl",
    }
    assert {n.split("/")[2] for n in names if n.startswith("adaflash_hf/checkpoints/") and n.count("/") > 2} == {
        drafter.split("/")[2], head.split("/")[2]}
    # The shipped checkpoints travel with their model code (`auto_map`) and their generation config.
    from adaflash_hf.checkpoints import code_copies

    shipped = {"adaflash_hf/" + str(copy.relative_to(REPO_ROOT / "adaflash_hf")) for _, copy in code_copies()
               if copy.is_relative_to(REPO_ROOT / "adaflash_hf")}
    assert shipped and shipped <= names
    assert "adaflash_hf/checkpoints/smollm2-135m-instruct-drafter/generation_config.json" in names
    script = (
        "import adaflash_hf, pathlib, sys\n"
        "from adaflash_hf.hub import render_drafter_card, template_path\n"
        "from adaflash_hf import AdaFlashDrafterConfig, AdaFlashDrafterModel\n"
        "site = pathlib.Path(sys.argv[1]).resolve()\n"
        "assert pathlib.Path(adaflash_hf.__file__).resolve().is_relative_to(site), adaflash_hf.__file__\n"
        f"for name in {TEMPLATE_NAMES!r}:\n"
        "    assert template_path(name).resolve().is_relative_to(site), template_path(name)\n"
        "config = AdaFlashDrafterConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
        "    num_attention_heads=4, num_key_value_heads=2, block_size=4, mask_token_id=49, target_layer_ids=[0, 2],\n"
        "    num_target_layers=4)\n"
        f"card = render_drafter_card(AdaFlashDrafterModel(config), {BENCH!r}, target_model={TARGET!r},\n"
        f"    repo_id={REPO!r}, training_method='m', training_data='d', bench_command='adaflash-hf bench')\n"
        "print(card.content)\n"
    )
    # Run outside the checkout, with only the unpacked wheel on the path ahead of site-packages.
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "site")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "3.14" in run.stdout and REPO.split("/")[-1] in run.stdout


def _code_references(card: str) -> list[tuple[str, str]]:
    """(object, attribute) pairs the card's python blocks use: `from X import Y` as ("X", "Y"), `Cls.attr` and
    `Cls(...).attr` for imported names, and `drafter.attr` as ("drafter", attr)."""
    import ast
    import re

    refs = []
    for block in re.findall(r"```python\n(.*?)```", card, flags=re.S):
        tree = ast.parse(block)
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    refs.append((node.module, alias.name))
                    imported[alias.asname or alias.name] = (node.module, alias.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                base = node.value.func if isinstance(node.value, ast.Call) else node.value
                if isinstance(base, ast.Name) and (base.id in imported or base.id == "drafter"):
                    refs.append((imported.get(base.id, base.id), node.attr))
    return refs


def test_card_code_only_uses_what_the_package_has(tmp_path, drafter, head):
    """Every import and every method the staged cards' code calls exists (a card once told users to call a drafter
    method that the runtime object had replaced)."""
    import importlib

    from adaflash_hf.checkpoints import HERE, LENGTH_HEAD

    folder = stage_drafter_repo(drafter, tmp_path / "repo", BENCH, repo_id=REPO, length_head=head, cost_model=COST,
                                training_method="m", training_data="d")
    cards = [(folder / "README.md").read_text(), (folder / "length_head" / "README.md").read_text(),
             (HERE / LENGTH_HEAD / "README.md").read_text()]
    refs = [ref for card in cards for ref in _code_references(card)]
    assert any(attr == "attach" for _, attr in refs)  # the runtime is attached in the cards' code
    for obj, attr in refs:
        if obj == "drafter":
            assert hasattr(AdaFlashDrafterModel, attr), f"the cards call drafter.{attr}, which does not exist"
        elif isinstance(obj, tuple):
            module, name = obj
            if module.startswith("adaflash_hf"):
                assert hasattr(getattr(importlib.import_module(module), name), attr), f"{name}.{attr}"
        elif obj.startswith("adaflash_hf"):
            assert hasattr(importlib.import_module(obj), attr), f"from {obj} import {attr}"
