"""adaflash_hf: adaptive block-diffusion speculative decoding for Hugging Face transformers.

`import adaflash_hf` registers the drafter with the Auto classes and lets
`target.generate(**inputs, assistant_model=drafter)` use `AdaFlashCandidateGenerator`.
"""

from .compat import check_transformers as _check_transformers


_check_transformers()  # before anything is wrapped: on a changed transformers internal, refuse in one line

from .generation import (  # noqa: E402
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
from .generation import install as _install_generation_hook  # noqa: E402
from .models import (  # noqa: E402
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
