"""Side-by-side demo on the offline testbed: plain greedy `generate` vs speculative decoding with a drafter.

    python examples/generate.py                       # shipped default drafter, 8 held-out prompts x 128 tokens
    python examples/generate.py --drafter PATH        # any saved AdaFlash drafter
    python examples/generate.py --dtype bfloat16 --max-new-tokens 64
    python examples/generate.py --no-length-head      # verify whole blocks (no adaptive length)

Both paths are warmed up first (untimed: kernels, allocator, the cost model's one-time calibration), then every
prompt runs plain and speculative back to back. For each prompt it prints the speculative text, tokens/s of both
runs, tau (tokens committed per target verification forward) and whether the outputs are identical token for token;
at the end the overall MEASURED speed-up on this machine and what it means: how much a forward over a drafted block
costs here, and the PROJECTED speed-up of the same rounds on an NVIDIA H200 (the shipped cost model
`adaflash_hf/cost_models/h200-smollm2-135m.json`: that device's forward costs + the host time measured here; not a
measurement).
"""

import argparse
import time
from pathlib import Path

import torch

import adaflash_hf  # noqa: F401  (registers the drafter and the generate() hook)
from adaflash_hf import AdaFlashDrafterModel
from adaflash_hf.testbed import default_eval_prompts, load_testbed


def default_drafter_path() -> Path | None:
    """The drafter shipped with the package, if any."""
    from adaflash_hf.checkpoints import default_drafter_dir

    return default_drafter_dir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=Path, default=None, help="saved drafter folder (default: shipped one)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=8, help="held-out prompts, spread over the domains")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--no-length-head", action="store_true",
                        help="do not attach the shipped length head (attached by default with the shipped drafter)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    target, tokenizer = load_testbed(dtype=dtype)
    path = args.drafter or default_drafter_path()
    if path is not None:
        drafter = AdaFlashDrafterModel.from_pretrained(path, dtype=dtype).eval()
        print(f"drafter: {path} ({sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}M params)")
        _attach_shipped_head(drafter, path, dtype, enabled=not args.no_length_head)
    else:
        drafter = AdaFlashDrafterModel.from_target(target, num_layers=1, block_size=8, tokenizer=tokenizer).eval()
        print("drafter: UNTRAINED (no trained drafter found) - it accepts almost nothing, so expect no speed-up")

    prompts = _spread(default_eval_prompts(), args.num_prompts)
    encoded = [_encode(tokenizer, r["prompt"]) for r in prompts]
    plain_kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    spec_kwargs = {**plain_kwargs, "assistant_model": drafter, "return_dict_in_generate": True}
    warm = {**encoded[0], "max_new_tokens": 16, "do_sample": False}
    print("warming up both paths (untimed) ...")
    _timed(lambda: target.generate(**warm))
    _timed(lambda: target.generate(**warm, assistant_model=drafter))

    from adaflash_hf.bench.projection import ForwardProbe

    probe = ForwardProbe(target, drafter)  # logs the forwards each run computes (for the projection)
    totals = {"plain": [0, 0.0], "speculative": [0, 0.0]}
    logs = {"plain": [], "speculative": []}
    for record, inputs in zip(prompts, encoded):
        n_prompt = inputs["input_ids"].shape[1]
        probe.reset()
        plain, t_plain = _timed(lambda: target.generate(**inputs, **plain_kwargs))
        logs["plain"].append(_finish(probe, t_plain))
        out, t_spec = _timed(lambda: target.generate(**inputs, **spec_kwargs))
        logs["speculative"].append(_finish(probe, t_spec))
        spec, stats = out.sequences, out.speculation_stats
        n_plain, n_spec = plain.shape[1] - n_prompt, spec.shape[1] - n_prompt
        print("=" * 100)
        print(f"[{record['domain']}] {record['prompt'][:160]!r}")
        print("-" * 100)
        print(tokenizer.decode(spec[0, n_prompt:], skip_special_tokens=True))
        print("-" * 100)
        print(f"plain {n_plain / t_plain:6.1f} tok/s | speculative {n_spec / t_spec:6.1f} tok/s "
              f"({t_plain / t_spec:4.2f}x) | tau {stats.tau:4.2f} tokens per target forward | "
              f"identical: {torch.equal(plain, spec)}")
        totals["plain"][0] += n_plain
        totals["plain"][1] += t_plain
        totals["speculative"][0] += n_spec
        totals["speculative"][1] += t_spec
    probe.close()
    print("=" * 100)
    plain_rate = totals["plain"][0] / totals["plain"][1]
    spec_rate = totals["speculative"][0] / totals["speculative"][1]
    where = "this CPU" if target.device.type == "cpu" else str(target.device)
    print(f"MEASURED on {where} ({args.dtype}, {torch.get_num_threads()} threads, {totals['plain'][0]} tokens per "
          f"path, warmed up): plain {plain_rate:.1f} tok/s, speculative {spec_rate:.1f} tok/s, speed-up "
          f"{spec_rate / plain_rate:.2f}x")
    _explain(target, drafter, args.dtype, totals, logs)


