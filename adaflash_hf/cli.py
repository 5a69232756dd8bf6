# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The `adaflash-hf` command line: `bench`, `compare`, `report`, `bench-online`, `bench-serving`, `calibrate`.

Only argument parsing and dispatch live here; loading, selection, measuring, printing and plotting are in
`adaflash_hf/bench/` (which never imports this module).
"""

import argparse
import json
import sys
from pathlib import Path

from .bench.args import (
    concurrency_levels,
    cost_model_file,
    drafter_dir,
    drafter_dir_list,
    fail,
    fail_on_load_error,
    length_head_dir,
    positive_int,
    prompts_file,
)
from .bench.models import DEVICES


BENCH_EPILOG = """\
tau is tokens committed per verification forward, bonus token included:
  tau = (new_tokens - 1) / (full_target_forwards - 1)   (the prefill and its token excluded; plain greedy = 1)
speed-up = a method's tokens/s over plain greedy's, on the same prompts in the same run.
JSON: {"overall": {"tau", "speedup", "identical", "total"}, "domains": {domain: {same keys}},
       "tau_cross_domain_std", "methods": {method: {"overall": {...}, "domains": {...}}}, "config": {...}}
where "overall"/"domains" describe our generate path ("adaflash": drafter + prompt lookup + no-draft fallback,
chosen per round) and identical counts outputs equal to plain greedy token for token out of total.
"drafter_only" is our generator drafting every round; "prompt_lookup" is transformers' lookup alone.
With --cost-model FILE|NAME (another device, e.g. h200-smollm2-135m) that device's costs decide the rounds, and
"projected": {"device", "note", "assumptions", "methods": {method: {"overall"|"domains": {"tokens_per_s",
"speedup"}}}} gives the tokens/s those rounds would take there: host time measured here + its forward costs.
PROJECTED, never measured: kept apart from every measured number.
"""


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side speed/acceptance benchmark", epilog=BENCH_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target model folder (default: the offline testbed model)")
    p.add_argument("--drafter", type=drafter_dir("--drafter"), default=None,
                   help="drafter folder (default: the shipped default drafter)")
    p.add_argument("--prompts", type=prompts_file, default=None,
                   help='JSONL with {"prompt", "domain"} lines (default: the committed held-out testbed prompts)')
    p.add_argument("--max-prompts", type=positive_int("--max-prompts"), default=None,
                   help="use at most this many prompts per domain")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--methods", default=",".join(_methods()),
                   help="comma-separated subset of the methods; also drafter_confidence, drafter_heuristic and "
                        "drafter_head (length baselines: transformers' confidence threshold and heuristic schedule "
                        "vs our length head, which needs --length-head)")
    p.add_argument("--threads", type=positive_int("--threads"), default=None, help="torch CPU threads")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of tokens/s per domain and method")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--concurrency", type=concurrency_levels, default=None,
                   help="e.g. 1,4,16,64: instead of the bs=1 methods, run the request-stream serving bench at these "
                        "levels (see `adaflash-hf bench-serving --help`); JSON key 'concurrency'")
    p.add_argument("--length-head", type=length_head_dir("--length-head"), default=None,
                   help="length head folder (with cost_model.json) for 'adaptive'")
    p.add_argument("--cost-model", type=cost_model_file, default=None,
                   help="a cost model measured on another device (JSON file, or a shipped name such as "
                        "h200-smollm2-135m): the policy and the length rule decide with its costs, and a separate "
                        "PROJECTED table (JSON 'projected') gives the tokens/s the rounds run here would take there")
    _device_arguments(p)


def _compare_parser(sub) -> None:
    p = sub.add_parser(
        "compare", help="tau per domain of several drafters on the same prompts (mean and cross-domain std)",
        description="Greedy speculative decoding with each drafter alone (no prompt lookup, no fallback), on the "
                    "same prompts; reports tau per domain, its mean and standard deviation across domains, and "
                    "identical outputs. Used to compare offline-only and OPD drafters.")
    p.add_argument("--drafters", required=True, type=drafter_dir_list("--drafters"),
                   help="comma-separated drafter folders")
    p.add_argument("--labels", default=None, help="comma-separated names (default: folder names)")
    p.add_argument("--prompts", type=prompts_file, default=None, help="JSONL prompts (default: committed eval prompts)")
    p.add_argument("--max-prompts", type=positive_int("--max-prompts"), default=None,
                   help="at most this many prompts per domain")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")
    _device_arguments(p)


def _device_arguments(p) -> None:
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the models run (auto: the accelerator when there is one, else the CPU)")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=1,
                   help="time every prompt this many times per method, methods interleaved; report the median "
                        "and the [min, max] spread")


def _methods(all_methods: bool = False):
    from .bench.runner import ALL_METHODS, METHODS

    return ALL_METHODS if all_methods else METHODS


def run_bench(args) -> dict:
    """`adaflash-hf bench`: the bs=1 methods side by side, or throughput at `--concurrency` levels."""
    import torch

    from .bench.models import apply_cost_model, attach_length_head, bench_records, load_models
    from .generation.attention import masked_gqa

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = set(methods) - set(_methods(all_methods=True))
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {list(_methods(all_methods=True))}")
    if "drafter_head" in methods and not args.length_head:
        raise SystemExit("method drafter_head needs --length-head PATH")
    if args.threads:
        torch.set_num_threads(args.threads)
    records = bench_records(args.prompts, args.max_prompts)
    # A checkpoint refused while loading (non-finite weights, a drafter for another target) is one line, exit 2.
    target, tokenizer, drafter = fail_on_load_error(load_models, args.target, args.drafter, getattr(torch, args.dtype),
                                                    args.device)
    if args.length_head:
        fail_on_load_error(attach_length_head, drafter, args.length_head)
    cost = apply_cost_model(drafter, args.cost_model)
    config = {"target": args.target or "testbed:SmolLM2-135M-Instruct", "drafter": str(args.drafter or "default"),
              "prompts": str(args.prompts or "default_eval_prompts"), "max_new_tokens": args.max_new_tokens,
              "dtype": args.dtype, "device": str(target.device), "threads": torch.get_num_threads(),
              "raw": args.raw, "n_prompts": len(records), "repeats": args.repeats,
              "cost_model": str(args.cost_model) if args.cost_model else None, "masked_gqa": masked_gqa()}
    if args.concurrency:  # the request-stream serving bench (`adaflash-hf bench-serving` has all its options)
        from .bench.serving import run_serving

        levels = [int(x) for x in args.concurrency.split(",")]
        result = run_serving(target, tokenizer, drafter, records, levels=levels, max_new_tokens=args.max_new_tokens,
                             raw=args.raw, repeats=args.repeats, progress=not args.quiet,
                             cost_model_path=args.cost_model)
        result["config"] = config
        return result
    from .bench.runner import run_benchmark, summarize

    results = run_benchmark(target, tokenizer, drafter, records, methods=methods, max_new_tokens=args.max_new_tokens,
                            raw=args.raw, progress=not args.quiet, repeats=args.repeats, count_ops=cost is not None)
    summary = summarize(results, block_size=drafter.config.block_size)
    summary["config"] = config
    if cost is not None:
        from .bench.projection import project_bench

        summary["projected"] = project_bench(results, cost, args.cost_model)
    return summary


def run_compare_command(args) -> dict:
    from .bench.compare import run_compare
    from .bench.models import bench_records

    drafters = args.drafters
    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    if labels is not None and len(labels) != len(drafters):
        fail("--labels", args.labels, f"{len(labels)} labels for {len(drafters)} drafters")
    return run_compare(drafters, labels, bench_records(args.prompts, args.max_prompts), args.max_new_tokens,
                       args.dtype, args.device, args.repeats, progress=not args.quiet)


def _report_parser(sub) -> None:
    from .bench.report import add_report_arguments

    p = sub.add_parser("report", help="rerun the benches behind the claims and write docs/results.md + plots",
                       description="Runs sections (a) OPD vs offline drafter, (b) fixed block vs length head at "
                                   "concurrency, (c) online drafter updates on a domain-shift stream, (d) plain vs "
                                   "speculative at bs=1, with fixed seeds, and writes OUTPUT_DIR/results.md with "
                                   "one table, a computed verdict and a PNG per section.")
    add_report_arguments(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaflash-hf", description="AdaFlash speculative decoding tools")
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    _compare_parser(sub)
    _report_parser(sub)
    from .bench.calibrate import add_parser as _calibrate_parser
    from .bench.online import add_parser as _online_parser
    from .bench.serving import add_parser as _serving_parser

    _online_parser(sub)
    _serving_parser(sub)
    _calibrate_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except ImportError as exc:  # an optional dependency (pip extra) that is not installed: one line naming it
        from .utils.extras import missing_extra_message

        message = missing_extra_message(exc, f"adaflash-hf {getattr(args, 'command', None) or ''}".strip())
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2


def _main(args) -> int:
    if args.command == "report":
        from .bench.report import main_report

        return main_report(args)
    if args.command == "bench-online":
        from .bench import online

        online.main(args)
        return 0
    if args.command == "bench-serving":
        from .bench import serving

        serving.main(args)
        return 0
    if args.command == "calibrate":
        from .bench import calibrate

        calibrate.main(args)
        return 0
    if args.command == "compare":
        from .bench.compare import print_compare

        result = run_compare_command(args)
        print_compare(result)
    else:
        result = run_bench(args)
        if "concurrency" in result:
            from .bench.serving import plot_serving, print_serving

            print_serving(result)
            plotter = plot_serving
        else:
            from .bench.runner import plot_bench, print_bench

            print_bench(result)
            plotter = plot_bench
        if args.plot:
            plotter(result, args.plot)
            print(f"wrote {args.plot}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
