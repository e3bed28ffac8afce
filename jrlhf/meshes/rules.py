"""Logical-axis -> mesh-axis rule sets, and turning logical annotations into shardings.

Model code names only logical axes (``vocab``, ``embed``, ``heads``...). A rule set maps each
logical name to zero or more mesh axes. Mesh axes that the mesh lacks are dropped, and a mesh axis
already used by an earlier dimension of the same array is not reused, so one rule set serves meshes
of different shapes (``fsdp=8`` or ``data=2,tensor=4``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    if isinstance(axes, str):
        return (axes,)
    return tuple(axes)


class MeshLayoutError(ValueError):
    """An array whose dimension does not divide the mesh axes its rules shard it over: a
    configuration error (the mesh does not fit the model), never a damaged checkpoint."""


# Parameters and activations. Activation axes carry an ``act_`` prefix so a rule set can shard
# weights (FSDP over ``embed``) differently from activations (replicated ``act_embed``).
FSDP_TP: Rules = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    # The stacked layer axis over pipeline stages: stage s holds layers [s*L/S, (s+1)*L/S)
    # (jrlhf.models.pipeline runs them as a pipeline); without a ``stage`` axis, every layer
    # everywhere.
    ("layers", "stage"),
    ("norm", None),
    ("lora_rank", None),  # LoRA adapters' inner axis (jrlhf.models.lora): a few dozen wide
    # mixture of experts (jrlhf.models.moe): experts split over the expert mesh axis, each
    # expert's width over tensor; outside the routed MLP the expert axis carries batch rows, so
    # attention and the dense parts are data-parallel over it
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("batch", ("data", "fsdp", "expert")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("act_experts", "expert"),
    # the stage dimension of a pipeline's in-flight activations (one micro-batch per stage)
    ("act_stage", "stage"),
    # decode state: slots (sequences in flight) split like the batch; each shard owns its slots'
    # KV pages, so a page pool is split the same way
    ("slots", ("data", "fsdp", "expert")),
    ("kv_pages", ("data", "fsdp", "expert")),
)

# Sampling drops FSDP: weights are replicated over data and split only over tensor, so each decode
# step reads its weights locally instead of all-gathering them.
DP_TP: Rules = tuple((name, None if name == "embed" else axes) for name, axes in FSDP_TP)

# Generation with a tensor size above the KV heads (a 405B model's 8 KV heads on 16 devices):
# query heads, MLP and vocabulary split over tensor as in dp_tp, while the K/V projections and
# the KV cache are replicated over it (every tensor shard computes and stores all KV heads; its
# query heads read the ones their group uses). The extra memory is the KV weights and cache.
DP_TP_KV_REPLICATED: Rules = tuple(
    (name, None if name in ("kv_heads", "act_kv_heads") else axes) for name, axes in DP_TP
)

# Generation with every expert on every device (experts replicated over the expert axis, which
# then only splits the slots): a decode step routes a few tokens, so reading local experts
# avoids dispatching them across devices, at the price of holding all experts.
DP_TP_EXPERTS_REPLICATED: Rules = tuple(
    (name, None if name in ("experts", "act_experts") else axes) for name, axes in DP_TP
)

REPLICATED: Rules = tuple((name, None) for name, _ in FSDP_TP)

RULE_SETS: dict[str, Rules] = {
    "fsdp_tp": FSDP_TP,
    "dp_tp": DP_TP,
    "dp_tp_kv_replicated": DP_TP_KV_REPLICATED,
    "dp_tp_experts_replicated": DP_TP_EXPERTS_REPLICATED,
    "replicated": REPLICATED,
}

# Every mesh axis some rule set names: a mesh axis outside these would shard nothing (rules drop
# axes they do not name), so a typo such as ``fsdpp=8`` would silently replicate the role.
MESH_AXES: tuple[str, ...] = tuple(
    sorted({a for rules in RULE_SETS.values() for _, axes in rules for a in _as_tuple(axes)})
)

# The rule set a phase uses unless a plan or a RoleConfig names another: training and inference
# shard weights with FSDP; generation drops it (every decode step reads all weights).
PHASE_RULES: dict[str, str] = {"train": "fsdp_tp", "infer": "fsdp_tp", "generate": "dp_tp"}


def get_rules(rules: str | Rules | Mapping[str, MeshAxes]) -> Rules:
    """Resolve a rule-set name (or pass rules through), failing with the known names."""
    if isinstance(rules, str):
        if rules not in RULE_SETS:
            raise ValueError(f"unknown rule set {rules!r} (known: {', '.join(sorted(RULE_SETS))})")
        return RULE_SETS[rules]
    if isinstance(rules, Mapping):
        return tuple(rules.items())
    return tuple((name, axes) for name, axes in rules)


def logical_to_spec(logical: tuple[str | None, ...], mesh: Mesh, rules: Rules) -> PartitionSpec:
    """PartitionSpec for one array whose dimensions carry the given logical names."""
    table = dict(get_rules(rules))
    used: set[str] = set()
    parts: list[Any] = []
    for name in logical:
        if name is None:
            parts.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule (rules cover {sorted(table)})")
        chosen = tuple(
            a
            for a in _as_tuple(table[name])
            if a in mesh.shape and mesh.shape[a] > 1 and a not in used
        )
        used.update(chosen)
        parts.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return PartitionSpec(*parts)


def axis_size(mesh: Mesh, part: Any) -> int:
    return math.prod(mesh.shape[a] for a in _as_tuple(part))


def named_sharding(
    logical: tuple[str | None, ...],
    shape: tuple[int, ...],
    mesh: Mesh,
    rules: Rules,
    what: str = "array",
) -> NamedSharding:
    """NamedSharding for one array, checking every sharded dimension divides its mesh axes."""
    if len(logical) != len(shape):
        raise ValueError(f"{what}: logical axes {logical} do not match shape {tuple(shape)}")
    spec = logical_to_spec(logical, mesh, rules)
    for dim, (size, part, name) in enumerate(zip(shape, spec, logical)):
        n = axis_size(mesh, part)
        if n > 1 and size % n and name == "layers":
            raise MeshLayoutError(
                f"{what}: {size} layers do not split over {part!r} of size {n} (pipeline "
                f"stages need a number of layers divisible by the stage count)"
            )
        if n > 1 and size % n:
            raise MeshLayoutError(
                f"{what} with shape {tuple(shape)}: dim {dim} ({name!r}, size {size}) is not "
                f"divisible by mesh axis {part!r} of size {n}"
            )
    return NamedSharding(mesh, spec)


def tree_shardings(logical_tree: Any, shape_tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """Map a tree of logical-axis tuples and a matching tree of shapes to NamedShardings."""
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str | None) for a in x)  # noqa: E731
    flat_axes, treedef = jax.tree_util.tree_flatten_with_path(logical_tree, is_leaf=is_axes)
    flat_shapes = treedef.flatten_up_to(shape_tree)
    out = []
    for (path, axes), leaf in zip(flat_axes, flat_shapes):
        shape = tuple(getattr(leaf, "shape", leaf))
        out.append(named_sharding(axes, shape, mesh, rules, what=f"parameter {path_str(path)}"))
    return treedef.unflatten(out)


def path_str(path: tuple) -> str:
    """'layers/attn/q_kernel' for a jax tree path."""
    parts = []
    for p in path:
        key = getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))
        parts.append(str(key))
    return "/".join(parts)
