"""Low-rank adapters (LoRA, Hu et al. 2021) on the layer projections.

A targeted projection ``x @ W`` becomes ``x @ W + scale * (dropout(x) @ A) @ B`` with
``scale = alpha / rank``: ``A`` maps the kernel's input axes to ``rank`` (logical axis
``lora_rank``, replicated by every rule set), ``B`` maps ``rank`` to the kernel's output axes, so
``A`` shards like the kernel's input and ``B`` like its output. ``B`` starts at zero, so a fresh
adapter computes the base model exactly. The low-rank path is computed as two thin products,
never by forming ``W + A @ B`` in the train step; :func:`merge` forms it once per weight sync and
for export.

The adapters live in the model's own parameter tree, stacked over layers beside the kernels they
adapt (``layers/attn/q_lora_a``, ``layers/mlp/down_lora_b``...); :func:`trainable` picks them
(and a value head, which a critic must train) out of the tree: the part the optimizer sees.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# Target name -> (the layer sub-module holding it, its kernel's number of input axes).
TARGETS = {
    "q": ("attn", 1),
    "k": ("attn", 1),
    "v": ("attn", 1),
    "o": ("attn", 2),
    "gate": ("mlp", 1),
    "up": ("mlp", 1),
    "down": ("mlp", 1),
}
ALL_TARGETS = tuple(TARGETS)
RANK_AXIS = "lora_rank"
# Leaves a LoRA model trains besides the adapters: a value head starts random, so it must.
ALWAYS_TRAINED = ("value_head",)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapter rank, ``alpha`` (the update is scaled by ``alpha / rank``), the projections
    adapted (names of ``TARGETS``) and the dropout on the adapters' input during training."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.targets, list | str):
            targets = (self.targets,) if isinstance(self.targets, str) else self.targets
            object.__setattr__(self, "targets", tuple(targets))
        problem = config_problem(self.rank, self.alpha, self.targets, self.dropout)
        if problem:
            raise ValueError(problem)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def config_problem(rank: Any, alpha: Any, targets: Any, dropout: Any) -> str | None:
    """Why these settings make no LoRA config (one line, naming the field), or None."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        return f"lora rank must be an integer >= 1 (got {rank!r})"
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < math.inf:
        return f"lora alpha must be a finite number > 0 (got {alpha!r})"
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown or len(set(targets)) != len(targets):
        return (
            f"lora targets {tuple(targets)!r}: name each of {', '.join(TARGETS)} at most once "
            "(at least one)"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, int | float) or not 0 <= dropout < 1:
        return f"lora dropout must be in [0, 1) (got {dropout!r})"
    return None


# -- the parameters ----------------------------------------------------------------------------
def _init_a(key: jax.Array, shape: tuple[int, ...], fan_in: int, dtype) -> jax.Array:
    # PEFT's default (kaiming-uniform with a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound).astype(dtype)


def attach(layers: nnx.Module, lora: LoraConfig, key: jax.Array) -> None:
    """Give the stacked decoder ``layers`` an adapter pair per target: ``{name}_lora_a``
    (layers, *kernel input, rank) and ``{name}_lora_b`` (layers, rank, *kernel output), with
    the kernel's logical axes on their sides and ``lora_rank`` between."""
    for i, name in enumerate(lora.targets):
        group, n_in = TARGETS[name]
        module = getattr(layers, group)
        if not hasattr(module, f"{name}_kernel"):  # a mixture of experts' MLP: no such kernel
            raise ValueError(
                f"lora target {name!r}: this model's MLP is routed experts, which LoRA does not "
                "adapt (use lora_targets among q, k, v, o)"
            )
        kernel = getattr(module, f"{name}_kernel")
        axes = kernel.get_metadata()["axes"]  # ("layers", *in, *out)
        shape, dtype = kernel.shape, kernel.dtype
        ins, outs = shape[1 : 1 + n_in], shape[1 + n_in :]
        a_shape = (shape[0], *ins, lora.rank)
        a = _init_a(jax.random.fold_in(key, i), a_shape, math.prod(ins), dtype)
        b = jnp.zeros((shape[0], lora.rank, *outs), dtype)
        setattr(module, f"{name}_lora_a", nnx.Param(a, axes=(*axes[: 1 + n_in], RANK_AXIS)))
        setattr(
            module, f"{name}_lora_b", nnx.Param(b, axes=(axes[0], RANK_AXIS, *axes[1 + n_in :]))
        )
    for group in {TARGETS[name][0] for name in lora.targets}:
        module = getattr(layers, group)
        module.lora_scale = lora.scale
        module.lora_dropout = lora.dropout


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(p, "key", p)) for p in path)


def is_trainable(keys: tuple[str, ...]) -> bool:
    """Whether the parameter at ``keys`` is one a LoRA model trains."""
    return "_lora_" in keys[-1] or keys[-1] in ALWAYS_TRAINED


def select(tree: dict, keep: Callable[[tuple[str, ...]], bool], prefix=()) -> dict:
    """The nested dict ``tree`` with only the leaves whose key path ``keep`` accepts (empty
    sub-dicts dropped)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = select(v, keep, (*prefix, k))
            if sub:
                out[k] = sub
        elif keep((*prefix, k)):
            out[k] = v
    return out


def trainable(params: dict) -> dict:
    """The adapters (and a value head) of a LoRA model's parameters."""
    return select(params, is_trainable)


