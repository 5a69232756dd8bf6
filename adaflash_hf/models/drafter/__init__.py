from .configuration_adaflash_drafter import AdaFlashDrafterConfig, AdaFlashGenerationConfig
from .modeling_adaflash_drafter import AdaFlashDrafterModel, AdaFlashDrafterPreTrainedModel


__all__ = ["AdaFlashDrafterConfig", "AdaFlashGenerationConfig", "AdaFlashDrafterModel", "AdaFlashDrafterPreTrainedModel"]
