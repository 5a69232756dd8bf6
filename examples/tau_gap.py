"""Where does training's tau_proxy go on the way to served tau? One factor at a time, on the same drafter.

    python examples/tau_gap.py --drafter adaflash_hf/checkpoints/smollm2-135m-instruct-drafter \
        --json docs/tau_gap.json --markdown docs/tau_gap.md

Every number is computed from teacher-forced drafter passes (`adaflash_hf/training/replay.py`); replayed tau equals
served drafter-only greedy tau (tested in tests/test_replay.py), so no decoding loop runs here. The chain:

  1. tau_proxy as training logs it (32 sampled anchors per response; the drafter's training_summary.json)
  2. every anchor instead of 32 sampled ones          (sampling noise)
  3. fp32 context instead of the fp16 cached states   (storage precision of the hidden-state cache)
  4. only the part of the bf16 response that stays on the fp32 target's greedy path
  5. serving's anchors instead of uniform anchors     (replayed tau on the same tokens)
  6. fp32 greedy responses of the same prompts, max_new_tokens as served (instead of the bf16 store responses)
  7. held-out eval-split prompts instead of the store's held-out slice (= served tau on those prompts)
"""

import argparse
import json
import statistics
from pathlib import Path

import torch

import adaflash_hf  # noqa: F401
from adaflash_hf.bench.models import bench_records, load_models
from adaflash_hf.testbed.prompts import encode_prompt
from adaflash_hf.training.label_store import LabelStore, store_dir
from adaflash_hf.training.replay import (cached_greedy_responses, draft_every_anchor, greedy_prefix_len,
                                         uniform_anchor_accepted, walk_rounds)
from adaflash_hf.training.store_data import split_holdout

STEPS = ("1 tau_proxy (logged, 32 sampled anchors)", "2 every anchor", "3 fp32 context", "4 on the fp32 greedy path",
         "5 serving anchors (replayed)", "6 fp32 responses, served length", "7 held-out eval-split prompts (served)")


def forward(target, ids, layer_ids):
    with torch.no_grad():
        out = target(input_ids=ids[None], output_hidden_states=True)
    context = torch.cat([out.hidden_states[i + 1][0] for i in layer_ids], dim=-1)
    return context, out.logits[0].argmax(dim=-1)


def measure(drafter, target, ids, prompt_len, max_new_tokens=None, fp16_too=False):
    """uniform-anchor accepted lengths (fp16 / fp32 context, full and on-path) and replayed rounds of one sequence."""
    ids = torch.as_tensor(ids)
    context, argmax = forward(target, ids, drafter.config.target_layer_ids)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    out = {}
    drafts = draft_every_anchor(drafter, embed, head, ids, context, prompt_len - 1)
    out["uniform32"] = uniform_anchor_accepted(drafts, ids, argmax, prompt_len - 1).tolist()
    if fp16_too:
        drafts16 = draft_every_anchor(drafter, embed, head, ids, context.half().float(), prompt_len - 1)
        out["uniform16"] = uniform_anchor_accepted(drafts16, ids, argmax, prompt_len - 1).tolist()
    end = greedy_prefix_len(ids, argmax, prompt_len)
    out["on_path"] = end - prompt_len
    out["uniform32_path"] = uniform_anchor_accepted(drafts[: end - prompt_len + 1], ids[:end], argmax[:end],
                                                    prompt_len - 1).tolist()
    max_length = None if max_new_tokens is None else prompt_len + max_new_tokens
    out["replayed"] = walk_rounds(drafts[1:], ids[:end], prompt_len, max_length).accepted
    return out


def tau_of(lengths):
    flat = [a for row in lengths for a in row]
    return 1.0 + sum(flat) / len(flat) if flat else 0.0


