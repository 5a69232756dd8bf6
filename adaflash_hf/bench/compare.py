# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`adaflash-hf compare`: tau per domain of several drafters on the same prompts (mean and cross-domain std).

Each drafter decodes alone (every round drafts: no prompt lookup, no plain rounds), greedy, on the same prompts with
the same target; plain greedy runs once and is the reference of every drafter's `identical` count. Used to compare
offline-only and OPD drafters (report section (a)).
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
        results[label] = {"path": str(path), "tau_by_domain": taus, "tau_mean": sum(taus.values()) / len(taus),
                          "tau_std": summary["tau_cross_domain_std"], "overall_tau": summary["overall"]["tau"],
                          "identical": summary["overall"]["identical"], "total": summary["overall"]["total"]}
    return {"drafters": results, "config": {"max_new_tokens": max_new_tokens, "dtype": dtype,
                                            "device": str(target.device), "n_prompts": len(records)}}


def print_compare(result: dict) -> None:
    drafters = result["drafters"]
    domains = list(next(iter(drafters.values()))["tau_by_domain"])
    print(f"\n{'drafter':<24}" + "".join(f"{d:>8}" for d in domains) + f"{'mean':>8}{'std':>8}{'identical':>11}")
    for label, row in drafters.items():
        print(f"{label:<24}" + "".join(f"{row['tau_by_domain'][d]:>8.2f}" for d in domains)
              + f"{row['tau_mean']:>8.2f}{row['tau_std']:>8.3f}{row['identical']:>6}/{row['total']}")


__all__ = ["print_compare", "run_compare"]
