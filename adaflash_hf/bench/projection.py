# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""PROJECTED speed on another device: what the forwards a run actually computed here would take there.

A bench measures on this machine. With `--cost-model FILE` (a `TargetCostModel` measured on another device, e.g. the
shipped `adaflash_hf/cost_models/h200-smollm2-135m.json`) it also reports, in a separate "projected" block, the
tokens/s the same rounds would reach on that device:

    projected seconds = host seconds measured here
                        + sum over target forwards of cost.seconds(tokens per row, rows)
                        + sum over drafter forwards of cost.draft_seconds(rows)

where a run's forwards are logged by hooks (`ForwardProbe`: rows x tokens of every target forward, rows of every
drafter forward, and the seconds spent in them here) and host seconds = wall seconds - target forward seconds -
drafter seconds (Python, the generate loop, lookup, acceptance). The drafter's seconds are its forward AND its
`draft_logits` (the LM-head slice over the drafted positions, computed outside the forward), because the cost
model's drafting step covers both (the shipped H200 file assumes "2 layers + context projection + the 8k-row LM-head
slice"); counting the slice as host time counted it twice (on this CPU it is 1-5 ms of a round, ~3x the host work
of a lookup round). Other tensor work outside the two models' forwards (argmax over the target's logits,
acceptance) stays in host time: a conservative projection. A prefill forward is projected as one forward of
the widest measured width (`cost.seconds` is not extrapolated past the measured widths). A run with partial target
forwards (early-exit drafting) is not projected.

Projected numbers are never measurements: they are printed and saved apart from the measured columns and verdicts.
"""

import time
from dataclasses import dataclass, field


SPLIT = ("host", "target", "drafter")  # host: measured here; target / drafter forwards: from the cost model
PROJECTED_NOTE = ("projected, not measured: this machine's host time + the cost model's seconds for the forwards "
                  "each run computed here (rows x tokens)")


@dataclass
class ForwardLog:
    """The forwards one run computed: `target[i] = (rows, tokens per row)`, `drafter[i] = rows`, and seconds here."""

    target: list[tuple[int, int]] = field(default_factory=list)
    drafter: list[int] = field(default_factory=list)
    target_seconds: float = 0.0
    drafter_seconds: float = 0.0
    wall_seconds: float = 0.0
    partial: int = 0  # target forwards that did not reach the last decoder layer (early exit)

    @property
    def host_seconds(self) -> float:
        return max(self.wall_seconds - self.target_seconds - self.drafter_seconds, 0.0)

    def copy(self) -> "ForwardLog":
        return ForwardLog(list(self.target), list(self.drafter), self.target_seconds, self.drafter_seconds,
                          self.wall_seconds, self.partial)


def projected_split(log: ForwardLog, cost) -> dict | None:
    """`{"host", "target", "drafter"}` seconds of the logged run on `cost`'s device: host measured here, forwards
    from the cost model (None: not projectable, e.g. early-exit forwards)."""
    if log.partial:
        return None
    widest = max(cost.num_tokens())
    return {"host": log.host_seconds,
            "target": sum(cost.seconds(min(tokens, widest), rows) for rows, tokens in log.target),
            "drafter": sum(cost.draft_seconds(rows) for rows in log.drafter)}


def projected_seconds(log: ForwardLog, cost) -> float | None:
    """Seconds the logged forwards would take on `cost`'s device, plus the host seconds measured here (None: not
    projectable, e.g. early-exit forwards)."""
    split = projected_split(log, cost)
    return None if split is None else sum(split.values())


def _rows_tokens(args, kwargs) -> tuple[int, int]:
    for name in ("input_ids", "inputs_embeds", "noise_embeds"):
        x = kwargs.get(name)
        if x is not None:
            return int(x.shape[0]), int(x.shape[1])
    x = args[0] if args else None
    return (int(x.shape[0]), int(x.shape[1])) if x is not None and getattr(x, "dim", lambda: 0)() >= 2 else (1, 1)


class ForwardProbe:
    """Hooks logging the target's and the drafter's forwards into `self.log` (a `ForwardLog`).

    `count` / `seconds`: the target's full forwards (reaching its last decoder layer) and the seconds spent in its
    forwards, as the bs=1 bench reports them. `reset()` starts a new log; `close()` removes the hooks.
    """

    def __init__(self, target, drafter=None):
        self.log = ForwardLog()
        self._last_layer_calls, self._target, self._drafter = 0, None, None
        last_layer = target.get_decoder().layers[-1]
        self._handles = [
            last_layer.register_forward_hook(self._layer),
            target.register_forward_pre_hook(self._target_in, with_kwargs=True),
            target.register_forward_hook(self._target_out),
        ]
        self._patched = None
        if drafter is not None:
            self._handles += [drafter.register_forward_pre_hook(self._drafter_in, with_kwargs=True),
                              drafter.register_forward_hook(self._drafter_out)]
            if callable(getattr(drafter, "draft_logits", None)):
                self._patched = drafter
                drafter.draft_logits = self._timed(drafter.draft_logits)  # an instance attribute: removed by close()

    @property
    def count(self) -> int:
        return len(self.log.target)

    @property
    def seconds(self) -> float:
        return self.log.target_seconds

    def _layer(self, *_):
        self._last_layer_calls += 1

    def _target_in(self, module, args, kwargs):
        if self._target is None:  # not a nested call
            self._target = (time.perf_counter(), self._last_layer_calls, _rows_tokens(args, kwargs))

    def _target_out(self, *_):
        if self._target is None:
            return
        start, calls, shape = self._target
        self._target = None
        self.log.target_seconds += time.perf_counter() - start
        if self._last_layer_calls > calls:
            self.log.target.append(shape)
        else:
            self.log.partial += 1

    def _drafter_in(self, module, args, kwargs):
        if self._drafter is None:
            self._drafter = (time.perf_counter(), _rows_tokens(args, kwargs)[0])

    def _drafter_out(self, *_):
        if self._drafter is None:
            return
        start, rows = self._drafter
        self._drafter = None
        self.log.drafter_seconds += time.perf_counter() - start
        self.log.drafter.append(rows)

    def _timed(self, draft_logits):
        """`draft_logits` whose seconds count as the drafter's (part of the drafting step, not a forward)."""
        def timed(*args, **kwargs):
            if self._drafter is not None:  # inside the drafter's forward: already counted
                return draft_logits(*args, **kwargs)
            start = time.perf_counter()
            try:
                return draft_logits(*args, **kwargs)
            finally:
                self.log.drafter_seconds += time.perf_counter() - start
        return timed

    def reset(self) -> None:
        self.log = ForwardLog()
        self._target = self._drafter = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._patched is not None:
            self._patched.__dict__.pop("draft_logits", None)
            self._patched = None


