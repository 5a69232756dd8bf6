"""Drafter shapes under the same compute: held-out tau_proxy of each (layers x block size) for a fixed CPU budget.

    python examples/drafter_shapes.py --shapes 2x8,3x8,5x8,3x16,3x8r --cpu_minutes 9 \\
        --output_dir outputs/shapes --json docs/drafter_shapes.json -- --label_store --corpus_ratio 0.5

A shape is `LAYERSxBLOCK` (`r` at the end: random initialisation instead of the target's top layers). Each one
runs `examples/train_drafter.py` twice: a few steps to measure its CPU seconds per training step, then a run of
`budget / (seconds per step)` steps (cosine schedule to the end, stopped by `--max_cpu_seconds` at the latest),
evaluated on the same held-out set. CPU time (not wall-clock) is the budget, so a busy machine does not bias the
comparison. Arguments after `--` go to every train_drafter.py run (the data: the same for every shape). Several
invocations may share `--output_dir` (e.g. two shapes each on two cores); each writes the table of every finished
shape in it to `--json`.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run(out: Path, shape: str, extra: list[str], *args: str) -> dict:
    layers, block = shape.rstrip("r").split("x")
    cmd = [sys.executable, str(Path(__file__).with_name("train_drafter.py")), "--output_dir", str(out),
           "--num_layers", layers, "--block_size", block, "--init_from_target", str(not shape.endswith("r")).lower(),
           "--disable_tqdm", "true", *extra, *args]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / "final" / "training_summary.json").read_text())


def table(output_dir: Path) -> list[dict]:
    rows = []
    for summary_file in sorted(output_dir.glob("*/run/final/training_summary.json")):
        summary = json.loads(summary_file.read_text())
        curve_file = summary_file.parents[1] / "eval_curve.json"
        curve = json.loads(curve_file.read_text())["points"] if curve_file.is_file() else []
        script, compute = summary["script"], summary["compute"]
        rows.append({
            "shape": summary_file.parents[2].name, "num_layers": script["num_layers"],
            "block_size": script["block_size"], "init_from_target": script["init_from_target"],
            "steps": summary["steps"], "train_cpu_seconds": compute["train_cpu_seconds"],
            "cpu_seconds_per_step": compute["cpu_seconds_per_step"],
            **{k.removeprefix("eval_"): round(v, 4) for k, v in summary["eval"].items() if "tau_proxy" in k},
            "eval_loss": round(summary["eval"]["eval_loss"], 4), "train_tokens": summary["train_tokens"],
            "curve": [{"step": p["step"], "tau_proxy": p.get("eval_tau_proxy")} for p in curve],
        })
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2x8,3x8,5x8,3x16", help="LAYERSxBLOCK[r],... (r: random init)")
    parser.add_argument("--cpu_minutes", type=float, default=9.0, help="training CPU budget per shape")
    parser.add_argument("--calibration_steps", type=int, default=8, help="steps timed to size each run")
    parser.add_argument("--evals", type=int, default=4, help="held-out evaluations per run")
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/shapes"))
    parser.add_argument("--json", type=Path, default=None, help="write the table here too")
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments for train_drafter.py")
    args = parser.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    budget = 60.0 * args.cpu_minutes
    for shape in args.shapes.split(","):
        folder = args.output_dir / shape
        if (folder / "run" / "final" / "training_summary.json").is_file():
            print(f"{shape}: done already", flush=True)
            continue
        probe = run(folder / "calibrate", shape, extra, "--max_steps", str(args.calibration_steps),
                    "--save_strategy", "no", "--eval_strategy", "no", "--val_per_domain", "1")
        steps = max(1, int(budget / probe["compute"]["cpu_seconds_per_step"]))
        print(f"{shape}: {probe['compute']['cpu_seconds_per_step']:.2f} CPU s/step -> {steps} steps", flush=True)
        run(folder / "run", shape, extra, "--max_steps", str(steps), "--max_cpu_seconds", str(1.05 * budget),
            "--eval_strategy", "steps", "--eval_steps", str(max(1, steps // args.evals)), "--save_strategy", "no")
    rows = table(args.output_dir)
    result = {"cpu_minutes": args.cpu_minutes, "train_drafter_args": extra, "shapes": rows}
    for path in filter(None, [args.output_dir / "shapes.json", args.json]):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    for row in rows:
        print(f"{row['shape']:>6} steps {row['steps']:>5} ({row['cpu_seconds_per_step']:.2f} s/step) "
              f"tau_proxy {row.get('tau_proxy', float('nan')):.3f}", flush=True)


if __name__ == "__main__":
    main()
