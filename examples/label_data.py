"""Extend the target-label store: greedy target responses to the train prompts, and corpus text labelled at prefill.

    python examples/label_data.py --responses_per_domain 2500 --corpus_tokens 3000000 --threads 1
    python examples/label_data.py --summary                       # only print what the store holds

Targets, not increments: the store ends up holding the responses to the first `--responses_per_domain` train prompts
of every domain (the testbed's round-robin order; near-duplicates of eval prompts left out) and at least
`--corpus_tokens` labelled corpus tokens. Re-running the same command resumes (done entries are skipped; a killed
run loses at most one batch); a larger number extends.
While responses are generated, corpus chunks are labelled in between so that corpus tokens keep up with
`--corpus_per_response_token` x the response tokens, then the corpus continues alone.

Responses are generated with a `--gen_dtype` copy of the target (bf16: ~2x faster on CPU; the store is keyed by
that dtype); corpus labels come from the `--label_dtype` target (fp32, the evaluation target). Eval-split prompts and
eval text are never used (see `adaflash_hf/testbed/corpus.py`). Train on the store with
`adaflash_hf.training.label_store.select_entries` + `label_hidden.build_label_dataset`.
"""

import argparse
import logging
import os
import sys
import time


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="causal LM folder (default: the offline testbed model)")
    parser.add_argument("--responses_per_domain", type=int, default=2500,
                        help="label the first N train prompts of every domain (0: none)")
    parser.add_argument("--corpus_tokens", type=int, default=0,
                        help="grow the corpus part of the store to at least M labelled tokens")
    parser.add_argument("--corpus_per_response_token", type=float, default=1.0,
                        help="while responses run, keep corpus tokens >= this x response tokens (0: corpus after)")
    parser.add_argument("--domains", nargs="+", default=None, help="domains (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--gen_dtype", default="bfloat16", help="dtype of the generating copy of the target")
    parser.add_argument("--label_dtype", default="float32", help="dtype of the target labelling corpus text")
    parser.add_argument("--max_new_tokens", type=int, default=160, help="response length cap")
    parser.add_argument("--max_prompt_tokens", type=int, default=384, help="prompts are cut from the left to this")
    parser.add_argument("--gen_batch_size", type=int, default=16,
                        help="prompts per generate() call (16 and 32 measured alike on 1 thread, 64 slower)")
    parser.add_argument("--window", type=int, default=256,
                        help="prompts sorted by length together (and interleaving granularity)")
    parser.add_argument("--corpus_batch_size", type=int, default=4, help="chunks per labelling forward")
    parser.add_argument("--chunk_tokens", type=int, default=512, help="corpus chunk length")
    parser.add_argument("--progress_interval", type=float, default=None,
                        help="seconds between progress-bar refreshes (default: 0.1 on a terminal, 60 otherwise)")
    parser.add_argument("--summary", action="store_true", help="only print what the stores hold")
    return parser.parse_args(argv)


