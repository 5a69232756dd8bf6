"""Small trained checkpoints shipped with the package (drafters for the testbed target)."""

from pathlib import Path


HERE = Path(__file__).resolve().parent
DEFAULT_DRAFTER = "smollm2-135m-instruct-drafter"


def default_drafter_dir() -> Path | None:
    """Folder of the shipped default drafter for SmolLM2-135M-Instruct, or None if none is shipped yet."""
    folder = HERE / DEFAULT_DRAFTER
    return folder if (folder / "config.json").is_file() else None
