"""The example scripts as a user runs them: `python examples/X.py --help`, `accelerate launch ... --help` (every
script's help in one process each way), and real tiny runs (a few training steps each) of `train_drafter.py`, then
`train_opd.py` and `train_length_head.py` on its drafter, under `accelerate launch --cpu --num_processes 1`, and
data-parallel under `accelerate launch --multi_gpu --num_processes 2` (gloo on CPUs): the same loss, one save.

Every script's entry point runs in real subprocesses (as on the command line), offline, on tiny random Llama targets
saved to a folder with a character-level tokenizer; the testbed is not used. Further runs of a script whose command
line is already exercised that way (the label-store runs, `--resume`, `--status`) run in this process as
`python examples/X.py ARGS` would (`runpy`), which spares a fresh interpreter's imports each. New scripts in
`examples/` are picked up automatically.
"""

import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import VOCAB, make_tiny_target


REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (REPO_ROOT / "examples").glob("*.py") if not p.name.startswith("_"))

# The arguments a user reaches for first; `--help` must list them. Scripts not listed here (new ones) must still
# print a usage line with at least one option.
MAIN_ARGUMENTS = {
    "accelerator_recipe.py": ["--device", "--minutes", "--output_dir", "--toy", "--target", "--train_prompts",
                              "--init_drafter", "--generate_minutes", "--train_minutes"],
    "data_curve.py": ["--sizes", "--max_steps", "--output_dir"],
    "drafter_shapes.py": ["--shapes", "--cpu_minutes", "--output_dir", "--json"],
    "label_data.py": ["--responses_per_domain", "--corpus_tokens", "--threads", "--max_new_tokens"],
    "online_adapter.py": ["--algorithm", "--learning_rate", "--resume", "--output_dir", "--prompts"],
    "generate.py": ["--drafter", "--max-new-tokens", "--num-prompts", "--dtype"],
    "push_to_hub.py": ["--drafter", "--repo-id", "--bench-json", "--length-head", "--adapters", "--dry-run"],
    "train_drafter.py": ["--target", "--train_prompts", "--output_dir", "--max_steps", "--block_size",
                         "--num_layers", "--init_drafter", "--resume_from_checkpoint", "--label_store",
                         "--corpus_ratio", "--max_cpu_seconds", "--max_train_seconds", "--init_from_target"],
    "train_campaign.py": ["--leg_cpu_minutes", "--status", "--name", "--init_drafter"],
    "replay_drafters.py": ["--drafters", "--labels", "--steps", "--candidates", "--widths", "--prompts", "--per_domain",
                           "--json"],
    "tau_gap.py": ["--drafter", "--max_new_tokens", "--eval_per_domain", "--store_per_domain", "--responses", "--json",
                   "--markdown"],
    "train_length_head.py": ["--drafter", "--target", "--train_prompts", "--output_dir", "--num_sequences",
                             "--max_steps"],
    "train_opd.py": ["--init_drafter", "--target", "--train_prompts", "--output_dir", "--lmbda", "--temperature",
                     "--kl_clip", "--max_steps", "--label_store", "--max_cpu_seconds"],
}


