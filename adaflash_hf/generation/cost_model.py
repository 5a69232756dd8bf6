# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""What a speculative round costs on the device it runs on, and the verify lengths that pay the most.

`TargetCostModel` holds measured latencies of

* one target forward that verifies `n` tokens per row for `b` rows over a cached context (`points[b][n]`), and
* one drafting step for `b` rows: a drafter forward over a block plus the draft logits (`draft[b]`),

interpolated linearly between measured points (in `n` and in `b`; extrapolated from the last two). It records the
device, dtype and CPU threads it was measured with: numbers from a 2-core CPU say nothing about a GPU, where a forward
of 1-16 tokens x 1-64 rows costs about the same (launch-bound). `calibrate` measures it (synchronizing the device
before every clock read, so GPU timings are kernels, not launches); `cost_model_for` returns the one measured for
the current target/drafter/device/dtype/threads from a cache under `~/.cache/adaflash_hf/cost_models`, calibrating
it when missing and saying so in the log.

A cost model from another device is applied only when the user passes it explicitly (a SIMULATED device:
`SpeculationRuntime(cost_model=TargetCostModel.load(FILE))`, `--cost-model FILE`): the proposal policy and the
length rule then decide with that device's costs, and the log says so. One that arrived implicitly, beside a
checkpoint (a length head folder's `cost_model.json`, loaded with `implicit=True`), is never applied where it was
not measured: a cost model measured here replaces it. `adaflash_hf/cost_models/` ships reference devices
(`shipped_cost_model("h200-smollm2-135m")`).

Calibration is bounded: it measures the corners a call needs, rows `1` and the call's batch size `B`, verify widths
`1`, `2` and the drafter's block (`calibration_tokens`), and interpolates everything in between (`interpolated()` lists
those points; the saved JSON records both). A later call with more rows measures only its own size. Each point is
timed a few times, or once when a single run already exceeds `budget_s`; the context cache is prefilled for one row
and repeated to `B` rows (so `B` x context tokens are never prefilled), and random inputs come from a private
generator (the global RNG, and so the seeded outputs of the call that calibrates, are untouched). One calibration at
a time per cache file: `cost_model_for` holds an `fcntl` lock next to it; a thread or process that waited reads
what the first one wrote. `adaflash-hf calibrate` measures ahead of serving.

A forward never gets cheaper with more tokens or more rows, so a measurement that says otherwise was taken while
something else ran (`inconsistencies()`; one such cache file had a one-token forward at 1350 ms against 37 ms, which
made every plain round look dearer than a drafted one). `calibrate` measures a disturbed model again, keeping each
point's fastest time, and `cost_model_for` measures a cached one again instead of deciding with it.

`verify_lengths(survival, budgets, cost, ...)` is the one length rule of both engines (bs=1 is `b = 1`): the padded
verify forward costs the same for every row, so all rows verify `min(M, budget_r)` drafted tokens with the `M`
maximising the batch's expected committed tokens per second of round time

    sum_r (1 + sum_{k <= min(M, budget_r)} S_r(k)) / (fixed_seconds + cost.seconds(M + 1, b)),

where `S_r(k)` is the length head's survival (P(the first k drafted tokens of row r are all accepted)).
"""

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..utils.cache import cache_dir, file_lock
from .attention import masked_gqa


logger = logging.getLogger(__name__)

DEFAULT_NUM_TOKENS = (1, 2, 4, 8, 16)
POINT_BUDGET_S = 1.0  # a point whose runs take longer is timed MIN_TIMED_RUNS times
MIN_TIMED_RUNS = 2
# A forward never gets cheaper with more tokens or more rows. A measured point below SLACK x a narrower (or smaller)
# one, by more than ABS_S, means the machine was busy while the narrower one ran: the calibration is disturbed.
MONOTONE_SLACK, MONOTONE_ABS_S = 0.8, 2e-3
# Nor does a one-token forward cost more PER ROW with more rows (it reads the weights once for all rows: per-row cost
# falls, or stays flat where attention dominates). A 64-row point above SLACK x the per-row cost of a smaller batch
# was measured busy: a cache from a session with a background job read 64x1 at 888 ms (13.9 ms a row against 16
# rows' 6.6), 317 ms quiet, which made plain rounds look dear and speculation cheap at 64 rows. Wider verifies are
# left out: on a CPU 64 rows x 2 tokens really cost ~2x per row what 16 x 2 do (measured quiet, twice).
PER_ROW_SLACK = 1.5
CALIBRATION_ATTEMPTS = 3
MASKED_SLOTS = 3  # invalid cache slots in a calibration forward's attention mask (the engine's forwards have some)


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA, XPU, MPS, ...; a no-op on CPU) before reading a clock."""
    device = torch.device(device)
    if device.type == "cpu":
        return
    module = getattr(torch, device.type, None)
    sync = getattr(module, "synchronize", None)
    if sync is not None:
        sync(device) if device.type in ("cuda", "xpu") else sync()


