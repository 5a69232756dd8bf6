# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""PROJECTED speed on another device: what the forwards a run actually computed here would take there.

A bench measures on this machine. With `--cost-model FILE` (a `TargetCostModel` measured on another device, e.g. the
shipped `adaflash_hf/cost_models/h200-smollm2-135m.json`) it also reports, in a separate "projected" block, the
tokens/s the same rounds would reach on that device:

    projected seconds = host seconds measured here
                        + sum over target forwards of cost.seconds(tokens per row, rows)
                        + sum over drafter forwards of cost.draft_seconds(rows)
                        + tensor ops outside the forwards x the device's seconds per op   (with `count_ops`)

where a run's forwards are logged by hooks (`ForwardProbe`: rows x tokens of every target forward, rows of every
drafter forward, and the seconds spent in them here) and host seconds = wall seconds - target forward seconds -
drafter seconds (Python, the generate loop, lookup, acceptance). The drafter's seconds are its forward AND its
`draft_logits` (the LM-head slice over the drafted positions, computed outside the forward), because the cost
model's drafting step covers both (the shipped H200 file assumes "2 layers + context projection + the 8k-row LM-head
slice"); counting the slice as host time counted it twice (on this CPU it is 1-5 ms of a round, ~3x the host work
of a lookup round).

Tensor work outside the two models' forwards (the argmax over `[rows, width, vocab]` logits, acceptance, KV-cache
selects and compaction, gathering the hidden states the drafter reads) runs on the device on an accelerator, as
kernels. Timed on this CPU it is compute, not host work, and it grows with rows x verify width (the argmax over
64 x 9 x 49k logits, KV-cache selects over 30 layers), so it made speculative rounds at many rows look dear. With
`count_ops=True` (the benches set it when they project) a `TorchDispatchMode` counts the tensor ops that launch
kernels (view-like ops excluded) and times them outside the forwards; they leave host time, and each is projected at
the device's seconds per op of the target's own forwards in the same run (`cost.seconds` of every target forward /
the ops counted inside them): the launch-bound price of a kernel there, an assumption the projected block states.
The counter's own Python (~7 us an op here, measured when the probe starts: `_dispatch_overhead`) is not host work
of the run, and is taken out of host time (`ForwardLog.counter_seconds`).
Without it (hand-made logs) that work stays in host time: the conservative projection. A prefill forward is
projected as one forward of the widest measured width (`cost.seconds` is not extrapolated past the measured widths).
A run with partial target forwards (early-exit drafting) is not projected.

Projected numbers are never measurements: they are printed and saved apart from the measured columns and verdicts.
"""

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode


SPLIT = ("host", "target", "drafter", "ops")  # host: measured here; forwards: the cost model; ops: see docstring
OPS_NOTE = ("tensor ops outside the forwards (counted here) are projected at the device's seconds per op of the "
            "target's forwards in the same run (launch-bound kernels)")
# Ops that launch no kernel (metadata / views): their dispatcher time stays host time, they are not counted.
VIEW_OPS = frozenset({"view", "_unsafe_view", "reshape", "expand", "slice", "select", "transpose", "permute",
                      "unsqueeze", "squeeze", "t", "detach", "alias", "as_strided", "unfold", "split",
                      "split_with_sizes", "chunk", "narrow", "lift_fresh", "unbind", "view_as", "expand_as",
                      "_reshape_alias", "numpy_T", "sym_size", "sym_stride", "sym_numel", "dim", "size", "stride",
                      "is_same_size"})
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
    ops: int = 0  # tensor ops outside the forwards (`count_ops`), and their seconds here
    ops_seconds: float = 0.0
    target_ops: int = 0  # tensor ops inside the full target forwards (the device's seconds per op: module docstring)
    dispatched: int = 0  # every op the counter saw outside the forwards (views included) ...
    dispatch_overhead: float = 0.0  # ... and the seconds the counter itself adds to each, measured here

    @property
    def counter_seconds(self) -> float:
        """The op counter's own Python time outside the forwards: measured overhead, not host work of the run."""
        return self.dispatched * self.dispatch_overhead

    @property
    def host_seconds(self) -> float:
        return max(self.wall_seconds - self.target_seconds - self.drafter_seconds - self.ops_seconds
                   - self.counter_seconds, 0.0)

    def copy(self) -> "ForwardLog":
        return dataclasses.replace(self, target=list(self.target), drafter=list(self.drafter))


