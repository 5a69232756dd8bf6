"""Train an AdaFlash (DFlash-recipe) drafter for the offline testbed target, or any causal LM folder.

    python examples/train_drafter.py --output_dir outputs/drafter                      # testbed, defaults
    python examples/train_drafter.py --prompts_per_domain 200 --max_steps 500 ...      # smaller run
    accelerate launch examples/train_drafter.py --output_dir outputs/drafter           # several GPUs
    python examples/train_drafter.py --label_store --corpus_ratio 1 --max_steps 10000 \
        --eval_strategy steps --eval_steps 250 --save_steps 500 --save_total_limit 2 \
        --resume_from_checkpoint last --output_dir outputs/drafter_store               # from the label store

Steps: (1) the target answers the training prompts of all domains (cached), (2) one teacher-forced pass records
its hidden states at the drafter's target layers and its greedy labels (cached `datasets` dataset), (3)
`DrafterTrainer` trains with a held-out validation split, evaluates `tau_proxy` (teacher-forced acceptance) and
stops early when it stops improving; the best drafter is saved to `output_dir/final` with `auto_map`.

With `--label_store` the data come from the target-label store instead (`examples/label_data.py`: target
responses, plus corpus chunks at `--corpus_ratio` x the response tokens); validation is a fixed held-out slice of
the store's responses that no run ever trains on (`adaflash_hf/training/store_data.py`), and the draft vocabulary
is counted on the training responses only. Every evaluation is appended to `output_dir/eval_curve.json` and the
best drafter so far is kept in `output_dir/best`. `--resume_from_checkpoint last` resumes from the newest
checkpoint of `output_dir` (or starts when there is none): the same command starts and resumes a run.
`--max_cpu_seconds` stops after that much training CPU time (to compare shapes under the same compute);
`--max_train_seconds` after that much wall-clock time (the budget that matters on a GPU).
"""

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, EarlyStoppingCallback, HfArgumentParser

import adaflash_hf  # noqa: F401
from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.testbed import load_testbed
from adaflash_hf.training import DrafterTrainer, DrafterTrainingConfig
from adaflash_hf.training.callbacks import ComputeBudgetCallback, EvalCurveCallback, best_metric, resolve_checkpoint
from adaflash_hf.testbed.datasets import script_training_dataset
from adaflash_hf.training.data import frequent_tokens
from adaflash_hf.training.distributed import use_cpu_when_data_parallel_without_gpus
from adaflash_hf.training.grow import grow_drafter
from adaflash_hf.training.store_data import StoreDataArguments, numpy_rows


@dataclass
class ScriptArguments:
    target: str | None = field(default=None, metadata={"help": "target folder (default: the testbed model)"})
    train_prompts: str | None = field(default=None, metadata={"help": "JSONL of training prompts (default: testbed)"})
    prompts_per_domain: int = field(default=300, metadata={"help": "training prompts per domain (testbed)"})
    max_new_tokens: int = field(default=160, metadata={"help": "target response length for the training data"})
    gen_batch_size: int = field(default=32, metadata={"help": "batch size of response generation"})
    gen_dtype: str = field(default="bfloat16", metadata={"help": "dtype used to generate responses (~2x faster)"})
    val_fraction: float = field(default=0.05, metadata={"help": "held-out validation fraction"})
    num_layers: int = field(default=2, metadata={"help": "drafter layers"})
    block_size: int = field(default=8, metadata={"help": "block size (anchor included)"})
    num_context_layers: int = field(default=5, metadata={"help": "target layers read by the drafter"})
    init_drafter: str | None = field(default=None, metadata={"help": "continue from this drafter folder"})
    grow_layers: int | None = field(default=None, metadata={
        "help": "with --init_drafter: append layers up to this depth, initialised so the grown drafter drafts exactly "
                "what --init_drafter drafts (adaflash_hf.training.grow; the deeper-drafter lever)"})
    draft_vocab_size: int | None = field(default=8192, metadata={
        "help": "draft only the K most frequent response tokens (cheaper drafting and training); 0: full vocab"})
    max_train_sequences: int | None = field(default=None, metadata={"help": "use at most this many (data curve)"})
    early_stopping_patience: int = field(default=4, metadata={"help": "evaluations without improvement"})
    init_from_target: bool = field(default=True, metadata={
        "help": "initialise the drafter layers from the target's top layers (false: random init)"})
    max_cpu_seconds: float | None = field(default=None, metadata={
        "help": "stop after this much CPU time in training steps (same-compute comparisons; legs of a long run)"})
    max_train_seconds: float | None = field(default=None, metadata={
        "help": "stop after this many wall-clock seconds of training, evaluations included (GPU time budgets)"})
    record_only: bool = field(default=False, metadata={
        "help": "label store: only record the hidden states of the selection (cached), then exit"})