def device_name(device) -> str:
    """`"cpu"`, or the accelerator's type and model name, e.g. `"cuda:NVIDIA H200"`."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def _interp(xs_ys: dict[int, float], x: float) -> float:
    """Piecewise-linear interpolation over `{x: y}`, extrapolated from the two points at either end."""
    xs = sorted(xs_ys)
    if len(xs) == 1:
        return xs_ys[xs[0]]
    if x <= xs[0]:
        lo, hi = xs[0], xs[1]
    elif x >= xs[-1]:
        lo, hi = xs[-2], xs[-1]
    else:
        hi = next(v for v in xs if v >= x)
        lo = xs[xs.index(hi) - 1]
    slope = (xs_ys[hi] - xs_ys[lo]) / (hi - lo)
    return max(xs_ys[lo] + slope * (x - lo), 1e-9)


@dataclass
class TargetCostModel:
    """Latencies (seconds) of one speculative round's forwards on one device (module docstring).

    Attributes:
        points: `points[batch_size][num_tokens]` seconds of a verify forward of `num_tokens` per row.
        draft: `draft[batch_size]` seconds of one drafting step (drafter forward + draft logits); empty: unknown (0).
        device, dtype, threads: what the numbers were measured on (`device_name`, e.g. "cpu", "cuda:NVIDIA H200").
        key: fingerprint of the target/drafter shapes the numbers describe (`cost_key`).
        assumptions: what the numbers do not come from a measurement of (e.g. an assumed drafting step).
        measurements: how many measurements each point is the fastest of (`calibrate` repeats a disturbed one;
            0: not recorded). A cached model that is inconsistent after every attempt is trusted (the device
            jitters); one with fewer is measured again.
        implicit: loaded beside a checkpoint rather than passed by the user: applied only on the device it
            describes (never saved; module docstring).
        overhead: `overhead[kind][batch_size]` seconds a round of `kind` ("plain": no proposal; "spec": a verified
            proposal) spends outside the forwards: host work and small kernels (`bench/overhead.py` measures it);
            empty: not known (0). A drafted round at 64 rows on the H200 reference paid ~13 ms of it, a plain one ~2.
    """

    points: dict[int, dict[int, float]] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)
    context_length: int = 256
    device: str = ""
    dtype: str = ""
    threads: int = 0
    key: str = ""
    description: str = ""
    assumptions: str = ""
    measurements: int = 0
    implicit: bool = field(default=False, compare=False)  # arrived beside a checkpoint, not passed by the user
    overhead: dict[str, dict[int, float]] = field(default_factory=dict)
    _rounds: dict = field(default_factory=dict, compare=False, repr=False)  # round_seconds memo (the policy's loop)

    def seconds(self, num_tokens: int, batch_size: int = 1) -> float:
        """Latency of verifying `num_tokens` per row for `batch_size` rows (interpolated)."""
        if not self.points:
            raise ValueError("empty cost model: use cost_model_for(target, drafter) or TargetCostModel.calibrate.")
        per_b = {b: _interp(row, num_tokens) for b, row in self.points.items()}
        return _interp(per_b, batch_size)

    def draft_seconds(self, batch_size: int = 1) -> float:
        """Latency of one drafting step for `batch_size` rows (0 when the model has no drafter points)."""
        return _interp(self.draft, batch_size) if self.draft else 0.0

    def overhead_seconds(self, kind: str, batch_size: int = 1) -> float:
        """Seconds a round of `kind` ("plain" / "spec") spends outside the forwards for `batch_size` rows
        (interpolated; 0 when not measured)."""
        table = self.overhead.get(kind)
        return _interp(table, batch_size) if table else 0.0

    def with_overhead(self, overhead: dict[str, dict[int, float]]) -> "TargetCostModel":
        """A copy that also prices each round's work outside the forwards (`overhead`, see the attribute)."""
        table = {kind: {int(b): max(float(s), 0.0) for b, s in rows.items()} for kind, rows in overhead.items()}
        return dataclasses.replace(self, overhead=table, _rounds={})

    def round_seconds(self, drafted: int, batch_size: int = 1, drafts: bool = True) -> float:
        """A round that verifies `drafted` tokens per row (plus the row's own token), with or without drafting, and
        its work outside the forwards (`overhead`). Memoised (the policy asks for the same few shapes every round);
        `extend` clears the memo."""
        key = (drafted, batch_size, drafts)
        if key not in self._rounds:
            kind = "spec" if drafted > 0 or drafts else "plain"
            self._rounds[key] = self.seconds(drafted + 1, batch_size) + (
                self.draft_seconds(batch_size) if drafts else 0.0) + self.overhead_seconds(kind, batch_size)
        return self._rounds[key]

    def batch_sizes(self) -> list[int]:
        return sorted(self.points)

    def num_tokens(self) -> list[int]:
        """Every verify width measured (for some batch size)."""
        return sorted({n for row in self.points.values() for n in row})

    def is_measured(self, num_tokens: int, batch_size: int = 1) -> bool:
        return num_tokens in self.points.get(batch_size, {})

    def interpolated(self) -> dict[str, dict[int, dict[int, float]]]:
        """What the model fills in between its measured points: `{"points": {b: {n: seconds}}, "draft": {b: s}}`
        over batch sizes 1, 2, 4, ... up to the largest measured one and widths 1 .. the widest measured one."""
        if not self.points:
            return {"points": {}, "draft": {}}
        top = max(self.points)
        sizes = sorted({1 << k for k in range(top.bit_length()) if 1 << k <= top} | set(self.points))
        widths = range(1, max(self.num_tokens()) + 1)
        points = {b: {n: self.seconds(n, b) for n in widths if not self.is_measured(n, b)} for b in sizes}
        draft = {b: self.draft_seconds(b) for b in sizes if self.draft and b not in self.draft}
        return {"points": {b: row for b, row in points.items() if row}, "draft": draft}

    def covers(self, batch_size: int, drafts: bool = False, widths=(), grid: bool = False) -> bool:
        """Whether batch sizes 1..`batch_size` lie within the measured ones (and drafting steps, with `drafts`), and
        every measured batch size has each of `widths` measured (`calibration_tokens`; an older cache lacks some);
        with `grid`, also the sizes `calibration_batches(batch_size)` puts below it (an older cache measured only 1
        and the max)."""
        sizes = [self.points] + ([self.draft] if drafts else [])
        return (all(table and min(table) <= 1 and max(table) >= batch_size for table in sizes)
                and all(n in row for row in self.points.values() for n in widths)
                and (not grid or all(b in table for table in sizes
                                     for b in calibration_batches(batch_size) if b < batch_size)))

    def describes(self, device, dtype=None, threads: int | None = None) -> bool:
        """Whether these numbers were measured on `device` (and dtype / CPU threads, when given)."""
        if self.device != device_name(device):
            return False
        if dtype is not None and self.dtype and self.dtype != str(dtype).replace("torch.", ""):
            return False
        if threads is not None and torch.device(device).type == "cpu" and self.threads and self.threads != threads:
            return False
        return True

    def inconsistencies(self) -> list[str]:
        """Measured points that contradict how a forward's cost grows: a wider verify or more rows (or a drafting
        step for more rows) timed below `MONOTONE_SLACK` x a narrower / smaller one, by more than `MONOTONE_ABS_S`;
        or a one-token forward of more rows dearer per row than `PER_ROW_SLACK` x a smaller batch's.
        Such a model was measured while something else ran; empty when consistent."""
        def compare(table: dict, label) -> list[str]:
            keys = sorted(table)
            return [f"{label(hi)} {table[hi] * 1e3:.1f} ms < {label(lo)} {table[lo] * 1e3:.1f} ms"
                    for i, hi in enumerate(keys) for lo in keys[:i]
                    if table[hi] < MONOTONE_SLACK * table[lo] and table[lo] - table[hi] > MONOTONE_ABS_S]

        found = [p for b, row in sorted(self.points.items()) for p in compare(row, lambda n, b=b: f"{b}x{n}")]
        for n in self.num_tokens():
            found += compare({b: row[n] for b, row in self.points.items() if n in row}, lambda b, n=n: f"{b}x{n}")
        single = sorted((b, row[1]) for b, row in self.points.items() if 1 in row)
        found += [f"{hi}x1 {t_hi * 1e3:.1f} ms > {PER_ROW_SLACK} x {hi}/{lo} x ({lo}x1 {t_lo * 1e3:.1f} ms)"
                  for i, (hi, t_hi) in enumerate(single) for lo, t_lo in single[:i]
                  if t_hi / hi > PER_ROW_SLACK * t_lo / lo and t_hi - t_lo * hi / lo > MONOTONE_ABS_S]
        return found + compare(self.draft, lambda b: f"drafting {b} rows")

    def merged_min(self, other: "TargetCostModel") -> "TargetCostModel":
        """Per point, the faster of two measurements of the same setup (interference only ever adds time)."""
        points = {b: {n: min(t, other.points.get(b, {}).get(n, t)) for n, t in row.items()}
                  for b, row in self.points.items()}
        draft = {b: min(t, other.draft.get(b, t)) for b, t in self.draft.items()}
        return dataclasses.replace(self, points=points, draft=draft, measurements=self.measurements + 1, _rounds={})

    # ------------------------------------------------------------------------------------------------ measuring
    @classmethod
    def calibrate(cls, target, drafter=None, num_tokens=None, batch_sizes=(1,), context_length: int = 256,
                  repeats: int = 3, budget_s: float = POINT_BUDGET_S, progress: bool = True, seed: int = 0,
                  attempts: int = CALIBRATION_ATTEMPTS) -> "TargetCostModel":
        """Time target verify forwards (and drafting steps, with `drafter`) on the target's device.

        Args:
            num_tokens: verify widths to measure (default `calibration_tokens(drafter)`: 1, 2 and the block).
            batch_sizes: rows to measure (`cost_model_for` asks for 1 and the call's batch size).
            repeats: a point is the fastest of this many timed runs after one warm-up, fewer (at least
                `MIN_TIMED_RUNS`) once the point took `budget_s` seconds; the warm-up is never timed.
            progress: show a progress bar over the points.
            seed: of the private generator drawing the random inputs (the global RNG is not touched).
            attempts: a measurement with `inconsistencies()` (the machine was busy) is repeated, up to this many
                times in all, keeping each point's fastest time; what is still inconsistent is logged.
        The device is synchronized before every clock read.
        """
        args = (target, drafter, num_tokens, batch_sizes, context_length, repeats, budget_s, progress)
        model = cls._measure(*args, seed=seed)
        model.measurements = 1
        problems = model.inconsistencies()
        while model.measurements < attempts and problems:
            logger.warning("cost model calibration disturbed (%s): measuring again (%d/%d)", "; ".join(problems),
                           model.measurements + 1, attempts)
            model = model.merged_min(cls._measure(*args, seed=seed + model.measurements))
            problems = model.inconsistencies()
        if problems:
            logger.warning("cost model still inconsistent after %d measurements: %s", attempts, "; ".join(problems))
        return model

    @classmethod
    @torch.inference_mode()
    def _measure(cls, target, drafter, num_tokens, batch_sizes, context_length, repeats, budget_s, progress,
                 seed: int) -> "TargetCostModel":
        """One measurement of every point (`calibrate`'s arguments)."""
        from transformers import DynamicCache

        device = target.device
        vocab = target.config.get_text_config().vocab_size
        num_tokens = calibration_tokens(drafter) if num_tokens is None else tuple(num_tokens)
        rng = torch.Generator().manual_seed(seed)
        points: dict[int, dict[int, float]] = {}
        draft: dict[int, float] = {}

        def once(fn) -> float:
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            return time.perf_counter() - start

        def timed(fn) -> float:
            # The warm-up is never the measurement, even for a slow point: the first call of a new shape pays for
            # allocations (64 rows x 1 token on a CPU: 1.24 s warm vs 0.5 s after), which once made large batches
            # look ~2x dearer per plain round and speculation look cheap there. At least one run follows it.
            # The fastest of at least two timed runs: interference only ever adds time, and a point timed once on
            # a noisy machine read 64 rows x 1 token at 666 ms against 576 ms for 2 tokens (364 ms quiet).
            spent = once(fn)
            times = []
            for _ in range(max(repeats, MIN_TIMED_RUNS)):
                times.append(once(fn))
                spent += times[-1]
                if spent >= budget_s and len(times) >= MIN_TIMED_RUNS:
                    break
            return min(times)

        bar = tqdm(total=len(batch_sizes) * (len(num_tokens) + (drafter is not None)), disable=not progress,
                   desc=f"calibrating the cost model on {device_name(device)}", unit="point", leave=False)
        for b in batch_sizes:
            ctx = torch.randint(0, vocab, (1, context_length), generator=rng).to(device)
            cache = DynamicCache(config=target.config)
            target(input_ids=ctx, cache=cache, use_cache=True, logits_to_keep=1)
            if b > 1:  # every row shares the one prefilled context: B x context tokens are never prefilled
                cache.batch_repeat_interleave(b)
            points[b] = {}
            for n in num_tokens:
                bar.set_postfix(rows=b, tokens=n)
                new = torch.randint(0, vocab, (b, n), generator=rng).to(device)
                # masked as the engine's forwards are (left padding, rejected slots): transformers' SDPA path under a
                # mask differs from the unmasked one (`attention.py`), and a one-token forward without it was timed
                # on the cheaper path than the engine's plain rounds run
                mask = torch.ones(b, context_length + n, dtype=torch.long, device=device)
                mask[:, :MASKED_SLOTS] = 0

                def verify():
                    target(input_ids=new, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=n)
                    cache.crop(-n)

                points[b][n] = timed(verify)
                bar.update()
            del cache
            if drafter is not None:
                bar.set_postfix(rows=b, drafting=True)
                draft[b] = timed(_drafting_step(target, drafter, b))
                bar.update()
        bar.close()
        return cls(points=points, draft=draft, context_length=context_length, device=device_name(device),
                   dtype=str(target.dtype).replace("torch.", ""), threads=torch.get_num_threads(),
                   key=cost_key(target, drafter),
                   description=f"{type(target).__name__} {target.dtype} on {device_name(device)}, "
                               f"threads={torch.get_num_threads()}")

    def extend(self, target, drafter=None, batch_sizes=(), **kwargs) -> "TargetCostModel":
        """Measure the batch sizes this model lacks (same device) and add them; returns self."""
        missing = [b for b in batch_sizes if b not in self.points or (drafter is not None and b not in self.draft)]
        if self.covers(max(batch_sizes, default=1), drafts=drafter is not None, grid=True):
            missing = []
        if missing:
            kwargs.setdefault("num_tokens", self.num_tokens() or None)
            more = type(self).calibrate(target, drafter, batch_sizes=missing, context_length=self.context_length,
                                        **kwargs)
            self.points.update(more.points)
            self.draft.update(more.draft)
            self._rounds.clear()
        return self

    # ------------------------------------------------------------------------------------------------ storing
    def to_dict(self) -> dict:
        """`points` / `draft`: the measured seconds; `interpolated`: what the model fills in between (not read back)."""
        return {"points": self.points, "draft": self.draft, "context_length": self.context_length,
                "device": self.device, "dtype": self.dtype, "threads": self.threads, "key": self.key,
                "description": self.description, **({"assumptions": self.assumptions} if self.assumptions else {}),
                **({"measurements": self.measurements} if self.measurements else {}),
                **({"overhead": self.overhead} if self.overhead else {}),
                "interpolated": self.interpolated()}

    def save(self, path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, path, implicit: bool = False) -> "TargetCostModel":
        """A saved cost model. `implicit=True` for one found beside a checkpoint (applied only where it was
        measured); one the user loads and passes is applied on any device (a simulated device)."""
        data = json.loads(Path(path).read_text())
        points = {int(b): {int(n): float(s) for n, s in row.items()} for b, row in data["points"].items()}
        draft = {int(b): float(s) for b, s in data.get("draft", {}).items()}
        return cls(points=points, draft=draft, context_length=data.get("context_length", 256),
                   device=data.get("device", ""), dtype=data.get("dtype", ""), threads=int(data.get("threads", 0)),
                   key=data.get("key", ""), description=data.get("description", ""),
                   assumptions=data.get("assumptions", ""), measurements=int(data.get("measurements", 0)),
                   overhead={kind: {int(b): float(s) for b, s in rows.items()}
                             for kind, rows in data.get("overhead", {}).items()},
                   implicit=implicit)


