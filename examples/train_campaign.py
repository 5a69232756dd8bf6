"""Train the default drafter as a campaign: one command runs the next leg where the last one stopped.

    python examples/train_campaign.py --leg_cpu_minutes 60          # record what is missing, then train one leg
    python examples/train_campaign.py --status                      # the campaign's curve so far, nothing runs
    python examples/train_campaign.py --cooldown_steps 800          # last in a session: anneal, then compare

Each leg (1) records the hidden states of label-store entries not yet recorded (cached per shard under
`~/.cache/adaflash_hf/labels/...`, so an interrupted recording loses one shard at most), then (2) trains
`examples/train_drafter.py` with the fixed recipe below and `--resume_from_checkpoint last`: model, optimizer,
scheduler and data order continue from the newest checkpoint in the campaign folder
(`~/.cache/adaflash_hf/campaign/<name>`, outside the repository). On a machine with no checkpoint yet the leg
starts from the committed default drafter (`--init_drafter`). A leg stops after `--leg_cpu_minutes` of training
CPU time and saves a checkpoint there. Every evaluation appends `eval_tau_proxy` and `eval_replay_tau` (the tau
drafter-only greedy serving gets on the store's held-out responses) to `eval_curve.json`, with the cumulative
training CPU seconds: that curve is the campaign's progress.

Recording costs one teacher-forced target forward per stored token, made by a bf16 copy of the target
(`--record_dtype bfloat16`, in the recipe): ~600 tokens/s on 2 CPU threads (fp32: ~390), so the whole store
(1.2M tokens) takes ~35 minutes there, and a new machine starts with an empty cache. A leg on a slice of the
store records only that slice: `--name sub300 -- --max_responses_per_domain 300` (the first 300 responses of each
domain, ~20 minutes; a change of data or recipe is a new campaign name, so curves stay comparable).

Machines do not outlive a session here, and the cache goes with them, so each leg is also written to a history
file in the repository (`docs/campaign_history.json`, `--history`): its points, the weights it warm-started from and
its best weights (sha256 prefixes). `--status` prints that history beside this machine's curve, including legs on
machines that are gone, and marks the leg whose best weights are the shipped drafter's (promoted), so the
tau-vs-CPU-hours curve spans sessions. A leg stopped by hand (at a checkpoint) is written with `--record`.

A leg stops on a CPU budget with its learning rate near the peak (cosine over 20k steps). Before comparing, anneal
it: `--cooldown_steps N` trains the newest checkpoint's weights with the learning rate falling linearly to 0 over N
steps (`cooldown_command`); the next session warm-starts from whatever was promoted.

A leg never replaces the shipped drafter. Promote one only when its served tau on held-out prompts beats the
shipped one: `adaflash-hf compare --drafters <shipped>,<campaign>/best --labels shipped,campaign`.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from adaflash_hf.checkpoints import default_drafter_dir
from adaflash_hf.utils.cache import cache_dir

HERE = Path(__file__).resolve().parent
HISTORY = HERE.parent / "docs" / "campaign_history.json"
POINT_FIELDS = ("step", "train_cpu_seconds", "eval_tau_proxy", "eval_replay_tau")

# The recipe: fixed for the whole campaign (a change of recipe is a new campaign name).
RECIPE = ["--label_store", "--corpus_ratio", "0", "--holdout_permille", "100", "--val_per_domain", "31",
          "--learning_rate", "3e-4", "--lr_scheduler_type", "cosine", "--warmup_steps", "100",
          "--per_device_train_batch_size", "4", "--num_anchors", "32", "--max_steps", "20000",
          "--eval_strategy", "steps", "--eval_steps", "250", "--save_strategy", "steps", "--save_steps", "250",
          "--save_total_limit", "2", "--logging_steps", "50", "--resume_from_checkpoint", "last",
          "--record_dtype", "bfloat16"]


def campaign_dir(name: str) -> Path:
    return cache_dir() / "campaign" / name


def leg_command(name: str, leg_cpu_minutes: float, init_drafter: str | None, extra: list[str]) -> list[str]:
    """The `train_drafter.py` command line of one leg."""
    init = init_drafter or str(default_drafter_dir())
    return [sys.executable, str(HERE / "train_drafter.py"), *RECIPE, "--init_drafter", init,
            "--max_cpu_seconds", str(60 * leg_cpu_minutes), "--output_dir", str(campaign_dir(name)), *extra]


def _value(args: list[str], flag: str) -> str:
    """The value after `flag` in `args`."""
    return args[args.index(flag) + 1]


def _set(args: list[str], flag: str, value: str) -> list[str]:
    """`args` with `flag`'s value replaced (appended when absent)."""
    if flag not in args:
        return [*args, flag, value]
    i = args.index(flag)
    return [*args[: i + 1], value, *args[i + 2 :]]


