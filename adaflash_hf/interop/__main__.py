# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""`python -m adaflash_hf.interop {convert,inspect}`: convert drafter checkpoints between layouts."""

import argparse
import json
import sys

import torch

from .convert import LAYOUTS, convert_checkpoint, detect_layout, load_dflash_checkpoint
from .safety import CheckpointError


SERVE_HINT = """\
serve a z-lab layout drafter with (num_speculative_tokens at most the block size; vLLM's own DFlash
test runs a block-16 drafter with 16)
  vLLM:   vllm serve TARGET --speculative-config \\
          '{{"method": "dflash", "model": "{dst}", "num_speculative_tokens": {n}}}'
  SGLang: python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH \\
          --speculative-draft-model-path {dst}
"""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m adaflash_hf.interop", description=__doc__,
                                     epilog=SERVE_HINT.format(dst="DST", n="N"),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert SRC (any supported layout) to DST in layout --to",
                          epilog=SERVE_HINT.format(dst="DST", n="N"),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--to", choices=LAYOUTS, required=True)
    conv.add_argument("--vocab-size", type=int, default=None, help="target vocabulary size (muse sources need it)")
    conv.add_argument("--mask-token-id", type=int, default=None, help="override / supply the mask token id")
    conv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                      help="cast the weights (default: keep the stored dtype)")
    conv.add_argument("--drop-unsupported-heads", action="store_true",
                      help="drop AdaFlash threshold/prob heads that cannot be mapped onto AdaFlashLengthHead")
    vocab = conv.add_mutually_exclusive_group()
    vocab.add_argument("--keep-draft-vocab", action="store_true",
                       help="refuse to export a drafter whose draft vocabulary the layout cannot express (default: "
                            "drop it with a warning; the drafter then drafts over the full vocabulary, outputs "
                            "stay exact)")
    vocab.add_argument("--drop-draft-vocab", action="store_true", help="the default (kept for old command lines)")
    conv.add_argument("--overwrite", action="store_true", help="write into a non-empty DST")
    insp = sub.add_parser("inspect", help="detect the layout of SRC and check that it loads")
    insp.add_argument("src")
    insp.add_argument("--vocab-size", type=int, default=None)
    insp.add_argument("--drop-unsupported-heads", action="store_true")
    args = parser.parse_args(argv)

    overrides = {}
    if args.vocab_size is not None:
        overrides["vocab_size"] = args.vocab_size
    try:
        if args.command == "convert":
            if args.mask_token_id is not None:
                overrides["mask_token_id"] = args.mask_token_id
            out = convert_checkpoint(args.src, args.dst, args.to, dtype=getattr(torch, args.dtype or "", None),
                                     drop_unsupported_heads=args.drop_unsupported_heads,
                                     drop_draft_vocab=not args.keep_draft_vocab, overwrite=args.overwrite,
                                     **overrides)
            print(f"wrote {args.to} checkpoint to {out}")
            if args.to == "zlab":
                block_size = json.loads((out / "config.json").read_text())["block_size"]
                print(SERVE_HINT.format(dst=out, n=block_size))
        else:
            layout = detect_layout(args.src)
            drafter = load_dflash_checkpoint(args.src, drop_unsupported_heads=args.drop_unsupported_heads,
                                             **overrides)
            c = drafter.config
            print(f"layout: {layout}\nlayers: {c.num_hidden_layers}  hidden: {c.hidden_size}  block_size: "
                  f"{c.block_size}  mask_token_id: {c.mask_token_id}\ntarget_layer_ids: {c.target_layer_ids}  "
                  f"num_target_layers: {c.num_target_layers}  vocab: {c.vocab_size}  dtype: {drafter.dtype}\n"
                  f"parameters: {sum(p.numel() for p in drafter.parameters()):,}")
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
