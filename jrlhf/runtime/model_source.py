"""Which model each role runs, and where its weights come from: resolved once, for the trainer,
the planner and evaluation alike.

A role's ``RoleConfig.init`` names the source: ``tiny`` (a small random Llama sized for the
task), ``hf:DIR`` (a HF checkpoint), ``ckpt:DIR`` (a jrlhf model checkpoint) or ``stage:sft`` /
``stage:rm`` / ``stage:dpo`` (this run's training-stage output). The role's ``model_overrides``
and dtypes apply on top. Before a stage has run (planning, or choosing the placement at
start-up), a ``stage:NAME`` role resolves to the model that stage starts from: the same
architecture.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gin
from jax.sharding import Mesh

from jrlhf import checkpoint
from jrlhf.config import ROLE_HEADS, Config, ConfigError, RoleConfig, check_model_overrides
from jrlhf.meshes.mesh import blame_setting
from jrlhf.meshes.rules import Rules
from jrlhf.models import hf
from jrlhf.models.config import ModelConfig, tiny_config
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.models.presets import get_preset

# The training stage that produces each stage:NAME source, and the role it trains.
STAGE_ROLES = {"sft": "actor", "rm": "reward", "dpo": "actor"}
_ROLE_MODEL_FIELDS = (
    "param_dtype",
    "dtype",
    "remat_policy",
    "pipeline_microbatches",
    "pipeline_schedule",
)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A role's model definition and its weights: ``hf:DIR``, ``ckpt:DIR`` or None (random)."""

    model: ModelDef
    weights: str | None


def model_overrides(rc: RoleConfig) -> dict[str, Any]:
    """A role's ``model_overrides`` as a dict, failing in one line on unknown model fields."""
    return check_model_overrides("RoleConfig.model_overrides", rc.model_overrides)


def stage_start(cfg: Config, stage: str) -> str:
    """The init a training stage starts from: its role's init, unless that names the output of
    a stage that has not run before this one (its own, or a later stage's, as when the actor's
    init is what RL starts from): then the output of the last earlier stage that trains the same
    role (SFT for DPO), or ``tiny``.

    E.g. with stages ``('sft', 'dpo', 'ppo')`` and ``actor/RoleConfig.init = 'stage:dpo'``,
    SFT starts from ``tiny``, DPO from ``stage:sft`` and PPO from ``stage:dpo``. SFT starts
    from ``SFTConfig.init`` when that is set.
    """
    if stage == "sft" and cfg.sft.init:
        return cfg.sft.init
    role = STAGE_ROLES[stage]
    init = cfg.roles[role].init
    stages = list(cfg.run.stages)
    earlier = stages[: stages.index(stage)] if stage in stages else []
    if not init.startswith("stage:") or init[6:] in earlier:
        return init
    same_role = [s for s in earlier if STAGE_ROLES.get(s) == role]
    return f"stage:{same_role[-1]}" if same_role else "tiny"


def _model_field(rc: RoleConfig, field: str) -> Any:
    """The model setting a RoleConfig field gives: a critic's 'fused' schedule is the PPO
    update's (jrlhf.ppo.update), its model's own passes (scoring) run GPipe."""
    value = getattr(rc, field)
    return "gpipe" if field == "pipeline_schedule" and value == "fused" else value


def _bound(role: str, field: str) -> bool:
    """Whether the loaded gin config binds ``RoleConfig.<field>`` for ``role`` (scoped or not)."""
    for name in (f"{role}/RoleConfig.{field}", f"RoleConfig.{field}"):
        try:
            gin.query_parameter(name)
            return True
        except ValueError:
            continue
    return False


TaskOverrides = Mapping[str, Any] | Callable[[], Mapping[str, Any]]


def resolve_model(
    cfg: Config,
    role: str,
    task_overrides: TaskOverrides,
    run_dir: str | Path | None = None,
    *,
    init: str | None = None,
    preset: str | None = None,
) -> ModelSource:
    """The model ``role`` runs and its weights' source: :func:`resolve_base`, with the
    role's LoRA adapters (``RoleConfig.lora_rank``) on the model where it has them."""
    source = resolve_base(cfg, role, task_overrides, run_dir, init=init, preset=preset)
    lora = cfg.roles[role].lora()
    if lora is None:
        return source
    return dataclasses.replace(source, model=dataclasses.replace(source.model, lora=lora))


