"""Train the adaptive length head for a drafter, and calibrate the target's verification cost model.

    python examples/train_length_head.py --drafter outputs/drafter/final --output_dir outputs/length_head
    accelerate launch examples/train_length_head.py ...
    python examples/train_length_head.py --target TARGET_DIR --train_prompts prompts.jsonl --drafter DRAFTER ...

1. Real acceptance: the drafter drafts greedily at random anchors of the cached training sequences and the target
   verifies every block in one forward (greedy), giving accepted/rejected per drafted position.
2. `LengthHeadTrainer` fits the head (survival BCE) with a held-out split; evaluation reports the mean predicted vs
   actual accepted length.
3. `TargetCostModel.calibrate` times verification forwards of 1..16 tokens; saved as `cost_model.json` next to the
   head. Attach both with `SpeculationRuntime(length_head=head, cost_model=cost).attach(drafter)`.
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, TrainingArguments

import adaflash_hf  # noqa: F401
from adaflash_hf.bench.models import load_models
from adaflash_hf.checkpoints import default_drafter_dir
from adaflash_hf.generation.cost_model import TargetCostModel
from adaflash_hf.models import AdaFlashLengthHead, AdaFlashLengthHeadConfig
from adaflash_hf.testbed import cache_dir, load_prompts
from adaflash_hf.training import build_training_dataset
from adaflash_hf.testbed.datasets import script_training_dataset
from adaflash_hf.training.distributed import use_cpu_when_data_parallel_without_gpus
from adaflash_hf.training.length_head import LengthHeadTrainer, collect_length_data, length_metrics


@dataclass
class ScriptArguments:
    drafter: str | None = field(default=None, metadata={"help": "drafter folder (default: shipped one)"})
    target: str | None = field(default=None, metadata={"help": "target folder (default: the testbed model)"})
    train_prompts: str | None = field(default=None, metadata={"help": "JSONL of training prompts (default: testbed)"})
    prompts_per_domain: int = field(default=300, metadata={"help": "training prompts per domain (cache hit)"})
    max_new_tokens: int = field(default=160, metadata={"help": "target response length of the training data"})
    gen_batch_size: int = field(default=32, metadata={"help": "batch size of response generation"})
    gen_dtype: str = field(default="bfloat16", metadata={"help": "dtype used to generate responses"})
    heldout_prompts_per_domain: int = field(default=0, metadata={
        "help": "testbed: collect acceptance on this many train-split prompts per domain that the drafter never saw "
                "(those after its first `prompts_per_domain`), instead of the drafter's own training sequences"})
    num_sequences: int = field(default=400, metadata={"help": "sequences used to collect acceptance outcomes"})
    num_anchors: int = field(default=16, metadata={"help": "blocks per sequence"})
    head_dim: int = field(default=128, metadata={"help": "hidden width of the head"})
    calibrate_threads: int | None = field(default=None, metadata={"help": "torch threads for the cost calibration"})


def heldout_dataset(target, tokenizer, drafter, script):
    """Recorded target responses to train-split prompts the drafter was not trained on (its acceptance there is
    what serving will see; on its own training sequences it is optimistic)."""
    first = script.prompts_per_domain
    records = load_prompts(split="train", max_per_domain=first + script.heldout_prompts_per_domain)
    by_domain: dict[str, list] = {}
    for record in records:
        by_domain.setdefault(record["domain"], []).append(record)
    heldout = [r for rs in by_domain.values() for r in rs[first:]]
    logging.info("held-out prompts for the length head: %d (%s)", len(heldout),
                 {d: len(rs[first:]) for d, rs in by_domain.items()})
    return build_training_dataset(
        target, tokenizer, heldout, drafter.config.target_layer_ids, cache_root=cache_dir() / "datasets",
        target_name="testbed:SmolLM2-135M-Instruct", max_new_tokens=script.max_new_tokens,
        gen_batch_size=script.gen_batch_size, gen_dtype=getattr(torch, script.gen_dtype))


def main():
    use_cpu_when_data_parallel_without_gpus()  # `accelerate launch --multi_gpu --num_processes N` on CPUs: gloo DDP
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    target, tokenizer, drafter = load_models(script.target, script.drafter, torch.float32)  # checked pair
    path = script.drafter or default_drafter_dir()

    if script.heldout_prompts_per_domain:
        dataset = heldout_dataset(target, tokenizer, drafter, script)
    else:
        dataset = script_training_dataset(target, tokenizer, drafter.config.target_layer_ids, target_path=script.target,
                                          train_prompts=script.train_prompts,
                                          prompts_per_domain=script.prompts_per_domain,
                                          max_new_tokens=script.max_new_tokens, gen_batch_size=script.gen_batch_size,
                                          gen_dtype=script.gen_dtype)
    subset = dataset.shuffle(seed=1).select(range(min(script.num_sequences, len(dataset))))
    data = collect_length_data(drafter, target, subset, num_anchors=script.num_anchors)
    train, val = data.split(0.1)

    config = AdaFlashLengthHeadConfig(hidden_size=drafter.config.hidden_size, block_size=drafter.config.block_size,
                                      head_dim=script.head_dim)
    head = AdaFlashLengthHead(config)
    trainer = LengthHeadTrainer(model=head, args=args, train_dataset=train, eval_dataset=val,
                                compute_metrics=length_metrics)
    train_loss = trainer.train().training_loss  # averaged over all processes
    metrics = trainer.evaluate()
    if not trainer.is_world_process_zero():  # data-parallel (`accelerate launch --num_processes N`): one measures
        return  # the cost model and saves

    if script.calibrate_threads:
        torch.set_num_threads(script.calibrate_threads)
    cost = TargetCostModel.calibrate(target, num_tokens=(1, 2, 3, 4, 6, 8, 12, 16))
    final = Path(args.output_dir) / "final"
    head.save_pretrained(final)
    cost.save(final / "cost_model.json")
    (final / "training_summary.json").write_text(json.dumps(
        {"drafter": str(path), "blocks": len(data), "eval": metrics, "train_loss": train_loss,
         "loss_curve": [h["loss"] for h in trainer.state.log_history if "loss" in h], "num_processes": args.world_size, "steps": trainer.state.global_step, "cost_model": cost.points}, indent=2))
    logging.info("saved %s: %s", final, metrics)


if __name__ == "__main__":
    main()