def _drafting_step(target, drafter, b: int):
    """A closure running one drafting step for `b` rows: drafter forward over a block + a short new context."""
    cfg = drafter.config
    param = next(drafter.parameters())
    features = len(cfg.target_layer_ids) * cfg.hidden_size
    block = int(cfg.block_size)
    embeddings = target.get_input_embeddings()
    lm_head = target.get_output_embeddings()
    ids = torch.full((b, block), int(cfg.mask_token_id), dtype=torch.long, device=target.device)
    context = torch.zeros(b, 2, features, dtype=param.dtype, device=param.device)
    positions = torch.arange(block + 2, device=param.device)[None].expand(b, -1)

    def step():
        states = drafter(noise_embeds=embeddings(ids), context_hidden_states=context,
                         position_ids=positions).last_hidden_state[:, 1:]
        if hasattr(drafter, "draft_logits"):
            drafter.draft_logits(states, lm_head)
        else:
            lm_head(states.to(lm_head.weight.dtype))

    return step


def cost_key(target, drafter=None) -> str:
    """Fingerprint of what a cost model's numbers depend on besides the device: model shapes and dtypes."""
    tc = target.config.get_text_config()
    parts = [type(target).__name__, str(target.dtype), tc.hidden_size, tc.num_hidden_layers, tc.vocab_size,
             getattr(tc, "intermediate_size", None), getattr(tc, "num_attention_heads", None),
             getattr(tc, "num_key_value_heads", None)]
    if drafter is not None:
        dc = drafter.config
        parts += [str(next(drafter.parameters()).dtype), dc.num_hidden_layers, dc.block_size, dc.hidden_size,
                  getattr(dc, "draft_vocab_size", None), len(dc.target_layer_ids)]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def calibration_tokens(drafter=None) -> tuple[int, ...]:
    """The verify widths calibration measures: 1, 2 and the widest a round verifies (the drafter's block: its
    drafted tokens + the row's own; 16 without a drafter).

    2 is the narrowest speculative verify, and on a CPU the step from one token per row to two is the dearest one:
    16 rows measured 107, 212, 241 and 397 ms for 1, 2, 3 and 8 tokens, where a line from 1 to 8 puts 2 and 3
    tokens at 151 and 196 ms, so drafted rounds at many rows looked cheaper than they were and the policy chose them
    where they lost. Most of that step was transformers copying the KV cache for a masked multi-token forward
    (`attention.py`; 16 x 2: 297 -> 228 ms without the copy)."""
    widest = int(drafter.config.block_size) if drafter is not None else DEFAULT_NUM_TOKENS[-1]
    return tuple(sorted({1, min(2, widest), widest}))