def main():
    use_cpu_when_data_parallel_without_gpus()  # `accelerate launch --multi_gpu --num_processes N` on CPUs: gloo DDP
    parser = HfArgumentParser((ScriptArguments, StoreDataArguments, DrafterTrainingConfig))
    script, store, config = parser.parse_args_into_dataclasses()
    if script.grow_layers and not script.init_drafter:
        parser.error("--grow_layers grows a trained drafter: pass it with --init_drafter FOLDER")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    dtype = getattr(torch, store.label_dtype) if store.label_store else torch.float32

    if script.target is None:
        target, tokenizer = load_testbed(dtype=dtype)
        target_name = "testbed:SmolLM2-135M-Instruct"
    else:
        target = AutoModelForCausalLM.from_pretrained(script.target, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(script.target)
        target_name = script.target
    target.requires_grad_(False)

    if script.init_drafter:
        drafter = AdaFlashDrafterModel.from_pretrained(script.init_drafter, dtype=torch.float32)
        drafter.check_compatible(target, tokenizer)
        if script.grow_layers:
            drafter = grow_drafter(drafter, script.grow_layers)
    else:
        drafter = AdaFlashDrafterModel.from_target(target, num_layers=script.num_layers, block_size=script.block_size,
                                                   num_context_layers=script.num_context_layers, tokenizer=tokenizer,
                                                   init_from_target=script.init_from_target)
    drafter.config._attn_implementation = "sdpa"

    data_info = {}
    if store.label_store:
        data = store.load(target, target_name, drafter.config.target_layer_ids, getattr(torch, script.gen_dtype),
                          progress=not config.disable_tqdm)
        train, val, data_info = data.train, data.val, data.info
        vocab_source = data.draft_vocab
        if script.record_only:
            logging.info("recorded: %s", json.dumps(data_info))
            return
    else:
        dataset = script_training_dataset(target, tokenizer, drafter.config.target_layer_ids,
                                          target_path=script.target, train_prompts=script.train_prompts,
                                          prompts_per_domain=script.prompts_per_domain,
                                          max_new_tokens=script.max_new_tokens, gen_batch_size=script.gen_batch_size,
                                          gen_dtype=script.gen_dtype)
        split = dataset.train_test_split(test_size=script.val_fraction, seed=0)
        train, val = split["train"], split["test"]
        if script.max_train_sequences:
            train = train.select(range(min(script.max_train_sequences, len(train))))

        def vocab_source(k, always):
            return frequent_tokens(train, k, always=always)

    output_dir = Path(config.output_dir)
    if script.draft_vocab_size and drafter.config.draft_vocab_size is None:
        vocab_file = output_dir / "draft_vocab.json"
        if vocab_file.is_file():  # a resumed run keeps the vocabulary its checkpoints were trained with
            stored = json.loads(vocab_file.read_text())
            vocab, coverage = torch.tensor(stored["token_ids"]), stored["coverage"]
        else:
            eos = [t for t in [tokenizer.eos_token_id] if t is not None]
            vocab, coverage = vocab_source(script.draft_vocab_size, eos)  # the same in every process (same data)
            if int(os.environ.get("RANK", "0")) == 0:  # `accelerate launch --num_processes N`: written once
                output_dir.mkdir(parents=True, exist_ok=True)
                vocab_file.write_text(json.dumps({"coverage": coverage, "token_ids": vocab.tolist()}))
        drafter.set_draft_vocab(vocab)
        logging.info("draft vocabulary: %d tokens covering %.2f%% of training response tokens",
                     len(vocab), 100 * coverage)
    n_tokens = data_info.get("train_tokens") or sum(len(x) for x in train["input_ids"])
    logging.info("training data: %d sequences (%d tokens), validation: %d sequences", len(train), n_tokens, len(val))
    domains = sorted(set(val["domain"])) if len(val) else None

    budget = ComputeBudgetCallback(script.max_cpu_seconds, max_train_seconds=script.max_train_seconds)
    shape = {"num_layers": drafter.config.num_hidden_layers, "block_size": drafter.config.block_size,
             "init_from_target": script.init_from_target, "train_sequences": len(train), "train_tokens": n_tokens}
    callbacks = [budget, EvalCurveCallback(output_dir, metric=best_metric(config), tokenizer=tokenizer, budget=budget,
                                           extra=shape)]
    if config.load_best_model_at_end:
        # Early stopping needs a tracked best metric: `--load_best_model_at_end true --metric_for_best_model tau_proxy`.
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=script.early_stopping_patience))
    trainer = DrafterTrainer(
        drafter, config, target.get_input_embeddings(), target.get_output_embeddings(),
        train_dataset=numpy_rows(train), eval_dataset=numpy_rows(val), callbacks=callbacks, eval_domains=domains,
    )
    resume = resolve_checkpoint(config.resume_from_checkpoint, output_dir)
    if resume:
        logging.info("resuming from %s", resume)
    train_loss = trainer.train(resume_from_checkpoint=resume).training_loss  # averaged over all processes
    evals = [h for h in trainer.state.log_history if "eval_tau_proxy" in h]
    if evals and evals[-1].get("step") == trainer.state.global_step and not config.load_best_model_at_end:
        # evaluated at the last step already
        metrics = {k: v for k, v in evals[-1].items() if k.startswith("eval_")}
    else:
        metrics = trainer.evaluate()
    if not trainer.is_world_process_zero():  # data-parallel (`accelerate launch --num_processes N`): one saves
        return
    final = output_dir / "final"
    trainer.model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    (final / "training_summary.json").write_text(json.dumps({
        "target": target_name, "train_sequences": len(train), "train_tokens": n_tokens,
        "val_sequences": len(val), "eval": metrics, "train_loss": train_loss,
        "loss_curve": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "script": {**vars(script), **vars(store)},
        "steps": trainer.state.global_step, "compute": budget.summary(), "data": data_info,
        "num_processes": trainer.args.world_size,
    }, indent=2, default=str))
    logging.info("saved %s (eval %s; %s)", final, metrics, budget.summary())


if __name__ == "__main__":
    main()