def cooldown_command(name: str, steps: int, extra: list[str]) -> tuple[list[str], str]:
    """`(train_drafter.py command line, campaign name of the run)` that anneals the campaign's newest checkpoint.

    A leg ends on a CPU budget, not at a planned step, so its learning rate is still near the peak when the session
    (and the machine) ends. The cool-down is the decay phase of a warmup-stable-decay schedule: a new run from the
    newest checkpoint's weights (fresh optimizer, 10 warm-up steps, a new data order), its learning rate falling
    linearly from where the leg's stood to 0 over `steps`, evaluated like a leg. It runs in
    `<campaign>/cooldown-<step>` (resumable there); its `best/` is what a promotion compares."""
    from transformers.trainer_utils import get_last_checkpoint

    folder = campaign_dir(name)
    last = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if last is None:
        raise SystemExit(f"campaign {name!r} has no checkpoint on this machine to cool down ({folder})")
    state = json.loads((Path(last) / "trainer_state.json").read_text())
    rates = [h["learning_rate"] for h in state["log_history"] if "learning_rate" in h]
    lr = rates[-1] if rates else float(_value(RECIPE, "--learning_rate"))
    args = _set(RECIPE, "--learning_rate", f"{lr:.4g}")
    for flag, value in (("--lr_scheduler_type", "linear"), ("--warmup_steps", "10"), ("--max_steps", str(steps)),
                        ("--seed", str(state["global_step"]))):
        args = _set(args, flag, value)
    run = f"{name}/cooldown-{state['global_step']}"
    return [sys.executable, str(HERE / "train_drafter.py"), *args, "--init_drafter", last,
            "--output_dir", str(campaign_dir(run)), *extra], run


def weights_id(folder) -> str | None:
    """The first 12 hex digits of the sha256 of `folder/model.safetensors` (None when there is none, or no folder:
    e.g. no shipped drafter in this install)."""
    if folder is None:
        return None
    path = Path(folder) / "model.safetensors"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12] if path.is_file() else None


def record_leg(name: str, init_drafter: str | None, history: Path = HISTORY) -> dict | None:
    """Write this machine's newest leg of campaign `name` into the `history` file (replacing an earlier record of
    the same leg). Returns the record, or None when the leg has no evaluation yet."""
    curve = campaign_dir(name) / "eval_curve.json"
    if not curve.is_file():
        return None
    data = json.loads(curve.read_text())
    run = data["runs"][-1] if data.get("runs") else {}
    points = [{k: v for k, v in p.items() if k in POINT_FIELDS or k.startswith("eval_replay_tau_")}
              for p in data["points"] if p["step"] > run.get("from_step", 0)]
    if not points:
        return None
    from_step = run.get("from_step", 0)
    # a leg that resumed continued the campaign's own checkpoint (`--init_drafter` is then ignored by the trainer)
    warm = f"{name}/checkpoint-{from_step}" if from_step else weights_id(init_drafter or default_drafter_dir())
    record = {"campaign": name, "started": run.get("started"), "from_step": from_step, "warm_start": warm,
              "best": weights_id(campaign_dir(name) / "best"), "points": points}
    stored = json.loads(history.read_text()) if history.is_file() else {"legs": []}
    stored["legs"] = [leg for leg in stored["legs"]
                      if (leg["campaign"], leg["started"]) != (name, record["started"])] + [record]
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text(json.dumps(stored, indent=1) + "\n")
    return record


