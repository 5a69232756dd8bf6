# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""The cache root of `adaflash_hf` (`$ADAFLASH_HF_CACHE` or `~/.cache/adaflash_hf`) and an `fcntl` file lock.

Library code (e.g. the cost models under `cost_models/`) and the offline testbed (`adaflash_hf.testbed`, which
imports these from here) share the same root.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator


try:  # POSIX only; on other platforms the lock degrades to a no-op.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None


CACHE_ENV_VAR = "ADAFLASH_HF_CACHE"
"""Environment variable that overrides the cache root (default ``~/.cache/adaflash_hf``)."""

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Return (and create) the cache root: ``$ADAFLASH_HF_CACHE`` or ``~/.cache/adaflash_hf``."""
    override = os.environ.get(CACHE_ENV_VAR)
    root = Path(override).expanduser() if override else Path.home() / ".cache" / "adaflash_hf"
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def file_lock(path: Path, waiting: str = "Waiting for %s (another process holds it)...",
              log: logging.Logger | None = None) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if missing) for the ``with`` block.

    The lock belongs to the open file, so it also serializes threads of one process. One that has to wait logs
    ``waiting % path`` once (at INFO on ``log``), so a slow first-time step elsewhere does not look like a hang.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        if fcntl is None:  # pragma: no cover
            yield
            return
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            (log or logger).info(waiting, path)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


__all__ = ["CACHE_ENV_VAR", "cache_dir", "file_lock"]
