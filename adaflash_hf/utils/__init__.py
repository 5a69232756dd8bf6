# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""Small helpers of the library that import nothing else from it (the testbed builds on them, never the reverse)."""

from .cache import CACHE_ENV_VAR, cache_dir, file_lock


__all__ = ["CACHE_ENV_VAR", "cache_dir", "file_lock"]