def print_history(history: Path = HISTORY) -> None:
    """Every recorded leg, machines gone included: where it started, how far it got, its best replayed tau."""
    if not history.is_file():
        print(f"no campaign history yet ({history})")
        return
    shipped = weights_id(default_drafter_dir())
    print(f"campaign history ({history}); shipped drafter {shipped}")
    print(f"{'started':>20} {'campaign':>16} {'warm start':>13} {'steps':>12} {'CPU-h':>6} {'best replay':>12}")
    for leg in json.loads(history.read_text())["legs"]:
        last = leg["points"][-1]
        best = max(p.get("eval_replay_tau", 0.0) for p in leg["points"])
        # `shipped_as`: a promotion may store the best weights differently (e.g. in bf16), so its sha is kept too
        mark = "  <- promoted (the shipped drafter)" if shipped in (leg.get("best"), leg.get("shipped_as")) else ""
        print(f"{leg['started'] or '-':>20} {leg['campaign']:>16} {leg['warm_start'] or '-':>13} "
              f"{leg['from_step']:>5}-{last['step']:<6} {last.get('train_cpu_seconds', 0) / 3600:>6.2f} "
              f"{best:>12.3f}{mark}")


def print_status(name: str) -> None:
    curve = campaign_dir(name) / "eval_curve.json"
    if not curve.is_file():
        print(f"campaign {name!r}: no evaluation on this machine yet ({curve})")
        return
    data = json.loads(curve.read_text())
    print(f"campaign {name!r}: {len(data['runs'])} leg(s); folder {curve.parent}")
    print(f"{'step':>7}{'CPU-h':>8}{'tau_proxy':>11}{'replay_tau':>12}  per domain (replayed)")
    for p in data["points"]:
        domains = " ".join(f"{k.removeprefix('eval_replay_tau_')} {v:.2f}" for k, v in p.items()
                           if k.startswith("eval_replay_tau_"))
        print(f"{p['step']:>7}{p.get('train_cpu_seconds', 0) / 3600:>8.2f}{p.get('eval_tau_proxy', 0):>11.3f}"
              f"{p.get('eval_replay_tau', 0):>12.3f}  {domains}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="default-drafter", help="campaign folder name under the cache")
    parser.add_argument("--leg_cpu_minutes", type=float, default=60.0, help="training CPU minutes of this leg")
    parser.add_argument("--init_drafter", default=None, help="warm start (default: the shipped default drafter)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (OMP_NUM_THREADS) of the leg")
    parser.add_argument("--status", action="store_true", help="print the campaign's curve and history, and exit")
    parser.add_argument("--record", action="store_true",
                        help="write this machine's newest leg into the history file and exit (a leg stopped by hand)")
    parser.add_argument("--history", type=Path, default=HISTORY, help="the committed history of every leg")
    parser.add_argument("--cooldown_steps", type=int, default=0,
                        help="instead of a leg: anneal the newest checkpoint to lr 0 over this many steps "
                             "(cooldown_command); run it last in a session, then compare and promote")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]  # `... -- --seed 3`: the rest goes to train_drafter.py
    if args.leg_cpu_minutes <= 0:
        parser.error("--leg_cpu_minutes must be > 0")
    if args.cooldown_steps < 0:
        parser.error("--cooldown_steps must be >= 0")
    name, init = args.name, args.init_drafter
    if not args.status and not args.record:
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        if args.cooldown_steps:
            command, name = cooldown_command(args.name, args.cooldown_steps, extra)
            init = _value(command, "--init_drafter")
        else:
            command = leg_command(args.name, args.leg_cpu_minutes, args.init_drafter, extra)
        print("leg:", " ".join(command), flush=True)
        result = subprocess.run(command, env=env)
        if result.returncode != 0:
            sys.exit(result.returncode)
    if not args.status:
        record_leg(name, init, args.history)
    print_status(name)
    print_history(args.history)


if __name__ == "__main__":
    main()