def _env(**extra) -> dict:
    """Offline, one thread, no accelerate config of the machine's user (the CLI flags decide)."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])), **extra}


def _run(args, timeout=180, **env) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO_ROOT, env=_env(**env), capture_output=True, text=True, timeout=timeout)


def _accelerate(script: str, *args, num_processes: int = 1) -> list[str]:
    """`accelerate launch --cpu --num_processes 1 examples/<script> ARGS` through this interpreter (`script`: a
    name in examples/, or a path). With `num_processes` > 1: `accelerate launch --multi_gpu --num_processes N`, N
    data-parallel processes over gloo on CPUs (`adaflash_hf.training.distributed`; accelerate's `--cpu` launches
    one process whatever `--num_processes` says)."""
    path = Path(script) if os.sep in script else REPO_ROOT / "examples" / script
    mode = "--cpu" if num_processes == 1 else "--multi_gpu"
    return [sys.executable, "-m", "accelerate.commands.launch", mode, "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(path), *args]


def _run_in_process(script: str, args: list[str], monkeypatch, caplog, **env) -> str:
    """`python examples/<script> ARGS` in this process (`runpy`, `__name__ == "__main__"`, `sys.argv`, the
    environment variables `env`), for runs whose command-line entry point is already run as a real subprocess by
    another test here (a fresh interpreter costs seconds of imports). Raises what the script raises (a failing
    `SystemExit` included); returns the log lines it wrote (INFO and above)."""
    import logging
    import runpy

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [str(REPO_ROOT / "examples" / script), *args])
    caplog.clear()
    with caplog.at_level(logging.INFO):
        try:
            runpy.run_path(str(REPO_ROOT / "examples" / script), run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (None, 0), f"{script} exited with {exc.code}:\n{caplog.text[-4000:]}"
    return caplog.text


def _check_usage(script: str, result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{script} --help failed:\n{result.stderr[-3000:]}"
    usage = result.stdout
    assert "usage:" in usage and script in usage, usage[:500]
    assert "--" in usage.split("usage:", 1)[1], usage[:500]
    missing = [arg for arg in MAIN_ARGUMENTS.get(script, []) if arg not in usage]
    assert not missing, f"{script} --help does not mention {missing}"


def test_every_example_is_documented_and_its_main_arguments_are_checked():
    readme = (REPO_ROOT / "README.md").read_text()
    undocumented = [s for s in EXAMPLES if f"examples/{s}" not in readme]
    unchecked = [s for s in EXAMPLES if not MAIN_ARGUMENTS.get(s)]
    assert not undocumented, f"examples missing from the README's command tables: {undocumented}"
    assert not unchecked, f"examples whose --help is not checked for their main arguments: {unchecked}"


# Every script's `--help`, as `python examples/X.py --help` runs it (`runpy`, `__name__ == "__main__"`, `sys.argv`),
# all in one process: this one for `python`, one `accelerate launch` for the launcher (a process per script spent
# its time importing torch 20 times); each script's stdout, stderr and exit status are returned as JSON.
_ALL_HELPS = """
import contextlib, io, json, runpy, sys
results = {}
for path in sys.argv[1:]:
    out, err, code = io.StringIO(), io.StringIO(), 0
    sys.argv = [path, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:
            code, _ = 1, err.write(repr(exc))
    results[path.rsplit("/", 1)[-1]] = [code, out.getvalue(), err.getvalue()]
print("HELPS" + json.dumps(results))
"""


@pytest.fixture(scope="module", params=["python", "accelerate launch"])
def helps(request, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """`{script: CompletedProcess}` of `--help`, run by plain python, or under `accelerate launch --cpu
    --num_processes 1` (the launcher starts one process that prints every script's help)."""
    runner = tmp_path_factory.mktemp("helps") / "all_helps.py"
    runner.write_text(_ALL_HELPS)
    scripts = [str(REPO_ROOT / "examples" / s) for s in EXAMPLES]
    if request.param == "python":  # in this process (the scripts' imports are the library's, loaded here anyway)
        import contextlib
        import io

        argv, out = sys.argv, io.StringIO()
        try:
            sys.argv = [str(runner), *scripts]
            with contextlib.redirect_stdout(out):
                exec(compile(_ALL_HELPS, str(runner), "exec"), {"__name__": "__main__"})
        finally:
            sys.argv = argv
        stdout = out.getvalue()
    else:
        result = _run(_accelerate(str(runner), *scripts), timeout=300)
        assert result.returncode == 0 and "HELPS" in result.stdout, result.stderr[-3000:]
        stdout = result.stdout
    data = json.loads(stdout.split("HELPS", 1)[1].strip().splitlines()[0])
    return {script: subprocess.CompletedProcess([script, "--help"], code, out, err)
            for script, (code, out, err) in data.items()}


@pytest.mark.parametrize("script", EXAMPLES)
def test_help(script, helps):
    _check_usage(script, helps[script])


# ------------------------------------------------------------------------------------------ a real tiny run


def save_tiny_target(folder: Path, seed: int = 0) -> Path:
    """A tiny random Llama (the conftest one) with a character-level fast tokenizer, saved like a Hub model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>"]
    chars = [chr(c) for c in range(32, 32 + VOCAB - len(specials))]  # printable ASCII
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + chars)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                        eos_token="<eos>")
    assert len(tokenizer) == VOCAB
    make_tiny_target(seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_prompts(path: Path, n: int = 8) -> Path:
    domains = ["chat", "code"]
    path.write_text("".join(json.dumps({"prompt": f"tiny prompt {i}: say something about {domains[i % 2]}",
                                        "domain": domains[i % 2]}) + "\n" for i in range(n)))
    return path


# Data arguments shared by the three training scripts: the same values give OPD / length head a cache hit on the
# data train_drafter.py generated.
DATA_ARGS = ["--max_new_tokens", "16", "--gen_batch_size", "8", "--gen_dtype", "float32"]
STEPS = 4
FEW_STEPS = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_strategy", "no", "--eval_strategy", "no",
             "--disable_tqdm", "true"]
# Data parallelism: two processes at half the per-device batch (the same global batch, the same sequences per
# step) reach the one-process loss within LOSS_TOLERANCE (relative, the mean training loss of the run). The runs
# differ only where each process draws its own random numbers (anchors; OPD's sampled blocks).
LOSS_TOLERANCE = 0.10


def _close(a: float, b: float, tolerance: float = LOSS_TOLERANCE) -> bool:
    return abs(a - b) <= tolerance * abs(b)


def _data_parallel_run(script: str, args: list[str], out: Path, one_process: dict, **env) -> dict:
    """`accelerate launch --multi_gpu --num_processes 2 examples/<script> ARGS --output_dir OUT` on CPUs: trains
    over gloo, saves once, and matches the one-process summary's loss; returns its summary."""
    result = _run(_accelerate(script, *args, "--output_dir", str(out), num_processes=2), timeout=300, **env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stderr.count(f"saved {out / 'final'}") == 1, "every process saved"  # rank 0 only
    summary = json.loads((out / "final" / "training_summary.json").read_text())
    assert summary["num_processes"] == 2 and one_process["num_processes"] == 1
    assert summary["steps"] == one_process["steps"] == STEPS and len(summary["loss_curve"]) == STEPS
    assert _close(summary["train_loss"], one_process["train_loss"]), (summary["loss_curve"],
                                                                       one_process["loss_curve"])
    return summary


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`accelerate launch --cpu --num_processes 1 examples/train_drafter.py --target DIR --train_prompts JSONL`: one
    training step on a tiny random target; returns the folders and the finished process."""
    root = tmp_path_factory.mktemp("tiny_run")
    paths = {"root": root, "target": save_tiny_target(root / "target"), "prompts": write_prompts(root / "p.jsonl"),
             "cache": root / "cache", "drafter": root / "drafter"}
    paths["args"] = ["--target", str(paths["target"]), "--train_prompts", str(paths["prompts"]), *DATA_ARGS,
                     *FEW_STEPS, "--val_fraction", "0.25", "--num_layers", "1", "--block_size", "4",
                     "--num_context_layers", "2", "--num_anchors", "4"]
    paths["result"] = _run(_accelerate(
        "train_drafter.py", *paths["args"], "--output_dir", str(paths["drafter"]), "--per_device_train_batch_size",
        "2"), timeout=300, ADAFLASH_HF_CACHE=str(paths["cache"]))
    return paths


def _cached_files(cache: Path) -> set[str]:
    return {p.name for p in (cache / "datasets").iterdir()}


def test_train_drafter_one_step_under_accelerate_launch(tiny_run):
    """Generates the data, trains a few steps, evaluates and saves a drafter that loads and drafts for that
    target."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf import AdaFlashDrafterModel

    assert tiny_run["result"].returncode == 0, tiny_run["result"].stderr[-4000:]
    final = tiny_run["drafter"] / "final"
    summary = json.loads((final / "training_summary.json").read_text())
    assert summary["steps"] == STEPS and summary["target"] == str(tiny_run["target"])
    assert summary["train_sequences"] == 6 and summary["val_sequences"] == 2
    assert summary["eval"]["eval_loss"] > 0 and 1.0 <= summary["eval"]["eval_tau_proxy"] <= 4.0
    assert _cached_files(tiny_run["cache"])  # the data cache went where ADAFLASH_HF_CACHE says

    target = AutoModelForCausalLM.from_pretrained(tiny_run["target"], dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    drafter = AdaFlashDrafterModel.from_pretrained(final, dtype=torch.float32).eval()
    drafter.check_compatible(target, tokenizer)
    assert drafter.config.block_size == 4 and drafter.config.num_hidden_layers == 1
    ids = tokenizer("tiny prompt", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        plain = target.generate(ids, max_new_tokens=12, do_sample=False)
        spec = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter)
    assert torch.equal(plain, spec)  # lossless with the freshly trained drafter


def test_train_drafter_data_parallel_matches_one_process(tiny_run):
    """Two processes at per-device batch 1 = one process at batch 2: the same loss (first step: same weights, same
    sequences, only the anchors drawn differ), one save."""
    assert tiny_run["result"].returncode == 0, "train_drafter.py failed (see the test above)"
    one = json.loads((tiny_run["drafter"] / "final" / "training_summary.json").read_text())
    two = _data_parallel_run("train_drafter.py", [*tiny_run["args"], "--per_device_train_batch_size", "1"],
                             tiny_run["root"] / "drafter_dp", one, ADAFLASH_HF_CACHE=str(tiny_run["cache"]))
    assert _close(two["loss_curve"][0], one["loss_curve"][0], 0.02)
    assert two["train_sequences"] == one["train_sequences"]


def _data_args(tiny_run) -> list[str]:
    return ["--target", str(tiny_run["target"]), "--train_prompts", str(tiny_run["prompts"]), *DATA_ARGS]


def test_train_opd_one_step_under_accelerate_launch(tiny_run):
    """OPD on the drafter trained above, reusing its cached data (no new cache entry)."""
    assert tiny_run["result"].returncode == 0, "train_drafter.py failed (see the test above)"
    cached = _cached_files(tiny_run["cache"])
    out = tiny_run["root"] / "opd"
    args = ["--init_drafter", str(tiny_run["drafter"] / "final"), *_data_args(tiny_run), *FEW_STEPS,
            "--val_fraction", "0.25", "--num_anchors", "4"]
    result = _run(_accelerate("train_opd.py", *args, "--output_dir", str(out), "--per_device_train_batch_size", "2"),
                  timeout=300, ADAFLASH_HF_CACHE=str(tiny_run["cache"]))
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((out / "final" / "training_summary.json").read_text())
    assert summary["steps"] == STEPS and set(summary["tau_proxy_after"]) >= {"chat", "code"}
    assert (out / "final" / "model.safetensors").is_file()
    assert _cached_files(tiny_run["cache"]) == cached
    # data parallel: two processes at half the per-device batch, the same loss, one save
    _data_parallel_run("train_opd.py", [*args, "--per_device_train_batch_size", "1"], tiny_run["root"] / "opd_dp",
                       summary, ADAFLASH_HF_CACHE=str(tiny_run["cache"]))
    assert _cached_files(tiny_run["cache"]) == cached


def test_train_length_head_one_step_under_accelerate_launch(tiny_run):
    """Length head + cost model for the drafter trained above; the result loads as a length-head folder."""
    from adaflash_hf.interop import load_length_head_folder

    assert tiny_run["result"].returncode == 0, "train_drafter.py failed (see the test above)"
    cached = _cached_files(tiny_run["cache"])
    out = tiny_run["root"] / "length_head"
    args = ["--drafter", str(tiny_run["drafter"] / "final"), *_data_args(tiny_run), *FEW_STEPS, "--num_sequences", "8",
            "--num_anchors", "4", "--head_dim", "8", "--report_to", "none"]
    result = _run(_accelerate("train_length_head.py", *args, "--output_dir", str(out),
                              "--per_device_train_batch_size", "4"), timeout=300, ADAFLASH_HF_CACHE=str(tiny_run["cache"]))
    assert result.returncode == 0, result.stderr[-4000:]
    head, cost = load_length_head_folder(out / "final")
    assert head.config.block_size == 4 and cost is not None and cost.points
    summary = json.loads((out / "final" / "training_summary.json").read_text())
    assert summary["blocks"] > 0
    assert _cached_files(tiny_run["cache"]) == cached
    # data parallel: two processes at half the per-device batch, the same loss (not twice it), one save
    _data_parallel_run("train_length_head.py", [*args, "--per_device_train_batch_size", "2"],
                       tiny_run["root"] / "length_head_dp", summary, ADAFLASH_HF_CACHE=str(tiny_run["cache"]))


def test_online_adapter_serves_and_saves_under_accelerate_launch(tiny_run, monkeypatch, caplog):
    """The online example serves a prompt stream with the drafter trained above, learns, saves a loadable adapter;
    `--resume` continues from it (run in this process as `python examples/online_adapter.py ARGS` would: the first
    run is the real `accelerate launch`)."""
    from adaflash_hf import AdaFlashDrafterModel
    from adaflash_hf.online import OnlineSpecAdapter

    assert tiny_run["result"].returncode == 0, "train_drafter.py failed (see the test above)"
    out = tiny_run["root"] / "online"
    common = ["--target", str(tiny_run["target"]), "--drafter", str(tiny_run["drafter"] / "final"), "--prompts",
              str(tiny_run["prompts"]), "--max_new_tokens", "12", "--output_dir", str(out), "--save_every", "2"]
    result = _run(_accelerate("online_adapter.py", *common, "--max_prompts", "3"), timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    log = json.loads((out / "stream.json").read_text())
    assert len(log) == 3 and log[-1]["learner_rounds"] > log[0]["learner_rounds"] > 0
    drafter = AdaFlashDrafterModel.from_pretrained(tiny_run["drafter"] / "final", dtype=torch.float32)
    adapter = OnlineSpecAdapter.from_pretrained(drafter, out / "adapter")
    assert adapter.config.algorithm == "ogd"
    _run_in_process("online_adapter.py", [*common, "--max_prompts", "1", "--resume", str(out / "adapter")],
                    monkeypatch, caplog)
    resumed = json.loads((out / "stream.json").read_text())
    assert len(resumed) == 1 and resumed[0]["learner_rounds"] > 0


def test_train_drafter_from_the_label_store_logs_its_curve_and_resumes(tmp_path, monkeypatch, caplog):
    """`train_drafter.py --label_store` on a tiny store: held-out eval curve, best drafter, and the same command
    with more steps resumes from the last checkpoint with the same draft vocabulary. The scripts run in this
    process, as `python examples/X.py ARGS` would (`train_drafter.py` and `train_opd.py` run as real subprocesses
    under `accelerate launch` above)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf import AdaFlashDrafterModel
    from adaflash_hf.training.label_store import LabelStore

    from .test_label_store import random_chunks

    target_dir, cache = save_tiny_target(tmp_path / "target"), tmp_path / "cache"
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    records = [{"prompt": f"tiny prompt {i}: say something about {d}", "domain": d, "source": "fake", "id": str(i)}
               for i, d in enumerate(["chat", "code"] * 12)]
    responses = LabelStore.open(str(target_dir), torch.bfloat16, vocab_size=VOCAB, root=cache / "labels")
    responses.add_responses(target, tokenizer, records, max_new_tokens=16, progress=False)
    corpus = LabelStore.open(str(target_dir), torch.float32, vocab_size=VOCAB, root=cache / "labels")
    corpus.add_corpus(target, random_chunks(6), progress=False)

    out = tmp_path / "drafter"
    command = ["--target", str(target_dir),
               "--label_store", "--corpus_ratio", "0.5", "--holdout_permille", "300", "--val_per_domain", "2",
               "--output_dir", str(out), "--num_layers", "1", "--block_size", "4", "--num_context_layers", "2",
               "--num_anchors", "4", "--per_device_train_batch_size", "2", "--draft_vocab_size", "16",
               "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps", "--save_steps", "2",
               "--save_total_limit", "2", "--resume_from_checkpoint", "last", "--disable_tqdm", "true"]
    def train_drafter(*args) -> str:
        return _run_in_process("train_drafter.py", [*command, *args], monkeypatch, caplog,
                               ADAFLASH_HF_CACHE=str(cache))

    recorded = train_drafter("--record_only")
    assert "recorded:" in recorded and not (out / "final").exists()
    train_drafter("--max_steps", "4")
    summary = json.loads((out / "final" / "training_summary.json").read_text())
    assert summary["steps"] == 4 and summary["val_sequences"] == 4
    assert set(summary["data"]["train"]) == {"responses", "corpus"} and set(summary["data"]["val"]) == {"responses"}
    assert {"eval_tau_proxy_chat", "eval_tau_proxy_code"} <= set(summary["eval"])
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert len(vocab["token_ids"]) == 16
    assert AdaFlashDrafterModel.from_pretrained(out / "best").config.draft_vocab_size == 16

    second = train_drafter("--max_steps", "6")
    assert "resuming from" in second and "checkpoint-4" in second
    curve = json.loads((out / "eval_curve.json").read_text())
    assert [p["step"] for p in curve["points"]] == [2, 4, 6]
    assert [r["from_step"] for r in curve["runs"]] == [0, 4]
    assert json.loads((out / "final" / "training_summary.json").read_text())["steps"] == 6
    assert json.loads((out / "draft_vocab.json").read_text()) == vocab
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert all(p["eval_replay_tau"] >= 1.0 for p in curve["points"])  # served tau, replayed, beside tau_proxy

    # OPD from the same store (same held-out slice), under a CPU budget, evaluated by replayed tau too
    opd_out = tmp_path / "opd"
    _run_in_process("train_opd.py", [
        "--target", str(target_dir), "--init_drafter", str(out / "final"), "--label_store", "--corpus_ratio", "0",
        "--holdout_permille", "300", "--val_per_domain", "2", "--output_dir", str(opd_out), "--max_steps", "2",
        "--num_anchors", "4", "--per_device_train_batch_size", "2", "--max_cpu_seconds", "600",
        "--save_strategy", "no", "--disable_tqdm", "true"], monkeypatch, caplog, ADAFLASH_HF_CACHE=str(cache))
    opd_summary = json.loads((opd_out / "final" / "training_summary.json").read_text())
    assert opd_summary["steps"] == 2 and opd_summary["compute"]["train_steps_this_run"] == 2


def test_campaign_leg_resumes_in_the_cache_and_prints_its_curve(tmp_path, monkeypatch, capsys):
    """`train_campaign.py`: each leg is train_drafter.py with the fixed recipe, resuming from the campaign folder in
    the cache; `--status` prints the cumulative curve (CPU hours, tau_proxy, replayed tau). Run in this process as
    `python examples/train_campaign.py --name c1 --status` would (its `--help` runs in a real subprocess above)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_campaign", REPO_ROOT / "examples" / "train_campaign.py")
    campaign = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(campaign)
    folder = tmp_path / "campaign" / "c1"
    folder.mkdir(parents=True)
    (folder / "eval_curve.json").write_text(json.dumps({"runs": [{}, {}], "points": [
        {"step": 250, "train_cpu_seconds": 1800.0, "eval_tau_proxy": 2.1, "eval_replay_tau": 1.61,
         "eval_replay_tau_code": 1.9},
        {"step": 500, "train_cpu_seconds": 3600.0, "eval_tau_proxy": 2.2, "eval_replay_tau": 1.7}]}))
    monkeypatch.setenv("ADAFLASH_HF_CACHE", str(tmp_path))
    history = tmp_path / "docs" / "campaign_history.json"
    argv = [str(REPO_ROOT / "examples" / "train_campaign.py"), "--name", "c1", "--history", str(history)]
    monkeypatch.setattr(sys, "argv", argv + ["--status"])
    capsys.readouterr()
    campaign.main()
    lines = capsys.readouterr().out.splitlines()
    assert "2 leg(s)" in lines[0] and lines[3].split()[:4] == ["500", "1.00", "2.200", "1.700"]
    assert "code 1.90" in lines[2] and "no campaign history" in lines[-1]
    assert not history.exists()  # --status writes nothing
    # A leg is written to the committed history: its points, its warm start and its best weights (sha256 prefixes);
    # the history outlives the machine's cache, and the leg whose best weights are shipped reads "promoted".
    (folder / "best").mkdir()
    (folder / "best" / "model.safetensors").write_bytes(b"weights of step 500")
    (folder / "eval_curve.json").write_text(json.dumps({"runs": [{"started": "T0", "from_step": 0},
                                                                 {"started": "T1", "from_step": 250}],
                                                        "points": json.loads((folder / "eval_curve.json").read_text())["points"]}))
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    (shipped / "model.safetensors").write_bytes(b"shipped weights")
    monkeypatch.setattr(campaign, "default_drafter_dir", lambda: shipped)
    monkeypatch.setattr(sys, "argv", argv + ["--record"])
    campaign.main()
    campaign.main()  # the same leg twice: one record
    legs = json.loads(history.read_text())["legs"]
    assert len(legs) == 1 and legs[0]["from_step"] == 250 and [p["step"] for p in legs[0]["points"]] == [500]
    assert legs[0]["warm_start"] == "c1/checkpoint-250" and legs[0]["best"] == campaign.weights_id(folder / "best")
    capsys.readouterr()
    (shipped / "model.safetensors").write_bytes(b"weights of step 500")  # promoted
    shutil.rmtree(folder)  # a new machine: the cache is gone, the history is not
    monkeypatch.setattr(sys, "argv", argv + ["--status"])
    campaign.main()
    out = capsys.readouterr().out
    assert "no evaluation on this machine yet" in out and "250-500" in out and "1.700  <- promoted" in out
    # A promotion that stores the weights differently (bf16) keeps their sha as `shipped_as`: still marked.
    (shipped / "model.safetensors").write_bytes(b"the same weights in bf16")
    stored = json.loads(history.read_text())
    stored["legs"][0]["shipped_as"] = campaign.weights_id(shipped)
    history.write_text(json.dumps(stored))
    campaign.main()
    assert "1.700  <- promoted" in capsys.readouterr().out
    command = campaign.leg_command("c1", 30, "INIT", ["--seed", "3"])
    joined = " ".join(command)
    assert "--resume_from_checkpoint last" in joined and "--init_drafter INIT" in joined
    assert "--max_cpu_seconds 1800" in joined and command[-2:] == ["--seed", "3"]
    assert command[command.index("--output_dir") + 1].endswith("campaign/c1")
    # The cool-down: a new run from the newest checkpoint's weights, lr from where the leg stood linearly to 0.
    with pytest.raises(SystemExit, match="no checkpoint"):
        campaign.cooldown_command("c1", 800, [])
    checkpoint = tmp_path / "campaign" / "c1" / "checkpoint-750"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"global_step": 750, "log_history": [
        {"step": 700, "learning_rate": 2.91e-4}, {"step": 750, "loss": 1.0}]}))
    command, run = campaign.cooldown_command("c1", 800, ["--seed", "9"])
    value = {flag: command[command.index(flag) + 1] for flag in
             ("--learning_rate", "--lr_scheduler_type", "--max_steps", "--init_drafter", "--output_dir")}
    assert value["--learning_rate"] == "0.000291" and value["--lr_scheduler_type"] == "linear"
    assert value["--max_steps"] == "800" and value["--init_drafter"] == str(checkpoint)
    assert run == "c1/cooldown-750" and value["--output_dir"] == str(campaign.campaign_dir(run))
    assert command.count("--learning_rate") == 1 and command[-2:] == ["--seed", "9"]
    assert campaign.weights_id(None) is None  # an install without the shipped drafter
