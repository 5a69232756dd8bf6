"""Held-out acceptance against training-data size: train one drafter per size, same steps, same validation set.

    python examples/data_curve.py --sizes 150,300,600,1140 --max_steps 300 --output_dir outputs/curve

Each point runs `examples/train_drafter.py --max_train_sequences N` (the cached testbed data, the same held-out
split) and reads its final `eval_tau_proxy` (teacher-forced acceptance on held-out sequences). Writes
`curve.json` and `curve.png` in `--output_dir`.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="150,300,600,1140", help="training sequences per point")
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/curve"))
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="further arguments for train_drafter.py")
    args = parser.parse_args()
    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra  # `... -- --eval_steps 100` style
    points = []
    for size in [int(s) for s in args.sizes.split(",")]:
        out = args.output_dir / f"n{size}"
        cmd = [sys.executable, str(Path(__file__).with_name("train_drafter.py")), "--output_dir", str(out),
               "--max_train_sequences", str(size), "--max_steps", str(args.max_steps), "--save_strategy", "no",
               "--eval_strategy", "no", "--disable_tqdm", "true", *extra]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        summary = json.loads((out / "final" / "training_summary.json").read_text())
        points.append({"train_sequences": summary["train_sequences"], "train_tokens": summary["train_tokens"],
                       "tau_proxy": summary["eval"]["eval_tau_proxy"], "eval_loss": summary["eval"]["eval_loss"]})
        print(points[-1], flush=True)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "curve.json").write_text(json.dumps({"max_steps": args.max_steps, "points": points}, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([p["train_tokens"] for p in points], [p["tau_proxy"] for p in points], marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("training response tokens")
    ax.set_ylabel("held-out tau (teacher-forced)")
    ax.set_title(f"data size vs acceptance ({args.max_steps} steps each)")
    fig.tight_layout()
    fig.savefig(args.output_dir / "curve.png", dpi=120)
    print(f"wrote {args.output_dir / 'curve.json'} and curve.png")


if __name__ == "__main__":
    main()
