# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Model cards and Hub uploads for drafters, length heads, adapters and generated training data.

Cards carry MEASURED numbers only: the per-domain rows come from an `adaflash-hf bench --json` summary.

One model repository holds everything that belongs to a drafter, each part in its own subfolder:

    README.md                      drafter card (from `adaflash_hf/model_cards/drafter.md`, numbers from bench.json)
    config.json, model.safetensors drafter (`AdaFlashDrafterModel`), with `auto_map` and its three code files,
    *_adaflash_drafter.py,           so it loads with `trust_remote_code=True` where adaflash_hf is absent
    checkpoint_checks.py
    bench.json                     the bench summary the card's table is rendered from
    length_head/                   `AdaFlashLengthHead` (safetensors, `auto_map`), README.md from
                                     `adaflash_hf/model_cards/length_head.md`, cost_model.json (the target's costs)
    adapters/<name>/               online adapters, copied as given (safetensors / json / text only)

`push_drafter` stages that folder locally and uploads it with `HfApi.create_repo` + `upload_folder`;
`push_training_data` does the same for a generated `datasets` dataset (parquet + a `DatasetCard`).
"""

import json
import shutil
import tempfile
from collections import Counter
from importlib import resources
from pathlib import Path

from huggingface_hub import DatasetCard, DatasetCardData, HfApi, ModelCard, ModelCardData


# The templates are package data (`adaflash_hf/model_cards/*.md`, shipped in the wheel); the repository root's
# `model_cards` is a link to that folder, kept for older references.
TEMPLATES = resources.files("adaflash_hf") / "model_cards"
_TAGS = ["speculative-decoding", "dflash", "adaflash"]
_ADAPTER_SUFFIXES = {".safetensors", ".json", ".md", ".txt", ".model", ".yaml", ".yml"}


def template_path(name: str) -> Path:
    """Path of the card template `name` (`drafter`, `length_head`, `training_data`), resolved through the package.

    Works from a source checkout, an editable install and an installed wheel alike (`importlib.resources`).
    """
    path = TEMPLATES / f"{name}.md"
    if not path.is_file():
        available = sorted(p.name[:-3] for p in TEMPLATES.iterdir() if p.name.endswith(".md"))
        raise FileNotFoundError(f"model card template {name!r} not found in {TEMPLATES} (available: {available})")
    return Path(str(path))  # a real file: wheels install as plain folders (`ModelCard.from_template` needs a path)


def load_bench_summary(bench_summary) -> dict:
    """A bench summary given as a dict or a path to the JSON of `adaflash-hf bench --json FILE`, checked."""
    source = "bench summary"
    if not isinstance(bench_summary, dict):
        source = str(bench_summary)
        bench_summary = json.loads(Path(bench_summary).read_text())
    for key in ("overall", "domains"):
        if not isinstance(bench_summary.get(key), dict):
            raise ValueError(f"{source}: missing {key!r}; expected the JSON written by `adaflash-hf bench --json`.")
    for name, row in [("overall", bench_summary["overall"]), *bench_summary["domains"].items()]:
        missing = [k for k in ("tau", "speedup", "identical", "total") if k not in row]
        if missing:
            raise ValueError(f"{source}: row {name!r} lacks the measured {missing}.")
    return bench_summary


def target_model_from_bench(bench_summary: dict) -> str:
    """The target's Hub id recorded in a bench summary (the offline testbed maps to its Hub model)."""
    target = str(bench_summary.get("config", {}).get("target", ""))
    if target.startswith("testbed:"):
        from .testbed.model import TESTBED_MODEL_ID

        return TESTBED_MODEL_ID
    if target.count("/") == 1 and not Path(target).exists():
        return target
    raise ValueError(f"cannot tell the target's Hub id from the bench config target {target!r}; pass target_model.")


def bench_command_from(bench_summary: dict) -> str:
    """The `adaflash-hf bench` command line that reproduces a summary, rebuilt from its `config`."""
    cfg = bench_summary.get("config", {})
    parts = ["adaflash-hf bench"]
    if cfg.get("target") and not str(cfg["target"]).startswith("testbed:"):
        parts.append(f"--target {cfg['target']}")
    for key, flag, default in (("drafter", "--drafter", "default"), ("prompts", "--prompts", "default_eval_prompts"),
                               ("max_new_tokens", "--max-new-tokens", None), ("dtype", "--dtype", None),
                               ("threads", "--threads", None)):
        if cfg.get(key) not in (None, default):
            parts.append(f"{flag} {cfg[key]}")
    if cfg.get("raw"):
        parts.append("--raw")
    return " ".join([*parts, "--json bench.json"])


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
    length_head: dict | None = None,
    repo_layout: list[dict] | None = None,
) -> ModelCard:
    """Render the drafter card. `bench_summary` is the JSON written by `adaflash-hf bench --json`.

    `length_head` (`{"cost_model": bool}`) adds how to load `length_head/`; `repo_layout` (`[{"path", "content"}]`)
    adds the table of files in the repository.
    """
    cfg = bench_summary.get("config", {})
    rows = [{"domain": "overall", **bench_summary["overall"]}]
    rows += [{"domain": d, **v} for d, v in bench_summary["domains"].items()]
    card_data = ModelCardData(
        base_model=target_model,
        library_name="adaflash_hf",
        license=license,
        pipeline_tag="text-generation",
        tags=[*_TAGS, "drafter"],
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
        length_head=length_head,
        repo_layout=repo_layout,
    )