def resolve_base(
    cfg: Config,
    role: str,
    task_overrides: TaskOverrides,
    run_dir: str | Path | None = None,
    *,
    init: str | None = None,
    preset: str | None = None,
) -> ModelSource:
    """The model ``role`` runs (without adapters) and its weights' source.

    ``init`` replaces the role's RoleConfig.init (a supervised stage starting from elsewhere);
    ``preset`` (jrlhf.models.presets, for planning) replaces the architecture and keeps the
    preset's own dtypes unless the config binds the role's dtype fields. With ``run_dir`` None
    the stages have not run: ``stage:NAME`` resolves to the model that stage starts from.
    ``task_overrides`` (the model fields the task imposes on ``tiny`` models) may be a function,
    called only when a ``tiny`` model needs it.
    """
    rc = cfg.roles[role]
    head = ROLE_HEADS[role]
    fields = model_overrides(rc)
    if preset is not None:
        fields.update({f: _model_field(rc, f) for f in _ROLE_MODEL_FIELDS if _bound(role, f)})
        return ModelSource(ModelDef(get_preset(preset).replace(**fields), head), None)
    fields.update({f: _model_field(rc, f) for f in _ROLE_MODEL_FIELDS})
    kind, _, where = (init or rc.init).partition(":")
    if kind == "stage":
        if run_dir is None:
            # Before any stage has run: the model the named stage starts from, which may be an
            # earlier stage's output in turn (DPO from SFT): follow the chain to a real source.
            while kind == "stage":  # each step names a stage earlier in the run: it ends
                kind, _, where = stage_start(cfg, where).partition(":")
        else:
            kind, where = "ckpt", str(Path(run_dir) / where)
    if kind == "tiny":
        overrides = task_overrides() if callable(task_overrides) else task_overrides
        return ModelSource(ModelDef(tiny_config(**overrides).replace(**fields), head), None)
    # A source that cannot be read names the setting that chose it.
    setting = f"{role}/RoleConfig.init" if init in (None, rc.init) else f"{role} model {init!r}"
    with blame_setting(setting, (FileNotFoundError, ValueError)):
        if kind == "hf":
            base, _ = hf.read_hf_config(where)
            source = ModelSource(ModelDef(base.replace(**fields), head), f"hf:{where}")
        elif kind == "ckpt":
            stored = checkpoint.read_model_json(where)
            source = ModelSource(ModelDef(stored.config.replace(**fields), head), f"ckpt:{where}")
        else:
            raise ValueError(f"unknown model source {init or rc.init!r}")
    _check_vocab(role, source, task_overrides)
    return source


def _check_vocab(role: str, source: ModelSource, task_overrides: TaskOverrides) -> None:
    """A model given by its weights must embed every token id the task's tokenizer makes:
    a larger id would index past the embedding (NaN or garbage, silently)."""
    overrides = task_overrides() if callable(task_overrides) else task_overrides
    needed, has = overrides.get("vocab_size"), source.model.config.vocab_size
    if needed is not None and has < needed:
        raise ConfigError(
            f"{role}/RoleConfig.init: {source.weights} has a vocabulary of {has} tokens, fewer "
            f"than the task's tokenizer's {needed} (TaskConfig.tokenizer)"
        )


def role_models(
    cfg: Config,
    task_overrides: TaskOverrides,
    presets: Mapping[str, str] | None = None,
) -> dict[str, ModelConfig]:
    """The ModelConfig of every role, before any stage has run (what the planner prices)."""
    presets = presets or {}
    return {
        role: resolve_model(cfg, role, task_overrides, preset=presets.get(role)).model.config
        for role in cfg.roles
    }


def load_weights(source: ModelSource, mesh: Mesh, rules: Rules, seed: int) -> Params:
    """Parameters of ``source.model`` on ``mesh``: random, or restored/imported
    (jrlhf.checkpoint.load_source_weights); a LoRA model's adapters start fresh (B zero)."""
    return checkpoint.load_source_weights(source.model, source.weights, mesh, rules, seed)
