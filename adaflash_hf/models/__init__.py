"""Models: the block-diffusion drafter (and, later, the adaptive length head)."""

from transformers import AutoConfig, AutoModel

from .drafter import AdaFlashDrafterConfig, AdaFlashDrafterModel, AdaFlashGenerationConfig
from .length_head import AdaFlashLengthHead, AdaFlashLengthHeadConfig


def _register() -> None:
    """Register our configs/models with the Auto classes and for `auto_map` on save (idempotent)."""
    for config_cls, model_cls in (
        (AdaFlashDrafterConfig, AdaFlashDrafterModel),
        (AdaFlashLengthHeadConfig, AdaFlashLengthHead),
    ):
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, model_cls, exist_ok=True)
        # Writes `auto_map` into saved configs and copies the modeling/config files next to the weights, so a
        # checkpoint loads with `trust_remote_code=True` where adaflash_hf is not installed.
        config_cls.register_for_auto_class()
        model_cls.register_for_auto_class("AutoModel")


_register()

__all__ = ["AdaFlashDrafterConfig", "AdaFlashDrafterModel", "AdaFlashGenerationConfig", "AdaFlashLengthHead", "AdaFlashLengthHeadConfig"]
