"""``python -m jrlhf.train --check``: everything a run builds before its first model step, built
and checked without running a model or writing anything.

What the run itself does at start-up (jrlhf.pipeline.run) and in each stage's set-up, in the same
order and with the same one-line errors: the task data read and validated (every data file, the
tokenizer, the prompts' meta a reward function reads), the user's reward function imported and
called on dummy samples (jrlhf.tasks.rewards.check_reward_fn), the execution plan on this job's
devices, and every role each stage sets up: its model resolved (a checkpoint's vocabulary
against the tokenizer), each of its meshes built on the devices and its parameters' shardings
derived from the abstract parameter tree (``nnx.eval_shape``: nothing allocated), which fails,
naming the setting that chose the mesh, where a dimension does not divide.

Then what the run finds only later, with lines naming the settings: each stage's training batch
against the batch shards and micro-batches of its role's training mesh (the run: at the stage's
first step), the RL scoring chunks against the scoring meshes (the run: once every role's weights
are loaded), and the RL iteration's memory by the planner's model against this machine's device
profile (the run: out of memory). Nothing is loaded, compiled or run.
"""

from __future__ import annotations

import jax

from jrlhf.config import Config, ConfigError
from jrlhf.meshes.batch import batch_shards
from jrlhf.meshes.mesh import blame_setting
from jrlhf.meshes.rules import axis_size, logical_to_spec
from jrlhf.pipeline.task_data import build_task_data
from jrlhf.placement import ExecutionPlan, effective_plan
from jrlhf.placement.estimator import estimate
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.search import local_device_kind
from jrlhf.placement.workload import Workload
from jrlhf.ppo import core_algos as algos
from jrlhf.runtime.model_source import resolve_model, role_models, stage_start
from jrlhf.runtime.roles import RoleSetup, mesh_setting, setup_role


def stage_roles(cfg: Config, stage: str) -> list[tuple[str, str | None]]:
    """(role, init) of every role ``stage`` sets up, as jrlhf.pipeline.run does (init None:
    the role's own RoleConfig.init)."""
    if stage == "sft":
        return [("actor", stage_start(cfg, "sft"))]
    if stage == "rm":
        return [("reward", stage_start(cfg, "rm"))]
    if stage == "dpo":
        return [("actor", stage_start(cfg, "dpo"))]
    # RL: roles whose output reaches the loss (no reference without a KL term, no critic in GRPO,
    # no reward model with a reward function).
    needed = ["actor"] + (["reference"] if algos.uses_reference(cfg.rl) else [])
    needed += ["critic"] if stage == "ppo" else []
    needed += [] if cfg.task.reward_fn else ["reward"]
    return [(role, None) for role in needed]


def train_batches(cfg: Config, stage: str) -> list[tuple[str, str, int]]:
    """(role, setting, rows) of each batch ``stage`` hands to a role's train step: what must
    split over the step's mesh (jrlhf.meshes.batch.check_batch_divides)."""
    if stage == "sft":
        return [("actor", f"SFTConfig.batch_size {cfg.sft.batch_size}", cfg.sft.batch_size)]
    if stage in ("rm", "dpo"):  # two rows per preference pair
        role, section, name = (
            ("reward", cfg.rm, "RewardModelConfig")
            if stage == "rm"
            else ("actor", cfg.dpo, "DPOConfig")
        )
        setting = f"{name}.batch_size {section.batch_size} (pairs of rows)"
        return [(role, setting, 2 * section.batch_size)]
    if cfg.rl.memory.pack_samples:  # packed rows are counted per minibatch, split by construction
        return []
    setting = f"RLConfig.minibatch_size {cfg.rl.minibatch_size}"
    trained = ["actor", "critic"] if stage == "ppo" else ["actor"]
    return [(role, setting, cfg.rl.minibatch_size) for role in trained]


