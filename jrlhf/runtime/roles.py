"""Roles (actor, critic, reference, reward): their models, meshes per phase, and placement.

``RunConfig.placement`` names an execution plan (jrlhf.placement) that places every model call:

- ``flatten`` (alias ``colocated``): every call on all devices (training ``fsdp x tensor``,
  generation ``data x tensor``), the actor switching layouts in place;
- ``interleave``: as flatten, with reference, reward and critic inference on disjoint slices so
  they run concurrently;
- ``separate`` (alias ``separated``): generation on the first half of the devices, everything else
  on the second half, the actor's generation copy refreshed by jrlhf.reshard after each update;
- ``search``: the plan the cost-model search picks for this machine;
- ``custom``: meshes from each role's RoleConfig (``python -m jrlhf.plan`` writes such gin files).

A RoleConfig mesh string overrides the plan for that role and phase.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jrlhf.config import Config, RoleConfig
from jrlhf.meshes.context import activation_sharding
from jrlhf.meshes.mesh import MeshSpec, make_mesh
from jrlhf.meshes.rules import Rules, get_rules
from jrlhf.models.config import ModelConfig, tiny_config
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.runtime.steps import check_batch_divides, shard_batch

PHASES = ("train", "infer", "generate")


def resolve_plan(cfg: Config, num_devices: int):
    """The execution plan named by ``RunConfig.placement`` for ``num_devices`` devices."""
    from jrlhf.placement import strategy

    placement = cfg.run.placement
    if placement == "custom":
        placement = "flatten"  # RoleConfig meshes fill in; flatten covers what they leave out
    if placement == "search":
        from jrlhf.placement.search import search_for_config

        return search_for_config(cfg, num_devices)
    return strategy(placement, num_devices)


@dataclasses.dataclass
class RoleSetup:
    """A role's model definition with its mesh and rules for each phase."""

    name: str
    config: RoleConfig
    model: ModelDef
    meshes: dict[str, Mesh]
    rules: dict[str, Rules]

    def shardings(self, phase: str) -> Params:
        return self.model.shardings(self.meshes[phase], self.rules[phase])

    def describe(self) -> str:
        return ", ".join(
            f"{phase}: {dict(mesh.shape)} {sorted(d.id for d in mesh.devices.flat)}"
            for phase, mesh in self.meshes.items()
        )


# A role's phase without a model call of its own borrows another phase's placement.
_FALLBACK = {
    ("actor", "infer"): ("actor", "train"),
    ("critic", "generate"): ("critic", "train"),
    ("reference", "train"): ("reference", "infer"),
    ("reference", "generate"): ("reference", "infer"),
    ("reward", "train"): ("reward", "infer"),
    ("reward", "generate"): ("reward", "infer"),
}


def role_meshes(cfg: Config, role: str, plan=None) -> tuple[dict[str, Mesh], dict[str, Rules]]:
    """Mesh and rules of ``role`` in each phase: from the plan, unless the role's RoleConfig
    names a mesh for that phase (then its rules apply too)."""
    rc = cfg.roles[role]
    plan = plan or resolve_plan(cfg, jax.device_count())
    meshes, rules = {}, {}
    for phase in PHASES:
        text = getattr(rc, f"{phase}_mesh")
        if text:
            spec, rule_name = MeshSpec.parse(text), getattr(rc, f"{phase}_rules")
        else:
            placement = plan.for_role(role, phase) or plan.for_role(*_FALLBACK[(role, phase)])
            spec, rule_name = placement.mesh, placement.rules
        try:
            meshes[phase] = make_mesh(spec)
        except ValueError as e:
            raise ValueError(f"{role}/RoleConfig.{phase}_mesh: {e}") from None
        rules[phase] = get_rules(rule_name)
    return meshes, rules


