"""Generation: our candidate generator and the narrow hook that lets plain `generate` use it."""

from .candidate_generator import AdaFlashCandidateGenerator, SpeculationStats
from .dispatch import check_pair, install, is_adaflash_drafter, is_installed, uninstall


__all__ = [
    "AdaFlashCandidateGenerator",
    "SpeculationStats",
    "check_pair",
    "install",
    "is_adaflash_drafter",
    "is_installed",
    "uninstall",
]