def render_length_head_card(head, *, repo_id: str, cost_model=None, training: str = "", metrics: dict | None = None,
                            metrics_source: str = "", license: str = "apache-2.0") -> ModelCard:
    """Card of `length_head/`: shapes from the head's config, cost table and metrics exactly as given."""
    c = head.config
    cost = None
    if cost_model is not None:
        points = [(b, ", ".join(f"{n}: {s:.4f} s" for n, s in sorted(row.items())))
                  for b, row in sorted(cost_model.points.items())]
        cost = {"description": cost_model.description or "on an unnamed machine",
                "context_length": cost_model.context_length, "points": points}
    return ModelCard.from_template(
        ModelCardData(library_name="adaflash_hf", license=license, tags=[*_TAGS, "length-head"]),
        template_path=str(template_path("length_head")),
        model_name=repo_id.split("/")[-1],
        repo_id=repo_id,
        block_size=c.block_size,
        hidden_size=c.hidden_size,
        head_dim=c.head_dim,
        num_prob_features=c.num_prob_features,
        num_params=f"{sum(p.numel() for p in head.parameters()):,}",
        training=training or "not documented by the uploader.",
        cost_model=cost,
        metrics=[(k, f"{v:.4f}" if isinstance(v, float) else v) for k, v in (metrics or {}).items()],
        metrics_source=metrics_source or "as supplied by the uploader",
    )


def _adapter_folders(adapter_dir) -> dict[str, Path]:
    """`{name: folder}`: `adapter_dir` itself if it holds files, else each of its subfolders."""
    root = Path(adapter_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"adapter folder {root} does not exist.")
    if any(p.is_file() and not p.name.startswith(".") for p in root.iterdir()):
        return {root.name: root}
    folders = {p.name: p for p in sorted(root.iterdir()) if p.is_dir() and not p.name.startswith(".")}
    if not folders:
        raise ValueError(f"{root}: no adapter files or adapter subfolders.")
    return folders


def _copy_adapter(src: Path, dst: Path) -> None:
    from .interop.safety import PICKLE_SUFFIXES, CheckpointError

    for path in sorted(src.rglob("*")):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(src).parts):
            continue
        if path.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(f"{path}: pickle-based adapter weights are not uploaded; save them as safetensors.")
        if path.suffix not in _ADAPTER_SUFFIXES:
            raise ValueError(f"{path}: unexpected file type in an adapter folder (allowed: "
                             f"{sorted(_ADAPTER_SUFFIXES)}).")
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)


