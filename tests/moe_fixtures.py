"""Small random Qwen3-MoE, Mixtral and Qwen2-MoE checkpoints built with transformers (the
reference)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from hf_fixtures import randomize_and_save

VOCAB = 96


def _build(kind: str, directory: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed({"qwen3_moe": 11, "mixtral": 12, "qwen2_moe": 13}[kind])
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        eos_token_id=2,
        pad_token_id=0,
        rope_theta=10000.0,
    )
    if kind == "qwen3_moe":
        # norm_topk_prob False (the config's default): the top-k probabilities unrenormalized
        cfg = tf.Qwen3MoeConfig(
            **common, num_experts=4, intermediate_size=48, moe_intermediate_size=24
        )
        cfg.norm_topk_prob = False
    elif kind == "qwen2_moe":  # q/k/v biases and a shared expert behind a sigmoid gate
        cfg = tf.Qwen2MoeConfig(
            **common,
            num_experts=4,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
        )
    else:
        cfg = tf.MixtralConfig(**common, num_local_experts=4, intermediate_size=24)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    # router weights large enough that routing depends on the token
    return randomize_and_save(model, directory, scale=0.1, scales=(("gate.weight", 0.5),))


@functools.cache
def moe_checkpoint(kind: str) -> Path:
    """Path of a cached random checkpoint: 'qwen3_moe', 'mixtral' or 'qwen2_moe' (2 layers,
    hidden 32, 4 experts, top-2; Qwen2-MoE with a shared expert)."""
    root = Path(tempfile.mkdtemp(prefix=f"jrlhf-{kind}-"))
    return _build(kind, root / kind)