def projected_split(log: ForwardLog, cost) -> dict | None:
    """`{"host", "target", "drafter"}` seconds of the logged run on `cost`'s device: host measured here, forwards
    from the cost model (None: not projectable, e.g. early-exit forwards)."""
    if log.partial:
        return None
    widest = max(cost.num_tokens())
    target = sum(cost.seconds(min(tokens, widest), rows) for rows, tokens in log.target)
    per_op = target / log.target_ops if log.target_ops else 0.0
    return {"host": log.host_seconds, "target": target,
            "drafter": sum(cost.draft_seconds(rows) for rows in log.drafter), "ops": log.ops * per_op}


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
    forwards, as the bs=1 bench reports them. `count_ops`: also count and time the tensor ops outside the forwards
    (`_OpCounter`, module docstring; each op then goes through Python, a few microseconds here: the measured columns
    of such a run carry that). `reset()` starts a new log; `close()` removes the hooks.
    """

    def __init__(self, target, drafter=None, count_ops: bool = False):
        self.log = ForwardLog()
        self._last_layer_calls, self._target, self._drafter, self._in_logits = 0, None, None, False
        self._target_ops = 0  # ops of the current target forward (kept only if it reaches the last layer)
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
        self._ops = _OpCounter(self) if count_ops else None
        self._overhead = _dispatch_overhead() if count_ops else 0.0
        self.log.dispatch_overhead = self._overhead
        if self._ops is not None:
            self._ops.__enter__()

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
            self._target_ops = 0
            self._target = (time.perf_counter(), self._last_layer_calls, _rows_tokens(args, kwargs))

    def _target_out(self, *_):
        if self._target is None:
            return
        start, calls, shape = self._target
        self._target = None
        self.log.target_seconds += time.perf_counter() - start
        if self._last_layer_calls > calls:
            self.log.target.append(shape)
            self.log.target_ops += self._target_ops
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
            start, self._in_logits = time.perf_counter(), True
            try:
                return draft_logits(*args, **kwargs)
            finally:
                self._in_logits = False
                self.log.drafter_seconds += time.perf_counter() - start
        return timed

    def reset(self) -> None:
        self.log = ForwardLog(dispatch_overhead=self._overhead)
        self._target = self._drafter = None

    def close(self) -> None:
        if self._ops is not None:
            self._ops.__exit__(None, None, None)
            self._ops = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._patched is not None:
            self._patched.__dict__.pop("draft_logits", None)
            self._patched = None


class _OpCounter(TorchDispatchMode):
    """Counts the kernel-launching tensor ops of a `ForwardProbe`'s run: inside a full target forward (for the
    device's seconds per op) and outside every forward (counted and timed: they leave host time)."""

    def __init__(self, probe: ForwardProbe):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        probe, kwargs = self.probe, kwargs or {}
        if probe._drafter is not None or probe._in_logits:
            return func(*args, **kwargs)  # part of the drafting step (the cost model's)
        if probe._target is not None:
            probe._target_ops += func.overloadpacket.__name__ not in VIEW_OPS
            return func(*args, **kwargs)
        probe.log.dispatched += 1  # this call's Python leaves host time (`ForwardLog.counter_seconds`)
        if func.overloadpacket.__name__ in VIEW_OPS:
            return func(*args, **kwargs)  # no kernel
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            probe.log.ops += 1
            probe.log.ops_seconds += time.perf_counter() - start


def _dispatch_overhead(n: int = 2000) -> float:
    """Seconds the op counter adds to one tensor op on this machine (its Python, the timer around it): the same
    small ops timed bare and under a counter, best of 3. Without the correction a run's host time carried it (~7 us
    an op here, a few ms a round at 64 rows), billed as host work the device would have to do."""
    x = torch.zeros(8)

    class _Log:  # a probe outside every forward, as the counter sees one
        _drafter = _target = None
        _in_logits = False
        log = ForwardLog()

    def timed(mode) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            with mode:
                for _ in range(n):
                    x.add(1)
            best = min(best, time.perf_counter() - start)
        return best

    return max(timed(_OpCounter(_Log())) - timed(contextlib.nullcontext()), 0.0) / n


def cost_model_info(cost, path=None) -> dict:
    """What the projection block says about the device it projects onto."""
    info = {"device": cost.device, "dtype": cost.dtype, "description": cost.description, "note": PROJECTED_NOTE}
    info["assumptions"] = f"{cost.assumptions} {OPS_NOTE}." if cost.assumptions else f"{OPS_NOTE}."
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
          "drafter (cost model) / ops")
    for method, data in block["methods"].items():
        for name, row in [("overall", data["overall"])] + [(d, data["domains"][d]) for d in domains
                                                           if d in data["domains"]]:
            rate = f"{row['tokens_per_s']:>11.1f}" if row["tokens_per_s"] else f"{'n/a':>11}"
            speed = f"{row['speedup']:>13.2f}x" if row["speedup"] else f"{'n/a':>14}"
            parts = row.get("seconds_split")
            split = " / ".join(f"{parts[k]:.2f}" for k in SPLIT) if parts else "-"
            print(f"{method:<19}{name:<9}{rate}{speed}   {split}")


__all__ = ["OPS_NOTE", "PROJECTED_NOTE", "SPLIT", "ForwardLog", "ForwardProbe", "cost_model_info", "print_projected",
           "project_bench", "projected_seconds", "projected_split", "rate_table"]