def frozen(params: dict) -> dict:
    """Everything but :func:`trainable`: the base model's parameters."""
    return select(params, lambda keys: not is_trainable(keys))


def combine(params: dict, part: dict) -> dict:
    """``params`` with the leaves of ``part`` (a :func:`select` of the same tree) replaced."""
    out = dict(params)
    for k, v in part.items():
        out[k] = combine(params[k], v) if isinstance(v, dict) else v
    return out


def adapters_only(params: dict) -> dict:
    return select(params, lambda keys: "_lora_" in keys[-1])


def merge(params: dict, lora: LoraConfig) -> dict:
    """The base model's parameter tree with each adapted kernel replaced by ``W + scale * A @ B``
    (computed in float32, stored in the kernel's dtype) and the adapters dropped."""
    out = select(params, lambda keys: "_lora_" not in keys[-1])
    layers = params["layers"]
    merged_layers = {group: dict(out["layers"][group]) for group in out["layers"]}
    for name in lora.targets:
        group, _ = TARGETS[name]
        w = layers[group][f"{name}_kernel"]
        a, b = layers[group][f"{name}_lora_a"], layers[group][f"{name}_lora_b"]
        n, r = w.shape[0], lora.rank
        delta = jnp.einsum(
            "lir,lro->lio",
            a.reshape(n, -1, r).astype(jnp.float32),
            b.reshape(n, r, -1).astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        merged = w.astype(jnp.float32) + lora.scale * delta.reshape(w.shape)
        merged_layers[group][f"{name}_kernel"] = merged.astype(w.dtype)
    out["layers"] = {**out["layers"], **merged_layers}
    return out


def count(params_or_shapes: Any) -> tuple[int, int]:
    """(elements, bytes) of a tree of arrays or ShapeDtypeStructs."""
    leaves = jax.tree.leaves(params_or_shapes)
    return (
        sum(math.prod(x.shape) for x in leaves),
        sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves),
    )


def num_adapter_params(cfg: Any, lora: LoraConfig) -> int:
    """Adapter parameter count of a ModelConfig ``cfg`` from its shapes (no allocation)."""
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    h, k = cfg.num_heads * d, cfg.num_kv_heads * d
    dims = {"q": (e, h), "k": (e, k), "v": (e, k), "o": (h, e), "gate": (e, f), "up": (e, f)}
    dims["down"] = (f, e)
    return cfg.num_layers * lora.rank * sum(sum(dims[t]) for t in lora.targets)


# -- the forward hook --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Adapted:
    """A projection kernel (compute dtype) with its adapter pair, as the layers pass it to
    jrlhf.models.transformer.project: the product is ``x @ kernel + scale * (x @ a) @ b``."""

    kernel: jax.Array
    a: jax.Array
    b: jax.Array
    scale: float
    dropout: float

    def delta(self, x: jax.Array, matmul: Callable[[jax.Array, jax.Array], jax.Array]):
        """The low-rank update ``scale * (dropout(x) @ a) @ b``, output axes merged."""
        r = self.a.shape[-1]
        key = _DROPOUT_KEY.get()
        if self.dropout > 0 and key is not None:
            keep = jax.random.bernoulli(_next_key(), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        low = matmul(x, self.a.reshape(-1, r))
        return self.scale * matmul(low, self.b.reshape(r, -1))


def adapted(module: nnx.Module, name: str, kernel: jax.Array, dtype) -> jax.Array | Adapted:
    """``kernel`` (``module``'s ``{name}_kernel`` in compute dtype), with its adapter pair
    when ``module`` has one."""
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return kernel
    b = getattr(module, f"{name}_lora_b")
    return Adapted(kernel, a[...].astype(dtype), b[...].astype(dtype), module.lora_scale,
                   module.lora_dropout)  # fmt: skip


# Dropout on the adapters' input runs only where a train step sets a key (``dropout_key``):
# scoring, generation and evaluation see no dropout. Each adapter call draws the next key of a
# per-layer stream (``layer``), so masks differ across projections and layers.
_DROPOUT_KEY: contextvars.ContextVar = contextvars.ContextVar("jrlhf_lora_key", default=None)


def _next_key() -> jax.Array:
    key, n = _DROPOUT_KEY.get()
    _DROPOUT_KEY.set((key, n + 1))
    return jax.random.fold_in(key, n)


@contextlib.contextmanager
def dropout_key(key: jax.Array | None) -> Iterator[None]:
    """Adapter dropout on, drawing from ``key``, for the forward passes traced inside."""
    token = _DROPOUT_KEY.set(None if key is None else (key, 0))
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


@contextlib.contextmanager
def layer(index: jax.Array) -> Iterator[None]:
    """The dropout stream of layer ``index`` (a traced index under a scan) for the adapters
    traced inside; nothing without a dropout key."""
    current = _DROPOUT_KEY.get()
    if current is None:
        yield
        return
    token = _DROPOUT_KEY.set((jax.random.fold_in(current[0], index), 0))
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)
