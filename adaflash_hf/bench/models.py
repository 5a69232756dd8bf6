# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""What every bench loads: the device, the target + tokenizer + drafter, a length head, and the prompts."""

import logging
from pathlib import Path

import torch


logger = logging.getLogger(__name__)
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str = "auto") -> torch.device:
    """`"auto"`: the accelerator when there is one (CUDA), else the CPU; `"cuda"` without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available on this machine.")
    return device


def load_models(target_path=None, drafter_path=None, dtype=torch.float32, device="auto"):
    """`(target, tokenizer, drafter)` on `device` in `dtype`: the offline testbed target and the shipped default
    drafter unless paths are given. The pair is checked (one error listing every mismatch) before any compute. On a
    CPU, masked multi-token forwards use SDPA's own GQA for the whole process (`generation/attention.py`)."""
    import adaflash_hf  # noqa: F401  (registers the drafter, installs the generate() hook)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..checkpoints import default_drafter_dir
    from ..models import AdaFlashDrafterModel

    device = resolve_device(device) if isinstance(device, str) else device
    # every model of the process (peers' plain `generate` too) takes SDPA's own GQA under a mask on a CPU
    from ..generation.attention import prefer_masked_gqa

    prefer_masked_gqa(device)
    drafter_path = drafter_path or default_drafter_dir()
    if drafter_path is None:
        raise SystemExit("No drafter given and no default drafter shipped: pass --drafter PATH.")
    if not Path(drafter_path).is_dir():
        raise SystemExit(f"--drafter {drafter_path}: no such folder.")
    if target_path is None:
        from ..testbed import load_testbed

        target, tokenizer = load_testbed(dtype=dtype)
    else:
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(target_path)
    target = target.to(device)
    drafter = AdaFlashDrafterModel.from_pretrained(drafter_path, dtype=dtype).to(device).eval()
    drafter.check_compatible(target, tokenizer)
    return target, tokenizer, drafter


def attach_length_head(drafter, folder):
    """Attach the length head in `folder` (and its `cost_model.json`, applied only on the device it describes) to
    the drafter's runtime; returns the runtime."""
    from ..generation.runtime import SpeculationRuntime
    from ..interop import load_length_head_folder

    head, cost = load_length_head_folder(folder)
    param = next(drafter.parameters())
    return SpeculationRuntime(length_head=head.to(device=param.device, dtype=param.dtype).eval(),
                              cost_model=cost).attach(drafter)


def apply_cost_model(drafter, path):
    """Decide with the cost model in `path` (`--cost-model`): passed explicitly, it is applied on any device (a
    simulated device; `generation.cost_model`). Returns it (None without a path)."""
    if path is None:
        return None
    from ..generation.cost_model import TargetCostModel
    from ..generation.runtime import runtime_of

    cost = TargetCostModel.load(path)
    runtime_of(drafter).cost_model = cost
    return cost


def select_per_domain(records: list[dict], max_per_domain: int | None) -> list[dict]:
    """The first `max_per_domain` records of each domain, in the records' order (all when None)."""
    if not max_per_domain:
        return records
    seen: dict[str, int] = {}
    out = []
    for r in records:
        seen[r["domain"]] = seen.get(r["domain"], 0) + 1
        if seen[r["domain"]] <= max_per_domain:
            out.append(r)
    return out


def bench_records(prompts=None, max_per_domain: int | None = None) -> list[dict]:
    """Prompt records of a JSONL file (or the committed held-out testbed prompts), `max_per_domain` of each."""
    from ..testbed import default_eval_prompts, read_prompts_jsonl

    return select_per_domain(read_prompts_jsonl(prompts) if prompts else default_eval_prompts(), max_per_domain)


__all__ = ["DEVICES", "apply_cost_model", "attach_length_head", "bench_records", "load_models", "resolve_device",
           "select_per_domain"]
