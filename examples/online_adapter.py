"""Serve a stream of prompts while an OnlineSpec LoRA adapter on the drafter learns from every verification round.

    python examples/online_adapter.py --output_dir outputs/online                      # testbed, eval prompts
    python examples/online_adapter.py --algorithm ensemble --prompts my_traffic.jsonl --output_dir outputs/online
    python examples/online_adapter.py --resume outputs/online/adapter ...              # keep learning later
    accelerate launch examples/online_adapter.py ...

Every prompt goes through plain `target.generate(assistant_model=drafter)`; the adapter attached to the drafter
keeps learning across prompts (outputs stay identical to greedy decoding by the target alone). The adapter is
saved (atomically, PEFT format) to `output_dir/adapter` every `--save_every` prompts and at the end; upload it
with `examples/push_to_hub.py --adapters output_dir/adapter`.
"""

import argparse
import json
import logging
from pathlib import Path

import torch

from adaflash_hf.online import OnlineSpecAdapter, OnlineSpecConfig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="target folder (default: the testbed model)")
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--prompts", type=Path, default=None, help="JSONL of {prompt, domain} (default: testbed eval)")
    parser.add_argument("--max_prompts", type=int, default=16)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--algorithm", default="ogd", choices=["ogd", "optimistic", "ensemble"])
    parser.add_argument("--optimizer", default="adam", choices=["sgd", "adam"])
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--loss", default="ce", choices=["ce", "reverse_kl"])
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--update_every", type=int, default=1)
    parser.add_argument("--update_mode", default="request", choices=["request", "background", "round"],
                        help="learn from each served request (between requests, or in a background worker), or from "
                             "every drafter round")
    parser.add_argument("--hybrid", action="store_true",
                        help="keep the default per-round choice of drafter / prompt lookup / no draft (the adapter "
                             "then learns only in drafter rounds); by default every round drafts, so every round "
                             "teaches the adapter")
    parser.add_argument("--resume", type=Path, default=None, help="continue from a saved adapter folder")
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--save_every", type=int, default=8, help="save the adapter every N prompts")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    from adaflash_hf.bench.models import load_models
    from adaflash_hf.testbed import default_eval_prompts, encode_prompt, read_prompts_jsonl

    target, tokenizer, drafter = load_models(args.target, args.drafter, torch.float32)
    if not args.hybrid:
        from adaflash_hf.bench.runner import DRAFTER_ONLY
        from adaflash_hf.generation.batch import run_knobs

        drafter.generation_config = run_knobs(drafter, **DRAFTER_ONLY)  # every round drafts (and teaches)
    if args.resume:
        adapter = OnlineSpecAdapter.from_pretrained(drafter, args.resume)
    else:
        adapter = OnlineSpecAdapter.attach(drafter, OnlineSpecConfig(
            algorithm=args.algorithm, optimizer=args.optimizer, learning_rate=args.learning_rate, loss=args.loss,
            lora_r=args.lora_r, lora_alpha=2.0 * args.lora_r, update_every=args.update_every,
            update_mode=args.update_mode))
    records = (read_prompts_jsonl(args.prompts) if args.prompts else default_eval_prompts())[: args.max_prompts]
    out_dir = args.output_dir / "adapter"
    log = []
    for i, record in enumerate(records, 1):
        ids = torch.tensor([encode_prompt(tokenizer, record["prompt"])])
        with torch.no_grad():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, assistant_model=drafter, return_dict_in_generate=True)
        stats = out.speculation_stats
        log.append({"prompt": i, "domain": record.get("domain"), "tau": stats.tau, "rounds": stats.rounds,
                    "learner_rounds": adapter.stats.rounds, "rollbacks": len(adapter.stats.rollbacks)})
        logging.info("prompt %d/%d (%s): tau %.2f, learner rounds %d, rollbacks %d", i, len(records),
                     record.get("domain"), stats.tau, adapter.stats.rounds, len(adapter.stats.rollbacks))
        if i % args.save_every == 0 or i == len(records):
            adapter.save_pretrained(out_dir)
    (args.output_dir / "stream.json").write_text(json.dumps(log, indent=2) + "\n")
    logging.info("saved %s and %s", out_dir, args.output_dir / "stream.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
