"""The trainer setup of ``python -m jrlhf.bench plan``, in one place for the bench that runs it and
for the fit that prices its reports again (``calibrate --from-bench-gpu`` with ``bench plan``
reports from a GPU).

A run is described by two small dicts, both recorded in the bench's JSON: ``model`` (``hidden``,
``intermediate``, ``layers``, ``heads``, ``dtype``, ``param_dtype``) and ``workload``
(``prompts``, ``minibatch``, ``gen_len``, ``iterations`` and any extra gin ``bindings``), plus
the device count, the plan and its batch knobs.
"""

from __future__ import annotations

from jrlhf.config import DEFAULT_CONFIG, ROLES, load_config
from jrlhf.meshes.mesh import MeshSpec
from jrlhf.pipeline.task_data import task_model_overrides
from jrlhf.placement.plan import CallPlacement, ExecutionPlan
from jrlhf.placement.workload import Workload
from jrlhf.runtime.model_source import resolve_model

# every bench model has two KV heads
KV_HEADS = 2


def trainer_bindings(
    model: dict, workload: dict, devices: int, plan: ExecutionPlan, knobs: dict[str, int]
) -> list[str]:
    """Gin bindings (over ``DEFAULT_CONFIG``) of the bench's PPO trainer: tiny-initialized roles
    of the ``model`` shape and dtypes, the synthetic task with responses of up to ``gen_len``
    tokens, 2 epochs, ``plan`` as each role's meshes and ``knobs`` (``infer_batch_size`` and
    the actor's and critic's micro-batches)."""
    overrides = (
        f"(('hidden_size', {model['hidden']}), ('intermediate_size', {model['intermediate']}), "
        f"('num_layers', {model['layers']}), ('num_heads', {model['heads']}), "
        f"('num_kv_heads', {KV_HEADS}))"
    )
    out = [
        "RunConfig.stages=('ppo',)",
        "RunConfig.tensorboard=False",
        "RunConfig.progress_bar=False",
        f"RunConfig.host_devices={devices}",
        f"RoleConfig.model_overrides={overrides}",
        f"RLConfig.iterations={workload['iterations']}",
        "RLConfig.checkpoint_every=0",
        "RLConfig.async_checkpoint=False",
        f"RLConfig.prompts_per_iteration={workload['prompts']}",
        f"RLConfig.minibatch_size={workload['minibatch']}",
        "RLConfig.epochs=2",
        "TaskConfig.num_heldout=8",
        f"TaskConfig.max_response_len={workload['gen_len']}",
        f"Memory.infer_batch_size={knobs.get('infer_batch_size', 0)}",
        f"actor/RoleConfig.microbatches={knobs.get('actor_microbatches', 1)}",
        f"critic/RoleConfig.microbatches={knobs.get('critic_microbatches', 1)}",
    ]
    for role in ROLES:
        out.append(f"{role}/RoleConfig.init='tiny'")
        for field in ("dtype", "param_dtype"):
            if model.get(field):
                out.append(f"{role}/RoleConfig.{field}='{model[field]}'")
    # the run's own extra bindings (bench plan --bind), before the plan's meshes
    out += list(workload.get("bindings", ()))
    # the plan as RoleConfig meshes ('custom' placement), the form every trainer version accepts
    for line in plan.to_gin().splitlines():
        if line and not line.startswith("#"):
            out.append(line.replace(" = ", "="))
    return out


def trainer_workload(bindings: list[str]) -> Workload:
    """The estimator's ``Workload`` of the trainer these bindings configure."""
    cfg = load_config([str(DEFAULT_CONFIG)], bindings)
    overrides = task_model_overrides(cfg)
    models = {role: resolve_model(cfg, role, overrides, init="tiny").model.config for role in ROLES}
    return Workload.from_config(cfg, models)


def plan_from_placements(name: str, placements: dict[str, str]) -> ExecutionPlan:
    """The plan a report's ``placements`` describe (call -> ``"MESH [rules]"``, as
    ``CallPlacement`` prints itself)."""
    calls = {}
    for call, text in placements.items():
        mesh, _, rules = text.rpartition(" [")
        if not mesh or not rules.endswith("]"):
            raise ValueError(f"placement of {call} {text!r} is not 'MESH [rules]'")
        calls[call] = CallPlacement(MeshSpec.parse(mesh), rules[:-1])
    return ExecutionPlan.of(name, **calls)
