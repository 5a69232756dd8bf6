"""Generation: both engines (bs=1 candidate generator, batched engine), their shared policy, lengths and cost model,
the drafter's runtime, and the narrow hook that lets plain `generate` use our generator."""

from .batch import AdaFlashBatchGenerator, batched_generate, generate_batch
from .candidate_generator import AdaFlashCandidateGenerator
from .cost_model import TargetCostModel, best_length, cost_model_for, verify_lengths
from .dispatch import (
    check_pair,
    install,
    installed,
    is_adaflash_drafter,
    is_installed,
    speculative_decoding,
    uninstall,
)
from .policy import ProposalPolicy
from .runtime import SpeculationRuntime
from .stats import BatchStats, SpeculationStats


__all__ = [
    "AdaFlashBatchGenerator",
    "AdaFlashCandidateGenerator",
    "BatchStats",
    "ProposalPolicy",
    "SpeculationRuntime",
    "SpeculationStats",
    "TargetCostModel",
    "batched_generate",
    "best_length",
    "check_pair",
    "cost_model_for",
    "generate_batch",
    "install",
    "installed",
    "is_adaflash_drafter",
    "is_installed",
    "speculative_decoding",
    "uninstall",
    "verify_lengths",
]