def check_train_batch(cfg: Config, plan: ExecutionPlan, setup: RoleSetup, setting: str, rows: int):
    """One line naming ``setting`` and the mesh's own setting when ``rows`` do not split over
    the batch shards of ``setup``'s training mesh times its micro-batches, as the train step
    would find at the stage's first step. With RoleConfig.microbatch_tokens the count is chosen
    among the splits that fit (jrlhf.data.batch.fit_microbatches): only the shards must divide."""
    role, rc = setup.name, setup.config
    shards = batch_shards(setup.meshes["train"], setup.rules["train"])
    m = 1 if rc.microbatch_tokens else rc.microbatches
    if rows % (shards * m):
        mesh = mesh_setting(cfg, role, "train", plan.for_role(role, "train"))
        raise ConfigError(
            f"{setting}: {rows} rows do not split into {role}/RoleConfig.microbatches={m} "
            f"micro-batch(es) over the {shards} batch shards of {mesh}"
        )
    # The 1F1B pipeline step cuts each step's rows into its micro-batches without padding
    # (jrlhf.runtime.pipeline_step); with a token budget the split is chosen per step.
    mesh, rules = setup.meshes["train"], setup.rules["train"]
    stages = axis_size(mesh, logical_to_spec(("layers",), mesh, rules)[0])
    model = setup.model.config
    if stages > 1 and model.pipeline_schedule == "1f1b" and not rc.microbatch_tokens:
        micro = model.pipeline_microbatches or stages
        if (rows // m) % micro:
            raise ConfigError(
                f"{role}/RoleConfig.pipeline_microbatches: the 1f1b schedule cuts each step's "
                f"{rows // m} rows ({setting}, {role}/RoleConfig.microbatches={m}) into {micro} "
                "equal micro-batches, which they do not make"
            )


def check_infer_batch(cfg: Config, plan: ExecutionPlan, roles: dict[str, RoleSetup]) -> None:
    """Memory.infer_batch_size rows per scoring call must split over the batch shards of
    every mesh that scores in chunks (jrlhf.runtime.roles.make_infer, which the RL trainer
    builds after loading every role's weights): the scoring roles' inference meshes and, with
    an off-policy correction, the actor's training mesh."""
    rows = cfg.rl.memory.infer_batch_size
    if not rows:
        return
    calls = [(role, "infer") for role in ("reference", "reward", "critic") if role in roles]
    if cfg.rl.off_policy.correction != "none":
        calls.append(("actor", "train"))
    for role, phase in calls:
        setup = roles[role]
        shards = batch_shards(setup.meshes[phase], setup.rules[phase])
        if rows % shards:
            mesh = mesh_setting(cfg, role, phase, plan.for_role(role, phase))
            raise ConfigError(
                f"Memory.infer_batch_size {rows}: does not split over the {shards} batch "
                f"shards of {mesh}"
            )


def check_memory(cfg: Config, plan: ExecutionPlan, roles: dict[str, RoleSetup]) -> None:
    """One line when the planner's memory model (jrlhf.placement.estimator) puts some call of
    an RL iteration of ``plan`` over a device's usable memory in this machine's device profile:
    the run would fail there (out of memory) or, on CPU devices sharing the host, swap. Nothing
    for runs without an RL stage (the model prices the RL iteration) or on devices without a
    built-in profile. ``roles``: the RL stage's roles (those it sets up, jrlhf.pipeline.run)."""
    try:
        profile = DeviceProfile.load(local_device_kind())
    except ValueError:  # no built-in profile for this device: nothing to price it against
        return
    models = {role: setup.model.config for role, setup in roles.items()}
    est = estimate(plan, Workload.from_config(cfg, models), profile)
    capacity = profile.usable_bytes
    for call, peak in est.memory_bytes.items():
        if peak > capacity:
            why = next((r for r in est.reasons if r.startswith(f"{call}: needs")), "")
            raise ConfigError(
                f"RunConfig.placement {cfg.run.placement!r}: plan {plan.name!r} does not fit in "
                f"memory by the planner's estimate ({why or f'{call}: needs {peak} bytes'}); "
                "lower the RL batch sizes (RLConfig.prompts_per_iteration, infer_batch_size, "
                "RoleConfig.microbatches) or see python -m jrlhf.plan"
            )


def check_run(cfg: Config) -> ExecutionPlan:
    """Build and check what a run of ``cfg`` builds before its first step (see the module
    docstring), on the devices JAX has; returns the run's execution plan. Raises the run's own
    one-line errors (ConfigError, ValueError, FileNotFoundError, RewardError)."""
    data = build_task_data(cfg)
    models = role_models(cfg, data.model_overrides) if cfg.run.placement == "search" else None
    plan = effective_plan(cfg, jax.device_count(), models)
    built: dict[tuple[str, str | None], RoleSetup] = {}
    for stage in cfg.run.stages:
        for role, init in stage_roles(cfg, stage):
            if (role, init) in built:
                continue
            # run_dir None: a stage:NAME source is the model that stage starts from (the same
            # architecture as its output, which does not exist yet).
            source = resolve_model(cfg, role, data.model_overrides, None, init=init)
            built[role, init] = setup_role(cfg, role, plan, source)
        roles = {role: built[role, init] for role, init in stage_roles(cfg, stage)}
        for role, setting, rows in train_batches(cfg, stage):
            check_train_batch(cfg, plan, roles[role], setting, rows)
        if stage in ("ppo", "grpo"):
            check_infer_batch(cfg, plan, roles)
            check_memory(cfg, plan, roles)
            if cfg.decode.record_routes and not roles["actor"].model.config.is_moe:
                raise ConfigError(
                    "DecodeConfig.record_routes: the actor is not a mixture-of-experts model "
                    "(num_experts 0): it has no routes to record"
                )
        if stage == "dpo":
            # The frozen reference scores the pairs on the actor's training mesh.
            actor = built["actor", stage_start(cfg, "dpo")]
            init = cfg.dpo.reference or stage_start(cfg, "dpo")
            reference = resolve_model(cfg, "reference", data.model_overrides, None, init=init)
            setting = mesh_setting(cfg, "actor", "train", plan.for_role("actor", "train"))
            with blame_setting(setting):
                reference.model.shardings(actor.meshes["train"], actor.rules["train"])
    return plan
