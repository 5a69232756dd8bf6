# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`adaflash-hf report`: one command that reruns the benches behind the seeds' claims and writes `docs/results.md`.

Four sections, each a table saying which claim it tests and whether it held on the testbed (the verdict is
computed from the measured numbers by the `verdict_*` functions below, never written by hand):

  (a) AdaFlash (i)  offline-only drafter vs OPD drafter: mean tau and cross-domain std of tau (`run_compare`);
  (b) AdaFlash (ii) fixed block vs length head at several concurrency levels, beside transformers' plain peers
      (`bench/serving.run_serving`, a request-stream bench);
  (c) OnlineSpec    static vs online drafter updates on traffic the drafter never saw (text-to-SQL requests, then
                    known-domain ones: `testbed/unseen.py`, `bench/online.run_online_bench`);
  (d) plain vs speculative decoding at batch size 1: speed-up and tau per domain (`run_benchmark`).

A section whose checkpoint or bench is missing says "not available" and why; a section that fails says so with
the error, and the other sections still run. Running the benches (`run_report`) and writing the report
(`write_report`, pure: section dicts in, markdown + PNGs out) are separate, so the writer is tested on synthetic
numbers.
"""

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

from ..checkpoints import LENGTH_HEAD, OPD_DRAFTER
from ..utils.speculation import pooled_tau
from .args import cost_model_file, existing_dir, positive_int
from .models import DEVICES


SECTIONS = ("a", "b", "c", "d")
DEFAULT_REPEATS = 3  # timings per prompt and method (sections a, d): medians over interleaved repeats
STD_REDUCTION = 0.30  # claim (i): OPD's cross-domain std of tau at least 30% lower ...
ONLINE_ALGORITHMS = ("static", "ogd", "optimistic", "ensemble")
# OnlineSpec's targets on unseen traffic (issue 27): last-100 tau and tokens/s gains, forgetting, speed floor
UNSEEN_TAIL, UNSEEN_TAU_GAIN, UNSEEN_SPEED_GAIN, FORGET_TOLERANCE, SPEED_FLOOR = 100, 1.15, 1.05, 0.03, 0.97

# Per-section settings; quick mode must finish within 15 minutes on 2 CPU cores.
SETTINGS = {
    "quick": {"a": {"max_prompts": 1, "max_new_tokens": 32},
              "b": {"levels": [1, 4], "max_new_tokens": 16, "max_requests": 8},
              "c": {"unseen": 6, "known": 4, "max_new_tokens": 16, "window": 2},
              "d": {"max_prompts": 1, "max_new_tokens": 32}},
    "full": {"a": {"max_prompts": 3, "max_new_tokens": 128},
             "b": {"levels": [1, 4, 16, 64], "max_new_tokens": 48, "max_requests": 64},
             # OnlineSpec's setting in full: 200 unseen requests, then 50 known ones (about an hour on 2 CPU cores
             # with plain and four algorithms interleaved); `--online-json` takes a finished bench-online run instead.
             "c": {"unseen": 200, "known": 50, "max_new_tokens": 32, "window": 20},
             "d": {"max_prompts": 3, "max_new_tokens": 128}},
}
BENCH_D_METHODS = ("plain", "prompt_lookup", "drafter_only", "adaflash")

TITLES = {
    "a": "(a) AdaFlash claim (i): on-policy distillation evens out acceptance across domains",
    "b": "(b) AdaFlash claim (ii): the adaptive length head under concurrency",
    "c": "(c) OnlineSpec: online drafter updates on traffic the drafter never saw",
    "d": "(d) Plain vs speculative decoding at batch size 1",
}
CLAIMS = {
    "a": f"The OPD drafter (reverse-KL on-policy distillation) has a cross-domain std of tau at least "
         f"{STD_REDUCTION:.0%} lower than the offline-only drafter, at a mean tau at least as high.",
    "b": "With the length head choosing how many drafted tokens to verify, fewer tokens are verified per committed "
         "token and throughput is higher than verifying the fixed block, at every concurrency level.",
    "c": f"On traffic the drafter was never trained on, learning from verification while serving (background "
         f"updates) pays: the best online algorithm's tau over the last {UNSEEN_TAIL} unseen requests is at least "
         f"{UNSEEN_TAU_GAIN:.2f}x the static drafter's and its tokens/s at least {UNSEEN_SPEED_GAIN:.2f}x; on the "
         f"known domains afterwards its tau stays within {FORGET_TOLERANCE:.0%} of static's; no algorithm falls "
         f"below {SPEED_FLOOR:.2f}x static tokens/s over the whole stream.",
    "d": "Speculative decoding with the shipped drafter (our default hybrid generate path, `adaflash`) is faster "
         "than plain greedy decoding at batch size 1, with outputs identical to plain greedy (fp32).",
}


# ----------------------------------------------------------------------------------------------------- verdicts
def verdict_a(data: dict) -> tuple[str, str]:
    """Claim (i) from `run_compare` output with drafters labelled "offline" and "opd"."""
    off, opd = data["drafters"]["offline"], data["drafters"]["opd"]
    reduction = 1.0 - opd["tau_std"] / off["tau_std"] if off["tau_std"] > 0 else (0.0 if opd["tau_std"] > 0 else 1.0)
    std_ok = reduction >= STD_REDUCTION - 1e-12
    mean_ok = opd["tau_mean"] >= off["tau_mean"] - 1e-12
    why = (f"std of tau {off['tau_std']:.3f} (offline) -> {opd['tau_std']:.3f} (OPD), {reduction:+.0%} reduction "
           f"(needs >= {STD_REDUCTION:.0%}: {'yes' if std_ok else 'no'}); mean tau {off['tau_mean']:.2f} -> "
           f"{opd['tau_mean']:.2f} (needs OPD >= offline: {'yes' if mean_ok else 'no'})")
    return ("held" if std_ok and mean_ok else "did not hold"), why


def verdict_b(data: dict) -> tuple[str, str]:
    """Claim (ii) from `bench/serving.run_serving` output with "fixed_block" and "adaptive" methods."""
    if "adaptive" not in data.get("methods", []):
        return "not tested", "no adaptive (length head) measurements"
    fewer, faster, parts = [], [], []
    for level, methods in data["detail"].items():
        fix, ada = methods["fixed_block"], methods["adaptive"]
        fewer.append(ada["verified_per_committed"] < fix["verified_per_committed"])
        faster.append(ada["tokens_per_s"] > fix["tokens_per_s"])
        peer = data.get("peer", {}).get(level)
        vs = f", {ada.get('vs_peer', 0):.2f}x the faster plain peer ({peer})" if peer else ""
        parts.append(f"c={level}: {fix['tokens_per_s']:.1f} -> {ada['tokens_per_s']:.1f} tok/s, "
                     f"verified/committed {fix['verified_per_committed']:.2f} -> {ada['verified_per_committed']:.2f}"
                     f"{vs}")
    why = (f"fixed -> adaptive: {'; '.join(parts)}. Fewer verified tokens at {sum(fewer)}/{len(fewer)} levels, "
           f"higher throughput at {sum(faster)}/{len(faster)}")
    return ("held" if all(fewer) and all(faster) else "did not hold"), why


def _known_after_tau(e: dict) -> float:
    """tau of one algorithm on the known domains after the unseen block (section (c)), pooled over the rounds of
    every request after it (from the block means where an older JSON has no per-request rows)."""
    after = e.get("per_request", [])[e["segments"][0]["span"][1]:]
    if after:
        return pooled_tau(after)
    rounds = [(s["tau"] - 1, s["requests"]) for s in e["segments"][1:]]
    return sum(t * n for t, n in rounds) / max(sum(n for _, n in rounds), 1) + 1


def verdict_c(data: dict) -> tuple[str, str]:
    """OnlineSpec claim (`CLAIMS["c"]`) from `run_online_bench` output on an unseen-then-known stream: the first
    block of one domain is the unseen traffic, the blocks after it the known domains."""
    algos = data["algorithms"]
    if "static" not in algos:
        return "not tested", "no static baseline"
    online = {k: v for k, v in algos.items() if k != "static"}
    if not online:
        return "not tested", "no online algorithm measured"
    static = algos["static"]
    if "segments" not in static or len(static["segments"]) < 2:
        return "not tested", "the stream has no unseen block followed by known ones"
    unseen = lambda e: e["segments"][0]["last"]  # noqa: E731
    known_tau = _known_after_tau
    best = max(online, key=lambda k: unseen(online[k])["tau"])
    u, us = unseen(online[best]), unseen(static)
    tau_gain, speed_gain = u["tau"] / max(us["tau"], 1e-9), u["tokens_per_s"] / max(us["tokens_per_s"], 1e-9)
    forgot = known_tau(online[best]) / max(known_tau(static), 1e-9)
    floor = {k: v["tokens_per_s"] / max(static["tokens_per_s"], 1e-9) for k, v in online.items()}
    seg = static["segments"][0]
    why = (f"best on the last {us['tail']} {seg['domain']} requests: {best}, tau {u['tau']:.3f} vs static "
           f"{us['tau']:.3f} ({tau_gain:.2f}x, target {UNSEEN_TAU_GAIN:.2f}x), {u['tokens_per_s']:.1f} vs "
           f"{us['tokens_per_s']:.1f} tok/s ({speed_gain:.2f}x, target {UNSEEN_SPEED_GAIN:.2f}x); known domains "
           f"afterwards: tau {forgot:.3f}x static (within {FORGET_TOLERANCE:.0%}?); whole stream tok/s vs static: "
           + ", ".join(f"{k} {v:.2f}x" for k, v in floor.items()) + f" (floor {SPEED_FLOOR:.2f}x)")
    held = (tau_gain >= UNSEEN_TAU_GAIN and speed_gain >= UNSEEN_SPEED_GAIN and abs(forgot - 1) <= FORGET_TOLERANCE
            and min(floor.values()) >= SPEED_FLOOR)
    return ("held" if held else "did not hold"), why


def verdict_d(data: dict) -> tuple[str, str]:
    """Speed-up claim from `summarize` output (needs "plain" and "adaflash")."""
    ours = data["methods"]["adaflash"]["overall"]
    lossless = ours["identical"] == ours["total"]
    faster = ours["speedup"] > 1.0
    extra = ""
    if "drafter_only" in data["methods"]:
        d = data["methods"]["drafter_only"]["overall"]
        extra = f"; drafter alone {d['speedup']:.2f}x (tau {d['tau']:.2f})"
    why = (f"adaflash {ours['speedup']:.2f}x over plain greedy (tau {ours['tau']:.2f}), identical "
           f"{ours['identical']}/{ours['total']}{extra}")
    return ("held" if faster and lossless else "did not hold"), why


VERDICTS = {"a": verdict_a, "b": verdict_b, "c": verdict_c, "d": verdict_d}


# ------------------------------------------------------------------------------------------------------ tables
def _table(headers, rows) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def table_a(data: dict) -> list[str]:
    drafters = data["drafters"]
    domains = list(next(iter(drafters.values()))["tau_by_domain"])
    rows = [[label] + [f"{row['tau_by_domain'][d]:.2f}" for d in domains]
            + [f"{row['tau_mean']:.2f}", f"{row['tau_std']:.3f}", _fmt(row.get("replayed_overall_tau")),
               f"{row['identical']}/{row['total']}"]
            for label, row in drafters.items()]
    return _table(["drafter", *[f"tau {d}" for d in domains], "mean tau", "std of tau", "replayed tau (pooled)",
                   "identical"], rows)


def table_b(data: dict) -> list[str]:
    methods = data["methods"]
    ours = [m for m in methods if "verified_per_committed" in next(iter(data["detail"].values()))[m]]
    headers = (["concurrency", "faster plain peer"] + [f"{m} tok/s" for m in methods] + [f"{m} tau" for m in ours]
               + [f"{m} verified/committed" for m in ours] + ["identical"])
    rows = []
    for level, det in data["detail"].items():
        same = sum(det[m]["identical"] for m in methods)
        rows.append([level, data.get("peer", {}).get(level, "-")] + [f"{det[m]['tokens_per_s']:.1f}" for m in methods]
                    + [_fmt(det[m].get("tau")) for m in ours] + [_fmt(det[m].get("verified_per_committed")) for m in ours]
                    + [f"{same}/{sum(det[m]['total'] for m in methods)}"])
    return _table(headers, rows)


def table_c(data: dict) -> list[str]:
    def seg(a, i, key, part=None):  # block i of one domain (part="last": its last requests), with the ratio
        segments = a.get("segments") or []
        if len(segments) <= i:
            return "-"
        entry = segments[i][part] if part else segments[i]
        ratio = entry.get("tau_vs_static" if key == "tau" else "speed_vs_static", 1.0)
        return f"{entry[key]:{'.3f' if key == 'tau' else '.1f'}} ({ratio:.2f}x)"

    static = data["algorithms"].get("static")

    def known(a):  # pooled over every request after the unseen block, as the verdict reads it
        if len(a.get("segments") or []) < 2:
            return "-"
        ratio = _known_after_tau(a) / _known_after_tau(static) if static else 1.0
        return f"{_known_after_tau(a):.3f} ({ratio:.2f}x)"

    rows = [[name, f"{a['tau']:.3f}", _fmt(a.get("tokens_per_s"), ".1f"), seg(a, 0, "tau", "last"),
             seg(a, 0, "tokens_per_s", "last"), known(a), _fmt(a.get("regret"), ".3f"),
             _fmt(a.get("learning_ms_per_request", {}).get("total"), ".1f"),
             _fmt(a.get("learning_ms_per_request", {}).get("critical_path"), ".1f"),
             f"{a.get('identical', '-')}/{a.get('total', '-')}"]
            for name, a in data["algorithms"].items()]
    return _table(["algorithm", "tau", "tok/s", "unseen: tau, last requests (vs static)",
                   "unseen: tok/s, last requests (vs static)", "known after: tau, pooled (vs static)", "regret",
                   "learning ms/request", "of which on the serving path", "identical"], rows)


def table_d(data: dict) -> list[str]:
    domains = list(data["domains"])
    rows = []
    for method, m in data["methods"].items():
        o = m["overall"]
        rows.append([method, f"{o['tokens_per_s']:.1f}", f"{o['speedup']:.2f}x", f"{o['tau']:.2f}"]
                    + [f"{m['domains'][d]['speedup']:.2f}x / {m['domains'][d]['tau']:.2f}" for d in domains]
                    + [f"{o['identical']}/{o['total']}", _fmt(o.get("verified_per_committed"))])
    return _table(["method", "tok/s", "speed-up", "tau", *[f"{d} speed-up / tau" for d in domains], "identical",
                   "verified / committed"], rows)


TABLES = {"a": table_a, "b": table_b, "c": table_c, "d": table_d}


# ------------------------------------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_a(data: dict, path: Path) -> None:
    plt = _pyplot()
    drafters = data["drafters"]
    domains = list(next(iter(drafters.values()))["tau_by_domain"])
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(drafters)
    for i, (label, row) in enumerate(drafters.items()):
        ax.bar([g + i * width for g in range(len(domains))], [row["tau_by_domain"][d] for d in domains], width,
               label=f"{label} (std {row['tau_std']:.3f})")
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(domains))], domains)
    ax.set_ylabel("tau (tokens / verification)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_b(data: dict, path: Path) -> None:
    from .serving import plot_serving

    plot_serving(data, path)


def plot_c(data: dict, path: Path) -> None:
    from .online import plot_online

    plot_online(data, path)


def plot_d(data: dict, path: Path) -> None:
    from .runner import plot_bench

    plot_bench(data, path)
    _pyplot().close("all")


PLOTS = {"a": (plot_a, "results_a_opd.png"), "b": (plot_b, "results_b_concurrency.png"),
         "c": (plot_c, "results_c_online.png"), "d": (plot_d, "results_d_speedup.png")}


# ------------------------------------------------------------------------------------------------------ writer
def _setup_line(key: str, section: dict) -> str:
    cfg = section.get("config") or {}
    return "Setup: " + ", ".join(f"{k} = {v}" for k, v in cfg.items()) + "." if cfg else ""


def render_section(key: str, section: dict, output_dir: Path) -> tuple[list[str], str, str]:
    """Markdown lines of one section, its verdict and the verdict's explanation; writes its PNG if measured."""
    status = section.get("status")
    lines = [f"## {TITLES[key]}", "", f"Claim tested: {CLAIMS[key]}", ""]
    if status != "ok":
        verdict = {"not_available": "not available", "error": "failed", "skipped": "not run"}.get(status, status)
        why = section.get("reason", "")
        lines += [f"**Verdict: {verdict}** ({why})", ""]
        return lines, verdict, why
    data = section["data"]
    verdict, why = VERDICTS[key](data)
    setup = _setup_line(key, section)
    lines += ([setup, ""] if setup else []) + TABLES[key](data) + ["", f"**Verdict: {verdict}.** {why}.", ""]
    lines += projected_lines(data)
    if section.get("note"):
        lines += [section["note"], ""]
    plot, name = PLOTS[key]
    try:
        plot(data, output_dir / name)
        lines += [f"![{TITLES[key]}]({name})", ""]
    except Exception as err:  # a plot must not lose the numbers
        lines += [f"(plot failed: {type(err).__name__}: {err})", ""]
    lines += [f"Section wall time: {section.get('seconds', 0.0):.0f} s.", ""]
    return lines, verdict, why


