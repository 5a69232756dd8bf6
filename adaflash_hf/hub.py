# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Model cards for drafters, rendered from `model_cards/` templates with huggingface_hub's `ModelCard`.

Cards carry MEASURED numbers only: the per-domain rows come from an `adaflash-hf bench --json` summary.
"""

from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData


TEMPLATES = Path(__file__).resolve().parent.parent / "model_cards"
_PACKAGED_TEMPLATES = Path(__file__).resolve().parent / "model_cards"


def template_path(name: str) -> Path:
    """Path of a card template (repo checkout first, then the copy packaged with the wheel)."""
    for folder in (TEMPLATES, _PACKAGED_TEMPLATES):
        path = folder / f"{name}.md"
        if path.is_file():
            return path
    raise FileNotFoundError(f"model card template {name!r} not found in {TEMPLATES} or {_PACKAGED_TEMPLATES}")


def render_drafter_card(
    drafter,
    bench_summary: dict,
    *,
    target_model: str,
    repo_id: str,
    training_method: str,
    training_data: str,
    bench_command: str,
    limitations: str = "",
    license: str = "apache-2.0",
) -> ModelCard:
    """Render the drafter card. `bench_summary` is the JSON written by `adaflash-hf bench --json`."""
    cfg = bench_summary.get("config", {})
    rows = [{"domain": "overall", **bench_summary["overall"]}]
    rows += [{"domain": d, **v} for d, v in bench_summary["domains"].items()]
    card_data = ModelCardData(
        base_model=target_model,
        library_name="adaflash_hf",
        license=license,
        pipeline_tag="text-generation",
        tags=["speculative-decoding", "dflash", "adaflash", "drafter"],
    )
    config = drafter.config
    return ModelCard.from_template(
        card_data,
        template_path=str(template_path("drafter")),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        target_model=target_model,
        block_size=config.block_size,
        target_layer_ids=list(config.target_layer_ids),
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        mask_token_id=config.mask_token_id,
        num_params_m=f"{sum(p.numel() for p in drafter.parameters()) / 1e6:.1f}",
        training_method=training_method,
        training_data=training_data,
        results_intro=(
            f"Measured with `adaflash-hf bench` on {cfg.get('n_prompts', '?')} held-out prompts, "
            f"{cfg.get('max_new_tokens', '?')} new tokens, {cfg.get('dtype', '?')}, batch size 1, "
            f"{cfg.get('threads', '?')} CPU threads, greedy decoding."
        ),
        results_rows=rows,
        bench_command=bench_command,
        limitations=limitations or "Trained for one target; it is refused (ValueError) with any other target.",
    )


__all__ = ["render_drafter_card", "template_path"]
