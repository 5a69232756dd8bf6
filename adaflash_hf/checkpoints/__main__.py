"""`python -m adaflash_hf.checkpoints [--fix-copies]`: check (or rewrite) the model code copied next to the
shipped checkpoints."""

import argparse
import sys

from . import stale_copies


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fix-copies", action="store_true", help="rewrite stale copies from their source")
    args = parser.parse_args(argv)
    stale = stale_copies(fix=args.fix_copies)
    for path in stale:
        print(f"stale copy: {path} (run `python -m adaflash_hf.checkpoints --fix-copies`)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
