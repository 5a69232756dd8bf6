from .configuration_adaflash_drafter import AdaFlashDrafterConfig
from .modeling_adaflash_drafter import AdaFlashDrafterModel, AdaFlashDrafterPreTrainedModel


__all__ = ["AdaFlashDrafterConfig", "AdaFlashDrafterModel", "AdaFlashDrafterPreTrainedModel"]
