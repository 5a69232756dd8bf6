"""Small trained checkpoints for the testbed target SmolLM2-135M-Instruct.

Shipped in the package (the wheel), because the demo and the documented default use them:

* `smollm2-135m-instruct-drafter`: the offline (DFlash-recipe) drafter, the default: `-v1` trained further on the
  label store (more target responses + target-labelled corpus text);
* `smollm2-135m-instruct-length-head`: the adaptive length head + the target's cost model (AdaFlash part ii).

Kept in the source repository only (`checkpoints/` at the repository root, not in the wheel; their commands are in
their cards and the README), for the report's OPD comparison:

* `smollm2-135m-instruct-drafter-v1`: the first offline drafter, kept because it is the OPD drafter's parent;
* `smollm2-135m-instruct-drafter-opd`: `-v1` fine-tuned on-policy with reverse KL (AdaFlash part i); the README
  says not to use it (it does not beat the default).

`DEFAULT_DRAFTER` is the one the demo and the CLI load when no `--drafter` is given: the better of the two drafters
by measurement (see the README's results).
"""

import filecmp
import shutil
from pathlib import Path


HERE = Path(__file__).resolve().parent
# The repository-level folder of the checkpoints that are not shipped (absent in an installed wheel).
REPO_CHECKPOINTS = HERE.parents[1] / "checkpoints"
OFFLINE_DRAFTER = "smollm2-135m-instruct-drafter"
OPD_DRAFTER = "smollm2-135m-instruct-drafter-opd"
OPD_PARENT_DRAFTER = "smollm2-135m-instruct-drafter-v1"  # what OPD_DRAFTER was fine-tuned from (report section (a))
LENGTH_HEAD = "smollm2-135m-instruct-length-head"
DEFAULT_DRAFTER = OFFLINE_DRAFTER


SHIPPED = (OFFLINE_DRAFTER, LENGTH_HEAD)  # what the wheel carries
UNSHIPPED = (OPD_PARENT_DRAFTER, OPD_DRAFTER)  # in the source repository only (REPO_CHECKPOINTS)


def checkpoint_dir(name: str) -> Path:
    """Where the checkpoint `name` lives: in the package if shipped, else in the repository's `checkpoints/`."""
    return (HERE if name in SHIPPED else REPO_CHECKPOINTS) / name


def _folder(name: str, required: str = "config.json") -> Path | None:
    folder = checkpoint_dir(name)
    return folder if (folder / required).is_file() else None


def default_drafter_dir() -> Path | None:
    """Folder of the shipped default drafter for SmolLM2-135M-Instruct, or None if none is shipped."""
    return _folder(DEFAULT_DRAFTER)


def offline_drafter_dir() -> Path | None:
    """The shipped offline-trained drafter (the baseline of OPD), or None."""
    return _folder(OFFLINE_DRAFTER)


def opd_parent_dir() -> Path | None:
    """The offline drafter the OPD drafter was fine-tuned from (its fair baseline), or None (source checkout only)."""
    return _folder(OPD_PARENT_DRAFTER)


def opd_drafter_dir() -> Path | None:
    """The OPD-fine-tuned drafter, or None (in the source repository's `checkpoints/` only, not in the wheel)."""
    return _folder(OPD_DRAFTER)


def length_head_dir() -> Path | None:
    """The shipped length head folder (with `cost_model.json`), or None."""
    folder = _folder(LENGTH_HEAD)
    return folder if folder is not None and (folder / "cost_model.json").is_file() else None


# Every checkpoint folder (shipped or repository-level) carries byte copies of its model's code (`auto_map`: it must load with
# `trust_remote_code=True` where adaflash_hf is absent). They are guarded like transformers' `# Copied from` +
# `check_copies`: `code_copies()` lists them, `tests/test_checkpoints.py` fails when one drifts from its source, and
# `python -m adaflash_hf.checkpoints --fix-copies` (or `make fix-copies`) rewrites them.
# `checkpoint_checks.py` (the loading checks both models run) has its source in `models/drafter/`; the length head's
# package copy `models/length_head/checkpoint_checks.py` is guarded the same way.
_CHECKS = "checkpoint_checks.py"
_CODE = {
    "drafter": ("models/drafter", ("configuration_adaflash_drafter.py", "modeling_adaflash_drafter.py", _CHECKS)),
    "length_head": ("models/length_head", ("configuration_adaflash_length_head.py", "modeling_adaflash_length_head.py",
                                           _CHECKS)),
}
_KIND = {OFFLINE_DRAFTER: "drafter", OPD_PARENT_DRAFTER: "drafter", OPD_DRAFTER: "drafter", LENGTH_HEAD: "length_head"}


def code_copies() -> list[tuple[Path, Path]]:
    """`(source, copy)` for every model-code file next to a shipped checkpoint, and the length head's package copy
    of `checkpoint_checks.py`."""
    pairs = []
    for name, kind in _KIND.items():
        if checkpoint_dir(name).is_dir():
            folder, files = _CODE[kind]
            pairs += [(HERE.parent / ("models/drafter" if f == _CHECKS else folder) / f, checkpoint_dir(name) / f)
                      for f in files]
    return pairs + [(HERE.parent / "models/drafter" / _CHECKS, HERE.parent / "models/length_head" / _CHECKS)]


def stale_copies(fix: bool = False) -> list[Path]:
    """The copies that differ from their source (rewritten first when `fix`; then the list is empty)."""
    stale = [copy for source, copy in code_copies() if not copy.is_file() or not filecmp.cmp(source, copy, False)]
    if fix:
        for source, copy in code_copies():
            if copy in stale:
                shutil.copyfile(source, copy)
        return []
    return stale
