# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`adaflash-hf bench-serving`: a request-stream benchmark in the style of SGLang's `bench_serving` / vLLM's
`benchmark_serving`, side by side in one run.

At each concurrency level `c`, `N` requests (default `4 c`, capped by `--max-requests`) are built from the prompts
file in order (cycled), all queued at t=0 or arriving as a Poisson process (`--rate` requests/s), and served with at
most `c` running at once by every method:

* `transformers_cb`: transformers' continuous batching (`generate_batch`: paged cache, a scheduler that refills
  slots as requests finish; CUDA graphs on a GPU) - a plain peer;
* `plain_batched`: transformers' padded batched `generate`, static batches of `c` - a plain peer;
* `engine_plain`: our batched engine without a drafter (continuous: a finished row's slot is refilled at once);
* `fixed_block`: our engine drafting and verifying the whole block every round;
* `adaptive`: our engine with the length head + the device-calibrated cost model choosing the verify length, and
  plain rounds when speculation does not pay (only with a length head);
* `hybrid`: our engine's defaults (per-row prompt lookup + drafter + head if any + plain-round fallback);
* `hybrid_trees`: `hybrid` with up to 8 candidate blocks per row where the device verifies them for free
  (`draft_candidates=8`, `generation/candidates.py`), to show what the candidates buy.

Reported per level and method: output tokens/s (all new tokens / the run's wall time), time to first token (TTFT)
and inter-token latency (ITL: gaps between a request's successive token deliveries; the tokens of one speculative
round are delivered together) as p50/p99, TPOT (a request's decode time per token) p50, tau (tokens committed per
row per round) and verified tokens per committed token for our engine, and how many outputs equal plain bs=1 greedy
`generate` (the lossless reference; fp32). With `--repeats`, methods are interleaved within each repeat and tokens/s
is the median with its [min, max] spread. The JSON keeps `concurrency.{level}.{method}` = tokens/s and the detail
beside it (`detail.{level}.{method}`); `peer` names the faster plain peer at each level. Arrivals and token times
are this driver's (`ArrivalSchedule`, the engine's `Admission`); `--profile` adds our engine's per-phase
`ms_per_round` (it synchronizes the device at every phase, so leave it off when measuring tokens/s on an accelerator).

`--cost-model FILE` (another device's `TargetCostModel`, e.g. `h200-smollm2-135m`): our engine decides with that
device's costs, and a separate "projected" block gives the tokens/s the first repeat's forwards would reach there
(`bench/projection.py`; not measured; `transformers_cb` packs requests into one row and is not projected).
"""

import json
import math
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..generation.batch import generate_batch, run_knobs
from ..generation.attention import masked_gqa
from ..generation.cost_model import cost_model_for, synchronize
from ..generation.runtime import SpeculationRuntime, runtime_of
from ..testbed.prompts import encode_prompt
from .overhead import measure_round_overhead
from .projection import SPLIT, ForwardProbe, cost_model_info, projected_split


PEERS = ("transformers_cb", "plain_batched")
OURS = ("engine_plain", "fixed_block", "adaptive", "hybrid", "hybrid_trees")
METHODS = (*PEERS, *OURS)
DEFAULT_METHODS = tuple(m for m in METHODS if m != "hybrid_trees")  # the ablation runs when asked for


@dataclass
class Served:
    """One request as a method served it: `token_times` in seconds from the run's start (one per token)."""

    prompt_index: int
    arrival: float
    token_times: list[float]
    tokens: list[int]


class ArrivalSchedule:
    """A request stream for our engine (its `Admission`: `generate_batch(admission=...)`): request `r` may join once
    `arrivals[r]` seconds have passed since the run's first admission decision; records when each of its tokens was
    committed (`token_times[r]`, seconds from that start; the tokens of one round share their time)."""

    def __init__(self, arrivals: list[float]):
        if any(b < a for a, b in zip(arrivals, arrivals[1:])):
            raise ValueError("arrivals must be nondecreasing (one time per request, in request order).")
        self.arrivals = [float(a) for a in arrivals]
        self.token_times: list[list[float]] = [[] for _ in arrivals]
        self.start: float | None = None

    def _now(self) -> float:
        if self.start is None:
            self.start = time.perf_counter()
        return time.perf_counter() - self.start

    def ready(self, i: int, idle: bool) -> bool:
        """Whether request `i` has arrived; when the engine is idle, wait for it first."""
        wait = self.arrivals[i] - self._now()
        if wait > 0 and idle:
            time.sleep(wait)
            return True
        return wait <= 0

    def committed(self, i: int, count: int) -> None:
        self.token_times[i].extend([self._now()] * count)


def request_stream(n: int, num_prompts: int, rate: float | None = None, seed: int = 0) -> list[tuple[int, float]]:
    """`(prompt index, arrival time)` of `n` requests: prompts in order (cycled); all at t=0, or Poisson arrivals
    at `rate` requests per second (exponential gaps, seeded)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        out.append((i % num_prompts, t))
        if rate:
            t += rng.expovariate(rate)
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def serving_metrics(served: list[Served], seconds: float) -> dict:
    """Throughput and latency of one run (module docstring)."""
    ttft = [s.token_times[0] - s.arrival for s in served if s.token_times]
    itl, tpot = [], []
    for s in served:
        deliveries = sorted(set(s.token_times))
        itl += [b - a for a, b in zip(deliveries, deliveries[1:])]
        if len(s.token_times) > 1:
            tpot.append((s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1))
    tokens = sum(len(s.tokens) for s in served)
    return {"tokens_per_s": tokens / max(seconds, 1e-9), "new_tokens": tokens, "seconds": seconds,
            "requests": len(served),
            "ttft_ms": {"p50": 1e3 * percentile(ttft, 0.5), "p99": 1e3 * percentile(ttft, 0.99)},
            "itl_ms": {"p50": 1e3 * percentile(itl, 0.5), "p99": 1e3 * percentile(itl, 0.99)},
            "tpot_ms": {"p50": 1e3 * percentile(tpot, 0.5)}}


def _engine_setup(drafter, method: str, head):
    """`(drafter or None, generation config, runtime)` of one of our methods."""
    runtime = runtime_of(drafter)
    if method == "engine_plain":  # no drafter; the same device costs decide how prompts are prefilled
        return None, None, SpeculationRuntime(cost_model=runtime.cost_model)
    if method == "fixed_block":
        return drafter, run_knobs(drafter, length_policy="full", hybrid_lookup=False, allow_no_draft=False), \
            SpeculationRuntime(cost_model=runtime.cost_model)
    if method == "adaptive":
        return drafter, run_knobs(drafter, length_policy="head", hybrid_lookup=False, allow_no_draft=True), \
            SpeculationRuntime(length_head=head, cost_model=runtime.cost_model)
    trees = {"draft_candidates": 8} if method == "hybrid_trees" else {}
    return drafter, run_knobs(drafter, **trees), SpeculationRuntime(length_head=head, cost_model=runtime.cost_model)


def serve(method: str, target, drafter, prompts: list[list[int]], stream: list[tuple[int, float]],
          max_new_tokens: int, concurrency: int, pad_id: int, eos, head=None,
          profile: bool = False) -> tuple[list[Served], dict | None]:
    """Serve `stream` (prompt index, arrival) with one method; returns the served requests and engine stats
    (`ms_per_round` only with `profile`: per-phase timing synchronizes the device at every phase)."""
    ids = [prompts[i] for i, _ in stream]
    arrivals = [a for _, a in stream]
    if method in PEERS:
        from . import peers

        run = peers.run_transformers_cb if method == "transformers_cb" else peers.run_padded_generate
        kwargs = {"pad_token_id": pad_id} if method == "plain_batched" else {}
        timings = run(target, ids, max_new_tokens, concurrency, arrivals, eos_token_id=eos, **kwargs)
        return [Served(stream[t.prompt_index][0], t.arrival, list(t.token_times), list(t.tokens))
                for t in sorted(timings, key=lambda t: t.prompt_index)], None
    model, knobs, runtime = _engine_setup(drafter, method, head)
    schedule = ArrivalSchedule(arrivals)
    rows, stats = generate_batch(target, model, ids, max_new_tokens, eos_token_id=eos, generation_config=knobs,
                                 runtime=runtime, max_batch_size=concurrency, continuous=True, admission=schedule,
                                 profile=profile, return_stats=True)
    served = [Served(i, a, schedule.token_times[r], rows[r]) for r, (i, a) in enumerate(stream)]
    detail = {"tau": stats.tau, "verified_per_committed": stats.tokens_verified / max(stats.tokens_committed, 1),
              "rounds": stats.rounds, "plain_rounds": stats.plain_rounds, "lookup_rounds": stats.lookup_rounds,
              "drafter_forwards": stats.drafter_forwards,
              "ms_per_round": {k: round(v, 2) for k, v in stats.ms_per_round.items()} if profile else None}
    return served, detail


@torch.inference_mode()
def run_serving(target, tokenizer, drafter, records, levels=(1, 4, 16, 64, 128), max_new_tokens: int = 64,
                methods=DEFAULT_METHODS, max_requests: int = 256, requests: int | None = None,
                rate: float | None = None,
                repeats: int = 1, seed: int = 0, raw: bool = False, progress: bool = True,
                cost_model_path=None, profile: bool = False, round_overhead: bool = True) -> dict:
    """Every method at every level on the same request stream (module docstring). Returns the JSON-ready dict;
    `profile`: our engine's per-phase `ms_per_round` (synchronizes the device at every phase of every round).
    `round_overhead` (with a cost model from another device): measure each round's work outside the forwards first
    (`bench/overhead.py`), so the policy prices rounds as the projection does; saved as `projected.round_overhead`."""
    from .models import apply_cost_model

    projected_on = apply_cost_model(drafter, cost_model_path)  # decide with it; project onto it
    head = runtime_of(drafter).length_head
    methods = [m for m in methods if m != "adaptive" or head is not None]
    prompts = [encode_prompt(tokenizer, r["prompt"], chat_template=not raw) for r in records]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = target.generation_config.eos_token_id
    # The cost model is measured once per device (cached): never inside a timed run.
    runtime_of(drafter).cost_model = cost_model_for(target, drafter, batch_sizes=sorted(
        {1 << k for k in range(max(levels).bit_length()) if 1 << k <= max(levels)} | {max(levels)}),
        candidate=runtime_of(drafter).cost_model)
    if projected_on is not None and round_overhead:  # price each round's host + ops work as the projection does
        table = measure_round_overhead(target, drafter, prompts, levels, runtime_of(drafter).cost_model,
                                       progress=progress)
        runtime_of(drafter).cost_model = runtime_of(drafter).cost_model.with_overhead(table)
    references: dict[int, list[int]] = {}

    def reference(i):  # bs=1 plain greedy: the lossless reference of prompt i
        if i not in references:
            ids = torch.tensor([prompts[i]], device=target.device)
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False)
            references[i] = out[0, ids.shape[1]:].tolist()
        return references[i]

    warm = request_stream(2, len(prompts))
    for method in methods:  # kernels, allocator, CB manager: warmed once, untimed
        serve(method, target, drafter, prompts, warm, 4, 2, pad_id, eos, head)

    result = {"concurrency": {}, "detail": {}, "peer": {}, "methods": methods, "max_new_tokens": max_new_tokens,
              "rate": rate, "repeats": repeats}
    probe = None
    if projected_on is not None:
        probe = ForwardProbe(target, drafter, count_ops=True)
        result["projected"] = {**cost_model_info(projected_on, cost_model_path), "concurrency": {}, "seconds_split": {},
                               "round_overhead": runtime_of(drafter).cost_model.overhead}
    for level in tqdm(levels, desc="serving", disable=not progress):
        n = requests or min(4 * level, max(max_requests, level))
        stream = request_stream(n, len(prompts), rate, seed)
        # The first run at a new batch shape pays for its allocations (a 16-row prefill measured ~35% slower the
        # first time on a CPU): every method is warmed at this level's full batch, untimed, so no method's
        # figure depends on its place in the order. Each serve builds a fresh policy: nothing learned carries over.
        shape = request_stream(min(level, n), len(prompts))
        for method in methods:
            serve(method, target, drafter, prompts, shape, 4, level, pad_id, eos, head)
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for repeat in range(repeats):
            for method in (methods if repeat % 2 == 0 else methods[::-1]):  # interleaved, order alternating
                if probe is not None:
                    probe.reset()
                synchronize(target.device)
                start = time.perf_counter()
                served, detail = serve(method, target, drafter, prompts, stream, max_new_tokens, level, pad_id, eos,
                                       head, profile)
                synchronize(target.device)
                metrics = serving_metrics(served, time.perf_counter() - start)
                if probe is not None and not runs[method]:
                    probe.log.wall_seconds = time.perf_counter() - start
                    split = None if method == "transformers_cb" else projected_split(probe.log, projected_on)
                    seconds = sum(split.values()) if split else None
                    tokens = sum(len(x.tokens) for x in served)
                    result["projected"]["concurrency"].setdefault(str(level), {})[method] = (
                        tokens / seconds if seconds else None)
                    if split:  # where the projected seconds go: host (measured here) / target / drafter / ops
                        result["projected"]["seconds_split"].setdefault(str(level), {})[method] = {
                            k: round(v, 6) for k, v in split.items()}
                if not runs[method]:
                    metrics["identical"] = sum(s.tokens == reference(s.prompt_index) for s in served)
                    metrics["total"] = len(served)
                    metrics.update(detail or {})
                runs[method].append(metrics)
        result["concurrency"][str(level)], result["detail"][str(level)] = {}, {}
        for method, measured in runs.items():
            rates = [m["tokens_per_s"] for m in measured]
            detail = {**measured[0], "tokens_per_s": statistics.median(rates),
                      "tokens_per_s_range": [min(rates), max(rates)]}
            result["concurrency"][str(level)][method] = detail["tokens_per_s"]
            result["detail"][str(level)][method] = detail
        peers = {m: result["concurrency"][str(level)][m] for m in PEERS if m in runs}
        if peers:
            best = max(peers, key=peers.get)
            result["peer"][str(level)] = best
            for method in runs:
                result["detail"][str(level)][method]["vs_peer"] = result["concurrency"][str(level)][method] / max(
                    peers[best], 1e-9)
    if probe is not None:
        probe.close()
    return result


def print_serving(result: dict) -> None:
    print(f"\n{'c':>4} {'method':<16}{'tok/s':>8}{'vs peer':>8}{'TTFT p50':>10}{'ITL p50':>9}{'ITL p99':>9}"
          f"{'tau':>6}{'verif/com':>10}{'identical':>11}")
    for level, methods in result["detail"].items():
        for method, d in methods.items():
            tau = f"{d['tau']:.2f}" if "tau" in d else "-"
            vpc = f"{d['verified_per_committed']:.2f}" if "verified_per_committed" in d else "-"
            print(f"{level:>4} {method:<16}{d['tokens_per_s']:>8.1f}{d.get('vs_peer', 0):>7.2f}x"
                  f"{d['ttft_ms']['p50']:>9.0f}m{d['itl_ms']['p50']:>8.0f}m{d['itl_ms']['p99']:>8.0f}m{tau:>6}"
                  f"{vpc:>10}{d['identical']:>7}/{d['total']}")
    projected = result.get("projected")
    if projected:
        print(f"\nPROJECTED on {projected['device']} ({projected['dtype']}; {projected.get('file', 'cost model')}): "
              "not measured - this machine's host time + that device's forward costs for the rounds run here")
        if projected.get("assumptions"):
            print(f"  assumes: {projected['assumptions']}")
        if projected.get("round_overhead"):
            print("  the policy priced each round's work outside the forwards (ms, by rows): " + "; ".join(
                f"{kind} " + ", ".join(f"{b}: {1e3 * s:.1f}" for b, s in sorted(rows.items()))
                for kind, rows in projected["round_overhead"].items()))
        print(f"{'c':>4} {'method':<16}{'proj tok/s':>11}{'vs engine_plain':>16}   seconds: host (here) / target / "
              "drafter (cost model) / ops")
        for level, rates in projected["concurrency"].items():
            plain = rates.get("engine_plain")
            for method, rate in rates.items():
                ratio = f"{rate / plain:>15.2f}x" if rate and plain else f"{'-':>16}"
                parts = projected.get("seconds_split", {}).get(level, {}).get(method)
                split = " / ".join(f"{parts[k]:.2f}" for k in SPLIT) if parts else "-"
                shown = f"{rate:>11.1f}" if rate else f"{'n/a':>11}"
                print(f"{level:>4} {method:<16}{shown}{ratio}   {split}")


def plot_serving(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [int(x) for x in result["concurrency"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for method in result["methods"]:
        left.plot(levels, [result["concurrency"][str(x)][method] for x in levels], marker="o", label=method)
        details = [result["detail"][str(x)][method] for x in levels]
        if all("itl_ms" in d for d in details):
            right.plot(levels, [d["itl_ms"]["p50"] for d in details], marker="o", label=method)
    for ax, label in ((left, "output tokens / s"), (right, "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)




def add_parser(sub) -> None:
    from .args import (choice_list, concurrency_levels, cost_model_file, drafter_dir, length_head_dir, positive_int,
                       prompts_file)
    from .models import DEVICES

    p = sub.add_parser("bench-serving", help="request-stream serving benchmark (throughput, TTFT, ITL) at "
                                             "concurrency levels, ours vs transformers' plain peers",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--target", default=None, help="target model folder (default: the offline testbed model)")
    p.add_argument("--drafter", type=drafter_dir("--drafter"), default=None,
                   help="drafter folder (default: the shipped default drafter)")
    p.add_argument("--length-head", type=length_head_dir("--length-head"), default=None,
                   help="length head folder (default: the shipped one, for the shipped drafter)")
    p.add_argument("--prompts", type=prompts_file, default=None,
                   help='JSONL with {"prompt", "domain"} lines (default: the committed held-out testbed prompts)')
    p.add_argument("--concurrency", type=concurrency_levels, default="1,4,16,64,128")
    p.add_argument("--requests", type=positive_int("--requests"), default=None,
                   help="requests per level (default: 4 x concurrency, capped by --max-requests)")
    p.add_argument("--max-requests", type=positive_int("--max-requests"), default=256)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals at this many requests/s "
                                                            "(default: all queued at t=0)")
    p.add_argument("--max-new-tokens", type=positive_int("--max-new-tokens"), default=64)
    p.add_argument("--methods", type=choice_list("--methods", METHODS), default=",".join(DEFAULT_METHODS))
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the models run (auto: the accelerator when there is one, else the CPU)")
    p.add_argument("--repeats", type=positive_int("--repeats"), default=1)
    p.add_argument("--threads", type=positive_int("--threads"), default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="write tokens/s and ITL vs concurrency (PNG) here")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--profile", action="store_true",
                   help="time every phase of our engine's rounds (detail 'ms_per_round'); synchronizes the device at "
                        "each phase, so tokens/s on an accelerator drop")
    p.add_argument("--cost-model", type=cost_model_file, default=None,
                   help="a cost model measured on another device (JSON file, or a shipped name such as "
                        "h200-smollm2-135m): our engine decides with its costs; a separate PROJECTED table (JSON "
                        "'projected') gives the tokens/s the rounds run here would take there")
    p.add_argument("--no-round-overhead", action="store_true",
                   help="with --cost-model: do not measure each round's host + ops work first (the policy then "
                        "prices rounds by their forwards alone; the projection still counts that work)")


def main(args) -> dict:
    from ..checkpoints import OFFLINE_DRAFTER, length_head_dir
    from .models import attach_length_head, bench_records, load_models

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_models(args.target, args.drafter, getattr(torch, args.dtype), args.device)
    head = args.length_head or (length_head_dir() if args.drafter is None or Path(args.drafter).name ==
                                OFFLINE_DRAFTER else None)
    if head is not None:
        attach_length_head(drafter, head)
    records = bench_records(args.prompts, None)
    levels = [int(x) for x in args.concurrency.split(",")]
    result = run_serving(target, tokenizer, drafter, records, levels=levels, max_new_tokens=args.max_new_tokens,
                         methods=args.methods.split(","), max_requests=args.max_requests, requests=args.requests,
                         rate=args.rate, repeats=args.repeats, seed=args.seed, progress=not args.quiet,
                         cost_model_path=args.cost_model, profile=args.profile,
                         round_overhead=not args.no_round_overhead)
    result["config"] = {"device": str(target.device), "dtype": args.dtype, "threads": torch.get_num_threads(),
                        "drafter": str(args.drafter or "default"), "length_head": str(head) if head else None,
                        "prompts": str(args.prompts or "default_eval_prompts"), "n_prompts": len(records),
                        "cost_model": str(args.cost_model) if args.cost_model else None, "masked_gqa": masked_gqa()}
    print_serving(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot_serving(result, args.plot)
    return result


__all__ = ["METHODS", "ArrivalSchedule", "Served", "add_parser", "main", "percentile", "plot_serving", "print_serving",
           "request_stream", "run_serving", "serve", "serving_metrics"]
