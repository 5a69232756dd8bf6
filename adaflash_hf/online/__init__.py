# Copyright 2026 The adaflash_hf authors. Licensed under the Apache License, Version 2.0.
"""OnlineSpec: the drafter keeps learning from verification feedback while it serves (LoRA via PEFT).

Needs the `online` extra (`pip install 'adaflash-hf[online]'`: peft).
"""

from ..utils.extras import require


require("adaflash_hf.online (OnlineSpec)", "peft")


from .adapter import OnlineSpecAdapter, OnlineStats
from .background import BackgroundUpdates
from .feedback import RoundFeedback, SequenceFeedback
from .learners import Hedge, OnlineLearner
from .online_config import OnlineSpecConfig
from .regret import hindsight_loss, regret


__all__ = [
    "BackgroundUpdates",
    "Hedge",
    "OnlineLearner",
    "OnlineSpecAdapter",
    "OnlineSpecConfig",
    "OnlineStats",
    "RoundFeedback",
    "SequenceFeedback",
    "hindsight_loss",
    "regret",
]
