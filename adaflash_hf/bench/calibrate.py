# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`adaflash-hf calibrate`: measure the target's cost model on this device ahead of serving.

Measures what `generate` / `generate_batch` would otherwise measure on their first call (rows 1 and `--max-batch`,
verify widths 1 and the drafter's block; the rest interpolated), caches it where they look for it
(`generation.cost_model.cache_path`) and prints the table, measured points marked `*`. A cost model already cached
for this target/drafter/device/dtype/threads that reaches `--max-batch` rows is only printed. `--overhead` also
measures what a plain and a speculative round cost outside the forwards at those rows (`bench/overhead.py`, on
synthetic prompts) and saves it in the same cached model, so the policy prices it on this device (~1 minute for
64 rows on a 2-core CPU).
"""

import torch


def add_parser(sub) -> None:
    from .args import drafter_dir, positive_int
    from .models import DEVICES

    p = sub.add_parser("calibrate", help="measure the target's cost model on this device ahead of serving",
                       description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--target", default=None, help="target model folder (default: the offline testbed model)")
    p.add_argument("--drafter", type=drafter_dir("--drafter"), default=None,
                   help="drafter folder (default: the shipped default drafter)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the models run (auto: the accelerator when there is one, else the CPU)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-batch", type=positive_int("--max-batch"), default=64,
                   help="most rows generate_batch will decode together (default 64)")
    p.add_argument("--threads", type=positive_int("--threads"), default=None,
                   help="torch CPU threads (a cost model is cached per thread count; use the serving one)")
    p.add_argument("--overhead", action="store_true",
                   help="also measure each round's work outside the forwards (host + small kernels) and cache it")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def format_table(model, max_batch: int) -> str:
    """Milliseconds per verify forward (rows x widths) and per drafting step; `*` marks measured points."""
    sizes = sorted({1 << k for k in range(max_batch.bit_length()) if 1 << k <= max_batch} | {max_batch}
                   | {b for b in model.points if b <= max_batch})
    widths = range(1, max(model.num_tokens()) + 1)
    lines = ["rows \\ tokens " + "".join(f"{n:>10}" for n in widths) + "    drafting"]
    for b in sizes:
        cells = "".join(f"{1e3 * model.seconds(n, b):9.2f}" + ("*" if model.is_measured(n, b) else " ")
                        for n in widths)
        draft = f"{1e3 * model.draft_seconds(b):9.2f}" + ("*" if b in model.draft else " ") if model.draft else ""
        lines.append(f"{b:>13} " + cells + "   " + draft)
    return "\n".join(lines) + "\n(ms; * measured, the rest interpolated)"


def main(args) -> dict:
    from ..generation.cost_model import cache_path, cost_model_for
    from .models import load_models

    if args.threads:
        torch.set_num_threads(args.threads)
    target, _, drafter = load_models(args.target, args.drafter, getattr(torch, args.dtype), args.device)
    path = cache_path(target, drafter)
    before = path.stat().st_mtime_ns if path.is_file() else None
    model = cost_model_for(target, drafter, batch_sizes=(1, args.max_batch), progress=not args.quiet)
    measured = before is None or path.stat().st_mtime_ns != before
    print(f"{'measured' if measured else 'already cached'}: {model.description} -> {path}")
    print(format_table(model, args.max_batch))
    if args.overhead:
        model = _with_overhead(target, drafter, model, args.max_batch, progress=not args.quiet)
        model.save(path)
        print("round overhead (ms outside the forwards): " + "; ".join(
            f"{kind} " + ", ".join(f"{b} rows {1e3 * t:.2f}" for b, t in sorted(rows.items()))
            for kind, rows in model.overhead.items()))
    return {"path": str(path), "measured": measured, "model": model}


def _with_overhead(target, drafter, model, max_batch: int, progress: bool):
    """`model` with the round overhead measured at `calibration_batches(max_batch)` rows on synthetic prompts (the
    work outside the forwards depends on shapes, not on the text)."""
    from ..generation.cost_model import calibration_batches
    from .overhead import measure_round_overhead

    g = torch.Generator().manual_seed(0)
    vocab = target.config.get_text_config().vocab_size
    prompts = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(8)]
    table = measure_round_overhead(target, drafter, prompts, calibration_batches(max_batch), model,
                                   progress=progress)
    return model.with_overhead(table)


__all__ = ["add_parser", "format_table", "main"]
