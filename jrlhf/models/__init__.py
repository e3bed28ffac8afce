"""Llama-family decoder in Flax NNX, its value-head variant, and HF checkpoint interop."""

from jrlhf.models.config import ModelConfig, RopeScaling, tiny_config
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.transformer import Transformer

__all__ = ["ModelConfig", "ModelDef", "Params", "RopeScaling", "Transformer", "tiny_config"]


def __getattr__(name):
    # HF interop pulls in file IO helpers; import lazily to keep `import jrlhf.models` light.
    if name in ("load_hf", "save_hf", "config_from_hf", "config_to_hf"):
        from jrlhf.models import hf

        return getattr(hf, name)
    raise AttributeError(name)
