# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Accelerator recipe: grow the label store, train the drafter, write it with its model card, in one time budget.

    python examples/accelerator_recipe.py --device cuda --minutes 10 --output_dir outputs/recipe    # one H200
    python examples/accelerator_recipe.py --toy --device cpu --output_dir /tmp/recipe               # tiny, any CPU
    python examples/accelerator_recipe.py --device cuda --output_dir out -- --learning_rate 1e-4    # extra
                                                                 # examples/train_drafter.py arguments after --

UNTESTED ON CUDA: written and tested end to end on CPUs only (`--toy`, tests/test_accelerator_recipe.py); the
CUDA sizes below are estimates for one large GPU (H200) and the testbed target (SmolLM2-135M-Instruct).

Stages (each prints its tokens/s; all of them go to `OUTPUT_DIR/recipe_summary.json`):

1. generate: the target (in `--gen_dtype`, on `--device`) answers the train prompts not in the label store yet,
   in left-padded batches of `--gen_batch_size` (`LabelStore.add_responses`, as `examples/label_data.py`), until
   the stage's time is up; the store (`$ADAFLASH_HF_CACHE/labels`) keeps everything for later runs.
2. record: the target (fp32, on `--device`) records its hidden states for the store selection training will read
   (`store_data.store_training_data`, cached per entry: only new entries are recorded; the selection is the whole
   store, so a large store recorded elsewhere without its hidden-state cache makes this stage longer).
3. train: `examples/train_drafter.py --label_store` continues from `--init_drafter` (default: the shipped drafter
   for the testbed target) in bf16 on CUDA, with a wall-clock budget (`--max_train_seconds`).
4. card: `adaflash-hf bench` on a few held-out prompts measures the new drafter, and
   `examples/push_to_hub.py --dry-run` stages it with its model card in `OUTPUT_DIR/hub` (nothing is uploaded).