def model_overrides(rc: RoleConfig) -> dict[str, Any]:
    """A role's ``model_overrides`` as a dict, failing in one line on unknown model fields."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    overrides = dict(rc.model_overrides)
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"RoleConfig.model_overrides: unknown model field(s) {bad}")
    return overrides


def _apply_role_overrides(model_cfg: ModelConfig, rc: RoleConfig) -> ModelConfig:
    overrides = model_overrides(rc)
    overrides.update(param_dtype=rc.param_dtype, dtype=rc.dtype, remat_policy=rc.remat_policy)
    return model_cfg.replace(**overrides)


def resolve_model(
    init: str, rc: RoleConfig, head: str, task_overrides: dict[str, Any], run_dir: Path
) -> tuple[ModelDef, str | None]:
    """The ModelDef a role starts from, and the directory its weights come from (None: random).

    ``tiny`` builds a small Llama config sized for the task; ``hf:DIR`` and ``ckpt:DIR`` read the
    config from the checkpoint; ``stage:sft`` / ``stage:rm`` use this run's stage outputs.
    """
    from jrlhf import checkpoint
    from jrlhf.models import hf

    kind, _, where = init.partition(":")
    if kind == "tiny":
        base = tiny_config(**task_overrides)
        return ModelDef(_apply_role_overrides(base, rc), head), None
    if kind == "stage":
        where = str(run_dir / where)
        kind = "ckpt"
    if kind == "hf":
        base, _ = hf.read_hf_config(where)
        return ModelDef(_apply_role_overrides(base, rc), head), f"hf:{where}"
    if kind == "ckpt":
        stored = checkpoint.read_model_json(where)
        return ModelDef(_apply_role_overrides(stored.config, rc), head), f"ckpt:{where}"
    raise ValueError(f"unknown model source {init!r}")


def load_weights(
    model: ModelDef, source: str | None, mesh: Mesh, rules: Rules, seed: int
) -> Params:
    """Parameters for ``model`` on ``mesh``: random, or restored/imported from ``source``.

    A value-head model initialised from a language model (e.g. a critic from the SFT policy)
    keeps the shared backbone and starts its value head from random numbers.
    """
    from jrlhf import checkpoint
    from jrlhf.models import hf

    if source is None:
        return model.init_sharded(mesh, rules, seed=seed)
    kind, _, where = source.partition(":")
    if kind == "hf":
        stored, params = hf.load_hf(where, mesh, rules, param_dtype=model.config.param_dtype)
    else:
        stored = checkpoint.read_model_json(where)
        stored = ModelDef(model.config.replace(), stored.head)
        params = checkpoint.restore_params(Path(where) / checkpoint.PARAMS_DIR, stored, mesh, rules)
    if stored.head == model.head:
        return params
    fresh = model.init_sharded(mesh, rules, seed=seed)
    return {k: params[k] if k in params and k not in ("lm_head",) else v for k, v in fresh.items()}


class ChunkedOutput(list):
    """Per-chunk device outputs of one inference call; ``np.asarray`` waits for and joins them.

    Keeping the pieces as device arrays until the caller asks for them lets the trainer dispatch
    the reference, reward and critic calls back to back without a host sync in between.
    """

    rows: int = 0

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate([np.asarray(piece) for piece in self], axis=0)[: self.rows]
        return out if dtype is None else out.astype(dtype)


def make_infer(
    model: ModelDef,
    mesh: Mesh,
    rules: Rules,
    fn: Callable[..., jax.Array],
    batch_size: int = 0,
) -> Callable[[Params, dict], Any]:
    """A jitted ``fn(module, batch)`` run on ``mesh``: the batch is split over its batch axes.

    With ``batch_size > 0`` the rows are scored ``batch_size`` at a time (the last chunk padded
    to full size, so one compiled program serves every call), bounding activation memory.
    """
    if batch_size:
        check_batch_divides({"infer_batch_size": np.zeros((batch_size, 1))}, mesh, rules)

    def run(params, batch):
        with activation_sharding(mesh, rules):
            return fn(model.bind(params), batch)

    jitted = jax.jit(run)

    def call(params, batch):
        rows = len(next(iter(batch.values())))
        if not batch_size or rows <= batch_size:
            return jitted(params, shard_batch(batch, mesh, rules))
        out = ChunkedOutput()
        out.rows = rows
        for start in range(0, rows, batch_size):
            idx = np.arange(start, start + batch_size) % rows  # wrap to pad the last chunk
            chunk = {k: np.asarray(v)[idx] for k, v in batch.items()}
            out.append(jitted(params, shard_batch(chunk, mesh, rules)))
        return out

    call.jitted = jitted
    return call


def frozen_infer(
    model: ModelDef,
    source: str | None,
    mesh: Mesh,
    rules: Rules,
    fn: Callable[..., jax.Array],
    seed: int,
    batch_size: int = 0,
) -> Callable[[dict], Any]:
    """Load a frozen model (reference, reward) onto ``mesh`` and return ``arrays -> fn(...)``."""
    params = load_weights(model, source, mesh, rules, seed)
    infer = make_infer(model, mesh, rules, fn, batch_size)
    return lambda arrays: infer(params, arrays)
