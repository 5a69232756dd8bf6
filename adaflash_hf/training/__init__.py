"""Training: offline DFlash-recipe drafter training (and, later, OPD and the length head)."""

from .blocks import block_attention_mask, block_labels, draft_blocks, position_weights, sample_anchors
from .data import build_training_dataset, generate_responses, record_targets
from .drafter_config import DrafterTrainingConfig
from .drafter_trainer import DrafterDataCollator, DrafterTrainer


__all__ = [
    "DrafterDataCollator",
    "DrafterTrainer",
    "DrafterTrainingConfig",
    "block_attention_mask",
    "block_labels",
    "build_training_dataset",
    "draft_blocks",
    "generate_responses",
    "position_weights",
    "record_targets",
    "sample_anchors",
]