def cache_path(target, drafter=None) -> Path:
    """Where `cost_model_for` caches the cost model of this target/drafter on the target's device and threads, and
    the attention path of masked forwards (`attention.masked_gqa`)."""
    name = device_name(target.device).replace(":", "-").replace(" ", "_").replace("/", "_")
    path = "-gqa" if masked_gqa() else ""  # masked forwards without the KV copy: other costs (`attention.py`)
    return cache_dir() / "cost_models" / f"{cost_key(target, drafter)}-{name}-t{torch.get_num_threads()}{path}.json"


def shipped_cost_model(name: str) -> TargetCostModel:
    """A reference device's cost model shipped in `adaflash_hf/cost_models/NAME.json` (explicit: applied as given)."""
    path = Path(__file__).resolve().parent.parent / "cost_models" / f"{name}.json"
    if not path.is_file():
        names = sorted(p.stem for p in path.parent.glob("*.json"))
        raise FileNotFoundError(f"no shipped cost model {name!r}; shipped: {', '.join(names) or 'none'}")
    return TargetCostModel.load(path)


def calibration_batches(needed: int) -> list[int]:
    """Batch sizes a calibration up to `needed` rows measures: 1, 4, 16, ... below `needed`, and `needed`.

    Rows between are interpolated linearly, and a CPU's costs are far from linear in rows: measured 1 and 64 rows
    only, 2 tokens x 16 rows read 424 ms (measured: 189 ms), so the policy never probed a drafter at 4-16 rows. A
    factor of 4 between points keeps a calibration to 64 rows at 4 sizes (~15 s on this CPU, ~1 s on an H200)."""
    sizes, b = {1, needed}, 4
    while b < needed:
        sizes.add(b)
        b *= 4
    return sorted(sizes)


