"""Small random HF checkpoints built with transformers (the independent reference)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

VOCAB = 128


def _build(kind: str, directory: Path) -> Path:
    import torch
    import transformers as tf

    torch.manual_seed({"llama3": 0, "qwen2": 1, "llama_mha": 2, "llama3_rm": 3, "mistral": 4}[kind])
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    if kind in ("llama3", "llama3_rm"):
        cfg = tf.LlamaConfig(
            **common,
            num_attention_heads=8,
            num_key_value_heads=4,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            eos_token_id=2,
            pad_token_id=0,
        )
    elif kind == "mistral":
        # A sliding window shorter than the test sequences, so the window mask matters.
        cfg = tf.MistralConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
            eos_token_id=2,
        )
    elif kind == "llama_mha":
        cfg = tf.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, eos_token_id=2)
    else:
        raise ValueError(kind)
    if kind == "llama3_rm":
        cfg.num_labels = 1
        model = tf.LlamaForSequenceClassification(cfg)
    else:
        model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        # Random non-trivial norms and biases so a wrong mapping cannot hide behind ones/zeros.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


@functools.cache
def hf_checkpoint(kind: str) -> Path:
    """Path of a cached random checkpoint: 'llama3', 'qwen2', 'llama_mha', 'mistral' or
    'llama3_rm'."""
    root = Path(tempfile.mkdtemp(prefix=f"jrlhf-{kind}-"))
    return _build(kind, root / kind)


def torch_logits(path, tokens, attention_mask=None):
    import numpy as np
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(
            torch.tensor(np.asarray(tokens)),
            attention_mask=None if attention_mask is None else torch.tensor(attention_mask),
        )
    return out.logits.numpy()
