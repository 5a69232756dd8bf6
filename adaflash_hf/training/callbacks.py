# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Trainer callbacks of long drafter runs: the held-out curve as JSON, the best drafter, a compute budget.

* `EvalCurveCallback` appends every evaluation (step, `tau_proxy` and its per-domain values, eval loss, the mean
  training loss since the previous evaluation, training CPU seconds) to `<output_dir>/eval_curve.json`, and saves
  the drafter with the best `tau_proxy` so far to `<output_dir>/best` (with `best_metrics.json`). Both survive a
  resumed run: a resumed run drops the points past its checkpoint (they belonged to the abandoned continuation)
  and keeps the best only if it beats the stored one.
* `ComputeBudgetCallback` measures the CPU time of the training steps alone (process time, so it does not depend
  on what else runs on the machine; evaluations and saves are excluded) and stops training once it reaches
  `max_cpu_seconds`: the way to compare drafter shapes "under the same compute" on a shared CPU, and to run a
  long training in legs (with checkpoints on, it saves one where it stops, so the next leg resumes there).
  `max_train_seconds` is the wall-clock alternative (what counts on an accelerator, where the CPU mostly waits):
  training stops once that many seconds have passed since it began, evaluations and saves included; the wall time
  of the steps alone is reported too (`train_wall_seconds`, for tokens/s).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from transformers import TrainerCallback


def _write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


class ComputeBudgetCallback(TrainerCallback):
    """Counts the process CPU seconds spent inside training steps; stops at `max_cpu_seconds` (None: never).

    `cpu_seconds` and `steps` cover this process (a resumed run starts counting again); `seconds_per_step()` leaves
    out the first `warmup_steps` steps (allocator and kernel warm-up).
    """

    def __init__(self, max_cpu_seconds: float | None = None, warmup_steps: int = 2,
                 max_train_seconds: float | None = None):
        self.max_cpu_seconds, self.warmup_steps = max_cpu_seconds, warmup_steps
        self.max_train_seconds = max_train_seconds
        self.cpu_seconds, self.steps, self.steady_seconds, self.steady_steps = 0.0, 0, 0.0, 0
        self.wall_seconds = 0.0  # wall time inside the training steps
        self._start = self._wall_start = self._train_begin = None
        self.offset = 0.0  # CPU seconds of earlier runs of this output_dir (set by EvalCurveCallback on resume)

    def on_train_begin(self, args, state, control, **kwargs):
        self._train_begin = time.perf_counter()

    def elapsed_seconds(self) -> float:
        """Wall-clock seconds since training began (0 before it did)."""
        return 0.0 if self._train_begin is None else time.perf_counter() - self._train_begin

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._wall_start = time.process_time(), time.perf_counter()
        if self._train_begin is None:
            self._train_begin = self._wall_start

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is None:
            return
        spent = time.process_time() - self._start
        self.wall_seconds += time.perf_counter() - self._wall_start
        self._start = None
        self.cpu_seconds += spent
        self.steps += 1
        if self.steps > self.warmup_steps:
            self.steady_seconds += spent
            self.steady_steps += 1
        if (self.max_cpu_seconds is not None and self.cpu_seconds >= self.max_cpu_seconds) or (
                self.max_train_seconds is not None and self.elapsed_seconds() >= self.max_train_seconds):
            control.should_training_stop = True
            if str(getattr(args, "save_strategy", "no")).lower().split(".")[-1] != "no":
                control.should_save = True  # a run stopped by its budget resumes from where it stopped

    def seconds_per_step(self) -> float:
        if self.steady_steps:
            return self.steady_seconds / self.steady_steps
        return self.cpu_seconds / self.steps if self.steps else math.nan

    def summary(self) -> dict:
        return {"train_cpu_seconds": round(self.cpu_seconds, 2), "train_steps_this_run": self.steps,
                "cpu_seconds_per_step": round(self.seconds_per_step(), 4),
                "max_cpu_seconds": self.max_cpu_seconds, "train_wall_seconds": round(self.wall_seconds, 2),
                "max_train_seconds": self.max_train_seconds}