def cost_model_for(target, drafter=None, batch_sizes=(1,), candidate: TargetCostModel | None = None,
                   calibrate: bool = True, progress: bool = True) -> TargetCostModel | None:
    """The cost model of `target` (+ `drafter`) on the target's current device, dtype and CPU threads.

    `candidate` (e.g. one shipped with a length head) is used when it was measured on this device/dtype/threads and
    covers `batch_sizes`; one from another device is used as given when it was passed explicitly (not `implicit`:
    a simulated device, logged once per model). Otherwise the cached measurement for this setup (`cache_path`) is
    loaded; when it does not reach `max(batch_sizes)` rows (or there is none), `calibration_batches(max(batch_sizes))`
    are measured (1, 4, 16, ... rows; logged, with a progress bar unless `progress=False`), under a file lock so that
    only one thread or process measures at a time (the others wait, then read what it wrote), and cached.
    `calibrate=False` returns the cached model or None instead of measuring.
    """
    dtype, threads = target.dtype, torch.get_num_threads()
    widths = calibration_tokens(drafter)  # a cache (or a checkpoint's cost model) lacking one is measured again
    if candidate is not None and candidate.describes(target.device, dtype, threads):
        if candidate.covers(max(batch_sizes), drafts=drafter is not None, widths=widths if candidate.implicit else ()):
            return candidate
    elif candidate is not None and not candidate.implicit:
        if not getattr(candidate, "_announced", False):
            candidate._announced = True
            logger.warning("deciding with the costs of %s (%s), passed explicitly, not with this %s's: a simulated "
                           "device (outputs are unchanged; measured speeds are this machine's)",
                           candidate.device or "an unnamed device", candidate.dtype or "?", device_name(target.device))
        return candidate
    elif candidate is not None:
        logger.warning("cost model measured on %s (%s, threads=%s) does not describe %s (%s, threads=%s): using one "
                       "measured here instead (pass one explicitly to simulate another device)",
                       candidate.device or "an unknown device", candidate.dtype or "?", candidate.threads or "?",
                       device_name(target.device), dtype, threads)
    path, needed, drafts = cache_path(target, drafter), max(batch_sizes), drafter is not None
    model = _load_consistent(path, quiet=calibrate)  # when it is measured again, the check under the lock says so
    if not calibrate or (model is not None and model.covers(needed, drafts=drafts, widths=widths, grid=True)):
        return model
    with file_lock(path.with_name(path.name + ".lock"), "waiting for %s: another calibration of this cost model",
                   logger):
        model = _load_consistent(path)  # written while this one waited?
        if model is not None and model.covers(needed, drafts=drafts, widths=widths, grid=True):
            return model
        start, sizes = time.perf_counter(), calibration_batches(needed)
        if model is not None and not model.covers(1, widths=widths):  # cached before a width was calibrated
            sizes, model = sorted(set(sizes) | set(model.points)), None
        if model is not None:
            model.extend(target, drafter, batch_sizes=sizes, progress=progress)
            if model.inconsistencies():  # the new rows contradict the cached ones: measure every size again
                sizes = sorted(set(sizes) | set(model.points))
                model = None
        if model is None:
            model = TargetCostModel.calibrate(target, drafter, batch_sizes=sizes, progress=progress)
        model.save(path)
    logger.warning("calibrated the target's cost model on %s for batch sizes %s in %.1f s (measured %s, the rest "
                   "interpolated; cached in %s)", model.device, sizes, time.perf_counter() - start,
                   {b: sorted(row) for b, row in sorted(model.points.items())}, path)
    return model


