# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Side-by-side measurement of decoding methods on the same prompts (batch size 1).

Every method runs on every prompt, interleaved prompt by prompt (so machine noise hits all methods alike), with
the same `max_new_tokens`, greedy unless stated. Per prompt we record generated tokens, wall time, whether the
output equals plain greedy token for token, the number of full target forwards, and for our generator the
per-round statistics and the time split (drafting / verification forward / rest).

tau (tokens committed per verification forward, bonus token included) is measured the same way for every
method: `tau = (new_tokens - 1) / (full_target_forwards - 1)`; the prefill forward and the token it commits are
excluded. A "full target forward" is a call that reaches the target's last decoder layer (early-exit drafting
does not). Plain greedy therefore has tau = 1.
"""

import contextlib
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..generation.cost_model import synchronize
from ..generation.stats import SpeculationStats
from ..testbed.prompts import encode_prompt
from .projection import ForwardLog, ForwardProbe


METHODS = ("plain", "prompt_lookup", "early_exit", "dflash_native", "drafter_only", "adaflash")
# "drafter_only": our generator drafting every round (no lookup, no fallback) with the fixed full block;
# "adaflash": the default hybrid (with the length head when one is attached). Length baselines, drafting every
# round: "drafter_confidence" / "drafter_heuristic" (transformers' assistant confidence threshold and heuristic
# schedule applied to the block) and "drafter_head" (our length head + cost model; needs `--length-head`).
LENGTH_METHODS = ("drafter_confidence", "drafter_heuristic", "drafter_head")
OURS = ("adaflash", "drafter_only", *LENGTH_METHODS)
ALL_METHODS = (*METHODS, *LENGTH_METHODS)
DRAFTER_ONLY = {"hybrid_lookup": False, "allow_no_draft": False}  # every round drafts


@dataclass
class Measurement:
    method: str
    domain: str
    new_tokens: int
    seconds: float
    identical: bool
    target_forwards: int
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    seconds_repeats: list[float] = field(default_factory=list)  # one wall time per repeat (`seconds`: their median)
    forwards: ForwardLog | None = None  # the first repeat's forwards (rows x tokens) and wall time, for projections


def method_kwargs(method: str, drafter, target, lookup_tokens: int = 10, early_exit_layer: int | None = None) -> dict:
    """`generate` keyword arguments of each method."""
    if method == "plain":
        return {}
    if method == "prompt_lookup":
        return {"prompt_lookup_num_tokens": lookup_tokens}
    if method == "early_exit":
        layers = target.config.get_text_config().num_hidden_layers
        return {"assistant_early_exit": early_exit_layer or max(1, layers // 4)}
    if method == "dflash_native":
        return {"assistant_model": drafter, "speculation_type": "dflash"}
    if method in OURS:
        return {"assistant_model": drafter}
    raise ValueError(f"unknown method {method!r}; choose from {ALL_METHODS}")


def method_setup(drafter, method: str):
    """`(generation_config, runtime)` the drafter decodes with for `method` (see `METHODS` / `LENGTH_METHODS`)."""
    from ..generation.batch import run_knobs
    from ..generation.runtime import SpeculationRuntime, runtime_of

    runtime = runtime_of(drafter)
    if method == "adaflash":
        return drafter.generation_config, runtime
    head = runtime.length_head
    if method == "drafter_head" and head is None:
        raise ValueError("method 'drafter_head' needs a length head: pass --length-head PATH")
    policy = {"drafter_only": "full", "drafter_confidence": "confidence", "drafter_heuristic": "heuristic",
              "drafter_head": "head"}[method]
    knobs = run_knobs(drafter, length_policy=policy, **DRAFTER_ONLY)
    return knobs, SpeculationRuntime(length_head=head if policy == "head" else None, cost_model=runtime.cost_model)


@contextlib.contextmanager
def _drafter_config(drafter, method: str):
    """Temporarily set the drafter up for `method` (its generation config and runtime; never its config.json)."""
    if method not in OURS:
        yield
        return
    from ..generation.runtime import decoding_setup

    knobs, runtime = method_setup(drafter, method)
    with decoding_setup(drafter, knobs, runtime):
        yield


@torch.inference_mode()
def run_benchmark(
    target,
    tokenizer,
    drafter,
    records: list[dict],
    methods=METHODS,
    max_new_tokens: int = 128,
    raw: bool = False,
    warmup: int = 1,
    progress: bool = True,
    references: list | None = None,
    repeats: int = 1,
    count_ops: bool = False,
) -> list[Measurement]:
    """Run `methods` on `records` (`{"prompt", "domain"}`) and return one `Measurement` per (prompt, method).

    Prompts and tensors live on the target's device. Plain greedy always runs first on each prompt (it is the
    reference for `identical` and speed-ups), unless `references` (one plain output per record, from an earlier run)
    is given; plain outputs are appended to a `references` list passed empty. With `repeats > 1` every prompt runs
    `repeats` times per method, methods interleaved within each repeat; each `Measurement` keeps every repeat's wall
    time (`seconds_repeats`) and its `seconds` is their median. `count_ops`: the forward logs also count the tensor
    ops outside the forwards (for a projection onto another device: `projection.ForwardProbe`).
    """
    reuse = bool(references)
    if "plain" not in methods and not reuse:
        methods = ("plain", *methods)
    # full target forwards and seconds; every forward's rows x tokens
    probe = ForwardProbe(target, drafter, count_ops=count_ops)
    results = []
    device = target.device

    def run(method, ids, new_tokens):
        ours = method in OURS
        with _drafter_config(drafter, method):
            synchronize(device)
            start = time.perf_counter()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                  do_sample=False, return_dict_in_generate=ours,
                                  **method_kwargs(method, drafter, target))
            synchronize(device)
            seconds = time.perf_counter() - start
        return (out.sequences, out.speculation_stats, seconds) if ours else (out, None, seconds)

    try:
        encoded = [torch.tensor([encode_prompt(tokenizer, r["prompt"], chat_template=not raw)], device=device)
                   for r in records]
        for ids in encoded[:warmup]:  # warm up kernels/allocator once per method
            for method in methods:
                run(method, ids, 8)
        for i, (record, ids) in enumerate(tqdm(list(zip(records, encoded)), desc="bench", disable=not progress,
                                                unit="prompt")):
            reference = references[i] if reuse else None
            measured: dict[str, Measurement] = {}
            for repeat in range(repeats):
                for method in methods:
                    probe.reset()
                    out, stats, seconds = run(method, ids, max_new_tokens)
                    if method in measured:  # a repeat: same output (deterministic), one more timing
                        measured[method].seconds_repeats.append(seconds)
                        continue
                    if method == "plain" and not reuse:
                        reference = out
                        if references is not None:
                            references.append(out)
                    m = Measurement(
                        method=method, domain=record.get("domain", "all"), new_tokens=out.shape[1] - ids.shape[1],
                        seconds=seconds, identical=bool(out.shape == reference.shape and torch.equal(out, reference)),
                        target_forwards=probe.count, verify_seconds=probe.seconds, seconds_repeats=[seconds],
                        forwards=probe.log.copy())
                    m.forwards.wall_seconds = seconds
                    if stats is not None:
                        m.draft_seconds, m.drafted, m.accepted = stats.draft_seconds, list(stats.drafted), list(
                            stats.accepted)
                    measured[method] = m
            for m in measured.values():
                m.seconds = statistics.median(m.seconds_repeats)
                results.append(m)
    finally:
        probe.close()
    return results


def summarize(results: list[Measurement], block_size: int | None = None) -> dict:
    """Aggregate measurements into the bench JSON (see `adaflash-hf bench --help` for the schema).

    With repeats, `tokens_per_s` and `speedup` are medians over repeats (each repeat's rate summed over prompts)
    and `tokens_per_s_range` / `speedup_range` their [min, max].
    """
    by_method = defaultdict(list)
    for m in results:
        by_method[m.method].append(m)
    domains = sorted({m.domain for m in results})

    def rates(ms: list[Measurement]) -> list[float]:
        n = min((len(m.seconds_repeats) for m in ms), default=0) or 1
        tokens = sum(m.new_tokens for m in ms)
        return [tokens / max(sum((m.seconds_repeats or [m.seconds])[r] for m in ms), 1e-9) for r in range(n)]

    def aggregate(ms: list[Measurement], plain: list[Measurement]) -> dict:
        tokens, seconds = sum(m.new_tokens for m in ms), sum(m.seconds for m in ms)
        ours, theirs = rates(ms), rates(plain) if plain else []
        ratios = [a / b for a, b in zip(ours, theirs) if b] if theirs else []
        verify_forwards = sum(max(m.target_forwards - 1, 0) for m in ms)
        out = {
            "tokens_per_s": statistics.median(ours),
            "tokens_per_s_range": [min(ours), max(ours)],
            "speedup": statistics.median(ratios) if ratios else 0.0,
            "speedup_range": [min(ratios), max(ratios)] if ratios else [0.0, 0.0],
            "repeats": len(ours),
            "tau": sum(max(m.new_tokens - 1, 0) for m in ms) / max(verify_forwards, 1),
            "identical": sum(m.identical for m in ms),
            "total": len(ms),
            "new_tokens": tokens,
            "seconds": seconds,
        }
        rounds = sum(len(m.accepted) for m in ms)
        if rounds:
            pooled = SpeculationStats(drafted=[d for m in ms for d in m.drafted],
                                      accepted=[a for m in ms for a in m.accepted])
            positions = block_size - 1 if block_size else max(pooled.drafted)
            out["acceptance_by_position"] = pooled.acceptance_by_position(positions)
            # Tokens the target verified (drafted + its own) per token committed: 1.0 is plain decoding's cost.
            out["verified_per_committed"] = (sum(pooled.drafted) + rounds) / max(sum(pooled.accepted) + rounds, 1)
            draft_s = sum(m.draft_seconds for m in ms)
            verify_s = sum(m.verify_seconds for m in ms)
            out["time_per_round_ms"] = {
                "drafting": 1e3 * draft_s / rounds,
                "verification_forward": 1e3 * verify_s / rounds,
                "other": 1e3 * max(seconds - draft_s - verify_s, 0.0) / rounds,
            }
        return out

    plain = by_method.get("plain", [])
    methods = {}
    for method, ms in by_method.items():
        methods[method] = {
            "overall": aggregate(ms, plain),
            "domains": {d: aggregate([m for m in ms if m.domain == d], [p for p in plain if p.domain == d])
                        for d in domains},
        }
    headline = methods.get("adaflash") or next(iter(methods.values()))
    keys = ("tau", "speedup", "identical", "total")
    taus = [headline["domains"][d]["tau"] for d in domains]
    return {
        "overall": {k: headline["overall"][k] for k in keys},
        "domains": {d: {k: headline["domains"][d][k] for k in keys} for d in domains},
        "tau_cross_domain_std": statistics.pstdev(taus) if len(taus) > 1 else 0.0,
        "methods": methods,
    }


def print_bench(summary: dict) -> None:
    methods = summary["methods"]
    domains = list(summary["domains"])
    print(f"\n{'method':<19}{'domain':<9}{'tok/s':>8}{'range':>15}{'speedup':>9}{'tau':>7}{'identical':>11}"
          f"{'verif/com':>10}")
    for method, data in methods.items():
        for name, row in [("overall", data["overall"])] + [(d, data["domains"][d]) for d in domains]:
            vpc = f"{row['verified_per_committed']:>8.2f}" if "verified_per_committed" in row else f"{'-':>8}"
            lo, hi = row.get("tokens_per_s_range", [row["tokens_per_s"]] * 2)
            print(f"{method:<19}{name:<9}{row['tokens_per_s']:>8.1f}{f'{lo:.1f}-{hi:.1f}':>15}"
                  f"{row['speedup']:>8.2f}x{row['tau']:>7.2f}{row['identical']:>6}/{row['total']:<4}{vpc}")
    ours = methods.get("adaflash", {}).get("overall", {})
    if "acceptance_by_position" in ours:
        rates = " ".join(f"{r:.2f}" for r in ours["acceptance_by_position"])
        print(f"\nadaflash acceptance by draft position: {rates}")
        t = ours["time_per_round_ms"]
        print(f"adaflash time per round: drafting {t['drafting']:.1f} ms, verification forward "
              f"{t['verification_forward']:.1f} ms, other {t['other']:.1f} ms")
    print(f"tau cross-domain std (adaflash): {summary['tau_cross_domain_std']:.3f}")
    if summary.get("projected"):
        from .projection import print_projected

        print_projected(summary["projected"], domains)


def plot_bench(summary: dict, path) -> None:
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
    ax.set_title(f"bs=1, {cfg.get('dtype', '')} on {cfg.get('device', '')}, {cfg.get('max_new_tokens', '')} new tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