def _encode(tokenizer, prompt):
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def _finish(probe, seconds):
    log = probe.log.copy()
    log.wall_seconds = seconds
    probe.reset()
    return log


def _explain(target, drafter, dtype, totals, logs) -> None:
    """What the measured figure means: the cost of a block forward here, and the same rounds projected on an H200."""
    from adaflash_hf.bench.projection import projected_seconds
    from adaflash_hf.generation.cost_model import cost_model_for, shipped_cost_model

    block = int(drafter.config.block_size)
    here = cost_model_for(target, drafter, calibrate=False)  # measured here by the warm-up, when the policy needed it
    if here is not None:
        ratio = here.seconds(block) / here.seconds(1)
        print(f"what it means: on this machine (its cost model, measured at the first call) a target forward over "
              f"a drafted block ({block} tokens) costs {ratio:.1f}x a one-token forward"
              + (", so a round pays only when many of its drafted tokens are accepted" if ratio >= 1.2 else "")
              + "; on an accelerator the forward is launch-bound (about the same cost for 1-16 tokens), so every "
                "accepted drafted token saves most of a forward.")
    name = "h200-smollm2-135m" + ("-bf16" if dtype == "bfloat16" else "")
    try:
        h200 = shipped_cost_model(name)
    except FileNotFoundError:
        return
    rates = {}
    for path, path_logs in logs.items():
        seconds = [projected_seconds(log, h200) for log in path_logs]
        rates[path] = totals[path][0] / sum(seconds) if all(s is not None for s in seconds) else None
    if rates["plain"] and rates["speculative"]:
        print(f"PROJECTED on an NVIDIA H200 ({name}.json; not measured: the same rounds with that device's forward "
              f"costs + the host time measured here; drafting step assumed {1e3 * h200.draft_seconds(1):.0f} ms): "
              f"plain {rates['plain']:.1f} tok/s, speculative {rates['speculative']:.1f} tok/s, speed-up "
              f"{rates['speculative'] / rates['plain']:.2f}x (rounds chosen with this machine's costs; "
              f"`adaflash-hf bench --cost-model {name}` lets the H200's costs choose them)")


def _attach_shipped_head(drafter, path, dtype, enabled: bool) -> None:
    """The shipped length head + cost model belong to the shipped default drafter: attach them to it only."""
    from adaflash_hf.checkpoints import OFFLINE_DRAFTER, length_head_dir
    from adaflash_hf import SpeculationRuntime
    from adaflash_hf.interop import load_length_head_folder

    head_dir = length_head_dir()
    if not enabled or head_dir is None or Path(path).resolve().name != OFFLINE_DRAFTER:
        return
    head, cost = load_length_head_folder(head_dir)
    SpeculationRuntime(length_head=head.to(dtype), cost_model=cost).attach(drafter)
    print(f"length head: {head_dir.name} (verifies only the part of each block likely to be accepted)")


def _spread(records, n):
    """Round-robin over domains so a short demo shows each of them."""
    by_domain = {}
    for r in records:
        by_domain.setdefault(r["domain"], []).append(r)
    out, i = [], 0
    while len(out) < n and any(i < len(v) for v in by_domain.values()):
        out.extend(v[i] for v in by_domain.values() if i < len(v))
        i += 1
    return out[:n]


def _timed(fn):
    start = time.perf_counter()
    with torch.inference_mode():
        result = fn()
    return result, time.perf_counter() - start


if __name__ == "__main__":
    main()
