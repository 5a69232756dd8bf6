"""Training: offline DFlash-recipe drafter training, OPD and the length head.

Needs the `train` extra (`pip install 'adaflash-hf[train]'`: trl, peft, accelerate, datasets).
"""

from ..utils.extras import require


require("adaflash_hf.training", "datasets", "accelerate", "trl")


from .blocks import block_attention_mask, block_labels, draft_blocks, position_weights, sample_anchors
from .callbacks import ComputeBudgetCallback, EvalCurveCallback
from .data import build_training_dataset, generate_responses, record_targets
from .drafter_config import DrafterTrainingConfig
from .drafter_trainer import DrafterDataCollator, DrafterTrainer
from .label_hidden import build_label_dataset
from .label_store import LabelStore, select_entries
from .opd_config import OPDConfig
from .opd_trainer import OPDTrainer, reverse_kl_per_token
from .store_data import StoreTrainingData, split_holdout, store_training_data


__all__ = [
    "ComputeBudgetCallback",
    "DrafterDataCollator",
    "DrafterTrainer",
    "DrafterTrainingConfig",
    "EvalCurveCallback",
    "LabelStore",
    "OPDConfig",
    "OPDTrainer",
    "StoreTrainingData",
    "block_attention_mask",
    "block_labels",
    "build_label_dataset",
    "build_training_dataset",
    "draft_blocks",
    "generate_responses",
    "position_weights",
    "record_targets",
    "reverse_kl_per_token",
    "sample_anchors",
    "select_entries",
    "split_holdout",
    "store_training_data",
]