def check_staging_folder(folder) -> Path:
    """`folder` as a `Path` if it is new or an empty folder; else `FileExistsError` / `NotADirectoryError`.

    Staging never writes next to files already there: everything in the staged folder is listed and uploaded, so
    strays (an old `pytorch_model.bin`, a `.env`) would be published with the drafter.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file, not a folder to stage the repository in.")
    strays = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    if strays:
        shown = ", ".join(strays[:5]) + (f", ... ({len(strays)} entries)" if len(strays) > 5 else "")
        raise FileExistsError(f"{folder} is not empty ({shown}): stage into a new or empty folder, so that nothing "
                              "but the staged repository is listed or uploaded.")
    return folder


def stage_drafter_repo(drafter, folder, bench_summary, *, repo_id: str, target_model: str | None = None,
                       length_head=None, cost_model=None, adapter_dir=None,
                       training_method: str = "not documented by the uploader", training_data: str = "",
                       bench_command: str | None = None, limitations: str = "",
                       length_head_training: str = "", length_head_metrics: dict | None = None,
                       length_head_metrics_source: str = "", license: str = "apache-2.0") -> Path:
    """Write the repository layout of the module docstring into `folder`, which must be new or empty
    (`check_staging_folder`); nothing is uploaded.

    `length_head` / `cost_model` default to the ones attached to `drafter`; `adapter_dir` is one adapter folder
    or a folder of adapter folders.
    """
    from .interop.convert import COST_MODEL_FILE, LENGTH_HEAD_DIR, save_drafter_folder

    check_staging_folder(folder)
    summary = load_bench_summary(bench_summary)
    target_model = target_model or target_model_from_bench(summary)
    runtime = getattr(drafter, "runtime", None)
    length_head = length_head if length_head is not None else getattr(runtime, "length_head", None)
    cost_model = cost_model if cost_model is not None else getattr(runtime, "cost_model", None)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_drafter_folder(drafter, folder, length_head=length_head, cost_model=cost_model)
    (folder / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    layout = [
        {"path": "config.json, model.safetensors", "content": "the drafter (`AdaFlashDrafterModel`)"},
        {"path": "*_adaflash_drafter.py, checkpoint_checks.py",
         "content": "its code, for `trust_remote_code=True` (`auto_map`)"},
        {"path": "bench.json", "content": "the `adaflash-hf bench --json` summary the results table is rendered from"},
    ]
    if length_head is not None:
        render_length_head_card(length_head, repo_id=repo_id, cost_model=cost_model, training=length_head_training,
                                metrics=length_head_metrics, metrics_source=length_head_metrics_source,
                                license=license).save(folder / LENGTH_HEAD_DIR / "README.md")
        extra = f" and `{COST_MODEL_FILE}` (the target's measured verification costs)" if cost_model else ""
        layout.append({"path": f"{LENGTH_HEAD_DIR}/",
                       "content": f"adaptive length head (`AdaFlashLengthHead`), its card{extra}"})
    if adapter_dir is not None:
        for name, src in _adapter_folders(adapter_dir).items():
            _copy_adapter(src, folder / "adapters" / name)
            layout.append({"path": f"adapters/{name}/", "content": f"online adapter `{name}`"})
    card = render_drafter_card(
        drafter, summary, target_model=target_model, repo_id=repo_id, training_method=training_method,
        training_data=training_data, bench_command=bench_command or bench_command_from(summary),
        limitations=limitations, license=license,
        length_head={"cost_model": cost_model is not None} if length_head is not None else None, repo_layout=layout,
    )
    card.save(folder / "README.md")
    return folder


def _upload(api, folder: Path, repo_id: str, repo_type: str, private: bool, token, commit_message: str):
    api = api if api is not None else HfApi(token=token)
    api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True, token=token)
    return api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type=repo_type,
                             commit_message=commit_message, token=token)


def push_drafter(drafter, repo_id: str, bench_summary, *, length_head=None, cost_model=None, adapter_dir=None,
                 private: bool = False, token: str | None = None, api=None,
                 commit_message: str = "Upload AdaFlash drafter", **card_kwargs):
    """Stage the drafter repository (see the module docstring) and upload it; returns `upload_folder`'s result.

    Args:
        bench_summary: dict or path of the `adaflash-hf bench --json` output; the card's numbers come from it.
        length_head, cost_model: default to the ones attached to `drafter`; go to `length_head/`.
        adapter_dir: online adapter(s), uploaded to `adapters/<name>/`.
        api: an `HfApi` (default: `HfApi(token=token)`); the only network access is its `create_repo` and
            `upload_folder`.
        card_kwargs: `target_model`, `training_method`, `training_data`, `bench_command`, `limitations`,
            `length_head_training`, `length_head_metrics`, `length_head_metrics_source`, `license`.
    """
    with tempfile.TemporaryDirectory(prefix="adaflash-push-") as tmp:
        folder = stage_drafter_repo(drafter, Path(tmp) / "repo", bench_summary, repo_id=repo_id,
                                    length_head=length_head, cost_model=cost_model, adapter_dir=adapter_dir,
                                    **card_kwargs)
        return _upload(api, folder, repo_id, "model", private, token, commit_message)


def _feature_kind(feature) -> str:
    if hasattr(feature, "dtype"):
        return str(feature.dtype)
    inner = getattr(feature, "feature", None)
    return f"list of {_feature_kind(inner)}" if inner is not None else type(feature).__name__


def _size_category(n: int) -> str:
    for limit, name in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M")):
        if n < limit:
            return name
    return "1M<n<10M" if n < 10_000_000 else "n>10M"


def render_training_data_card(dataset, *, repo_id: str, target_model: str, description: str = "",
                              drafter_repo: str | None = None, target_layer_ids=None,
                              license: str = "apache-2.0", pretty_name: str | None = None) -> DatasetCard:
    """`DatasetCard` of generated drafter training data (`datasets.Dataset` or `DatasetDict`); counts are read
    from the data itself."""
    splits = dict(dataset) if hasattr(dataset, "keys") else {"train": dataset}
    first = next(iter(splits.values()))
    domains = Counter()
    if "domain" in first.column_names:
        for ds in splits.values():
            domains.update(ds["domain"])
    total = sum(len(ds) for ds in splits.values())
    pretty_name = pretty_name or f"AdaFlash drafter training data for {target_model.split('/')[-1]}"
    card_data = DatasetCardData(
        license=license, pretty_name=pretty_name, size_categories=_size_category(total),
        task_categories=["text-generation"], tags=[*_TAGS, "synthetic", "distillation"],
        configs=[{"config_name": "default",
                  "data_files": [{"split": s, "path": f"data/{s}-*.parquet"} for s in splits]}],
    )
    return DatasetCard.from_template(
        card_data, template_path=str(template_path("training_data")), pretty_name=pretty_name, repo_id=repo_id,
        target_model=target_model, description=description, drafter_repo=drafter_repo,
        has_hidden_states="hidden_states" in first.column_names, target_layer_ids=target_layer_ids,
        splits=[(s, len(ds)) for s, ds in splits.items()],
        columns=[(name, _feature_kind(f)) for name, f in first.features.items()],
        domains=sorted(domains.items()),
    )


def stage_training_data(dataset, folder, *, repo_id: str, target_model: str, **card_kwargs) -> Path:
    """Write `data/<split>-00000-of-00001.parquet` per split and the README.md card into `folder`."""
    folder = Path(folder)
    splits = dict(dataset) if hasattr(dataset, "keys") else {"train": dataset}
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, ds in splits.items():
        ds.to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))
    render_training_data_card(dataset, repo_id=repo_id, target_model=target_model, **card_kwargs).save(
        folder / "README.md")
    return folder


def push_training_data(dataset, repo_id: str, *, target_model: str, private: bool = False, token: str | None = None,
                       api=None, commit_message: str = "Upload AdaFlash training data", **card_kwargs):
    """Stage generated training data (parquet + `DatasetCard`) and upload it as a dataset repository."""
    with tempfile.TemporaryDirectory(prefix="adaflash-data-") as tmp:
        folder = stage_training_data(dataset, Path(tmp) / "repo", repo_id=repo_id, target_model=target_model,
                                     **card_kwargs)
        return _upload(api, folder, repo_id, "dataset", private, token, commit_message)


__all__ = [
    "bench_command_from",
    "check_staging_folder",
    "load_bench_summary",
    "push_drafter",
    "push_training_data",
    "render_drafter_card",
    "render_length_head_card",
    "render_training_data_card",
    "stage_drafter_repo",
    "stage_training_data",
    "target_model_from_bench",
    "template_path",
]
