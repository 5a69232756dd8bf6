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

from ..generation.candidate_generator import SpeculationStats
from ..training.data import encode_prompt


METHODS = ("plain", "prompt_lookup", "early_exit", "dflash_native", "drafter_only", "adaflash")
# "drafter_only": our generator drafting every round (no lookup, no fallback) with the fixed full block;
# "adaflash": the default hybrid (with the length head when one is attached). Length baselines, drafting every
# round: "drafter_confidence" / "drafter_heuristic" (transformers' assistant confidence threshold and heuristic
# schedule applied to the block) and "drafter_head" (our length head + cost model; needs `--length-head`).
LENGTH_METHODS = ("drafter_confidence", "drafter_heuristic", "drafter_head")
OURS = ("adaflash", "drafter_only", *LENGTH_METHODS)
ALL_METHODS = (*METHODS, *LENGTH_METHODS)
_DRAFTER_ONLY = {"hybrid_lookup": False, "allow_no_draft": False}


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


class _TargetProbe:
    """Counts and times the target's full forwards (hooks on the last decoder layer and on the model)."""

    def __init__(self, target):
        self.count, self.seconds, self._start = 0, 0.0, None
        last_layer = target.get_decoder().layers[-1]
        self._handles = [
            last_layer.register_forward_hook(self._count),
            target.register_forward_pre_hook(self._tic),
            target.register_forward_hook(self._toc),
        ]

    def _count(self, *_):
        self.count += 1

    def _tic(self, *_):
        self._start = time.perf_counter()

    def _toc(self, *_):
        if self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None

    def reset(self):
        self.count, self.seconds = 0, 0.0

    def close(self):
        for h in self._handles:
            h.remove()


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


@contextlib.contextmanager
def _drafter_config(drafter, method: str):
    """Temporarily set the drafter up for `method`: config flags, length head and length policy."""
    overrides = _DRAFTER_ONLY if method in OURS and method != "adaflash" else {}
    head = getattr(drafter, "length_head", None)
    if method == "drafter_head" and head is None:
        raise ValueError("method 'drafter_head' needs a length head: pass --length-head PATH")
    attrs = {"length_head": head if method in ("adaflash", "drafter_head") else None,
             "length_policy": {"drafter_confidence": "confidence", "drafter_heuristic": "heuristic"}.get(method)}
    saved = {k: getattr(drafter.config, k) for k in overrides}
    saved_attrs = {k: getattr(drafter, k, None) for k in attrs}
    for k, v in overrides.items():
        setattr(drafter.config, k, v)
    for k, v in attrs.items():
        setattr(drafter, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(drafter.config, k, v)
        for k, v in saved_attrs.items():
            setattr(drafter, k, v)


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
) -> list[Measurement]:
    """Run `methods` on `records` (`{"prompt", "domain"}`) and return one `Measurement` per (prompt, method).

    Plain greedy always runs first on each prompt (it is the reference for `identical` and speed-ups), unless
    `references` (one plain output per record, from an earlier run) is given; plain outputs are appended to a
    `references` list passed empty.
    """
    reuse = bool(references)
    if "plain" not in methods and not reuse:
        methods = ("plain", *methods)
    probe = _TargetProbe(target)
    results = []
    try:
        encoded = [torch.tensor([encode_prompt(tokenizer, r["prompt"], chat_template=not raw)]) for r in records]
        for ids in encoded[:warmup]:  # warm up kernels/allocator once per method
            for method in methods:
                with _drafter_config(drafter, method):
                    target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                    **method_kwargs(method, drafter, target))
        for i, (record, ids) in enumerate(tqdm(list(zip(records, encoded)), desc="bench", disable=not progress,
                                                unit="prompt")):
            reference = references[i] if reuse else None
            for method in methods:
                probe.reset()
                with _drafter_config(drafter, method):
                    start = time.perf_counter()
                    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                          do_sample=False, **method_kwargs(method, drafter, target))
                    seconds = time.perf_counter() - start
                if method == "plain" and not reuse:
                    reference = out
                    if references is not None:
                        references.append(out)
                m = Measurement(
                    method=method,
                    domain=record.get("domain", "all"),
                    new_tokens=out.shape[1] - ids.shape[1],
                    seconds=seconds,
                    identical=bool(out.shape == reference.shape and torch.equal(out, reference)),
                    target_forwards=probe.count,
                    verify_seconds=probe.seconds,
                )
                if method in OURS:
                    stats = drafter.generation_stats
                    m.draft_seconds, m.drafted, m.accepted = stats.draft_seconds, list(stats.drafted), list(stats.accepted)
                results.append(m)
    finally:
        probe.close()
    return results


def summarize(results: list[Measurement], block_size: int | None = None) -> dict:
    """Aggregate measurements into the bench JSON (see `adaflash-hf bench --help` for the schema)."""
    by_method = defaultdict(list)
    for m in results:
        by_method[m.method].append(m)
    domains = sorted({m.domain for m in results})

    def aggregate(ms: list[Measurement], plain: list[Measurement]) -> dict:
        tokens, seconds = sum(m.new_tokens for m in ms), sum(m.seconds for m in ms)
        plain_rate = sum(p.new_tokens for p in plain) / max(sum(p.seconds for p in plain), 1e-9)
        rate = tokens / max(seconds, 1e-9)
        verify_forwards = sum(max(m.target_forwards - 1, 0) for m in ms)
        out = {
            "tokens_per_s": rate,
            "speedup": rate / plain_rate if plain_rate else 0.0,
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
