# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`adaflash-hf compare`: tau per domain of several drafters on the same prompts (mean and cross-domain std).

Each drafter decodes alone (every round drafts: no prompt lookup, no plain rounds), greedy, on the same prompts with
the same target; plain greedy runs once and is the reference of every drafter's `identical` count. Used to compare
offline-only and OPD drafters (report section (a)).

Beside the served tau, each drafter's replayed tau (`training/replay.py`: one teacher-forced pass over the plain
greedy output, walked as serving moves) is reported per domain: it is what training's `eval_replay_tau` measures,
and equals the served tau up to near-tied argmax flips, so the two columns check each other.
"""

from pathlib import Path

import torch

from .models import load_models
from .runner import DRAFTER_ONLY, run_benchmark, summarize


def run_compare(drafters: list[str], labels: list[str] | None, records: list[dict], max_new_tokens: int = 128,
                dtype: str = "float32", device="auto", repeats: int = 1, progress: bool = True) -> dict:
    """Returns `{"drafters": {label: {"tau_by_domain", "tau_mean", "tau_std", ...}}, "config": {...}}`."""
    from ..generation.batch import run_knobs
    from ..models import AdaFlashDrafterModel

    labels = labels or [Path(p).name for p in drafters]
    if len(labels) != len(drafters):
        raise SystemExit("--labels must name every drafter")
    torch_dtype = getattr(torch, dtype)
    target, tokenizer, first = load_models(None, drafters[0], torch_dtype, device)
    references: list = []
    results = {}
    for label, path in zip(labels, drafters):
        drafter = first if path == drafters[0] else AdaFlashDrafterModel.from_pretrained(
            path, dtype=torch_dtype).to(target.device).eval()
        drafter.check_compatible(target, tokenizer)
        drafter.generation_config = run_knobs(drafter, **DRAFTER_ONLY)  # the drafter alone, every round
        methods = ("adaflash",) if references else ("plain", "adaflash")
        measured = run_benchmark(target, tokenizer, drafter, records, methods=methods, max_new_tokens=max_new_tokens,
                                 progress=progress, references=references, repeats=repeats)
        summary = summarize([m for m in measured if m.method == "adaflash"], block_size=drafter.config.block_size)
        taus = {d: v["tau"] for d, v in summary["domains"].items()}
        replayed = replayed_taus(drafter, target, tokenizer, records, references, max_new_tokens)
        results[label] = {"path": str(path), "tau_by_domain": taus, "tau_mean": sum(taus.values()) / len(taus),
                          "tau_std": summary["tau_cross_domain_std"], "overall_tau": summary["overall"]["tau"],
                          "identical": summary["overall"]["identical"], "total": summary["overall"]["total"],
                          "replayed_tau_by_domain": {d: replayed[d] for d in taus},
                          "replayed_overall_tau": replayed["all"]}
    return {"drafters": results, "config": {"max_new_tokens": max_new_tokens, "dtype": dtype,
                                            "device": str(target.device), "n_prompts": len(records)}}


def replayed_taus(drafter, target, tokenizer, records: list[dict], outputs: list, max_new_tokens: int) -> dict:
    """`{domain: tau, "all": tau}` replayed on each record's greedy output (`outputs[i]`: `[1, T]`), pooled."""
    from ..testbed.prompts import encode_prompt
    from ..training.replay import pooled_tau, replay

    by_domain: dict[str, list] = {}
    for record, out in zip(records, outputs):
        prompt_len = len(encode_prompt(tokenizer, record["prompt"]))
        result = replay(drafter, target, out[0], prompt_len, max_new_tokens)
        by_domain.setdefault(record.get("domain", "all"), []).append(result)
    return {**{d: pooled_tau(rs) for d, rs in by_domain.items()}, "all": pooled_tau(
        [r for rs in by_domain.values() for r in rs])}


def print_compare(result: dict) -> None:
    drafters = result["drafters"]
    domains = list(next(iter(drafters.values()))["tau_by_domain"])
    print(f"\n{'drafter':<24}" + "".join(f"{d:>8}" for d in domains) + f"{'mean':>8}{'std':>8}{'identical':>11}")
    for label, row in drafters.items():
        print(f"{label:<24}" + "".join(f"{row['tau_by_domain'][d]:>8.2f}" for d in domains)
              + f"{row['tau_mean']:>8.2f}{row['tau_std']:>8.3f}{row['identical']:>6}/{row['total']}")
        if "replayed_tau_by_domain" in row:
            replayed = row["replayed_tau_by_domain"]
            print(f"{'  replayed':<24}" + "".join(f"{replayed[d]:>8.2f}" for d in domains)
                  + f"{sum(replayed.values()) / len(replayed):>8.2f}")


__all__ = ["print_compare", "run_compare"]
