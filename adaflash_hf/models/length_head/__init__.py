from .configuration_adaflash_length_head import AdaFlashLengthHeadConfig
from .modeling_adaflash_length_head import AdaFlashLengthHead, LengthHeadOutput, probability_features


__all__ = ["AdaFlashLengthHead", "AdaFlashLengthHeadConfig", "LengthHeadOutput", "probability_features"]
