"""adaflash_hf: adaptive block-diffusion speculative decoding for Hugging Face transformers.

`import adaflash_hf` registers the drafter with the Auto classes and lets
`target.generate(**inputs, assistant_model=drafter)` use `AdaFlashCandidateGenerator`.
"""

from .generation import AdaFlashCandidateGenerator, SpeculationStats, check_pair
from .generation import install as _install_generation_hook
from .models import AdaFlashDrafterConfig, AdaFlashDrafterModel


_install_generation_hook()

__version__ = "0.1.0"
__all__ = [
    "AdaFlashCandidateGenerator",
    "AdaFlashDrafterConfig",
    "AdaFlashDrafterModel",
    "SpeculationStats",
    "check_pair",
]
