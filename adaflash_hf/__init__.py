"""adaflash_hf: adaptive block-diffusion speculative decoding for Hugging Face transformers.

`import adaflash_hf` registers the drafter with the Auto classes and lets
`target.generate(**inputs, assistant_model=drafter)` use `AdaFlashCandidateGenerator`.
"""

from .generation import (
    AdaFlashBatchGenerator,
    AdaFlashCandidateGenerator,
    SpeculationRuntime,
    SpeculationStats,
    TargetCostModel,
    batched_generate,
    check_pair,
    generate_batch,
    speculative_decoding,
)
from .generation import install as _install_generation_hook
from .models import (
    AdaFlashDrafterConfig,
    AdaFlashDrafterModel,
    AdaFlashGenerationConfig,
    AdaFlashLengthHead,
    AdaFlashLengthHeadConfig,
)


_install_generation_hook()

__version__ = "0.1.0"
__all__ = [
    "AdaFlashBatchGenerator",
    "AdaFlashCandidateGenerator",
    "AdaFlashDrafterConfig",
    "AdaFlashDrafterModel",
    "AdaFlashGenerationConfig",
    "AdaFlashLengthHead",
    "AdaFlashLengthHeadConfig",
    "SpeculationRuntime",
    "SpeculationStats",
    "TargetCostModel",
    "batched_generate",
    "check_pair",
    "generate_batch",
    "speculative_decoding",
]
