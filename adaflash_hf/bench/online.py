# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""OnlineSpec bench: static drafter vs online adapters (ogd / optimistic / ensemble) on a domain-shift stream.

    adaflash-hf bench-online [--prompts stream.jsonl] [--update-mode request|background|round] [--device auto]
                             [--algorithms static,ogd,optimistic,ensemble] [--output docs/bench_online.json]

The stream is served in its order through plain `target.generate(assistant_model=drafter)`, one request after the
other; every algorithm serves the same stream starting from the same drafter, and an online adapter keeps learning
across requests. The algorithms (and plain greedy) take turns request by request (`_serve_interleaved`), so their
tokens/s ratios are measured side by side even on a shared machine. By default the stream is `shift_stream()`: held-out testbed prompts (never trained on), in blocks
of one domain after another (prose -> code -> chat -> math, repeated), so the traffic shifts. By default every round
drafts (`--hybrid` keeps the default path's lookup and plain rounds), so tau measures the drafter alone.

Reported per algorithm: tau and tokens/s overall and per window of requests (over time), outputs identical to
plain greedy, the learning cost per request and per round, split into what the serving thread spent (on the
critical path: sync updates, waiting for the worker, copying weights in) and the total learning compute (in a
background worker it runs beside serving), the drafted positions each update learned from, and regret: the
cumulative online loss minus that of the best fixed adapter in hindsight on the same stream (`online.regret`).
"""

import copy
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..generation.batch import run_knobs
from ..generation.cost_model import synchronize
from ..testbed.prompts import encode_prompt
from ..utils.speculation import pooled_tau, tau
from .models import DEVICES
from .runner import DRAFTER_ONLY


ALGORITHMS = ("static", "ogd", "optimistic", "ensemble")
SHIFT_ORDER = ("prose", "code", "chat", "math")


def shift_stream(per_block: int = 25, cycles: int = 2, domains=SHIFT_ORDER, split: str = "eval") -> list[dict]:
    """Held-out testbed prompts in domain blocks: `per_block` of each domain in `domains` order, `cycles` times
    (different prompts each cycle): `per_block * len(domains) * cycles` requests (default 200)."""
    from ..testbed import load_prompts

    records = load_prompts(split=split, max_per_domain=per_block * cycles)
    by_domain = {d: [r for r in records if r["domain"] == d] for d in domains}
    short = [d for d, rs in by_domain.items() if len(rs) < per_block * cycles]
    if short:
        raise ValueError(f"not enough {split} prompts in {short} for {cycles} x {per_block} per domain")
    return [r for c in range(cycles) for d in domains for r in by_domain[d][c * per_block : (c + 1) * per_block]]


def online_config(algorithm: str, learning_rate: float | None = None, **overrides):
    """The `OnlineSpecConfig` the bench uses for `algorithm`."""
    from ..online import OnlineSpecConfig

    lr = {"ogd": 1e-3, "optimistic": 1e-3, "ensemble": 1e-3}[algorithm] if learning_rate is None else learning_rate
    return OnlineSpecConfig(algorithm=algorithm, learning_rate=lr, ensemble_base="optimistic", **overrides)


@torch.no_grad()  # not inference_mode: the online adapter trains inside generate
def _serve_one(target, tokenizer, drafter, record, max_new_tokens) -> dict:
    """Serve one request (plain greedy when `drafter` is None): its output, seconds and drafter-round statistics."""
    ids = torch.tensor([encode_prompt(tokenizer, record["prompt"])], device=target.device)
    kwargs = {"assistant_model": drafter, "return_dict_in_generate": True} if drafter is not None else {}
    runtime = getattr(drafter, "runtime", None)
    adapter = runtime.online_adapter if runtime is not None else None
    static_before = adapter.stats.static_requests if adapter is not None else 0
    synchronize(target.device)
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, **kwargs)
    synchronize(target.device)
    seconds = time.perf_counter() - start
    stats, out = (out.speculation_stats, out.sequences) if drafter is not None else (None, out)
    return {"output": out.cpu(), "new_tokens": out.shape[1] - ids.shape[1], "seconds": seconds,
            "accepted": list(stats.accepted) if stats else [], "domain": record["domain"],
            "proposers": list(stats.proposers) if stats else [],
            # drafted by the static drafter while the adapter did not pay (`OnlineSpecConfig.fallback_window`)
            "static": adapter is not None and adapter.stats.static_requests > static_before}


def _serve_interleaved(target, tokenizer, drafters: dict, records, max_new_tokens, progress) -> dict[str, list]:
    """Serve every request with every drafter in `drafters` (name -> drafter or None for plain greedy) before the
    next request, rotating which goes first: each server keeps its own state over the stream, and load from other
    processes on a shared machine falls on all of them alike (the ratios are measured side by side)."""
    names = list(drafters)
    rows = {name: [] for name in names}
    for i, record in enumerate(tqdm(records, desc=f"serving x{len(names)}", disable=not progress, unit="request")):
        for name in names[i % len(names):] + names[: i % len(names)]:
            rows[name].append(_serve_one(target, tokenizer, drafters[name], record, max_new_tokens))
    return rows


def _windows(rows: list[dict], size: int) -> list[dict]:
    """tau and tokens/s per window of `size` consecutive requests (the stream over time)."""
    out = []
    for start in range(0, len(rows), size):
        chunk = rows[start : start + size]
        accepted = [a for r in chunk for a in r["accepted"]]
        out.append({"requests": [start, start + len(chunk)], "domain": chunk[0]["domain"],
                    "tau": tau(accepted),
                    "tokens_per_s": sum(r["new_tokens"] for r in chunk) / sum(r["seconds"] for r in chunk)})
    return out


def _pooled(rows: list[dict]) -> dict:
    """tau (pooled over rounds) and tokens/s of some served requests."""
    accepted = [a for r in rows for a in r["accepted"]]
    return {"requests": len(rows), "tau": tau(accepted),
            "tokens_per_s": sum(r["new_tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)}


def _segments(rows: list[dict], tail: int = 100) -> list[dict]:
    """One entry per contiguous run of one domain (a stream of 200 unseen requests then 50 known ones has two):
    tau and tokens/s over the whole run and over its last `tail` requests."""
    out, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i]["domain"] != rows[start]["domain"]:
            chunk = rows[start:i]
            out.append({"domain": chunk[0]["domain"], "span": [start, i], **_pooled(chunk),
                        "drafted_static": sum(r.get("static", False) for r in chunk),
                        "last": {"tail": min(tail, len(chunk)), **_pooled(chunk[-tail:])}})
            start = i
    return out


def run_online_bench(target, tokenizer, drafter, algorithms=ALGORITHMS, records: list[dict] | None = None,
                     quick: bool = False, seed: int = 0, per_block: int | None = None, cycles: int | None = None,
                     max_new_tokens: int | None = None, learning_rate: float | None = None,
                     update_mode: str = "request", hybrid: bool = False, hindsight_epochs: int | None = None,
                     window: int | None = None, progress: bool = True) -> dict:
    """Run the bench (module docstring). Returns the JSON-ready dict (schema: `algorithms` -> name -> metrics)."""
    from ..online import OnlineSpecAdapter, regret

    unknown = set(algorithms) - set(ALGORITHMS)
    if unknown:
        raise ValueError(f"unknown algorithms {sorted(unknown)}; choose from {ALGORITHMS}")
    if records is None:
        records = shift_stream(per_block or (2 if quick else 25), cycles or (1 if quick else 2))
    max_new_tokens = max_new_tokens or (32 if quick else 64)
    hindsight_epochs = hindsight_epochs or (1 if quick else 2)
    window = window or max(1, len(records) // 10)
    base = copy.deepcopy(drafter)
    base.runtime = None  # each algorithm starts from a fresh runtime
    if not hybrid:
        base.generation_config = run_knobs(drafter, **DRAFTER_ONLY)
    drafters, adapters = {"plain": None}, {}
    for algorithm in algorithms:
        torch.manual_seed(seed)
        drafters[algorithm] = copy.deepcopy(base)
        if algorithm != "static":
            adapters[algorithm] = OnlineSpecAdapter.attach(drafters[algorithm], online_config(
                algorithm, learning_rate, record_stream=True, seed=seed, update_mode=update_mode))
    served = _serve_interleaved(target, tokenizer, drafters, records, max_new_tokens, progress)
    plain = served["plain"]
    plain_rate = sum(r["new_tokens"] for r in plain) / sum(r["seconds"] for r in plain)
    result = {"stream": {"domains": list(dict.fromkeys(r["domain"] for r in records)), "requests": len(records),
                         "order": [r["domain"] for r in records], "max_new_tokens": max_new_tokens, "seed": seed,
                         "update_mode": update_mode, "path": "hybrid" if hybrid else "drafter every round",
                         "served": "interleaved: every request by every algorithm (and plain) in rotating order"},
              "plain_tokens_per_s": plain_rate, "algorithms": {}}
    for algorithm in algorithms:
        rows, adapter = served[algorithm], adapters.get(algorithm)
        if adapter is not None:
            adapter.finish()
        accepted = [a for r in rows for a in r["accepted"]]
        seconds = sum(r["seconds"] for r in rows)
        entry = {
            "tau": tau(accepted),
            "tokens_per_s": sum(r["new_tokens"] for r in rows) / seconds,
            "over_time": _windows(rows, window),
            "tau_over_time": [tau(r["accepted"]) for r in rows],
            "segments": _segments(rows),
            "per_request": [{"rounds": len(r["accepted"]), "accepted": sum(r["accepted"]),
                             "new_tokens": r["new_tokens"], "seconds": r["seconds"], "static": r["static"]}
                            for r in rows],
            "domains_over_time": [r["domain"] for r in rows],
            "identical": sum(torch.equal(r["output"], p["output"]) for r, p in zip(rows, plain)),
            "total": len(rows), "rounds": len(accepted),
            "drafter_rounds": sum(p == "drafter" for r in rows for p in r["proposers"]),
            "cumulative_loss": None, "hindsight_loss": None, "regret": None,
        }
        if adapter is not None:
            stats = adapter.stats
            entry.update(
                updates=stats.updates, rollbacks=len(stats.rollbacks), vocab_added=stats.vocab_added,
                static_requests=stats.static_requests,
                positions_per_update=sum(stats.positions) / max(len(stats.positions), 1),
                learning_ms_per_request={"critical_path": 1e3 * stats.critical_seconds / len(rows),
                                         "total": 1e3 * stats.update_seconds / len(rows)},
                learning_ms_per_round={"critical_path": 1e3 * stats.critical_seconds / max(len(accepted), 1),
                                       "total": 1e3 * stats.update_seconds / max(len(accepted), 1)},
                critical_share=stats.critical_seconds / seconds)
            start = time.perf_counter()
            r = regret(adapter, target.get_output_embeddings(), epochs=hindsight_epochs, seed=seed)
            entry.update(cumulative_loss=r["online"], hindsight_loss=r["best_fixed"], regret=r["regret"],
                         static_loss=r["static"], learner_rounds=r["rounds"],
                         hindsight_seconds=time.perf_counter() - start)
            if stats.weights:
                entry["final_weights"] = stats.weights[-1]
        result["algorithms"][algorithm] = entry
    static = result["algorithms"].get("static")
    if static:
        for entry in result["algorithms"].values():
            entry["tau_vs_static"] = entry["tau"] / max(static["tau"], 1e-9)
            entry["speed_vs_static"] = entry["tokens_per_s"] / max(static["tokens_per_s"], 1e-9)
            for seg, ref in zip(entry["segments"], static["segments"]):
                for part, base in ((seg, ref), (seg["last"], ref["last"])):
                    part["tau_vs_static"] = part["tau"] / max(base["tau"], 1e-9)
                    part["speed_vs_static"] = part["tokens_per_s"] / max(base["tokens_per_s"], 1e-9)
    return result


MIN_BLOCK = 2  # a domain changing every request is one "mixed" stretch in the tables (its runs pooled together)


def _mixed_spans(segments: list[dict]) -> list[tuple[int, int, list[str]]]:
    """Consecutive runs shorter than `MIN_BLOCK` requests (e.g. a known tail cycling through four domains), merged:
    `(start, end, domains)` per merged stretch."""
    out = []
    for g in segments:
        if g["requests"] >= MIN_BLOCK:
            continue
        if out and out[-1][1] == g["span"][0]:
            start, _, domains = out[-1]
            out[-1] = (start, g["span"][1], domains + [g["domain"]] * (g["domain"] not in domains))
        else:
            out.append((g["span"][0], g["span"][1], [g["domain"]]))
    return out


def _pooled_requests(entry: dict, start: int, end: int) -> dict:
    """tau (pooled over rounds), tokens/s and requests drafted static of requests `start:end` (`per_request`)."""
    rows = entry["per_request"][start:end]
    return {"tau": pooled_tau(rows),
            "tokens_per_s": sum(r["new_tokens"] for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9),
            "static": sum(r.get("static", False) for r in rows)}


def markdown_online(result: dict) -> list[str]:
    """Markdown tables of a bench: per algorithm (learning time on and off the serving path), per block of one
    domain vs static, and tau / tokens/s per window of requests over time."""
    algos, stream = result["algorithms"], result["stream"]
    row = lambda cells: "| " + " | ".join(str(c) for c in cells) + " |"  # noqa: E731
    lines = [f"{stream['requests']} requests ({' -> '.join(stream['domains'])}), {stream['max_new_tokens']} new tokens "
             f"each, update mode {stream['update_mode']}, {stream['path']}; {stream.get('served', '')}.", "",
             row(["algorithm", "tau", "tok/s", "vs static", "learning ms/request (all)", "on the serving path",
                  "tok/s if all learning were on the serving path (derived)", "updates", "vocab added",
                  "identical"]), row(["---"] * 10)]
    for name, e in algos.items():
        learn = e.get("learning_ms_per_request") or {}
        seconds = sum(r["seconds"] for r in e.get("per_request", [])) or None
        on_path = "-"
        if learn and seconds:  # the worker's time moved onto the serving thread (what update_mode="request" costs)
            extra = (learn["total"] - learn["critical_path"]) * e["total"] / 1e3
            on_path = f"{sum(r['new_tokens'] for r in e['per_request']) / (seconds + extra):.1f}"
        lines.append(row([name, f"{e['tau']:.3f}", f"{e['tokens_per_s']:.2f}", f"{e.get('speed_vs_static', 1):.3f}x",
                          f"{learn['total']:.0f}" if learn else "-", f"{learn['critical_path']:.0f}" if learn else "-",
                          on_path, e.get("updates", "-"), e.get("vocab_added", "-"), f"{e['identical']}/{e['total']}"]))
    lines += ["", row(["algorithm", "block", "requests", "drafted static", "tau (vs static)", "tok/s (vs static)",
                       "last requests", "tau (vs static)", "tok/s (vs static)"]), row(["---"] * 9)]
    static = algos.get("static")
    for name, e in algos.items():
        for g in e.get("segments", []):
            if g["requests"] < MIN_BLOCK:
                continue
            last = g["last"]
            lines.append(row([name, g["domain"], f"{g['span'][0]}-{g['span'][1]}",
                              g.get("drafted_static", "-") if name != "static" else "all",
                              f"{g['tau']:.3f} ({g.get('tau_vs_static', 1):.3f}x)",
                              f"{g['tokens_per_s']:.2f} ({g.get('speed_vs_static', 1):.3f}x)", f"last {last['tail']}",
                              f"{last['tau']:.3f} ({last.get('tau_vs_static', 1):.3f}x)",
                              f"{last['tokens_per_s']:.2f} ({last.get('speed_vs_static', 1):.3f}x)"]))
        for start, end, domains in _mixed_spans(e.get("segments", [])):
            mine, ref = _pooled_requests(e, start, end), _pooled_requests(static or e, start, end)
            lines.append(row([name, "mixed: " + "/".join(domains), f"{start}-{end}",
                              mine["static"] if name != "static" else "all",
                              f"{mine['tau']:.3f} ({mine['tau'] / ref['tau']:.3f}x)",
                              f"{mine['tokens_per_s']:.2f} ({mine['tokens_per_s'] / ref['tokens_per_s']:.3f}x)",
                              "-", "-", "-"]))
    names = list(algos)
    windows = [w["requests"] for w in algos[names[0]]["over_time"]]
    lines += ["", row(["requests", "domain", *[f"{n} tau" for n in names], *[f"{n} tok/s" for n in names]]),
              row(["---"] * (2 + 2 * len(names)))]
    for i, span in enumerate(windows):
        ws = [algos[n]["over_time"][i] for n in names]
        lines.append(row([f"{span[0]}-{span[1]}", ws[0]["domain"], *[f"{w['tau']:.3f}" for w in ws],
                          *[f"{w['tokens_per_s']:.2f}" for w in ws]]))
    return lines


def print_online(result: dict) -> None:
    stream = result["stream"]
    print(f"stream: {stream['requests']} requests over {stream['domains']} ({stream['path']}, update mode "
          f"{stream['update_mode']}), {stream['max_new_tokens']} new tokens each; plain "
          f"{result['plain_tokens_per_s']:.1f} tok/s")
    print(f"{'algorithm':<12}{'tau':>7}{'vs static':>10}{'tok/s':>8}{'vs static':>10}{'learn ms/req':>13}"
          f"{'(critical)':>11}{'regret':>9}{'identical':>11}")
    fmt = lambda v, spec=".1f": format(v, spec) if isinstance(v, float) else "-"  # noqa: E731
    for name, e in result["algorithms"].items():
        learn = e.get("learning_ms_per_request", {})
        print(f"{name:<12}{e['tau']:>7.3f}{e.get('tau_vs_static', 1.0):>9.2f}x{e['tokens_per_s']:>8.1f}"
              f"{e.get('speed_vs_static', 1.0):>9.2f}x{fmt(learn.get('total')):>13}{fmt(learn.get('critical_path')):>11}"
              f"{fmt(e['regret']):>9}{e['identical']:>7}/{e['total']}")
    print("per contiguous block of one domain (whole block | its last 100 requests), vs static:")
    for name, e in result["algorithms"].items():
        parts = [f"{s['domain']} {s['span'][0]}-{s['span'][1]}: tau {s['tau']:.3f} ({s.get('tau_vs_static', 1):.2f}x) "
                 f"{s['tokens_per_s']:.1f} tok/s ({s.get('speed_vs_static', 1):.2f}x) | last {s['last']['tail']}: "
                 f"tau {s['last'].get('tau_vs_static', 1):.2f}x tok/s {s['last'].get('speed_vs_static', 1):.2f}x"
                 for s in e.get("segments", [])]
        print(f"  {name:<11}" + "\n             ".join(parts))


def plot_online(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, e in result["algorithms"].items():
        windows = e.get("over_time") or [{"requests": [i, i + 1], "tau": t, "tokens_per_s": 0.0}
                                         for i, t in enumerate(e["tau_over_time"])]
        x = [w["requests"][1] for w in windows]
        left.plot(x, [w["tau"] for w in windows], marker=".", label=f"{name} (tau {e['tau']:.2f})")
        right.plot(x, [w["tokens_per_s"] for w in windows], marker=".", label=name)
    domains = next(iter(result["algorithms"].values())).get("domains_over_time", [])
    for ax in (left, right):
        for i in range(1, len(domains)):  # where the stream switches domain
            if domains[i] != domains[i - 1]:
                ax.axvline(i + 0.5, color="grey", lw=0.6, ls=":")
        ax.set_xlabel("requests served")
    left.set_ylabel("tau (per window)")
    right.set_ylabel("output tokens / s (per window)")
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(sub) -> None:
    from .args import choice_list, drafter_dir, positive_int, prompts_file

    p = sub.add_parser("bench-online", help="static vs online adapters on a domain-shift stream (OnlineSpec)")
    p.add_argument("--drafter", type=drafter_dir("--drafter"), default=None,
                   help="drafter folder (default: the shipped one)")
    p.add_argument("--target", default=None, help="target folder (default: the testbed model)")
    p.add_argument("--prompts", type=prompts_file, default=None,
                   help='JSONL of {"prompt", "domain"} requests, served in the file\'s order (default: 200 held-out '
                        "testbed prompts in shifting domain blocks)")
    p.add_argument("--algorithms", type=choice_list("--algorithms", ALGORITHMS), default=",".join(ALGORITHMS))
    p.add_argument("--update-mode", choices=("request", "background", "round"), default="request",
                   help="when the adapter learns (OnlineSpecConfig.update_mode)")
    p.add_argument("--hybrid", action="store_true", help="serve with the default path (lookup and plain rounds)")
    p.add_argument("--quick", action="store_true", help="a short stream: 2 prompts per domain, 32 new tokens")
    p.add_argument("--per-block", type=positive_int("--per-block"), default=None,
                   help="requests per domain block of the default stream (default 25)")
    p.add_argument("--cycles", type=positive_int("--cycles"), default=None,
                   help="times the default stream goes through the domains (default 2)")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=None)
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--window", type=positive_int("--window"), default=None,
                   help="requests per window of the over-time table and plot (default: a tenth of the stream)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the models run (auto: the accelerator when there is one, else the CPU)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--output", type=Path, default=None, help="write the JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write tau and tokens/s over time (PNG) here")
    p.add_argument("--markdown", type=Path, default=None, help="write the tables (per algorithm, block, window) here")


def main(args) -> dict:
    from ..testbed import read_prompts_jsonl
    from .models import load_models

    target, tokenizer, drafter = load_models(args.target, args.drafter, getattr(torch, args.dtype), args.device)
    records = read_prompts_jsonl(args.prompts) if args.prompts else None
    result = run_online_bench(target, tokenizer, drafter, args.algorithms.split(","), records=records,
                              quick=args.quick, seed=args.seed, per_block=args.per_block, cycles=args.cycles,
                              max_new_tokens=args.max_new_tokens, learning_rate=args.learning_rate,
                              update_mode=args.update_mode, hybrid=args.hybrid, window=args.window)
    result["config"] = {"device": str(target.device), "dtype": args.dtype, "threads": torch.get_num_threads(),
                        "prompts": str(args.prompts or "shift_stream()")}
    print_online(result)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot_online(result, args.plot)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text("\n".join(markdown_online(result)) + "\n")
    return result


__all__ = ["ALGORITHMS", "markdown_online", "online_config", "plot_online", "print_online", "run_online_bench", "shift_stream"]