def print_summary(stores) -> None:
    print("\nlabel store contents")
    print(f"{'store':<48} {'kind':<10} {'domain':<8} {'sequences':>10} {'tokens':>12} {'label tokens':>13}")
    for store in stores:
        summary = store.summary()
        size = sum(p.stat().st_size for p in store.path.glob("*.bin"))
        for kind, per in summary.items():
            for domain, c in per.items():
                print(f"{store.name:<48} {kind:<10} {domain:<8} {c['sequences']:>10} {c['tokens']:>12} "
                      f"{c['label_tokens']:>13}")
            total = {k: sum(c[k] for c in per.values()) for k in ("sequences", "tokens", "label_tokens")}
            print(f"{store.name:<48} {kind:<10} {'all':<8} {total['sequences']:>10} {total['tokens']:>12} "
                  f"{total['label_tokens']:>13}")
        print(f"  {store.path} ({size / 2**20:.1f} MiB of tokens)")
    sys.stdout.flush()


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    log = logging.getLogger("label_data")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf.testbed import load_prompts, load_testbed
    from adaflash_hf.testbed.corpus import drop_near_eval, testbed_corpus_chunks
    from adaflash_hf.training.label_store import LabelStore

    gen_dtype, label_dtype = getattr(torch, args.gen_dtype), getattr(torch, args.label_dtype)
    interval = args.progress_interval if args.progress_interval is not None else (
        0.1 if sys.stderr.isatty() else 60.0)

    def load(dtype):
        if args.target is None:
            return load_testbed(dtype=dtype)
        model = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
        return model, AutoTokenizer.from_pretrained(args.target)

    target_name = args.target or "testbed:SmolLM2-135M-Instruct"
    label_model, tokenizer = load(label_dtype)
    vocab = label_model.config.get_text_config().vocab_size
    response_store = LabelStore.open(target_name, gen_dtype, vocab_size=vocab)
    corpus_store = LabelStore.open(target_name, label_dtype, vocab_size=vocab)
    if args.summary:
        print_summary([response_store, corpus_store])
        return
    label_model.requires_grad_(False)
    gen_model = label_model
    if args.responses_per_domain and gen_dtype != label_dtype:
        gen_model = load(gen_dtype)[0].requires_grad_(False)

    def corpus_have() -> int:
        return sum(int(e["n"]) for e in corpus_store.entries("corpus"))

    def response_label_tokens() -> int:
        return sum(int(e["n"]) - int(e["prompt_len"]) for e in response_store.entries("responses"))

    chunks = testbed_corpus_chunks(tokenizer, args.domains, max_len=args.chunk_tokens)
    totals = {"resp_tokens": 0, "resp_s": 0.0, "corpus_tokens": 0, "corpus_s": 0.0}

    def label_corpus(goal: int) -> bool:
        """Label corpus chunks until the store holds `goal` tokens; False when the corpus is exhausted."""
        missing = goal - corpus_have()
        if missing <= 0:
            return True
        stats = corpus_store.add_corpus(label_model, chunks, max_tokens=missing, batch_size=args.corpus_batch_size,
                                        mininterval=interval)
        totals["corpus_tokens"] += stats["tokens"]
        totals["corpus_s"] += stats["seconds"]
        log.info("corpus: +%d chunks, +%d tokens in %.0f s (%.0f tok/s; run %.0f tok/s); store %d tokens",
                 stats["sequences"], stats["tokens"], stats["seconds"], stats["tokens"] / max(stats["seconds"], 1e-9),
                 totals["corpus_tokens"] / max(totals["corpus_s"], 1e-9), corpus_have())
        return not stats["exhausted"]

    start = time.perf_counter()
    records = load_prompts(split="train", domains=args.domains, max_per_domain=args.responses_per_domain) \
        if args.responses_per_domain else []
    records, near_eval = drop_near_eval(records)
    if near_eval:
        log.info("left out %d train prompts that are near-duplicates of eval prompts: %s", len(near_eval),
                 ", ".join(f"{r['source']}/{r['id']}" for r in near_eval[:10]))
    log.info("%d train prompts to answer (%s); stores: %s, %s", len(records), target_name, response_store.path,
             corpus_store.path)
    corpus_left = True
    for w in range(0, len(records), args.window):
        stats = response_store.add_responses(
            gen_model, tokenizer, records[w : w + args.window], max_new_tokens=args.max_new_tokens,
            batch_size=args.gen_batch_size, max_prompt_tokens=args.max_prompt_tokens, window=args.window,
            mininterval=interval)
        if stats["sequences"]:
            totals["resp_tokens"] += stats["new_tokens"]
            totals["resp_s"] += stats["seconds"]
            log.info("responses: prompts %d-%d of %d, +%d sequences, +%d new tokens in %.0f s (%.0f tok/s; run "
                     "%.0f tok/s)", w, min(w + args.window, len(records)), len(records), stats["sequences"],
                     stats["new_tokens"], stats["seconds"], stats["new_tokens"] / max(stats["seconds"], 1e-9),
                     totals["resp_tokens"] / max(totals["resp_s"], 1e-9))
        if corpus_left and args.corpus_tokens and args.corpus_per_response_token > 0:
            goal = min(args.corpus_tokens, int(args.corpus_per_response_token * response_label_tokens()))
            corpus_left = label_corpus(goal)
    if corpus_left and args.corpus_tokens:
        label_corpus(args.corpus_tokens)
    log.info("done in %.0f s: responses %d new tokens (%.0f tok/s), corpus %d tokens (%.0f tok/s)",
             time.perf_counter() - start, totals["resp_tokens"], totals["resp_tokens"] / max(totals["resp_s"], 1e-9),
             totals["corpus_tokens"], totals["corpus_tokens"] / max(totals["corpus_s"], 1e-9))
    print_summary([response_store, corpus_store])


if __name__ == "__main__":
    main()