def _earlier_report(path: Path) -> tuple[dict[str, list[str]], dict[str, str], str]:
    """An earlier `results.md`: each section's markdown lines, its summary row, and where it came from."""
    lines = path.read_text().splitlines()
    blocks, rows, key = {}, {}, None
    for line in lines:
        if line.startswith("## "):
            key = next((k for k in SECTIONS if line.startswith(f"## ({k})")), None)
            if key:
                blocks[key] = []
        elif line.startswith("| (") and line[3:4] in SECTIONS and line[4:6] == ") ":
            rows[line[3]] = line
        if key:
            blocks[key].append(line)
    text = "\n".join(lines)
    kept = re.search(r"^\| sections kept from an earlier run \| [^:]*: (.*) \|$", text, re.M)
    if kept:  # sections it kept itself keep their own origin (a report regenerated twice does not lose it)
        return blocks, rows, kept.group(1)
    cells = dict(re.findall(r"^\| (date \(UTC\)|git commit) \| (.*) \|$", text, re.M))
    return blocks, rows, f"{cells.get('date (UTC)', '?')}, commit {cells.get('git commit', '?')}"


def write_report(sections: dict, header: dict, output_dir, keep_other_sections: bool = False) -> Path:
    """Write `results.md` (and one PNG per measured section) into `output_dir`; returns the markdown path. With
    `keep_other_sections`, sections not run now keep their text (and PNGs) from the `results.md` already there."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "results.md"
    earlier = _earlier_report(path) if keep_other_sections and path.is_file() else ({}, {}, "")
    body, summary, kept = [], [], []
    for key in SECTIONS:
        section = sections.get(key)
        if section is None and key in earlier[0]:
            body += [*earlier[0][key], ""] if earlier[0][key][-1] else earlier[0][key]
            summary.append(earlier[1].get(key, f"| {TITLES[key].split(' ', 1)[0]} | {CLAIMS[key]} | - | - |"))
            kept.append(f"({key})")
            continue
        section = section or {"status": "skipped", "reason": "not selected with --sections"}
        lines, verdict, why = render_section(key, section, output_dir)
        body += lines
        summary.append(f"| {TITLES[key].split(' ', 1)[0]} | {CLAIMS[key]} | **{verdict}** | "
                       f"{section.get('seconds', 0.0):.0f} s |")
    mode = "quick" if header.get("quick") else "full"
    head = [
        "# Results on the testbed",
        "",
        f"Generated by `{header.get('command', 'adaflash-hf report')}` ({mode} mode); regenerate with `make report` "
        "(full) or `make report QUICK=1`. Do not edit by hand: every number and verdict below is computed.",
        "",
        *_table(["item", "value"], [[k, v] for k, v in [
            ("command", f"`{header.get('command', '')}`"), ("date (UTC)", header.get("date", "")),
            ("machine", header.get("machine", "")), ("torch", header.get("torch", "")),
            ("transformers", header.get("transformers", "")), ("seed", header.get("seed", "")),
            ("git commit", header.get("commit", "")),
            ("total wall time", f"{header.get('seconds', 0.0):.0f} s")]
            + ([("sections kept from an earlier run", f"{', '.join(kept)}: {earlier[2]}")] if kept else [])]),
        "",
    ]
    if header.get("quick"):
        head += ["**Quick mode**: one prompt per domain and short generations; the verdicts rest on very few "
                 "samples and are indicative only. Run `make report` for the full numbers.", ""]
    head += ["## Summary", "", *_table(["section", "claim", "verdict", "wall time"], [])[:2], *summary, ""]
    path.write_text("\n".join(head + body).rstrip() + "\n")
    return path


# ----------------------------------------------------------------------------------------------------- running
def _not_available(reason: str) -> dict:
    return {"status": "not_available", "reason": reason}


class _Models:
    """Testbed target + tokenizer + shipped drafter, loaded once and shared by sections (b)-(d)."""

    def __init__(self, device="auto"):
        self._models = None
        self.device = device

    def get(self):
        if self._models is None:
            import torch

            from .models import load_models

            self._models = load_models(None, None, torch.float32, self.device)
        return self._models


def _records(max_prompts):
    from .models import bench_records

    return bench_records(None, max_prompts)


def section_a(args, cfg, models) -> dict:
    from ..checkpoints import checkpoint_dir, opd_parent_dir
    from .compare import run_compare

    # OPD is judged against the offline drafter it was fine-tuned from (not whatever the default drafter is now)
    offline = Path(args.offline_drafter) if getattr(args, "offline_drafter", None) else opd_parent_dir()
    opd = Path(args.opd_drafter) if args.opd_drafter else checkpoint_dir(OPD_DRAFTER)
    if offline is None:
        return _not_available("no offline drafter that the OPD drafter started from (checkpoints/ of the source "
                              "repository; not in the wheel): pass --offline-drafter PATH")
    if not (opd / "config.json").is_file():
        return _not_available(f"no OPD drafter at {opd} (no config.json): train one with examples/train_opd.py "
                              "and commit it there, or pass --opd-drafter PATH")
    drafters, labels = [str(offline), str(opd)], ["offline", "opd"]
    if args.control_drafter:  # offline-only training for the same extra compute: is OPD's gain just more training?
        drafters, labels = drafters + [args.control_drafter], labels + ["offline_control"]
    data = run_compare(drafters, labels, _records(cfg["max_prompts"]), cfg["max_new_tokens"], "float32",
                       args.device, args.repeats, progress=False)
    return {"status": "ok", "data": data,
            "config": {"offline drafter": offline.name, "OPD drafter": str(opd), "prompts per domain": cfg["max_prompts"],
                       "max new tokens": cfg["max_new_tokens"], "dtype": "float32",
                       "decoding": "greedy, drafter alone (no lookup, no fallback)"}}


def section_b(args, cfg, models) -> dict:
    from ..checkpoints import HERE

    head_dir = Path(args.length_head) if args.length_head else HERE / LENGTH_HEAD
    if not (head_dir / "config.json").is_file() or not (head_dir / "cost_model.json").is_file():
        return _not_available(f"no length head at {head_dir} (needs config.json and cost_model.json): train one "
                              "with examples/train_length_head.py and commit it there, or pass --length-head PATH")
    from .models import attach_length_head
    from .serving import run_serving

    target, tokenizer, drafter = models.get()
    attach_length_head(drafter, head_dir)
    data = run_serving(target, tokenizer, drafter, _records(None), levels=cfg["levels"],
                       max_new_tokens=cfg["max_new_tokens"], max_requests=cfg["max_requests"], repeats=args.repeats,
                       seed=args.seed, progress=False, cost_model_path=getattr(args, "cost_model", None))
    return {"status": "ok", "data": data,
            "config": {"levels": ",".join(map(str, cfg["levels"])), "max new tokens": cfg["max_new_tokens"],
                       "requests": f"4 x concurrency, at most {cfg['max_requests']}, all queued at t=0",
                       "prompts": "held-out prompts in order", "dtype": "float32", "device": str(target.device),
                       "length head": str(head_dir), "repeats": args.repeats, **_cost_model_setup(args)}}


def section_c(args, cfg, models) -> dict:
    from ..testbed.unseen import unseen_stream
    from .online import run_online_bench

    if getattr(args, "online_json", None):  # a finished `adaflash-hf bench-online` run of the same setting
        data = json.loads(Path(args.online_json).read_text())
        source = f"`{args.online_json}` (adaflash-hf bench-online)"
    else:
        target, tokenizer, drafter = models.get()
        records = unseen_stream(cfg.pop("unseen"), cfg.pop("known"), seed=args.seed)
        data = run_online_bench(target, tokenizer, drafter, algorithms=ONLINE_ALGORITHMS, records=records,
                                seed=args.seed, progress=False, update_mode="background", **cfg)
        source = "this run"
    stream = data.get("stream", {})
    return {"status": "ok", "data": data,
            "config": {"stream domains": " -> ".join(stream.get("domains", [])) or "-",
                       "requests": stream.get("requests", "-"), "max new tokens": stream.get("max_new_tokens", "-"),
                       "update mode": stream.get("update_mode", "-"), "path": stream.get("path", "-"),
                       "served": stream.get("served", "one algorithm after the other"), "measured in": source}}


def section_d(args, cfg, models) -> dict:
    from .runner import run_benchmark, summarize

    from ..checkpoints import HERE
    from .runner import LENGTH_METHODS

    target, tokenizer, drafter = models.get()
    records = _records(cfg["max_prompts"])
    methods = BENCH_D_METHODS
    head_dir = Path(args.length_head) if args.length_head else HERE / LENGTH_HEAD
    if (head_dir / "config.json").is_file() and (head_dir / "cost_model.json").is_file():
        # Length baselines at bs=1 (fixed block = drafter_only, transformers' confidence threshold and heuristic
        # schedule, our head); with a head attached, `adaflash` is the full default: hybrid proposals + head.
        from ..interop import load_length_head_folder

        head, cost = load_length_head_folder(head_dir)
        from ..generation.runtime import SpeculationRuntime

        SpeculationRuntime(length_head=head.to(drafter.dtype).eval(), cost_model=cost).attach(drafter)
        methods = (*BENCH_D_METHODS, *LENGTH_METHODS)
    from .models import apply_cost_model

    projected_on = apply_cost_model(drafter, getattr(args, "cost_model", None))  # decides; projected separately
    measured = run_benchmark(target, tokenizer, drafter, records, methods=methods,
                             max_new_tokens=cfg["max_new_tokens"], progress=False, repeats=args.repeats,
                             count_ops=projected_on is not None)
    data = summarize(measured, block_size=drafter.config.block_size)
    if projected_on is not None:
        from .projection import project_bench

        data["projected"] = project_bench(measured, projected_on, args.cost_model)
    data["config"] = {"dtype": "float32", "device": str(target.device), "max_new_tokens": cfg["max_new_tokens"],
                      "repeats": args.repeats}
    return {"status": "ok", "data": data,
            "config": {"prompts per domain": cfg["max_prompts"], "held-out prompts": len(records),
                       "max new tokens": cfg["max_new_tokens"], "dtype": "float32", "decoding": "greedy",
                       "methods": ", ".join(methods) + " (interleaved prompt by prompt)", **_cost_model_setup(args)}}


def _cost_model_setup(args) -> dict:
    path = getattr(args, "cost_model", None)
    return {"cost model": f"{Path(path).name} (decides the rounds; its projection is reported apart)"} if path else {}


def projected_lines(data: dict) -> list[str]:
    """The PROJECTED table of a section run with --cost-model: apart from the measured table, never in a verdict."""
    block = data.get("projected")
    if not block:
        return []
    lines = [f"Projected on {block['device']} ({block['dtype']}): **not measured**; {block['note']}."]
    if block.get("assumptions"):
        lines[-1] += f" Assumes: {block['assumptions']}"
    lines.append("")
    if "methods" in block:  # bs=1
        rows = [[m, _fmt(d["overall"]["tokens_per_s"], ".1f"),
                 "-" if d["overall"]["speedup"] is None else f"{d['overall']['speedup']:.2f}x"]
                for m, d in block["methods"].items()]
        lines += _table(["method", "projected tok/s", "projected speed-up"], rows)
    else:  # concurrency levels
        methods = sorted({m for rates in block["concurrency"].values() for m in rates})
        rows = [[level, *[_fmt(rates.get(m), ".1f") for m in methods]] for level, rates in block["concurrency"].items()]
        lines += _table(["concurrency", *[f"{m} projected tok/s" for m in methods]], rows)
    return lines + [""]


RUNNERS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d}


def _git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "-"
    except Exception:
        return "-"


def command_line(args) -> str:
    parts = ["adaflash-hf report"] + (["--quick"] if args.quick else []) + ["--output-dir", str(args.output_dir)]
    if tuple(args.sections) != SECTIONS:
        parts += ["--sections", ",".join(args.sections)]
    if args.seed:
        parts += ["--seed", str(args.seed)]
    for flag in ("opd_drafter", "offline_drafter", "control_drafter", "length_head", "cost_model", "online_json"):
        if getattr(args, flag, None):
            parts += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if getattr(args, "device", "auto") != "auto":
        parts += ["--device", args.device]
    if getattr(args, "keep_other_sections", False):
        parts.append("--keep-other-sections")
    if getattr(args, "repeats", DEFAULT_REPEATS) != DEFAULT_REPEATS:
        parts += ["--repeats", str(args.repeats)]
    return " ".join(parts)


def run_report(args) -> tuple[dict, dict]:
    """Run the selected sections with fixed seeds; returns (sections, header) for `write_report`."""
    import torch
    import transformers

    settings = SETTINGS["quick" if args.quick else "full"]
    models = _Models(args.device)
    sections = {}
    start = time.perf_counter()
    for key in args.sections:
        print(f"[report] section {key}: {TITLES[key]} ...", file=sys.stderr, flush=True)
        transformers.set_seed(args.seed)
        tic = time.perf_counter()
        try:
            section = RUNNERS[key](args, dict(settings[key]), models)
        except Exception as err:
            traceback.print_exc()
            section = {"status": "error", "reason": f"{type(err).__name__}: {err}"}
        section["seconds"] = time.perf_counter() - tic
        sections[key] = section
        print(f"[report] section {key}: {section['status']} in {section['seconds']:.0f} s", file=sys.stderr, flush=True)
    header = {
        "command": command_line(args), "quick": args.quick, "seed": args.seed, "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, "
                   f"torch threads {torch.get_num_threads()}, Python {platform.python_version()}",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "seconds": time.perf_counter() - start,
    }
    return sections, header


# --------------------------------------------------------------------------------------------------------- CLI
def _sections_arg(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip().lower() for k in text.split(",") if k.strip())
    bad = [k for k in keys if k not in SECTIONS]
    if bad or not keys:
        raise argparse.ArgumentTypeError(f"sections must be a comma-separated subset of {','.join(SECTIONS)}")
    return tuple(k for k in SECTIONS if k in keys)


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="one prompt per domain, short generations, concurrency 1 and 4 (within 15 min on 2 cores)")
    p.add_argument("--output-dir", type=Path, default=Path("docs"), help="where results.md and the PNGs go")
    p.add_argument("--sections", type=_sections_arg, default=SECTIONS, help="subset of a,b,c,d (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--opd-drafter", type=existing_dir("--opd-drafter"), default=None,
                   help=f"OPD drafter (default: checkpoints/{OPD_DRAFTER} of the source repository)")
    p.add_argument("--offline-drafter", type=existing_dir("--offline-drafter"), default=None,
                   help="the offline drafter the OPD drafter was fine-tuned from (default: the shipped OPD drafter's "
                        "parent)")
    p.add_argument("--control-drafter", type=existing_dir("--control-drafter"), default=None,
                   help="offline drafter trained for the same extra compute as OPD; added to section (a)")
    p.add_argument("--length-head", type=existing_dir("--length-head"), default=None,
                   help=f"length head with cost_model.json (default: adaflash_hf/checkpoints/{LENGTH_HEAD})")
    p.add_argument("--json", type=Path, default=None, help="also write the raw section results here")
    p.add_argument("--keep-other-sections", action="store_true",
                   help="sections not selected keep their text from the results.md already in --output-dir")
    p.add_argument("--online-json", type=Path, default=None,
                   help="section (c) from a finished `adaflash-hf bench-online --prompts <unseen stream>` JSON instead "
                        "of rerunning it (the full stream takes about an hour on 2 CPU cores)")
    p.add_argument("--cost-model", type=cost_model_file, default=None,
                   help="a cost model of another device (file or shipped name, e.g. h200-smollm2-135m): sections (b) "
                        "and (d) decide with its costs and add a PROJECTED table (not measured, not in the verdicts)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the models run (auto: the accelerator when there is one, else the CPU)")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=DEFAULT_REPEATS,
                   help="timings per prompt and method in sections (a) and (d), interleaved; medians are reported")


def main_report(args) -> int:
    sections, header = run_report(args)
    path = write_report(sections, header, args.output_dir, keep_other_sections=args.keep_other_sections)
    print(f"wrote {path} in {header['seconds']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": header, "sections": sections}, indent=2, default=str))
        print(f"wrote {args.json}")
    return 1 if any(s["status"] == "error" for s in sections.values()) else 0
