# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The `adaflash-hf` command line: `adaflash-hf bench ...`, `adaflash-hf compare ...`, `adaflash-hf report ...`."""

import argparse
import json
import sys
from pathlib import Path

import torch

from .bench.args import concurrency_levels, existing_dir, positive_int, prompts_file


BENCH_EPILOG = """\
tau is tokens committed per verification forward, bonus token included:
  tau = (new_tokens - 1) / (full_target_forwards - 1)   (the prefill and its token excluded; plain greedy = 1)
speed-up = a method's tokens/s over plain greedy's, on the same prompts in the same run.
JSON: {"overall": {"tau", "speedup", "identical", "total"}, "domains": {domain: {same keys}},
       "tau_cross_domain_std", "methods": {method: {"overall": {...}, "domains": {...}}}, "config": {...}}
where "overall"/"domains" describe our generate path ("adaflash": drafter + prompt lookup + no-draft fallback,
chosen per round) and identical counts outputs equal to plain greedy token for token out of total.
"drafter_only" is our generator drafting every round; "prompt_lookup" is transformers' lookup alone.
"""


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="side-by-side speed/acceptance benchmark", epilog=BENCH_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target model folder (default: the offline testbed model)")
    p.add_argument("--drafter", type=existing_dir("--drafter"), default=None,
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
                   help="e.g. 1,4,16,32: instead of the bs=1 methods, measure batched throughput at these levels "
                        "(plain batched generate, fixed block, adaptive length head); JSON key 'concurrency'")
    p.add_argument("--length-head", type=existing_dir("--length-head"), default=None,
                   help="length head folder (with cost_model.json) for 'adaptive'")


def _compare_parser(sub) -> None:
    p = sub.add_parser(
        "compare", help="tau per domain of several drafters on the same prompts (mean and cross-domain std)",
        description="Greedy speculative decoding with each drafter alone (no prompt lookup, no fallback), on the "
                    "same prompts; reports tau per domain, its mean and standard deviation across domains, and "
                    "identical outputs. Used to compare offline-only and OPD drafters.")
    p.add_argument("--drafters", required=True, help="comma-separated drafter folders")
    p.add_argument("--labels", default=None, help="comma-separated names (default: folder names)")
    p.add_argument("--prompts", type=prompts_file, default=None, help="JSONL prompts (default: committed eval prompts)")
    p.add_argument("--max-prompts", type=positive_int("--max-prompts"), default=None,
                   help="at most this many prompts per domain")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--quiet", action="store_true")


def _select(records, max_per_domain):
    if not max_per_domain:
        return records
    seen = {}
    return [r for r in records if seen.setdefault(r["domain"], []).append(r) or len(seen[r["domain"]]) <= max_per_domain]


def run_compare(args) -> dict:
    from .bench.runner import run_benchmark, summarize
    from .testbed import default_eval_prompts, read_prompts_jsonl

    records = _select(read_prompts_jsonl(args.prompts) if args.prompts else default_eval_prompts(), args.max_prompts)
    paths = [p.strip() for p in args.drafters.split(",") if p.strip()]
    labels = [x.strip() for x in args.labels.split(",")] if args.labels else [Path(p).name for p in paths]
    if len(labels) != len(paths):
        raise SystemExit("--labels must name every drafter")
    dtype = getattr(torch, args.dtype)
    references: list = []
    results = {}
    for label, path in zip(labels, paths):
        target, tokenizer, drafter = load_models(None, path, dtype)
        drafter.config.hybrid_lookup, drafter.config.allow_no_draft = False, False  # the drafter alone
        methods = ("adaflash",) if references else ("plain", "adaflash")
        measured = run_benchmark(target, tokenizer, drafter, records, methods=methods,
                                 max_new_tokens=args.max_new_tokens, progress=not args.quiet, references=references)
        summary = summarize([m for m in measured if m.method == "adaflash"], block_size=drafter.config.block_size)
        taus = {d: v["tau"] for d, v in summary["domains"].items()}
        results[label] = {"path": path, "tau_by_domain": taus, "tau_mean": sum(taus.values()) / len(taus),
                          "tau_std": summary["tau_cross_domain_std"], "overall_tau": summary["overall"]["tau"],
                          "identical": summary["overall"]["identical"], "total": summary["overall"]["total"]}
    return {"drafters": results, "config": {"max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
                                            "n_prompts": len(records)}}


def print_compare(result: dict) -> None:
    drafters = result["drafters"]
    domains = list(next(iter(drafters.values()))["tau_by_domain"])
    print(f"\n{'drafter':<24}" + "".join(f"{d:>8}" for d in domains) + f"{'mean':>8}{'std':>8}{'identical':>11}")
    for label, row in drafters.items():
        print(f"{label:<24}" + "".join(f"{row['tau_by_domain'][d]:>8.2f}" for d in domains)
              + f"{row['tau_mean']:>8.2f}{row['tau_std']:>8.3f}{row['identical']:>6}/{row['total']}")


def _methods(all_methods: bool = False):
    from .bench.runner import ALL_METHODS, METHODS

    return ALL_METHODS if all_methods else METHODS


