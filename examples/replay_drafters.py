"""Replayed tau of several drafters on held-out prompts, by number of drafting steps (no decoding loop runs).

    python examples/replay_drafters.py --drafters adaflash_hf/checkpoints/smollm2-135m-instruct-drafter,outputs/x/final \
        --labels shipped,x --steps 1,2,3 --json docs/replay.json

The target's greedy responses to the prompts are generated once (fp32, cached in `--responses`) and each drafter
is replayed on them (`adaflash_hf/training/replay.py`): one target forward per response, `steps` drafter forwards
per response. Replayed tau with `steps=1` equals served drafter-only greedy tau (tests/test_replay.py); `steps > 1`
is multi-step drafting (the first drafted tokens fed back into the block), which serving does not run yet.
`--candidates 1,2,4,8 --widths 7,3` replays multi-candidate verification (`generation/candidates.py`: each round
keeps the best of `k` candidate blocks, verified `w` tokens deep), as the batched engine serves it on a
launch-bound device.
Prompts: the committed held-out eval prompts (`--per_domain` of each domain) or `--prompts FILE.jsonl`.
"""

import argparse
import json
from pathlib import Path

import torch

import adaflash_hf  # noqa: F401
from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.bench.models import bench_records, load_models
from adaflash_hf.testbed.prompts import encode_prompt
from adaflash_hf.training.replay import (cached_greedy_responses, draft_every_anchor, greedy_prefix_len,
                                         pooled_tau, target_context, walk_rounds)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", required=True, help="comma-separated drafter folders")
    parser.add_argument("--labels", default=None, help="comma-separated names (default: folder names)")
    parser.add_argument("--steps", default="1", help="comma-separated numbers of drafting steps, e.g. 1,2,3")
    parser.add_argument("--candidates", default="1", help="comma-separated candidate blocks per round (multi-candidate "
                                                          "verification, steps=1 only), e.g. 1,2,4,8")
    parser.add_argument("--widths", default=None, help="comma-separated most drafted tokens verified per round "
                                                       "(default: the whole block)")
    parser.add_argument("--prompts", default=None, help="JSONL of {prompt, domain} (default: held-out eval prompts)")
    parser.add_argument("--per_domain", type=int, default=12, help="prompts per domain")
    parser.add_argument("--max_new_tokens", type=int, default=128)
    parser.add_argument("--responses", type=Path, default=Path("outputs/heldout_responses.jsonl"),
                        help="cache of the target's greedy responses")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    paths = [p for p in args.drafters.split(",") if p.strip()]
    labels = args.labels.split(",") if args.labels else [Path(p).name for p in paths]
    steps = [int(s) for s in args.steps.split(",")]
    candidates = [int(k) for k in args.candidates.split(",")]
    widths = [int(w) for w in args.widths.split(",")] if args.widths else [None]
    if len(labels) != len(paths) or min(steps) < 1 or min(candidates) < 1 or min(w or 1 for w in widths) < 1:
        parser.error("--labels must name every drafter; --steps, --candidates and --widths must be >= 1")
    if max(candidates) > 1 and steps != [1]:
        parser.error("--candidates > 1 replays one drafting step (--steps 1)")
    variants = [(s, k, w) for s in steps for k in candidates for w in widths]
    target, tokenizer, first = load_models(None, paths[0], torch.float32, "cpu")
    records = bench_records(args.prompts, args.per_domain)
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in records]
    sequences = cached_greedy_responses(target, tokenizer, prompts, args.max_new_tokens, args.responses)
    contexts, ends, starts = [], [], []
    for prompt, seq in zip(prompts, sequences):
        ids = torch.tensor(seq)
        start = len(prompt)
        with torch.no_grad():
            argmax = target(input_ids=ids[None]).logits[0].argmax(-1)
        ends.append(greedy_prefix_len(ids, argmax, start))
        contexts.append(target_context(target, ids, first.config.target_layer_ids))
        starts.append(start)
    result = {"config": vars(args) | {"responses": str(args.responses), "json": str(args.json)},
              "n_prompts": len(records), "drafters": {}}
    for label, path in zip(labels, paths):
        drafter = first if path == paths[0] else AdaFlashDrafterModel.from_pretrained(path).eval()
        drafter.check_compatible(target, tokenizer)
        rows = {}
        for s, k, w in variants:
            by_domain: dict[str, list] = {}
            for record, seq, ctx, start, end in zip(records, sequences, contexts, starts, ends):
                ids = torch.tensor(seq[:end])
                drafts = draft_every_anchor(drafter, target.get_input_embeddings(), target.lm_head, ids, ctx[:end],
                                            start, steps=s, candidates=k)
                walked = walk_rounds(drafts, ids, start, start + args.max_new_tokens, width=w)
                by_domain.setdefault(record["domain"], []).append(walked)
            name = str(s) if (k, w) == (1, None) else f"steps={s},candidates={k},width={w or 'block'}"
            rows[name] = {**{d: pooled_tau(r) for d, r in sorted(by_domain.items())},
                          "all": pooled_tau([w for r in by_domain.values() for w in r])}
            print(f"{label:<24} {name}: " + "  ".join(f"{d} {v:.3f}" for d, v in rows[name].items()), flush=True)
        result["drafters"][label] = {"path": path, "replayed_tau_by_steps": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
