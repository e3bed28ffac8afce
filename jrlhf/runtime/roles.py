"""Roles (actor, critic, reference, reward): each one's model, and its mesh and rules in every
phase it has, as the effective plan (jrlhf.placement.effective) places them; and the jitted
inference calls that run a role's model on its mesh.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jrlhf.config import ROLE_PHASES, Config, RoleConfig
from jrlhf.meshes.batch import batch_sharding, check_batch_divides, shard_batch, to_host
from jrlhf.meshes.context import activation_sharding
from jrlhf.meshes.mesh import blame_setting, make_mesh
from jrlhf.meshes.rules import Rules, axis_size, get_rules
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.placement.plan import CALLS, CallPlacement, ExecutionPlan, ReshardEdge
from jrlhf.reshard.processes import check_separable
from jrlhf.reshard.resharder import path_between
from jrlhf.runtime.model_source import ModelSource, load_weights
from jrlhf.shared_programs import shared_program


@dataclasses.dataclass
class RoleSetup:
    """A role's model source with its mesh and rules for each of its phases."""

    name: str
    config: RoleConfig
    source: ModelSource
    meshes: dict[str, Mesh]
    rules: dict[str, Rules]
    _shardings: dict[str, Params] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def model(self) -> ModelDef:
        return self.source.model

    def shardings(self, phase: str) -> Params:
        """The parameters' shardings in ``phase`` (built once: the trainer asks every
        iteration, before each weight transition). Outside training a LoRA model's weights
        travel merged (jrlhf.ppo.weights): the plain model's shardings."""
        if phase not in self._shardings:
            model = self.model if phase == "train" else self.model.base
            self._shardings[phase] = model.shardings(self.meshes[phase], self.rules[phase])
        return self._shardings[phase]

    def describe(self) -> str:
        return ", ".join(
            f"{phase}: {dict(mesh.shape)} {sorted(d.id for d in mesh.devices.flat)}"
            for phase, mesh in self.meshes.items()
        )


def setup_role(cfg: Config, role: str, plan: ExecutionPlan, source: ModelSource) -> RoleSetup:
    """``role`` placed as ``plan`` says in each of its phases; fails in one line, naming the
    parameter, when a layout does not divide its mesh."""
    meshes, rules = {}, {}
    for phase in ROLE_PHASES[role]:
        placement = plan.for_role(role, phase)
        with blame_setting(mesh_setting(cfg, role, phase, placement)):
            meshes[phase] = make_mesh(placement.mesh)
            if phase == "train":
                # A training mesh over some processes only (a placement that separates
                # processes) must admit the copies view its checkpoints go through
                # (jrlhf.reshard.processes); the other phases' weights are never saved.
                check_separable(meshes[phase])
        rules[phase] = get_rules(placement.rules)
    for edge in plan.reshard_edges():
        if edge.role == role:
            phase = CALLS[edge.dst][1]
            with blame_setting(mesh_setting(cfg, role, phase, plan[edge.dst])):
                _check_edge(edge, plan)
    setup = RoleSetup(role, cfg.roles[role], source, meshes, rules)
    for phase in meshes:
        with blame_setting(mesh_setting(cfg, role, phase, plan.for_role(role, phase))):
            setup.shardings(phase)
    return setup


def mesh_setting(cfg: Config, role: str, phase: str, placement: CallPlacement) -> str:
    """The setting that chose ``role``'s mesh in ``phase``, for errors about that mesh: the
    role's own binding (``actor/RoleConfig.train_mesh``) or the plan of RunConfig.placement."""
    mesh = placement.mesh
    if cfg.roles[role].placement(phase) is not None:
        return f"{role}/RoleConfig.{phase}_mesh {mesh} [{placement.rules}]"
    return (
        f"the {role} {phase} mesh {mesh} [{placement.rules}] of RunConfig.placement="
        f"{cfg.run.placement!r} (set {role}/RoleConfig.{phase}_mesh to choose another)"
    )


def _check_edge(edge: ReshardEdge, plan: ExecutionPlan) -> None:
    """One-line error for weights that would move between meshes of different processes in a
    way JAX's cross-host transfer cannot: it copies shard for shard only, so the resharder
    (whose path this asks) needs the same device count, disjoint device sets (stacked or relay
    layouts between different counts) or a part of the source whose count divides it."""
    src, dst = plan[edge.src].mesh, plan[edge.dst].mesh
    devices = jax.devices()
    ids = [frozenset(devices[i] for i in m.device_ids()) for m in (src, dst)]
    procs = [{d.process_index for d in m} for m in ids]
    crosses = procs[0] != procs[1]
    if not crosses or path_between(ids[0], ids[1], crosses) != "device_put":
        return
    raise ValueError(
        f"{edge.dst} mesh {dst} holds devices of process(es) {sorted(procs[1])} and "
        f"{edge.src} mesh {src} of {sorted(procs[0])}: weights move between processes "
        "shard for shard only, so the meshes need as many devices, or disjoint ones"
    )


class ChunkedOutput(list):
    """Per-chunk device outputs of one inference call; ``np.asarray`` waits for and joins them.

    Keeping the pieces as device arrays until the caller asks for them lets the trainer dispatch
    the reference, reward and critic calls back to back without a host sync in between.
    """

    rows: int = 0

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate(to_host(list(self)), axis=0)[: self.rows]
        return out if dtype is None else out.astype(dtype)


@shared_program()
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
    Rows that do not split over the mesh's batch axes are padded (repeated) up to a multiple of
    them and the padding dropped from the result, so any number of rows scores on any mesh.
    """
    if batch_size:
        check_batch_divides({"infer_batch_size": np.zeros((batch_size, 1))}, mesh, rules)
    spec = batch_sharding(mesh, rules, 2).spec
    shards = axis_size(mesh, spec[0] if spec else None)

    def run(params, batch):
        with activation_sharding(mesh, rules):
            return fn(model.bind(params), batch)

    jitted = jax.jit(run)

    def call(params, batch):
        rows = len(next(iter(batch.values())))
        if (not batch_size or rows <= batch_size) and rows % shards == 0:
            return jitted(params, shard_batch(batch, mesh, rules))
        size = batch_size if batch_size and rows > batch_size else -(-rows // shards) * shards
        out = ChunkedOutput()
        out.rows = rows
        for start in range(0, rows, size):
            idx = np.arange(start, start + size) % rows  # wrap to pad the last chunk
            chunk = {k: np.asarray(v)[idx] for k, v in batch.items()}
            out.append(jitted(params, shard_batch(chunk, mesh, rules)))
        return out

    call.jitted = jitted
    return call


def frozen_infer(
    source: ModelSource,
    mesh: Mesh,
    rules: Rules,
    fn: Callable[..., jax.Array],
    seed: int,
    batch_size: int = 0,
) -> Callable[[dict], Any]:
    """Load a frozen model (reference, reward) onto ``mesh`` and return ``arrays -> fn(...)``
    (a :class:`FrozenModel`, whose ``params`` may be moved off the device while idle)."""
    params = load_weights(source, mesh, rules, seed)
    return FrozenModel(make_infer(source.model, mesh, rules, fn, batch_size), params)


class FrozenModel:
    """A frozen model's parameters and its inference call: ``model(arrays)``. ``params`` is a
    plain attribute so the trainer can park it in host memory between scoring phases
    (jrlhf.ppo.residency) and put it back before the next call."""

    def __init__(self, infer: Callable[[Params, dict], Any], params: Params):
        self.infer, self.params = infer, params

    def __call__(self, arrays: dict) -> Any:
        return self.infer(self.params, arrays)
