# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""OnlineSpec bench: static drafter vs online adapters (ogd / optimistic / ensemble) on a domain-shift stream.

    adaflash-hf bench-online [--quick] [--algorithms static,ogd,optimistic,ensemble] [--output docs/bench_online.json]

The stream is the held-out prompts of the testbed domains, served one domain after the other (the traffic
shifts). Every algorithm serves the same stream with a fresh copy of the drafter through plain
`target.generate(assistant_model=drafter)`; an online adapter keeps learning across prompts. Every round drafts
(lookup and no-draft rounds are off), so each round feeds the learner and tau measures the drafter alone.

Reported per algorithm: tau (overall and per window of prompts, i.e. over time), tokens/s, identical outputs vs
plain greedy, the learner's overhead per round, and regret: the cumulative online loss minus that of the best fixed
adapter in hindsight on the same stream (`online.regret`).
"""

import copy
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..generation.batch import run_knobs
from ..testbed.prompts import encode_prompt
from .models import DEVICES
from .runner import DRAFTER_ONLY


ALGORITHMS = ("static", "ogd", "optimistic", "ensemble")


def shift_stream(domains=("prose", "code", "chat", "math"), per_domain: int = 4, split: str = "eval") -> list[dict]:
    """Held-out testbed prompts, `per_domain` of each domain, one domain after the other."""
    from ..testbed import load_prompts

    records = load_prompts(split=split, max_per_domain=per_domain)
    return [r for d in domains for r in records if r["domain"] == d][: per_domain * len(domains)]


def online_config(algorithm: str, learning_rate: float | None = None, **overrides):
    """The `OnlineSpecConfig` the bench uses for `algorithm` (tuned on the training split, see the README)."""
    from ..online import OnlineSpecConfig

    lr = {"ogd": 1e-3, "optimistic": 1e-3, "ensemble": 1e-3}[algorithm] if learning_rate is None else learning_rate
    return OnlineSpecConfig(algorithm=algorithm, learning_rate=lr, ensemble_base="optimistic", **overrides)


@torch.no_grad()  # not inference_mode: the online adapter trains inside generate
def _serve(target, tokenizer, drafter, records, max_new_tokens, desc, progress):
    """Serve `records` in order; returns per-prompt outputs, seconds and (speculative) accepted/drafted lists."""
    rows = []
    for record in tqdm(records, desc=desc, disable=not progress, unit="prompt"):
        ids = torch.tensor([encode_prompt(tokenizer, record["prompt"])], device=target.device)
        kwargs = {"assistant_model": drafter, "return_dict_in_generate": True} if drafter is not None else {}
        start = time.perf_counter()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False, **kwargs)
        seconds = time.perf_counter() - start
        stats, out = (out.speculation_stats, out.sequences) if drafter is not None else (None, out)
        rows.append({"output": out, "new_tokens": out.shape[1] - ids.shape[1], "seconds": seconds,
                     "accepted": list(stats.accepted) if stats else [], "domain": record["domain"]})
    return rows


def run_online_bench(target, tokenizer, drafter, algorithms=ALGORITHMS, quick: bool = False, seed: int = 0,
                     per_domain: int | None = None, max_new_tokens: int | None = None,
                     learning_rate: float | None = None, hindsight_epochs: int | None = None,
                     progress: bool = True, records: list[dict] | None = None) -> dict:
    """Run the bench (module docstring). Returns the JSON-ready dict (schema: `algorithms` -> name -> metrics)."""
    from ..online import OnlineSpecAdapter, regret

    unknown = set(algorithms) - set(ALGORITHMS)
    if unknown:
        raise ValueError(f"unknown algorithms {sorted(unknown)}; choose from {ALGORITHMS}")
    per_domain = per_domain or (2 if quick else 5)
    max_new_tokens = max_new_tokens or (48 if quick else 96)
    hindsight_epochs = hindsight_epochs or (2 if quick else 4)
    records = records if records is not None else shift_stream(per_domain=per_domain)
    torch.manual_seed(seed)
    plain = _serve(target, tokenizer, None, records, max_new_tokens, "plain", progress)
    result = {"stream": {"domains": list(dict.fromkeys(r["domain"] for r in records)), "prompts": len(records),
                         "max_new_tokens": max_new_tokens, "seed": seed},
              "plain_tokens_per_s": sum(r["new_tokens"] for r in plain) / sum(r["seconds"] for r in plain),
              "algorithms": {}}
    base = copy.deepcopy(drafter)
    base.runtime = None  # each algorithm starts from a fresh runtime
    base.generation_config = run_knobs(drafter, **DRAFTER_ONLY)
    for algorithm in algorithms:
        torch.manual_seed(seed)
        served = copy.deepcopy(base)
        adapter = None
        if algorithm != "static":
            adapter = OnlineSpecAdapter.attach(served, online_config(algorithm, learning_rate, record_stream=True,
                                                                     seed=seed))
        rows = _serve(target, tokenizer, served, records, max_new_tokens, algorithm, progress)
        accepted = [a for r in rows for a in r["accepted"]]
        entry = {
            "tau": (sum(accepted) / len(accepted) + 1) if accepted else 0.0,
            "tau_over_time": [(sum(r["accepted"]) / len(r["accepted"]) + 1) if r["accepted"] else 0.0 for r in rows],
            "domains_over_time": [r["domain"] for r in rows],
            "tokens_per_s": sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows),
            "identical": sum(torch.equal(r["output"], p["output"]) for r, p in zip(rows, plain)),
            "total": len(rows), "rounds": len(accepted),
            "cumulative_loss": None, "hindsight_loss": None, "regret": None, "overhead_ms_per_round": 0.0,
        }
        if adapter is not None:
            stats = adapter.stats
            entry["overhead_ms_per_round"] = 1e3 * stats.update_seconds / max(stats.rounds, 1)
            entry["rollbacks"] = len(stats.rollbacks)
            start = time.perf_counter()
            r = regret(adapter, target.get_output_embeddings(), epochs=hindsight_epochs, seed=seed)
            entry.update(cumulative_loss=r["online"], hindsight_loss=r["best_fixed"], regret=r["regret"],
                         static_loss=r["static"], learner_rounds=r["rounds"],
                         hindsight_seconds=time.perf_counter() - start)
            if stats.weights:
                entry["final_weights"] = stats.weights[-1]
        result["algorithms"][algorithm] = entry
    return result


def print_online(result: dict) -> None:
    print(f"stream: {result['stream']['prompts']} prompts over {result['stream']['domains']}, "
          f"{result['stream']['max_new_tokens']} new tokens each; plain {result['plain_tokens_per_s']:.1f} tok/s")
    print(f"{'algorithm':<12}{'tau':>7}{'tok/s':>8}{'overhead ms':>13}{'online loss':>13}{'hindsight':>11}"
          f"{'regret':>9}{'identical':>11}")
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "-"  # noqa: E731
    for name, e in result["algorithms"].items():
        print(f"{name:<12}{e['tau']:>7.3f}{e['tokens_per_s']:>8.1f}{e['overhead_ms_per_round']:>13.1f}"
              f"{fmt(e['cumulative_loss']):>13}{fmt(e['hindsight_loss']):>11}{fmt(e['regret']):>9}"
              f"{e['identical']:>7}/{e['total']}")


def plot_online(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for name, e in result["algorithms"].items():
        series = e["tau_over_time"]
        smooth = [sum(series[max(0, i - 1) : i + 2]) / len(series[max(0, i - 1) : i + 2]) for i in range(len(series))]
        ax.plot(range(1, len(series) + 1), smooth, marker=".", label=f"{name} (tau {e['tau']:.2f})")
    domains = next(iter(result["algorithms"].values())).get("domains_over_time", [])
    for i in range(1, len(domains)):  # where the stream switches domain
        if domains[i] != domains[i - 1]:
            ax.axvline(i + 0.5, color="grey", lw=0.6, ls=":")
    order = result.get("stream", {}).get("domains")
    ax.set_xlabel("prompt in the stream" + (f" (domains: {' -> '.join(order)})" if order else ""))
    ax.set_ylabel("tau (3-prompt moving mean)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> None:
    from .args import choice_list, existing_dir, positive_int

    p = sub.add_parser("bench-online", help="static vs online adapters on a domain-shift stream (OnlineSpec)")
    p.add_argument("--drafter", type=existing_dir("--drafter"), default=None,
                   help="drafter folder (default: the shipped one)")
    p.add_argument("--target", default=None, help="target folder (default: the testbed model)")
    p.add_argument("--algorithms", type=choice_list("--algorithms", ALGORITHMS), default=",".join(ALGORITHMS))
    p.add_argument("--quick", action="store_true", help="2 prompts per domain, 48 new tokens")
    p.add_argument("--per-domain", type=positive_int("--per-domain"), default=None)
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=None)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, help="write the JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write tau over time (PNG) here")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the models run (auto: the accelerator when there is one, else the CPU)")


def main(args) -> dict:
    from .models import load_models

    target, tokenizer, drafter = load_models(args.target, args.drafter, torch.float32, args.device)
    result = run_online_bench(target, tokenizer, drafter, [a.strip() for a in args.algorithms.split(",")],
                              quick=args.quick, seed=args.seed, per_domain=args.per_domain,
                              max_new_tokens=args.max_new_tokens, learning_rate=args.learning_rate)
    print_online(result)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot_online(result, args.plot)
    return result


__all__ = ["ALGORITHMS", "online_config", "plot_online", "print_online", "run_online_bench", "shift_stream"]
