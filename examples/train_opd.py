"""Fine-tune a drafter with on-policy distillation (reverse KL), AdaFlash part (i).

    python examples/train_opd.py --init_drafter outputs/drafter/final --output_dir outputs/opd --max_steps 600
    python examples/train_opd.py ... --lmbda 0.5 --temperature 0.7 --alpha 0.1 --kl_clip 10
    accelerate launch examples/train_opd.py ...
    python examples/train_opd.py --target TARGET_DIR --train_prompts prompts.jsonl --init_drafter DRAFTER ...

Uses the same cached training data as `train_drafter.py` (same prompt and generation arguments give a cache hit).
Evaluation reports `tau_proxy` per domain (`eval_<domain>_tau_proxy`) on the held-out split. The result is saved
to `output_dir/final`.
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

import adaflash_hf  # noqa: F401
from adaflash_hf.bench.models import load_models
from adaflash_hf.checkpoints import default_drafter_dir
from adaflash_hf.training import OPDConfig, OPDTrainer
from adaflash_hf.training.callbacks import ComputeBudgetCallback, EvalCurveCallback, best_metric
from adaflash_hf.testbed.datasets import script_training_dataset
from adaflash_hf.training.distributed import use_cpu_when_data_parallel_without_gpus
from adaflash_hf.training.store_data import StoreDataArguments, numpy_rows


@dataclass
class ScriptArguments:
    init_drafter: str | None = field(default=None, metadata={"help": "drafter to fine-tune (default: shipped one)"})
    target: str | None = field(default=None, metadata={"help": "target folder (default: the testbed model)"})
    train_prompts: str | None = field(default=None, metadata={"help": "JSONL of training prompts (default: testbed)"})
    prompts_per_domain: int = field(default=300, metadata={"help": "training prompts per domain (testbed)"})
    max_new_tokens: int = field(default=160, metadata={"help": "target response length of the training data"})
    gen_batch_size: int = field(default=32, metadata={"help": "batch size of response generation"})
    gen_dtype: str = field(default="bfloat16", metadata={"help": "dtype used to generate responses"})
    val_fraction: float = field(default=0.05, metadata={"help": "held-out validation fraction"})
    max_cpu_seconds: float | None = field(default=None, metadata={
        "help": "stop after this much CPU time in training steps (compute-matched comparisons)"})
    eval_before: bool = field(default=True, metadata={"help": "evaluate per domain before training too"})


def main():
    use_cpu_when_data_parallel_without_gpus()  # `accelerate launch --multi_gpu --num_processes N` on CPUs: gloo DDP
    script, store, config = HfArgumentParser(
        (ScriptArguments, StoreDataArguments, OPDConfig)).parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    target, tokenizer, drafter = load_models(script.target, script.init_drafter, torch.float32)  # checked pair
    path = script.init_drafter or default_drafter_dir()

    if store.label_store:  # the store's fixed held-out slice is the validation set, as in train_drafter.py
        data = store.load(target, script.target or "testbed:SmolLM2-135M-Instruct", drafter.config.target_layer_ids,
                          getattr(torch, script.gen_dtype), progress=not config.disable_tqdm)
        train, val = numpy_rows(data.train), numpy_rows(data.val)
    else:
        dataset = script_training_dataset(target, tokenizer, drafter.config.target_layer_ids,
                                          target_path=script.target, train_prompts=script.train_prompts,
                                          prompts_per_domain=script.prompts_per_domain,
                                          max_new_tokens=script.max_new_tokens, gen_batch_size=script.gen_batch_size,
                                          gen_dtype=script.gen_dtype)
        split = dataset.train_test_split(test_size=script.val_fraction, seed=0)
        train, val = split["train"], split["test"]
    by_domain = {d: val.filter(lambda r, d=d: r["domain"] == d) for d in sorted(set(val["domain"]))}
    budget = ComputeBudgetCallback(script.max_cpu_seconds)
    callbacks = [budget, EvalCurveCallback(config.output_dir, metric=best_metric(config), tokenizer=tokenizer,
                                           budget=budget)]
    trainer = OPDTrainer(drafter, config, target, train_dataset=train, eval_dataset=val, callbacks=callbacks,
                         eval_domains=sorted(by_domain))
    before = trainer.evaluate_per_domain(by_domain) if script.eval_before else None
    train_loss = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint).training_loss
    final = Path(config.output_dir) / "final"
    if trainer.is_world_process_zero():  # data-parallel (`accelerate launch --num_processes N`): one saves
        trainer.model.save_pretrained(final)  # before the evaluation: a killed evaluation loses nothing
    after = trainer.evaluate_per_domain(by_domain)
    if not trainer.is_world_process_zero():
        return
    (final / "training_summary.json").write_text(json.dumps(
        {"init_drafter": str(path), "tau_proxy_before": before, "tau_proxy_after": after,
         "train_loss": train_loss, "loss_curve": [h["loss"] for h in trainer.state.log_history if "loss" in h],
         "num_processes": trainer.args.world_size, "steps": trainer.state.global_step,
         "compute": budget.summary(), "opd": {k: getattr(config, k) for k in
                                                      ("temperature", "beta", "alpha", "kl_clip", "lmbda",
                                                       "learning_rate", "num_anchors")}}, indent=2))
    logging.info("tau_proxy per domain before %s after %s; saved %s", before, after, final)


if __name__ == "__main__":
    main()