def load_models(target_path, drafter_path, dtype):
    """Target + tokenizer (testbed by default) and the drafter (shipped default by default)."""
    import adaflash_hf  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .checkpoints import default_drafter_dir
    from .models import AdaFlashDrafterModel

    if target_path is None:
        from .testbed import load_testbed

        target, tokenizer = load_testbed(dtype=dtype)
    else:
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(target_path)
    drafter_path = drafter_path or default_drafter_dir()
    if drafter_path is None:
        raise SystemExit("No drafter given and no default drafter shipped: pass --drafter PATH.")
    if not Path(drafter_path).is_dir():
        raise SystemExit(f"--drafter {drafter_path}: no such folder.")
    drafter = AdaFlashDrafterModel.from_pretrained(drafter_path, dtype=dtype).eval()
    drafter.check_compatible(target, tokenizer)
    return target, tokenizer, drafter


def run_bench(args) -> dict:
    from .bench.runner import run_benchmark, summarize
    from .testbed import default_eval_prompts, read_prompts_jsonl

    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    unknown = set(methods) - set(_methods(all_methods=True))
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {list(_methods(all_methods=True))}")
    if "drafter_head" in methods and not args.length_head:
        raise SystemExit("method drafter_head needs --length-head PATH")
    if args.threads:
        torch.set_num_threads(args.threads)
    records = _select(read_prompts_jsonl(args.prompts) if args.prompts else default_eval_prompts(), args.max_prompts)
    dtype = getattr(torch, args.dtype)
    target, tokenizer, drafter = load_models(args.target, args.drafter, dtype)
    if args.length_head:
        from .generation.cost_model import TargetCostModel
        from .models import AdaFlashLengthHead

        head = AdaFlashLengthHead.from_pretrained(args.length_head, dtype=dtype).eval()
        drafter.attach_length_head(head, TargetCostModel.load(Path(args.length_head) / "cost_model.json"))
    if args.concurrency:
        from .bench.concurrency import run_concurrency

        levels = [int(x) for x in args.concurrency.split(",")]
        result = run_concurrency(target, tokenizer, drafter, records, levels=levels,
                                 max_new_tokens=args.max_new_tokens, raw=args.raw, progress=not args.quiet)
        result["config"] = {"dtype": args.dtype, "threads": torch.get_num_threads(), "n_prompts": len(records)}
        return result
    results = run_benchmark(target, tokenizer, drafter, records, methods=methods,
                            max_new_tokens=args.max_new_tokens, raw=args.raw, progress=not args.quiet)
    summary = summarize(results, block_size=drafter.config.block_size)
    summary["config"] = {
        "target": args.target or "testbed:SmolLM2-135M-Instruct", "drafter": str(args.drafter or "default"),
        "prompts": str(args.prompts or "default_eval_prompts"), "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype, "threads": torch.get_num_threads(), "raw": args.raw, "n_prompts": len(records),
    }
    return summary


def print_bench(summary: dict) -> None:
    methods = summary["methods"]
    domains = list(summary["domains"])
    print(f"\n{'method':<19}{'domain':<9}{'tok/s':>8}{'speedup':>9}{'tau':>7}{'identical':>11}{'verif/com':>10}")
    for method, data in methods.items():
        for name, row in [("overall", data["overall"])] + [(d, data["domains"][d]) for d in domains]:
            vpc = f"{row['verified_per_committed']:>8.2f}" if "verified_per_committed" in row else f"{'-':>8}"
            print(f"{method:<19}{name:<9}{row['tokens_per_s']:>8.1f}{row['speedup']:>8.2f}x{row['tau']:>7.2f}"
                  f"{row['identical']:>6}/{row['total']:<4}{vpc}")
    ours = methods.get("adaflash", {}).get("overall", {})
    if "acceptance_by_position" in ours:
        rates = " ".join(f"{r:.2f}" for r in ours["acceptance_by_position"])
        print(f"\nadaflash acceptance by draft position: {rates}")
        t = ours["time_per_round_ms"]
        print(f"adaflash time per round: drafting {t['drafting']:.1f} ms, verification forward "
              f"{t['verification_forward']:.1f} ms, other {t['other']:.1f} ms")
    print(f"tau cross-domain std (adaflash): {summary['tau_cross_domain_std']:.3f}")


def plot_bench(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(summary["methods"])
    groups = ["overall", *summary["domains"]]
    fig, ax = plt.subplots(figsize=(1.6 * len(groups) + 2, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        data = summary["methods"][method]
        values = [data["overall"]["tokens_per_s"]] + [data["domains"][d]["tokens_per_s"] for d in groups[1:]]
        ax.bar([g + i * width for g in range(len(groups))], values, width, label=method)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups)
    ax.set_ylabel("output tokens / s")
    cfg = summary.get("config", {})
    ax.set_title(f"bs=1, {cfg.get('dtype', '')}, {cfg.get('max_new_tokens', '')} new tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


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
    from .bench.online import add_parser as _online_parser

    _online_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "report":
        from .bench.report import main_report

        return main_report(args)
    if args.command == "bench-online":
        from .bench import online

        online.main(args)
        return 0
    if args.command == "compare":
        result = run_compare(args)
        print_compare(result)
    else:
        result = run_bench(args)
        if "concurrency" in result:
            from .bench.concurrency import plot_concurrency, print_concurrency

            print_concurrency(result)
            plotter = plot_concurrency
        else:
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
