# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Upload a trained drafter (and its length head) to the Hugging Face Hub, with a card of MEASURED numbers.

    adaflash-hf bench --drafter out/drafter/final --json bench.json
    python examples/push_to_hub.py --drafter out/drafter/final --repo-id me/smollm2-drafter --bench-json bench.json \
        --length-head out/length_head/final --dry-run staged/     # look at staged/ first, then drop --dry-run

One repository holds it all (see `adaflash_hf/hub.py`): the drafter at the root, `length_head/`, `adapters/<name>/`.
"""

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=Path, required=True, help="drafter folder (save_pretrained output)")
    parser.add_argument("--repo-id", required=True, help="Hub repository, e.g. user/name")
    parser.add_argument("--bench-json", type=Path, required=True, help="`adaflash-hf bench --json` output")
    parser.add_argument("--length-head", type=Path, default=None,
                        help="length head folder (a cost_model.json inside it is uploaded too)")
    parser.add_argument("--adapters", type=Path, default=None, help="online adapter folder(s) -> adapters/<name>/")
    parser.add_argument("--target-model", default=None, help="target Hub id (default: from the bench JSON)")
    parser.add_argument("--training-method", default="not documented by the uploader")
    parser.add_argument("--training-data", default="")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--dry-run", type=Path, default=None, metavar="DIR",
                        help="stage the repository into DIR and stop (no upload)")
    args = parser.parse_args(argv)

    from adaflash_hf import AdaFlashDrafterModel
    from adaflash_hf.hub import check_staging_folder, push_drafter, stage_drafter_repo
    from adaflash_hf.interop import load_length_head_folder

    if args.dry_run is not None:  # before loading anything: never stage next to (and list) files already there
        try:
            check_staging_folder(args.dry_run)
        except OSError as error:
            print(f"error: --dry-run: {error}", file=sys.stderr)
            return 2

    drafter = AdaFlashDrafterModel.from_pretrained(args.drafter, use_safetensors=True)
    head, cost = load_length_head_folder(args.length_head) if args.length_head else (None, None)
    kwargs = dict(length_head=head, cost_model=cost, adapter_dir=args.adapters, target_model=args.target_model,
                  training_method=args.training_method, training_data=args.training_data)
    summary = args.length_head / "training_summary.json" if args.length_head else None
    # Written by examples/train_length_head.py; the shipped head carries one too (with its card's training text).
    if summary is not None and summary.is_file():
        data = json.loads(summary.read_text())
        kwargs["length_head_metrics"] = {k: v for k, v in data.get("eval", {}).items() if isinstance(v, (int, float))}
        kwargs["length_head_metrics_source"] = data.get("metrics_source",
                                                        "held-out split of examples/train_length_head.py")
        kwargs["length_head_training"] = data.get("training") or (
            f"survival BCE on {data.get('blocks', '?')} blocks of real acceptance (examples/train_length_head.py).")
    if args.dry_run is not None:
        folder = stage_drafter_repo(drafter, args.dry_run, args.bench_json, repo_id=args.repo_id, **kwargs)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            print(path.relative_to(folder))
        print(f"staged in {folder}; nothing uploaded")
        return 0
    commit = push_drafter(drafter, args.repo_id, args.bench_json, private=args.private, **kwargs)
    print(f"uploaded: {getattr(commit, 'commit_url', commit)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
