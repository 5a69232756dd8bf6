# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Throughput at concurrency: many requests decoded together, side by side on the same prompts.

For each concurrency level `c` the first `c` prompts (cycled if there are fewer) run, in the same process, as:
  * `plain_batched`: transformers' batched greedy `target.generate` (left-padded);
  * `fixed_block`: our batched speculative engine drafting and verifying the whole block every round
    (`speculation="always"`: what speculation alone costs);
  * `fixed_block_auto`: the same with the engine's default plain-round fallback (`speculation="auto"`: per round,
    speculate or decode plainly, whichever has been committing more tokens per second);
  * `adaptive`: the default engine with the length head + cost model choosing the verify length each round and the
    plain-round fallback (only when a length head is attached to the drafter or given).
Reported per level and method: output tokens/s (new tokens of all rows / wall seconds), tau (tokens committed per
row-round) and tokens verified per committed token, and whether every row equals plain greedy of its prompt
alone (checked against bs=1 `generate`, the lossless reference).
"""

import time

import torch
from tqdm.auto import tqdm

from ..generation.batch import generate_batch, run_knobs
from ..generation.runtime import SpeculationRuntime, runtime_of
from ..testbed.prompts import encode_prompt


def _plain_batched(target, prompts, max_new_tokens, pad_id):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    out = target.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                          max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    eos = target.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    rows = []
    for row in out[:, width:].tolist():
        for j, tok in enumerate(row):
            if tok in eos:
                row = row[: j + 1]
                break
        rows.append(row)
    return rows


@torch.inference_mode()
def run_concurrency(target, tokenizer, drafter, records, levels=(1, 4, 16, 32), max_new_tokens: int = 64,
                    length_head=None, cost_model=None, raw: bool = False, progress: bool = True) -> dict:
    """Measure every method at every level; returns the JSON-ready dict described in the module docstring."""
    prompts_all = [encode_prompt(tokenizer, r["prompt"], chat_template=not raw) for r in records]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    head = length_head or runtime_of(drafter).length_head
    cost = cost_model or runtime_of(drafter).cost_model
    # fixed_block / fixed_block_auto / adaptive: the block drafter alone (lookup off), so the length choice is what
    # differs; hybrid: the engine's defaults (per-row prompt lookup + drafter, head if any, plain-round fallback).
    methods = ["plain_batched", "fixed_block", "fixed_block_auto"]
    methods += ["adaptive"] if head is not None else []
    methods += ["hybrid"]
    references: dict[int, list[int]] = {}

    def reference(i):  # bs=1 plain greedy: the lossless reference of prompt i
        if i not in references:
            ids = torch.tensor([prompts_all[i]], device=target.device)
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False)
            references[i] = out[0, ids.shape[1]:].tolist()
        return references[i]

    result = {"concurrency": {}, "detail": {}, "methods": methods, "max_new_tokens": max_new_tokens}
    for level in tqdm(levels, desc="concurrency", disable=not progress):
        idx = [i % len(prompts_all) for i in range(level)]
        prompts = [prompts_all[i] for i in idx]
        result["concurrency"][str(level)] = {}
        result["detail"][str(level)] = {}
        for method in methods:
            start = time.perf_counter()
            if method == "plain_batched":
                rows, stats = _plain_batched(target, prompts, max_new_tokens, pad_id), None
            else:
                adaptive = method == "adaptive" or (method == "hybrid" and head is not None)
                knobs = run_knobs(drafter, length_policy="head" if adaptive else "full",
                                  hybrid_lookup=method == "hybrid", allow_no_draft=method != "fixed_block")
                runtime = SpeculationRuntime(length_head=head if adaptive else None, cost_model=cost)
                rows, stats = generate_batch(target, drafter, prompts, max_new_tokens, return_stats=True,
                                             generation_config=knobs, runtime=runtime)
            seconds = time.perf_counter() - start
            new_tokens = sum(len(r) for r in rows)
            detail = {"tokens_per_s": new_tokens / seconds, "new_tokens": new_tokens, "seconds": seconds,
                      "identical": sum(r == reference(i) for r, i in zip(rows, idx)), "total": level}
            if stats is not None:
                detail["tau"] = stats.tau
                detail["verified_per_committed"] = stats.tokens_verified / max(stats.tokens_committed, 1)
                detail.update(rounds=stats.rounds, plain_rounds=stats.plain_rounds,
                              drafter_forwards=stats.drafter_forwards,
                              seconds_split={k: round(v, 3) for k, v in stats.seconds.items()})
            result["concurrency"][str(level)][method] = detail["tokens_per_s"]
            result["detail"][str(level)][method] = detail
    return result


def print_concurrency(result: dict) -> None:
    print(f"\n{'level':>6} {'method':<17}{'tok/s':>9}{'tau':>7}{'verif/commit':>14}{'plain rounds':>14}"
          f"{'identical':>11}")
    for level, methods in result["detail"].items():
        for method, d in methods.items():
            tau = f"{d['tau']:.2f}" if "tau" in d else "-"
            vpc = f"{d['verified_per_committed']:.2f}" if "verified_per_committed" in d else "-"
            plain = f"{d['plain_rounds']}/{d['rounds']}" if "rounds" in d else "-"
            print(f"{level:>6} {method:<17}{d['tokens_per_s']:>9.1f}{tau:>7}{vpc:>14}{plain:>14}"
                  f"{d['identical']:>6}/{d['total']}")


def plot_concurrency(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [int(x) for x in result["concurrency"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in result["methods"]:
        ax.plot(levels, [result["concurrency"][str(x)][method] for x in levels], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
