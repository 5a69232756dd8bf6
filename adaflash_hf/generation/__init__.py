"""Generation: our candidate generator and the narrow hook that lets plain `generate` use it."""

from .batch import AdaFlashBatchGenerator, batched_generate, generate_batch
from .batch_state import BatchStats
from .candidate_generator import AdaFlashCandidateGenerator, SpeculationStats
from .cost_model import TargetCostModel, best_length
from .dispatch import check_pair, install, is_adaflash_drafter, is_installed, uninstall


__all__ = [
    "AdaFlashBatchGenerator",
    "AdaFlashCandidateGenerator",
    "BatchStats",
    "TargetCostModel",
    "batched_generate",
    "best_length",
    "generate_batch",
    "SpeculationStats",
    "check_pair",
    "install",
    "is_adaflash_drafter",
    "is_installed",
    "uninstall",
]