def _load_consistent(path: Path, quiet: bool = False) -> TargetCostModel | None:
    """The cached model at `path`, or None when there is none or it is inconsistent with fewer than every
    calibration attempt behind it (measured on a busy machine: logged, and measured again by the caller)."""
    if not path.is_file():
        return None
    model = TargetCostModel.load(path)
    problems = model.inconsistencies()
    if problems and model.measurements < CALIBRATION_ATTEMPTS:
        if not quiet:
            logger.warning("the cached cost model %s was measured on a busy machine (%s): measuring it again", path,
                           "; ".join(problems))
        return None
    return model


def verify_lengths(survival: torch.Tensor, budgets: torch.Tensor, cost: TargetCostModel | None,
                   fixed_seconds: float = 0.0) -> torch.Tensor:
    """Per-row verify lengths `min(M, budget_r)` with the `M` that maximises expected committed tokens per second.

    Args:
        survival: `[b, n]` survival `S_r(k)` of each row's drafted positions (non-finite values count as 0).
        budgets: `[b]` most drafted tokens each row may verify (`<= n`).
        cost: the cost model; `None`: every length costs the same, so every row verifies its whole budget.
        fixed_seconds: the round's cost that does not depend on the length (the drafting step).
    Returns:
        `[b]` long, on `budgets`' device.
    """
    b, n = survival.shape
    if cost is None or b == 0 or n == 0:
        return budgets.clone()
    caps = budgets.to("cpu")
    k = torch.arange(1, n + 1)
    s = torch.nan_to_num(survival.float().cpu(), nan=0.0, posinf=0.0, neginf=0.0).clamp(0, 1)
    s = s * (k[None, :] <= caps[:, None])
    expected = torch.cat([torch.zeros(1), s.sum(dim=0).cumsum(dim=0)]) + b  # [n + 1]: sum over rows of E[commit]
    top = int(caps.max())
    seconds = torch.tensor([fixed_seconds + cost.seconds(m + 1, b) for m in range(top + 1)])
    m = int(torch.argmax(expected[: top + 1] / seconds))
    return budgets.clamp(max=m)


def best_length(survival: torch.Tensor, cost: TargetCostModel | None, fixed_seconds: float = 0.0) -> int:
    """bs=1 form of `verify_lengths`: `survival [n]` -> the number of drafted tokens to verify."""
    budget = torch.tensor([survival.shape[-1]])
    return int(verify_lengths(survival.reshape(1, -1), budget, cost, fixed_seconds)[0])


__all__ = ["TargetCostModel", "best_length", "cache_path", "calibration_tokens", "cost_key", "cost_model_for",
           "device_name", "shipped_cost_model", "synchronize", "verify_lengths"]
