"""The decoder in Flax NNX (Llama, Qwen2, Qwen3, Mistral, Gemma 2, Gemma 3 text), its value-head
variant, and HF checkpoint interop."""

from jrlhf.models import hf
from jrlhf.models.config import ModelConfig, RopeScaling, tiny_config
from jrlhf.models.hf import config_from_hf, config_to_hf, load_hf, save_hf
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.transformer import Transformer

__all__ = [
    "ModelConfig",
    "ModelDef",
    "Params",
    "RopeScaling",
    "Transformer",
    "config_from_hf",
    "config_to_hf",
    "hf",
    "load_hf",
    "save_hf",
    "tiny_config",
]