`--minutes` is split by fixed shares (generate 40%, train 35%; the rest covers loading, recording and the card);
`--generate_minutes` / `--train_minutes` override a share. Nothing is downloaded: the target is the cached testbed
(`make fetch`) or `--target DIR`.
"""

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from pathlib import Path


EXAMPLES = Path(__file__).resolve().parent
SHARES = {"generate": 0.40, "train": 0.35}  # of --minutes; the rest: loading, recording, bench and card
TESTBED_NAME = "testbed:SmolLM2-135M-Instruct"
# Per-device defaults: (gen_batch_size, train batch, record batch, bench prompts per domain, bench new tokens)
SIZES = {"cuda": (128, 64, 32, 4, 128), "cpu": (16, 4, 4, 2, 64), "toy": (4, 2, 2, 1, 8)}


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:  # the rest goes to examples/train_drafter.py (later values override the recipe's)
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="where the target and the drafter run (auto: cuda when there is one)")
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget of the whole recipe")
    parser.add_argument("--generate_minutes", type=float, default=None, help="override the generation share")
    parser.add_argument("--train_minutes", type=float, default=None, help="override the training share")
    parser.add_argument("--output_dir", type=Path, required=True, help="training run, bench, staged drafter + card")
    parser.add_argument("--toy", action="store_true", help="tiny sizes: a smoke run of every stage on a CPU")
    parser.add_argument("--target", default=None, help="causal LM folder (default: the cached testbed target)")
    parser.add_argument("--train_prompts", default=None,
                        help='JSONL of {"prompt", "domain"} to answer (default: the testbed train prompts)')
    parser.add_argument("--max_prompts", type=int, default=None, help="answer at most the first N prompts")
    parser.add_argument("--init_drafter", default="auto",
                        help="drafter to continue from (auto: the shipped drafter for the testbed target, a fresh "
                             "one for --target; none: a fresh one)")
    parser.add_argument("--gen_dtype", default="bfloat16", help="dtype of the generating target (keys the store)")
    parser.add_argument("--gen_batch_size", type=int, default=None, help="prompts per generate() call")
    parser.add_argument("--max_new_tokens", type=int, default=None, help="response length cap (default 160)")
    parser.add_argument("--max_prompt_tokens", type=int, default=384, help="prompts are cut from the left to this")
    parser.add_argument("--record_batch_size", type=int, default=None, help="sequences per recording forward")
    parser.add_argument("--per_device_train_batch_size", type=int, default=None, help="training batch")
    parser.add_argument("--learning_rate", type=float, default=2e-4, help="constant after warm-up")
    parser.add_argument("--max_steps", type=int, default=None, help="cap on training steps (default: the budget)")
    parser.add_argument("--corpus_ratio", type=float, default=0.25, help="label store corpus tokens per response "
                        "token (the corpus part is not grown here: examples/label_data.py --corpus_tokens)")
    parser.add_argument("--holdout_permille", type=int, default=None, help="held-out store entries (default 50)")
    parser.add_argument("--val_per_domain", type=int, default=None, help="held-out responses per domain (32)")
    parser.add_argument("--bench_prompts", default=None, help="JSONL of bench prompts (default: the eval prompts)")
    parser.add_argument("--bench_max_prompts", type=int, default=None, help="bench prompts per domain")
    parser.add_argument("--bench_max_new_tokens", type=int, default=None, help="bench new tokens per prompt")
    parser.add_argument("--bench_methods", default="plain,drafter_only,adaflash", help="bench methods (the card's)")
    parser.add_argument("--repo_id", default=None, help="repo id written into the card (default: local/<dir name>)")
    parser.add_argument("--target_model", default=None,
                        help="the target's Hub id for the card (default: the testbed's; --target: its folder name)")
    args = parser.parse_args(argv)
    args.train_args = extra
    return args


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stage(name: str, message: str) -> None:
    print(f"[{name}] {message}", flush=True)


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    gen_bs, train_bs, record_bs, bench_n, bench_tokens = SIZES["toy" if args.toy else device]
    gen_bs = args.gen_batch_size or gen_bs
    train_bs = args.per_device_train_batch_size or train_bs
    record_bs = args.record_batch_size or record_bs
    max_new_tokens = args.max_new_tokens or (8 if args.toy else 160)
    max_prompts = args.max_prompts or (12 if args.toy else None)
    max_steps = args.max_steps or (2 if args.toy else 1_000_000)
    holdout = args.holdout_permille if args.holdout_permille is not None else (250 if args.toy else 50)
    val_per_domain = args.val_per_domain if args.val_per_domain is not None else (2 if args.toy else 32)
    budget = {k: 60.0 * (getattr(args, f"{k}_minutes") if getattr(args, f"{k}_minutes") is not None
                         else args.minutes * share) for k, share in SHARES.items()}
    output_dir = args.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    summary = {"device": device, "toy": args.toy, "minutes": args.minutes, "budget_seconds": budget, "stages": {}}
    _stage("plan", f"device {device}; generate <= {budget['generate']:.0f} s, train <= {budget['train']:.0f} s; "
                   f"gen batch {gen_bs}, train batch {train_bs}, {max_new_tokens} new tokens per response")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf import AdaFlashDrafterModel
    from adaflash_hf.checkpoints import default_drafter_dir
    from adaflash_hf.testbed import load_prompts, load_testbed, read_prompts_jsonl
    from adaflash_hf.testbed.corpus import drop_near_eval
    from adaflash_hf.training.label_hidden import _cache_key, _cached_shards, hidden_cache_dir
    from adaflash_hf.training.label_store import LabelStore
    from adaflash_hf.training.store_data import store_training_data

    target_name = args.target or TESTBED_NAME
    gen_dtype = getattr(torch, args.gen_dtype)

    def load_target(dtype):
        if args.target is None:
            model, tokenizer = load_testbed(dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
            tokenizer = AutoTokenizer.from_pretrained(args.target)
        return model.requires_grad_(False).to(device), tokenizer

    def free(model) -> None:
        del model
        if device == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ 1. generate (batched, time-boxed)
    t0 = time.perf_counter()
    model, tokenizer = load_target(gen_dtype)
    vocab = model.config.get_text_config().vocab_size
    store = LabelStore.open(target_name, gen_dtype, vocab_size=vocab)
    if args.train_prompts:
        records = read_prompts_jsonl(args.train_prompts)
    else:
        records, _ = drop_near_eval(load_prompts(split="train"))
    records = records[:max_prompts] if max_prompts else records
    before = len(store.entries("responses"))
    deadline = t0 + budget["generate"]
    gen = {"sequences": 0, "new_tokens": 0, "seconds": 0.0}
    chunk = 4 * gen_bs  # the deadline is checked between chunks
    for i in range(0, len(records), chunk):
        if time.perf_counter() >= deadline:
            break
        stats = store.add_responses(model, tokenizer, records[i : i + chunk], max_new_tokens=max_new_tokens,
                                    batch_size=gen_bs, max_prompt_tokens=args.max_prompt_tokens, window=chunk,
                                    progress=False)
        for k in gen:
            gen[k] += stats[k]
    free(model)
    after = len(store.entries("responses"))
    gen.update(store_before=before, store_after=after, stage_seconds=time.perf_counter() - t0,
               tokens_per_s=_rate(gen["new_tokens"], gen["seconds"]))
    summary["stages"]["generate"] = gen
    _stage("generate", f"store {before} -> {after} responses (+{gen['sequences']}), {gen['new_tokens']} new tokens "
                       f"in {gen['seconds']:.1f} s of generate(); stage {gen['stage_seconds']:.1f} s")
    _stage("generate", f"generation tokens/s: {gen['tokens_per_s']:.1f}")

    # ------------------------------------------------------------------ 2. record hidden states (cached)
    t0 = time.perf_counter()
    target, tokenizer = load_target(torch.float32)
    init = args.init_drafter
    if init == "auto":
        init = str(default_drafter_dir()) if args.target is None and default_drafter_dir() else "none"
    if init.lower() != "none":
        layer_ids = list(AdaFlashDrafterModel.config_class.from_pretrained(init).target_layer_ids)
    else:  # what train_drafter.py builds by default (its --num_layers/--block_size/--num_context_layers)
        layer_ids = list(AdaFlashDrafterModel.from_target(target, num_layers=2, block_size=8, num_context_layers=5,
                                                          tokenizer=tokenizer).config.target_layer_ids)
    folder = hidden_cache_dir(target_name, target, layer_ids)
    cached = set(_cached_shards(folder)) if folder.is_dir() else set()
    t1 = time.perf_counter()
    data = store_training_data(target, target_name, layer_ids, response_dtype=gen_dtype,
                               corpus_ratio=args.corpus_ratio, holdout_permille=holdout,
                               val_per_domain=val_per_domain, record_batch_size=record_bs, progress=False)
    seconds = time.perf_counter() - t1
    fresh = set(_cached_shards(folder)) - cached
    recorded = [e for s, kind, e in data.train_selection + data.val_selection if _cache_key(s, kind, e) in fresh]
    rec = {"sequences": len(recorded), "tokens": int(sum(int(e["n"]) for e in recorded)), "seconds": seconds,
           "train_sequences": data.info["train_sequences"], "train_tokens": data.info["train_tokens"],
           "val_sequences": data.info["val_sequences"]}
    train_kinds = data.info["train"]
    del data
    free(target)
    rec.update(stage_seconds=time.perf_counter() - t0, tokens_per_s=_rate(rec["tokens"], rec["seconds"]))
    summary["stages"]["record"] = rec
    _stage("record", f"{rec['sequences']} new sequences ({rec['tokens']} tokens) recorded in {seconds:.1f} s; "
                     f"selection: {rec['train_sequences']} train ({rec['train_tokens']} tokens), "
                     f"{rec['val_sequences']} val; stage {rec['stage_seconds']:.1f} s")
    _stage("record", f"hidden-state recording tokens/s: {rec['tokens_per_s']:.1f}")

    # ------------------------------------------------------------------ 3. train (examples/train_drafter.py)
    t0 = time.perf_counter()
    train_dir = output_dir / "train"
    train_argv = ["--label_store", "--gen_dtype", args.gen_dtype, "--corpus_ratio", str(args.corpus_ratio),
                  "--holdout_permille", str(holdout), "--val_per_domain", str(val_per_domain),
                  "--output_dir", str(train_dir),
                  "--max_steps", str(max_steps), "--max_train_seconds", f"{0.9 * budget['train']:.0f}",
                  "--per_device_train_batch_size", str(train_bs), "--per_device_eval_batch_size", str(train_bs),
                  "--learning_rate", str(args.learning_rate), "--lr_scheduler_type", "constant_with_warmup",
                  "--warmup_steps", "0" if args.toy else "50", "--eval_strategy", "no", "--save_strategy", "no",
                  "--logging_steps", "1" if args.toy else "50", "--disable_tqdm", "true"]
    if args.target:
        train_argv += ["--target", args.target]
    if init.lower() != "none":
        train_argv += ["--init_drafter", init]
    if device == "cuda":
        train_argv += ["--bf16", "true"]
    elif torch.cuda.is_available():
        train_argv += ["--use_cpu", "true"]
    train_argv += args.train_args
    _stage("train", "examples/train_drafter.py " + " ".join(train_argv))
    argv0 = sys.argv
    sys.argv = [str(EXAMPLES / "train_drafter.py"), *train_argv]  # it parses sys.argv (HfArgumentParser)
    try:
        _load_example("train_drafter").main()
    finally:
        sys.argv = argv0
    final = train_dir / "final"
    trained = json.loads((final / "training_summary.json").read_text())
    compute, steps = trained["compute"], trained["steps"]
    # tokens per step ~ batch x processes x the mean training sequence length (truncated at max_length 640)
    mean_len = min(trained["train_tokens"] / max(trained["train_sequences"], 1), 640)
    step_tokens = steps * train_bs * trained.get("num_processes", 1) * mean_len
    tr = {"steps": steps, "train_wall_seconds": compute.get("train_wall_seconds"), "tokens": round(step_tokens),
          "eval": trained.get("eval", {}), "stage_seconds": time.perf_counter() - t0,
          "tokens_per_s": _rate(step_tokens, compute.get("train_wall_seconds") or 0.0)}
    summary["stages"]["train"] = tr
    _stage("train", f"{steps} steps in {tr['train_wall_seconds']} s of steps (stage {tr['stage_seconds']:.1f} s), "
                    f"eval tau_proxy {tr['eval'].get('eval_tau_proxy')}")
    _stage("train", f"training tokens/s: {tr['tokens_per_s']:.1f} (~{mean_len:.0f} tokens x {train_bs} sequences "
                    "per step)")

    # ------------------------------------------------------------------ 4. bench + model card (staged)
    t0 = time.perf_counter()
    from adaflash_hf.cli import main as cli_main

    bench_json = output_dir / "bench.json"
    bench_argv = ["bench", "--drafter", str(final), "--json", str(bench_json), "--device", device, "--quiet",
                  "--methods", args.bench_methods,
                  "--max-prompts", str(args.bench_max_prompts or bench_n),
                  "--max-new-tokens", str(args.bench_max_new_tokens or bench_tokens)]
    if args.target:
        bench_argv += ["--target", args.target]
    if args.bench_prompts:
        bench_argv += ["--prompts", args.bench_prompts]
    code = cli_main(bench_argv)
    if code not in (0, None):
        print(f"error: adaflash-hf {' '.join(bench_argv)} exited with {code}", file=sys.stderr)
        return 1
    hub_dir = output_dir / "hub"
    if hub_dir.is_dir():  # a re-run restages (push_to_hub refuses a non-empty staging folder)
        import shutil

        shutil.rmtree(hub_dir)
    target_model = args.target_model or (Path(args.target).name if args.target else None)
    push_argv = ["--drafter", str(final), "--repo-id", args.repo_id or f"local/{output_dir.resolve().name}",
                 "--bench-json", str(bench_json), "--dry-run", str(hub_dir),
                 "--training-method", f"examples/accelerator_recipe.py on {device}: DFlash block-diffusion training "
                 f"(examples/train_drafter.py --label_store) for {steps} steps"
                 + (f", continued from {Path(init).name}" if init.lower() != "none" else ""),
                 "--training-data", f"{rec['train_sequences']} label-store sequences ({rec['train_tokens']} tokens: "
                 + ", ".join(f"{kind} {sum(d['tokens'] for d in per.values())}"
                             for kind, per in train_kinds.items())
                 + "): greedy target responses to train prompts (examples/label_data.py's store)"]
    if target_model:
        push_argv += ["--target-model", target_model]
    code = _load_example("push_to_hub").main(push_argv)
    if code:
        return code
    bench = json.loads(bench_json.read_text())["overall"]
    summary["stages"]["card"] = {"stage_seconds": time.perf_counter() - t0, "hub_dir": str(hub_dir),
                                 "bench_overall": {k: bench.get(k) for k in ("tau", "speedup", "identical", "total")}}
    _stage("card", f"drafter + README.md staged in {hub_dir} (bench overall tau {bench.get('tau')}, "
                   f"speedup {bench.get('speedup')}); stage {summary['stages']['card']['stage_seconds']:.1f} s")

    summary["total_seconds"] = time.perf_counter() - start
    (output_dir / "recipe_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(f"\n{'stage':<12} {'tokens':>10} {'seconds':>9} {'tokens/s':>10}")
    for name, key, tokens in (("generation", "generate", gen["new_tokens"]), ("recording", "record", rec["tokens"]),
                              ("training", "train", tr["tokens"])):
        s = summary["stages"][key]
        secs = s.get("seconds", s.get("train_wall_seconds")) or 0.0
        print(f"{name:<12} {tokens:>10} {secs:>9.1f} {s['tokens_per_s']:>10.1f}")
    print(f"total {summary['total_seconds']:.0f} s (budget {60 * args.minutes:.0f} s); "
          f"{output_dir / 'recipe_summary.json'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