def cost_model_info(cost, path=None) -> dict:
    """What the projection block says about the device it projects onto."""
    info = {"device": cost.device, "dtype": cost.dtype, "description": cost.description, "note": PROJECTED_NOTE}
    if cost.assumptions:
        info["assumptions"] = cost.assumptions
    if path is not None:
        info["file"] = str(path)
    return info


def rate_table(items, cost, plain: str = "plain") -> dict:
    """`items`: `(method, domain, new tokens, ForwardLog)` -> `{method: {"overall": {...}, "domains": {...}}}` with
    projected `tokens_per_s` and `speedup` (over the projected plain runs of the same prompts); a method with an
    unprojectable run gets None."""
    groups: dict = {}
    for method, domain, tokens, log in items:
        split = projected_split(log, cost)
        for key in ("overall", domain):
            acc = groups.setdefault(method, {}).setdefault(key, [0, 0.0, True, dict.fromkeys(SPLIT, 0.0)])
            acc[0] += tokens
            acc[1] += sum(split.values()) if split else 0.0
            acc[2] = acc[2] and split is not None
            for part in SPLIT:
                acc[3][part] += split[part] if split else 0.0
    out = {}
    for method, by_key in groups.items():
        rows = {}
        for key, (tokens, seconds, ok, parts) in by_key.items():
            rate = tokens / seconds if ok and seconds > 0 else None
            base = groups.get(plain, {}).get(key)
            base_rate = base[0] / base[1] if base and base[2] and base[1] > 0 else None
            rows[key] = {"tokens_per_s": rate, "speedup": rate / base_rate if rate and base_rate else None,
                         "seconds": seconds if ok else None, "new_tokens": tokens,
                         "seconds_split": parts if ok else None}
        out[method] = {"overall": rows.pop("overall"), "domains": rows}
    return out


def project_bench(results, cost, path=None) -> dict:
    """The bench JSON's "projected" block from `runner.Measurement`s that carry a `forwards` log."""
    items = [(m.method, m.domain, m.new_tokens, m.forwards) for m in results if m.forwards is not None]
    return {**cost_model_info(cost, path), "methods": rate_table(items, cost)}


def print_projected(block: dict, domains=()) -> None:
    """The projected table, headed so that it cannot be read as a measurement."""
    print(f"\nPROJECTED on {block['device']} ({block['dtype']}; {block.get('file', 'cost model')}): not measured - "
          "this machine's host time + that device's forward costs for the rounds run here")
    if block.get("assumptions"):
        print(f"  assumes: {block['assumptions']}")
    print(f"{'method':<19}{'domain':<9}{'proj tok/s':>11}{'proj speedup':>14}   seconds: host (here) / target / "
          "drafter (cost model)")
    for method, data in block["methods"].items():
        for name, row in [("overall", data["overall"])] + [(d, data["domains"][d]) for d in domains
                                                           if d in data["domains"]]:
            rate = f"{row['tokens_per_s']:>11.1f}" if row["tokens_per_s"] else f"{'n/a':>11}"
            speed = f"{row['speedup']:>13.2f}x" if row["speedup"] else f"{'n/a':>14}"
            parts = row.get("seconds_split")
            split = " / ".join(f"{parts[k]:.2f}" for k in SPLIT) if parts else "-"
            print(f"{method:<19}{name:<9}{rate}{speed}   {split}")


__all__ = ["PROJECTED_NOTE", "SPLIT", "ForwardLog", "ForwardProbe", "cost_model_info", "print_projected",
           "project_bench", "projected_seconds", "projected_split", "rate_table"]