def resolve_checkpoint(value, output_dir) -> str | None:
    """`--resume_from_checkpoint`: a folder as given; `last` / `true` / `auto`: the newest `checkpoint-*` in
    `output_dir` (None when there is none yet, so the same command starts a run and resumes it)."""
    if value is None or str(value).lower() in ("", "none", "false", "no"):
        return None
    if str(value).lower() in ("last", "true", "auto", "yes"):
        from transformers.trainer_utils import get_last_checkpoint

        return get_last_checkpoint(str(output_dir)) if Path(output_dir).is_dir() else None
    return str(value)


def best_metric(config) -> str:
    """The metric that picks a run's best drafter: `replay_tau` (what serving gets, `training/replay.py`) when the
    evaluation reports it, else `tau_proxy` (uniform anchors, which overstates served tau: docs/tau_gap.md)."""
    return "replay_tau" if getattr(config, "replay_eval", False) else "tau_proxy"


class EvalCurveCallback(TrainerCallback):
    """`<output_dir>/eval_curve.json` (a list of points, one per evaluation) and `<output_dir>/best`.

    Args:
        output_dir: the run's folder.
        metric: the metric whose maximum picks the best drafter (`eval_` is prefixed when missing).
        save_best: also save the best drafter (and `tokenizer`, if given) to `<output_dir>/best`.
        budget: a `ComputeBudgetCallback` whose CPU seconds go into each point.
        extra: constant fields recorded in the file's header (e.g. the data and the shape).
    """

    def __init__(self, output_dir, metric: str = "tau_proxy", save_best: bool = True, tokenizer=None,
                 budget: ComputeBudgetCallback | None = None, extra: dict | None = None):
        self.output_dir = Path(output_dir)
        self.metric = metric if metric.startswith("eval_") else f"eval_{metric}"
        self.save_best, self.tokenizer, self.budget = save_best, tokenizer, budget
        self.path = self.output_dir / "eval_curve.json"
        self.best_dir = self.output_dir / "best"
        self.extra = extra or {}
        self.points: list[dict] = []
        self.runs: list[dict] = []
        if self.path.is_file():
            stored = json.loads(self.path.read_text())
            self.points, self.runs = stored.get("points", []), stored.get("runs", [])
        self.best = None
        best_file = self.best_dir / "best_metrics.json"
        if best_file.is_file():
            self.best = json.loads(best_file.read_text()).get(self.metric)
        self._wall = time.time()

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        # Points past the step we (re)start from belong to an abandoned continuation.
        kept = [p for p in self.points if p["step"] <= state.global_step]
        if self.budget is not None and kept:
            self.budget.offset = kept[-1].get("train_cpu_seconds", 0.0)
        self.points = kept
        self.runs.append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "from_step": state.global_step,
                          "max_steps": state.max_steps, **self.extra})
        self._dump()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        if not state.is_world_process_zero or not metrics:
            return
        step = state.global_step
        previous = self.points[-1]["step"] if self.points else 0
        losses = [h["loss"] for h in state.log_history if "loss" in h and previous < h.get("step", 0) <= step]
        point = {"step": step, "epoch": round(float(state.epoch or 0.0), 4),
                 "wall_seconds": round(time.time() - self._wall, 1)}
        if self.budget is not None:
            point["train_cpu_seconds"] = round(self.budget.offset + self.budget.cpu_seconds, 3)
        if losses:
            point["train_loss"] = round(sum(losses) / len(losses), 5)
        point.update({k: round(float(v), 5) for k, v in metrics.items() if isinstance(v, (int, float))})
        self.points = [p for p in self.points if p["step"] < step] + [point]
        value = metrics.get(self.metric)
        if value is not None and (self.best is None or value > self.best):
            self.best = float(value)
            if self.save_best:
                model = kwargs.get("model")
                if model is not None:
                    model = getattr(model, "module", model)
                    model.save_pretrained(self.best_dir)
                    if self.tokenizer is not None:
                        self.tokenizer.save_pretrained(self.best_dir)
                    _write_json(self.best_dir / "best_metrics.json", point)
        self._dump()

    def _dump(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        best = max(self.points, key=lambda p: p.get(self.metric, -math.inf)) if self.points else None
        _write_json(self.path, {"metric": self.metric, "best": best, "runs": self.runs, "points": self.points})


__all__ = ["ComputeBudgetCallback", "EvalCurveCallback", "best_metric", "resolve_checkpoint"]
