"""jrlhf: a JAX/XLA trainer for RLHF on large language models."""

__version__ = "0.1.0"
