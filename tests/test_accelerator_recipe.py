"""`examples/accelerator_recipe.py --toy --device cpu` end to end on a tiny saved target (offline, no testbed): the
label store grows, a drafter and its README card are staged, and every stage prints its tokens/s. Plus the
wall-clock budget of `ComputeBudgetCallback` (`max_train_seconds`) that the recipe's training stage relies on."""

import json
import sys
import time
from types import SimpleNamespace

import torch

from .conftest import VOCAB
from .test_examples import REPO_ROOT, _run, save_tiny_target, write_prompts


def test_wall_clock_budget_stops_training_and_is_reported():
    from adaflash_hf.training.callbacks import ComputeBudgetCallback

    budget = ComputeBudgetCallback(max_train_seconds=0.5)
    args, state = SimpleNamespace(save_strategy="steps"), SimpleNamespace()
    control = SimpleNamespace(should_training_stop=False, should_save=False)
    budget.on_train_begin(args, state, control)
    budget.on_step_begin(args, state, control)
    budget.on_step_end(args, state, control)
    assert not control.should_training_stop  # well within the budget
    time.sleep(0.6)  # time outside the steps (evaluations, data) counts against a wall-clock budget too
    budget.on_step_begin(args, state, control)
    budget.on_step_end(args, state, control)
    assert control.should_training_stop and control.should_save  # checkpoints on: it saves where it stops
    summary = budget.summary()
    assert summary["max_train_seconds"] == 0.5 and 0 <= summary["train_wall_seconds"] < 0.5
    assert summary["train_steps_this_run"] == 2
    # without a budget it never stops
    never, control = ComputeBudgetCallback(), SimpleNamespace(should_training_stop=False, should_save=False)
    never.on_step_begin(args, state, control)
    never.on_step_end(args, state, control)
    assert not control.should_training_stop


def test_toy_recipe_grows_the_store_trains_and_stages_a_card(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf.training.label_store import LabelStore

    target_dir, cache = save_tiny_target(tmp_path / "target"), tmp_path / "cache"
    prompts = write_prompts(tmp_path / "prompts.jsonl", n=12)
    # Two responses are in the store already (the recipe must skip them and add the rest).
    store = LabelStore.open(str(target_dir), torch.bfloat16, vocab_size=VOCAB, root=cache / "labels")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    records = [json.loads(line) for line in prompts.read_text().splitlines()][:2]
    store.add_responses(target, AutoTokenizer.from_pretrained(target_dir), records, max_new_tokens=8,
                        progress=False)
    assert len(store.entries("responses")) == 2

    out = tmp_path / "recipe"
    result = _run([sys.executable, str(REPO_ROOT / "examples" /
                   "accelerator_recipe.py"), "--toy", "--device", "cpu", "--minutes", "5",
                   "--target", str(target_dir), "--train_prompts", str(prompts), "--bench_prompts", str(prompts),
                   "--output_dir", str(out)], timeout=300, ADAFLASH_HF_CACHE=str(cache))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-4000:]
    stdout = result.stdout
    for line in ("generation tokens/s:", "hidden-state recording tokens/s:", "training tokens/s:"):
        assert line in stdout, stdout
    assert "store 2 -> 12 responses (+10)" in stdout, stdout

    grown = LabelStore.open(str(target_dir), torch.bfloat16, root=cache / "labels")
    assert len(grown.entries("responses")) == 12
    hub = out / "hub"
    assert (hub / "config.json").is_file() and (hub / "model.safetensors").is_file()
    card = (hub / "README.md").read_text()
    assert "accelerator_recipe.py" in card and "overall" in card
    summary = json.loads((out / "recipe_summary.json").read_text())
    assert summary["stages"]["generate"]["sequences"] == 10
    assert summary["stages"]["record"]["sequences"] > 0 and summary["stages"]["train"]["steps"] == 2
    assert all(summary["stages"][k]["tokens_per_s"] > 0 for k in ("generate", "record", "train"))
