"""Train an AdaFlash (DFlash-recipe) drafter for the offline testbed target, or any causal LM folder.

    python examples/train_drafter.py --output_dir outputs/drafter                      # testbed, defaults
    python examples/train_drafter.py --prompts_per_domain 200 --max_steps 500 ...      # smaller run
    accelerate launch examples/train_drafter.py --output_dir outputs/drafter           # several GPUs

Steps: (1) the target answers the training prompts of all domains (cached), (2) one teacher-forced pass records
its hidden states at the drafter's target layers and its greedy labels (cached `datasets` dataset), (3)
`DrafterTrainer` trains with a held-out validation split, evaluates `tau_proxy` (teacher-forced acceptance) and
stops early when it stops improving; the best drafter is saved to `output_dir/final` with `auto_map`.
"""

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, EarlyStoppingCallback, HfArgumentParser

import adaflash_hf  # noqa: F401
from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.testbed import load_testbed
from adaflash_hf.training import DrafterTrainer, DrafterTrainingConfig
from adaflash_hf.training.data import frequent_tokens, script_training_dataset


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
    draft_vocab_size: int | None = field(default=8192, metadata={
        "help": "draft only the K most frequent response tokens (cheaper drafting and training); 0: full vocab"})
    max_train_sequences: int | None = field(default=None, metadata={"help": "use at most this many (data curve)"})
    early_stopping_patience: int = field(default=4, metadata={"help": "evaluations without improvement"})


def main():
    parser = HfArgumentParser((ScriptArguments, DrafterTrainingConfig))
    script, config = parser.parse_args_into_dataclasses()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    if script.target is None:
        target, tokenizer = load_testbed(dtype=torch.float32)
        target_name = "testbed:SmolLM2-135M-Instruct"
    else:
        target = AutoModelForCausalLM.from_pretrained(script.target, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(script.target)
        target_name = script.target
    target.requires_grad_(False)

    if script.init_drafter:
        drafter = AdaFlashDrafterModel.from_pretrained(script.init_drafter, dtype=torch.float32)
        drafter.check_compatible(target, tokenizer)
    else:
        drafter = AdaFlashDrafterModel.from_target(target, num_layers=script.num_layers, block_size=script.block_size,
                                                   num_context_layers=script.num_context_layers, tokenizer=tokenizer)
    drafter.config._attn_implementation = "sdpa"

    dataset = script_training_dataset(target, tokenizer, drafter.config.target_layer_ids, target_path=script.target,
                                      train_prompts=script.train_prompts,
                                      prompts_per_domain=script.prompts_per_domain,
                                      max_new_tokens=script.max_new_tokens, gen_batch_size=script.gen_batch_size,
                                      gen_dtype=script.gen_dtype)
    split = dataset.train_test_split(test_size=script.val_fraction, seed=0)
    if script.max_train_sequences:
        split["train"] = split["train"].select(range(min(script.max_train_sequences, len(split["train"]))))
    if script.draft_vocab_size and drafter.config.draft_vocab_size is None:
        eos = [t for t in [tokenizer.eos_token_id] if t is not None]
        vocab, coverage = frequent_tokens(split["train"], script.draft_vocab_size, always=eos)
        drafter.set_draft_vocab(vocab)
        logging.info("draft vocabulary: %d tokens covering %.2f%% of training response tokens",
                     len(vocab), 100 * coverage)
    n_tokens = sum(len(x) for x in split["train"]["input_ids"])
    logging.info("training data: %d sequences (%d tokens), validation: %d sequences",
                 len(split["train"]), n_tokens, len(split["test"]))

    trainer = DrafterTrainer(
        drafter, config, target.get_input_embeddings(), target.get_output_embeddings(),
        train_dataset=split["train"], eval_dataset=split["test"],
        # Early stopping needs a tracked best metric: `--load_best_model_at_end true --metric_for_best_model tau_proxy`.
        callbacks=[EarlyStoppingCallback(early_stopping_patience=script.early_stopping_patience)]
        if config.load_best_model_at_end else None,
    )
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    metrics = trainer.evaluate()
    final = Path(config.output_dir) / "final"
    trainer.model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    (final / "training_summary.json").write_text(json.dumps({
        "target": target_name, "train_sequences": len(split["train"]), "train_tokens": n_tokens,
        "val_sequences": len(split["test"]), "eval": metrics, "script": vars(script),
        "steps": trainer.state.global_step,
    }, indent=2, default=str))
    logging.info("saved %s (eval %s)", final, metrics)


if __name__ == "__main__":
    main()
