"""The effective plan: the one placement a run executes, produced once from the config.

``RunConfig.placement`` names a strategy (flatten, interleave, separate), the cost-model search
(search) or custom (flatten under the RoleConfig meshes); every mesh a RoleConfig gives is then
laid over that plan, with its rules. The result is what the roles are built on, what the trainer
reshards along (``reshard_edges``), what the log line shows and what ``plan.gin`` records, so
all of them describe the placement that ran.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jrlhf.config import Config
from jrlhf.meshes.mesh import MeshSpec
from jrlhf.models.config import ModelConfig
from jrlhf.placement.estimator import tail_replicas
from jrlhf.placement.plan import CALLS, STAGE_CALLS, CallPlacement, ExecutionPlan, strategy
from jrlhf.placement.search import search_for_config


def effective_plan(
    cfg: Config,
    num_devices: int,
    models: Mapping[str, ModelConfig] | None = None,
) -> ExecutionPlan:
    """The plan this run executes on ``num_devices`` devices.

    ``models`` (each role's ModelConfig, jrlhf.runtime.model_source.role_models) is needed only
    by ``placement='search'``, whose cost model prices them. Raises ValueError in one line for a
    plan whose slices do not exist on ``num_devices`` devices.
    """
    placement = cfg.run.placement
    if placement == "search":
        if models is None:
            raise ValueError("RunConfig.placement='search' needs the roles' models to price")
        base = search_for_config(cfg, num_devices, models)
    else:
        base = strategy("flatten" if placement == "custom" else placement, num_devices)
    calls, stages, overridden = dict(base.placements), {}, []
    for call, (role, phase) in (*CALLS.items(), *STAGE_CALLS.items()):
        fixed = cfg.roles[role].placement(phase)
        if fixed is None:
            continue
        mesh, rules = fixed
        try:
            placed = CallPlacement(MeshSpec.parse(mesh), rules)
        except ValueError as e:
            raise ValueError(f"{role}/RoleConfig.{phase}_mesh: {e}") from None
        ids = placed.mesh.device_ids()
        if max(ids) >= num_devices:  # named here by its binding; plan.validate would not
            raise ValueError(
                f"{role}/RoleConfig.{phase}_mesh {placed.mesh}: needs device {max(ids)} but "
                f"only {num_devices} devices exist"
            )
        (calls if call in CALLS else stages)[call] = placed
        overridden.append(call)
    name = (
        base.name
        if not overridden
        else f"{base.name}+custom"
        if placement != "custom"
        else "custom"
    )
    plan = dataclasses.replace(
        base, name=name, placements=tuple(calls.items()), stage_placements=tuple(stages.items())
    )
    plan.validate(num_devices)
    if cfg.rl.fusion.migrate_rows:  # the tail needs a generation replica to leave for
        replicas = len(tail_replicas(plan["actor_generate"]))
        if cfg.rl.fusion.migrate_replicas >= replicas:
            raise ValueError(
                f"Fusion.migrate_replicas {cfg.rl.fusion.migrate_replicas} must be fewer than the "
                f"{replicas} data-parallel replica(s) of plan '{plan.name}''s actor_generate mesh "
                f"{plan['actor_generate'].mesh}: nothing would be freed"
            )
    return plan