def by_domain(rows, key):
    domains = sorted({r["domain"] for r in rows})
    res = {d: tau_of([r[key] for r in rows if r["domain"] == d]) for d in domains}
    res["all"] = tau_of([r[key] for r in rows])
    return res


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped default drafter)")
    parser.add_argument("--holdout_permille", type=int, default=100)
    parser.add_argument("--val_per_domain", type=int, default=31)
    parser.add_argument("--max_new_tokens", type=int, default=128, help="served length (steps 6-7)")
    parser.add_argument("--eval_per_domain", type=int, default=12, help="held-out eval-split prompts per domain")
    parser.add_argument("--store_per_domain", type=int, default=None,
                        help="use the first N held-out store responses of each domain (default: all of --val_per_domain)")
    parser.add_argument("--responses", default="outputs/heldout_responses.jsonl",
                        help="cache of the target's fp32 greedy responses (shared with examples/replay_drafters.py)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer, drafter = load_models(None, args.drafter, torch.float32, "cpu")
    store = LabelStore(store_dir("testbed:SmolLM2-135M-Instruct", torch.bfloat16))
    candidates = [(store, "responses", e) for e in store.entries("responses")]
    _, val = split_holdout(candidates, args.holdout_permille, args.store_per_domain or args.val_per_domain)

    store_rows, prompts = [], []
    for i, (_, _, entry) in enumerate(val):
        ids, plen = store.read("responses", entry)["input_ids"], int(entry["prompt_len"])
        store_rows.append({"domain": entry["domain"], **measure(drafter, target, ids, plen, fp16_too=True)})
        prompts.append(ids[:plen].tolist())
        print(f"store {i + 1}/{len(val)}", flush=True)
    fp32_rows = []
    fp32 = cached_greedy_responses(target, tokenizer, prompts, args.max_new_tokens, args.responses, batch_size=16)
    for (_, _, entry), prompt, seq in zip(val, prompts, fp32):
        fp32_rows.append({"domain": entry["domain"], **measure(drafter, target, seq, len(prompt), args.max_new_tokens)})
    records = bench_records(max_per_domain=args.eval_per_domain)
    eval_prompts = [encode_prompt(tokenizer, r["prompt"]) for r in records]
    eval_rows = []
    eval_seqs = cached_greedy_responses(target, tokenizer, eval_prompts, args.max_new_tokens, args.responses)
    for r, prompt, seq in zip(records, eval_prompts, eval_seqs):
        eval_rows.append({"domain": r["domain"], **measure(drafter, target, seq, len(prompt), args.max_new_tokens)})

    summary_file = Path(drafter.name_or_path) / "training_summary.json"
    logged = {}
    if summary_file.is_file():
        ev = json.loads(summary_file.read_text()).get("eval", {})
        logged = {k.removeprefix("eval_tau_proxy_"): v for k, v in ev.items() if k.startswith("eval_tau_proxy_")}
        logged["all"] = ev.get("eval_tau_proxy")
    chain = {STEPS[0]: logged, STEPS[1]: by_domain(store_rows, "uniform16"), STEPS[2]: by_domain(store_rows, "uniform32"),
             STEPS[3]: by_domain(store_rows, "uniform32_path"), STEPS[4]: by_domain(store_rows, "replayed"),
             STEPS[5]: by_domain(fp32_rows, "replayed"), STEPS[6]: by_domain(eval_rows, "replayed")}
    extra = {"uniform anchors, fp32 responses of the store prompts": by_domain(fp32_rows, "uniform32_path"),
             "uniform anchors, held-out eval-split prompts": by_domain(eval_rows, "uniform32_path"),
             "on-path fraction of the bf16 store responses": statistics.mean(
                 r["on_path"] / max(len(r["uniform32"]) - 1, 1) for r in store_rows)}
    result = {"drafter": str(args.drafter or drafter.name_or_path), "chain": chain, "also": extra,
              "n": {"store_val": len(store_rows), "eval": len(eval_rows)}, "config": vars(args)}
    text = render(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(text)


def render(result) -> str:
    chain = result["chain"]
    first, last = chain[STEPS[0]].get("all") or chain[STEPS[1]]["all"], chain[STEPS[-1]]["all"]
    gap = first - last
    domains = [d for d in chain[STEPS[-1]] if d != "all"]
    lines = ["| step | " + " | ".join(domains) + " | all | change | share of the gap |",
             "|---|" + "---|" * (len(domains) + 3)]
    prev = None
    for step in STEPS:
        row = chain[step]
        if not row or row.get("all") is None:
            continue
        change = "" if prev is None else f"{row['all'] - prev:+.3f}"
        share = "" if prev is None or not gap else f"{100 * (prev - row['all']) / gap:.0f}%"
        lines.append(f"| {step} | " + " | ".join(f"{row.get(d, float('nan')):.3f}" for d in domains)
                     + f" | {row['all']:.3f} | {change} | {share} |")
        prev = row["all"]
    lines.append("")
    for name, row in result["also"].items():
        if isinstance(row, dict):
            lines.append(f"- {name}: " + ", ".join(f"{d} {v:.3f}" for d, v in row.items()))
        else:
            lines.append(f"- {name}: {row:.3f}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
