"""Typed run configuration bound by gin.

Each section is a frozen dataclass registered with gin; a gin file (configs/*.gin) and
command-line bindings set its fields, e.g. ``RLConfig.iterations = 40`` or, for per-role settings,
``actor/RoleConfig.train_mesh = "fsdp=4,tensor=2"``. ``load_config`` parses files and overrides,
builds every section, validates values and reports the first problem in one line, before any
model is built. The operative config is written into each run directory.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import typing
from pathlib import Path
from typing import Any

import gin

from jrlhf.devices import MAX_HOST_DEVICES
from jrlhf.meshes.mesh import MeshSpec
from jrlhf.meshes.rules import PHASE_RULES, RULE_SETS
from jrlhf.models.config import (
    DTYPES,
    PIPELINE_SCHEDULES,
    REMAT_POLICIES,
    ModelConfig,
    value_problem,
)
from jrlhf.models.lora import ALL_TARGETS as LORA_TARGETS
from jrlhf.models.lora import LoraConfig
from jrlhf.models.lora import config_problem as lora_problem

ROLES = ("actor", "critic", "reference", "reward")
# The head each role's model carries: value-head models score and have no lm_head.
ROLE_HEADS = {"actor": "lm", "reference": "lm", "critic": "value", "reward": "value"}
STAGES = ("sft", "rm", "dpo", "ppo", "grpo")
# The stages whose output a role may start from (``stage:NAME``).
MODEL_STAGES = ("sft", "rm", "dpo")
# jrlhf.ppo.core_algos.AGG_MODES (config does not import JAX).
LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# jrlhf.ppo.core_algos.DPO_LOSSES (config does not import JAX).
DPO_LOSS_TYPES = ("sigmoid", "ipo")
# jrlhf.ppo.core_algos.OFF_POLICY_CORRECTIONS (config does not import JAX).
OFF_POLICY_CORRECTIONS = ("none", "tis", "decoupled")
# Memory knobs of the RL trainer (jrlhf.ppo.residency; priced by jrlhf.placement.estimator).
GENERATION_COPIES = ("kept", "dropped")
OFFLOADABLE = ("reference", "reward", "actor_optimizer", "critic_optimizer")
# The trainer phases in which an offloaded item is on device (in host memory in the others): the
# trainer moves it by this table and the estimator prices its bytes and transfers from it.
OFFLOAD_PHASES = {
    "reference": ("score",),
    "reward": ("score",),
    "actor_optimizer": ("train",),
    "critic_optimizer": ("train",),
}
# A dropped generation copy exists from the reshard that builds it to the end of generation.
DROPPED_COPY_PHASES = ("reshard", "generate")
# DecodeConfig.layer_loop -> EngineConfig.unroll_layers (None: unrolled on CPU; on accelerators
# when the copies fit in half the free device memory, single-process jobs only).
DECODE_LAYER_LOOPS = {"auto": None, "scan": False, "unroll": True}
PHASES = ("train", "infer", "generate")
# The phases each role has: the actor trains and generates, the critic trains and scores, the
# reference scores, the reward model scores (RL) and trains (its supervised stage).
ROLE_PHASES = {
    "actor": ("train", "generate"),
    "critic": ("train", "infer"),
    "reference": ("infer",),
    "reward": ("infer", "train"),
}
# The most records of each kind a TaskConfig count may ask for: built-in tasks draw them in
# Python at every start, --check included (about 7,000 a second on the 2-core CPU machine, so a
# million take minutes; a billion, a typo's worth, would never finish).
MAX_TASK_RECORDS = 1_000_000
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.gin"
PLACEMENTS = ("flatten", "interleave", "separate", "search", "custom")


class ConfigError(ValueError):
    """A bad configuration value, reported in one line naming the field."""


def _check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {message}")


def _type_error(value: Any, hint: Any) -> str | None:
    """Why ``value`` does not fit the field type ``hint`` (None when it fits). Gin parses
    literals as Python does, so ``"3"`` is a str and ``32.5`` a float: neither is an int."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a sub-config (RLConfig.fusion)
        return None if isinstance(value, hint) else f"expects @{hint.__name__}()"
    if hint is bool:
        return None if isinstance(value, bool) else "expects true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "expects an int"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return "expects a number"
        return None if math.isfinite(value) else "expects a finite number"
    if hint is str:
        return None if isinstance(value, str) else "expects a string"
    if origin is tuple:
        if not isinstance(value, tuple | list):
            return "expects a tuple"
        args = typing.get_args(hint)
        items = args[:1] * len(value) if len(args) == 2 and args[1] is Ellipsis else args
        if len(items) != len(value):
            return f"expects a tuple of {len(items)}"
        for item_hint, item in zip(items, value, strict=True):
            why = _type_error(item, item_hint)
            if why:
                return f"item {item!r}: {why}"
        return None
    return None


def check_types(section: Any, field_prefix: str) -> None:
    """Every field of the dataclass ``section`` has its declared type; else one ConfigError
    naming ``field_prefix.field``."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        why = _type_error(getattr(section, f.name), hints[f.name])
        if why:
            raise ConfigError(f"{field_prefix}.{f.name}: {why}, got {getattr(section, f.name)!r}")


def check_model_overrides(field: str, overrides: Any) -> dict[str, Any]:
    """``RoleConfig.model_overrides`` (pairs of ModelConfig field and value) as a dict; a
    ConfigError naming ``field`` for an unknown model field or a value of the wrong type."""
    hints = typing.get_type_hints(ModelConfig)
    out = {}
    for pair in overrides:
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise ConfigError(f"{field}: expects (name, value) pairs, got {pair!r}")
        name, value = pair
        if name not in hints:
            raise ConfigError(f"{field}: unknown model field {name!r}")
        why = _type_error(value, hints[name])
        if why:
            raise ConfigError(f"{field}: {name} {why}, got {value!r}")
        problem = value_problem(name, value)
        if problem:
            raise ConfigError(f"{field}: {problem}")
        out[name] = value
    return out


def _check_mesh(field: str, value: str) -> None:
    if value:
        try:
            MeshSpec.parse(value)
        except ValueError as e:
            raise ConfigError(f"{field}: {e}") from None


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What to run and where its outputs go."""

    run_dir: str = ""  # "" means runs/run-<timestamp>
    seed: int = 0
    stages: tuple[str, ...] = ("sft", "rm", "ppo")
    # An execution plan (jrlhf.placement): flatten, interleave, separate, search or custom
    # (custom: meshes from RoleConfig, e.g. a gin file written by `python -m jrlhf.plan`).
    placement: str = "flatten"
    host_devices: int = 8  # virtual CPU devices when running without an accelerator
    progress_bar: bool = True
    tensorboard: bool = True
    resume: bool = False
    # Updates with a non-finite loss or gradient norm are skipped, and overflowing ones counted
    # with them (metrics: skipped_updates);
    # more than this many in a row, in any stage, stop the run before anything is saved.
    max_nonfinite_updates: int = 8
    # After a stage's first step or iteration, freeze the objects it holds, so that Python's
    # garbage collector stops re-scanning the compiled programs (runtime/gc_freeze.py).
    gc_freeze: bool = True

    def validate(self) -> None:
        check_types(self, "RunConfig")
        _check(bool(self.stages), "RunConfig.stages", "needs at least one stage")
        _check(self.seed >= 0, "RunConfig.seed", "must be >= 0 (NumPy's generators refuse less)")
        for s in self.stages:
            _check(s in STAGES, "RunConfig.stages", f"unknown stage {s!r} (known: {STAGES})")
        _check(self.placement in PLACEMENTS, "RunConfig.placement", f"use one of {PLACEMENTS}")
        _check(
            1 <= self.host_devices <= MAX_HOST_DEVICES,
            "RunConfig.host_devices",
            f"must be in 1..{MAX_HOST_DEVICES} (virtual CPU devices cost memory and threads at "
            f"start-up), got {self.host_devices}",
        )
        _check(self.max_nonfinite_updates >= 0, "RunConfig.max_nonfinite_updates", "must be >= 0")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """Where prompts, demonstrations and preferences come from.

    ``name="synthetic"``, ``"longtail"`` (long-tailed response lengths), ``"arithmetic"`` or
    ``"calculator"`` (arithmetic with a calculator tool, jrlhf.tasks.calculator) or
    ``"guess_number"`` (a guessing game over several turns, jrlhf.tasks.guessing) uses a
    built-in task (jrlhf.tasks); ``name="files"`` reads JSONL/Parquet files tokenized with
    ``tokenizer`` (a directory or tokenizer.json path).
    """

    name: str = "synthetic"
    prompts: str = ""
    heldout_prompts: str = ""
    sft_data: str = ""
    preference_data: str = ""
    # Preference pairs the dpo stage evaluates on and never trains on; built-in tasks draw
    # num_heldout_pairs pairs on their held-out prompts. Without it, files runs evaluate on
    # their first num_heldout_pairs training pairs (reported as training pairs).
    heldout_preference_data: str = ""
    tokenizer: str = ""
    max_prompt_len: int = 16
    max_response_len: int = 16
    # A verifiable reward: a registered name (answer_match, math_verify, format, boxed_format,
    # ...), module:function, or a weighted sum of them ("math_verify + 0.1*format";
    # jrlhf.tasks.rewards); "" means the learned reward model.
    reward_fn: str = ""
    # The regex a response must match whole for the "format" reward ("" = DeepSeek-R1's
    # <think>...</think><answer>...</answer>; jrlhf.tasks.math_rewards).
    format_pattern: str = ""
    num_heldout: int = 64
    num_sft_examples: int = 2048
    num_preference_pairs: int = 2048
    num_heldout_pairs: int = 256

    def validate(self) -> None:
        check_types(self, "TaskConfig")
        _check(
            self.name
            in ("synthetic", "longtail", "arithmetic", "calculator", "guess_number", "files"),
            "TaskConfig.name",
            "use synthetic, longtail, arithmetic, calculator, guess_number or files",
        )
        if self.format_pattern:
            try:
                re.compile(self.format_pattern)
            except re.error as e:
                raise ConfigError(f"TaskConfig.format_pattern: not a regex ({e})") from None
        if self.name == "files":
            _check(bool(self.prompts), "TaskConfig.prompts", "required when name='files'")
        _check(self.max_prompt_len > 0, "TaskConfig.max_prompt_len", "must be > 0")
        _check(self.max_response_len > 0, "TaskConfig.max_response_len", "must be > 0")
        for name in (
            "num_heldout",
            "num_sft_examples",
            "num_preference_pairs",
            "num_heldout_pairs",
        ):
            _check(getattr(self, name) >= 1, f"TaskConfig.{name}", "must be >= 1")
            _check(
                getattr(self, name) <= MAX_TASK_RECORDS,
                f"TaskConfig.{name}",
                f"must be <= {MAX_TASK_RECORDS:,} (built-in tasks draw them at every start)",
            )


# A role's pipeline_schedule: the model's schedules, or "fused" (the critic only: its PPO
# steps and the actor's in one fused pipeline, jrlhf.runtime.fused_step).
ROLE_PIPELINE_SCHEDULES = (*PIPELINE_SCHEDULES, "fused")


def check_fused_role(rc: RoleConfig, role: str) -> None:
    """One ConfigError for a setting of the actor or critic that the fused actor-critic step
    (critic/RoleConfig.pipeline_schedule='fused') cannot run: it trains each minibatch as one
    step of pipeline micro-batches, without gradient accumulation or adapter dropout."""
    why = "with critic/RoleConfig.pipeline_schedule='fused'"
    _check(
        rc.microbatches == 1,
        f"{role}/RoleConfig.microbatches",
        f"{rc.microbatches} {why}: the fused schedule runs a minibatch as one step of "
        "pipeline micro-batches (set pipeline_microbatches instead)",
    )
    _check(
        not rc.microbatch_tokens,
        f"{role}/RoleConfig.microbatch_tokens",
        f"{rc.microbatch_tokens} {why}: the fused schedule runs a minibatch as one step of "
        "pipeline micro-batches (set pipeline_microbatches instead)",
    )
    _check(
        not (rc.lora_rank and rc.lora_dropout),
        f"{role}/RoleConfig.lora_dropout",
        f"{rc.lora_dropout} {why}: adapter dropout in the fused step is not built",
    )


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RoleConfig:
    """One role's model, meshes and optimizer; bind per role with a gin scope (``actor/...``).

    ``init``: ``tiny`` (a small random Llama), ``hf:DIR``, ``ckpt:DIR``, ``stage:sft`` (the SFT
    stage's output), ``stage:rm`` (the reward-model stage's output) or ``stage:dpo`` (the DPO
    stage's output). Meshes left empty come from ``RunConfig.placement``; a mesh given here
    replaces the plan's for that role and phase, laid out by the phase's ``*_rules`` (default:
    jrlhf.meshes.PHASE_RULES). A ``*_rules`` without its ``*_mesh`` is an error: rules alone
    would silently not apply.
    """

    init: str = "tiny"
    model_overrides: tuple[tuple[str, Any], ...] = ()
    train_mesh: str = ""
    infer_mesh: str = ""
    generate_mesh: str = ""
    train_rules: str = ""
    infer_rules: str = ""
    generate_rules: str = ""
    param_dtype: str = "float32"
    dtype: str = "float32"
    remat_policy: str = "none"
    learning_rate: float = 1e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    microbatches: int = 1
    # > 0: micro-batches sized by tokens instead of counted (verl's ppo_max_token_len_per_gpu):
    # each train step of this role splits its minibatch into the fewest equal micro-batches
    # that leave no device more than this many token columns (rows x (max_prompt_len +
    # max_response_len)) per micro-batch (jrlhf.data.batch.fit_microbatches). With
    # Memory.pack_samples the packed rows count, so a minibatch of short samples takes fewer
    # micro-batches than a full-length one; each count compiles once. Exclusive with
    # microbatches > 1; 0 (default) uses microbatches.
    microbatch_tokens: int = 0
    # Pipeline parallelism (docs/pipelines.md): a ``stage=S`` axis in this role's train or
    # infer mesh splits its layers over S stages; each full-sequence pass (a train step's
    # micro-batch, a scoring call) then runs its rows through the stages in this many pipeline
    # micro-batches (GPipe); 0: S of them.
    pipeline_microbatches: int = 0
    # How this role's train steps schedule the pipeline micro-batches: "gpipe" or "1f1b"
    # (jrlhf.models.config.PIPELINE_SCHEDULES; docs/pipelines.md). On the critic, "fused"
    # (PPO only): each minibatch's actor and critic updates run as one fused bidirectional
    # pipeline on their shared training mesh (jrlhf.runtime.fused_step; RLHFuse).
    pipeline_schedule: str = "gpipe"
    # LoRA (jrlhf.models.lora): lora_rank > 0 trains low-rank adapters on the lora_targets
    # projections (of q, k, v, o, gate, up, down) of this role's model, its base frozen; the
    # update is scaled by lora_alpha / lora_rank, and lora_dropout drops the adapters' input
    # in train steps. Actor and critic only (the roles that train).
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_dropout: float = 0.0

    def lora(self) -> LoraConfig | None:
        """The role's adapters, None without (``lora_rank`` 0)."""
        if not self.lora_rank:
            return None
        return LoraConfig(
            self.lora_rank, float(self.lora_alpha), tuple(self.lora_targets), self.lora_dropout
        )

    def validate(self, role: str) -> None:
        f = f"{role}/RoleConfig"
        check_types(self, f)
        _check(self.lora_rank >= 0, f"{f}.lora_rank", "must be >= 0 (0: no LoRA)")
        if self.lora_rank:
            _check(
                role in ("actor", "critic"),
                f"{f}.lora_rank",
                f"only the trained roles (actor, critic) take adapters; the {role} is frozen",
            )
            problem = lora_problem(
                self.lora_rank, self.lora_alpha, tuple(self.lora_targets), self.lora_dropout
            )
            if problem:
                field = problem.split()[1]  # "lora rank must ..." -> rank
                raise ConfigError(f"{f}.lora_{field}: {problem}")
        check_model_overrides(f"{f}.model_overrides", self.model_overrides)
        ok_init = self.init == "tiny" or self.init.split(":", 1)[0] in ("hf", "ckpt", "stage")
        _check(ok_init, f"{f}.init", f"{self.init!r} (use tiny, hf:DIR, ckpt:DIR or stage:NAME)")
        if self.init.startswith("stage:"):
            _check(
                self.init[6:] in MODEL_STAGES,
                f"{f}.init",
                f"{self.init!r}: use one of {', '.join('stage:' + s for s in MODEL_STAGES)}",
            )
        for phase in PHASES:
            mesh, rules = getattr(self, f"{phase}_mesh"), getattr(self, f"{phase}_rules")
            _check_mesh(f"{f}.{phase}_mesh", mesh)
            if mesh or rules:
                _check(
                    phase in ROLE_PHASES[role],
                    f"{f}.{phase}_{'mesh' if mesh else 'rules'}",
                    f"the {role} has no {phase} phase (its phases: {', '.join(ROLE_PHASES[role])})",
                )
            if rules:
                _check(rules in RULE_SETS, f"{f}.{phase}_rules", f"unknown rule set {rules!r}")
                _check(
                    bool(mesh),
                    f"{f}.{phase}_rules",
                    f"needs {f}.{phase}_mesh too (rules apply to a mesh given here; the plan's "
                    "meshes carry their own rules)",
                )

        _check(self.param_dtype in DTYPES, f"{f}.param_dtype", f"use one of {DTYPES}")
        _check(self.dtype in DTYPES, f"{f}.dtype", f"use one of {DTYPES}")
        _check(self.remat_policy in REMAT_POLICIES, f"{f}.remat_policy", f"{REMAT_POLICIES}")
        _check(self.learning_rate > 0, f"{f}.learning_rate", "must be > 0")
        _check(self.warmup_steps >= 0, f"{f}.warmup_steps", "must be >= 0")
        _check(self.weight_decay >= 0, f"{f}.weight_decay", "must be >= 0")
        _check(self.grad_clip >= 0, f"{f}.grad_clip", "must be >= 0 (0 disables clipping)")
        _check(self.microbatches >= 1, f"{f}.microbatches", "must be >= 1")
        _check(self.microbatch_tokens >= 0, f"{f}.microbatch_tokens", "must be >= 0")
        _check(
            self.pipeline_microbatches >= 0,
            f"{f}.pipeline_microbatches",
            "must be >= 0 (0: one per pipeline stage)",
        )
        _check(
            self.pipeline_schedule in ROLE_PIPELINE_SCHEDULES,
            f"{f}.pipeline_schedule",
            f"{self.pipeline_schedule!r} unknown (use one of {ROLE_PIPELINE_SCHEDULES})",
        )
        if self.pipeline_schedule == "fused":
            _check(
                role == "critic",
                f"{f}.pipeline_schedule",
                "'fused' is the critic's setting: it fuses the critic's PPO train steps into "
                "the actor's pipeline (critic/RoleConfig.pipeline_schedule='fused')",
            )
            check_fused_role(self, role)
        _check(
            not (self.microbatch_tokens and self.microbatches > 1),
            f"{f}.microbatch_tokens",
            f"set either it or {f}.microbatches={self.microbatches}, not both",
        )

    def placement(self, phase: str) -> tuple[str, str] | None:
        """(mesh, rules) this role's config fixes for ``phase``, or None to follow the plan."""
        mesh = getattr(self, f"{phase}_mesh")
        return (mesh, getattr(self, f"{phase}_rules") or PHASE_RULES[phase]) if mesh else None


def _check_supervised(section: Any, name: str) -> None:
    check_types(section, name)
    _check(section.steps >= 1, f"{name}.steps", "must be >= 1")
    _check(section.batch_size >= 1, f"{name}.batch_size", "must be >= 1")
    _check(section.learning_rate > 0, f"{name}.learning_rate", "must be > 0")
    _check(section.warmup_steps >= 0, f"{name}.warmup_steps", "must be >= 0")
    _check(section.checkpoint_every >= 0, f"{name}.checkpoint_every", "must be >= 0")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning of the actor on demonstrations.

    ``init``: the model SFT starts from (``tiny``, ``hf:DIR`` or ``ckpt:DIR``); empty: the
    actor's init, or ``tiny`` when that names a stage's output (``stage:sft``, what the RL stage
    after it starts from). E.g. ``SFTConfig.init = 'hf:/ckpt/base'`` with ``actor/RoleConfig.init
    = 'stage:sft'``: SFT from the HF checkpoint, then RL from SFT's output.
    """

    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    checkpoint_every: int = 100  # steps; 0 saves only the stage's output at the end
    init: str = ""

    def validate(self) -> None:
        _check_supervised(self, "SFTConfig")
        _check(
            self.init in ("", "tiny") or self.init.split(":", 1)[0] in ("hf", "ckpt"),
            "SFTConfig.init",
            f"{self.init!r} (use tiny, hf:DIR or ckpt:DIR; empty: the actor's init)",
        )


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """Bradley-Terry training of the reward model on preference pairs."""

    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    checkpoint_every: int = 100  # steps; 0 saves only the stage's output at the end

    def validate(self) -> None:
        _check_supervised(self, "RewardModelConfig")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimization of the actor on preference pairs (the dpo stage).

    The policy starts from ``actor/RoleConfig.init`` unless that names the DPO stage's own
    output (``stage:dpo``, what a later RL stage starts from), when it starts from the SFT
    stage's output if the run has one before dpo, else ``tiny``. The frozen reference is
    ``reference`` (any RoleConfig.init source, with reference/RoleConfig's dtypes and
    overrides), by default the policy's own start. Its log-probs of every pair are computed
    once, before training, on the actor's training mesh.
    """

    steps: int = 100
    batch_size: int = 32  # preference pairs per step
    learning_rate: float = 1e-3
    warmup_steps: int = 10
    checkpoint_every: int = 100  # steps; 0 saves only the stage's output at the end
    beta: float = 0.1  # implicit reward = beta * (log policy - log reference)
    # jrlhf.ppo.core_algos.DPO_LOSSES: "sigmoid" (DPO) or "ipo" (IPO: per-token mean log-probs,
    # the margin regressed to 1 / (2 beta)).
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0  # conservative DPO: labels wrong with this probability
    reference: str = ""  # "" is the policy's start
    infer_batch_size: int = 128  # pairs (two rows each) per reference or evaluation call

    def validate(self) -> None:
        _check_supervised(self, "DPOConfig")
        _check(self.beta > 0, "DPOConfig.beta", "must be > 0")
        _check(
            self.loss_type in DPO_LOSS_TYPES,
            "DPOConfig.loss_type",
            f"unknown loss type {self.loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}",
        )
        _check(
            0 <= self.label_smoothing < 0.5,
            "DPOConfig.label_smoothing",
            "must be in [0, 0.5)",
        )
        _check(
            self.label_smoothing == 0 or self.loss_type == "sigmoid",
            "DPOConfig.label_smoothing",
            f"applies to loss_type 'sigmoid' only, not {self.loss_type!r}",
        )
        if self.reference:
            kind = self.reference.split(":", 1)[0]
            _check(
                self.reference == "tiny" or kind in ("hf", "ckpt", "stage"),
                "DPOConfig.reference",
                f"{self.reference!r} (use '', tiny, hf:DIR, ckpt:DIR or stage:NAME)",
            )
            if kind == "stage":
                _check(
                    self.reference == "stage:sft",
                    "DPOConfig.reference",
                    f"{self.reference!r}: the only stage a reference can come from is stage:sft",
                )
        _check(self.infer_batch_size >= 1, "DPOConfig.infer_batch_size", "must be >= 1")


# Where each RLConfig field that moved into a sub-config of its concern is bound now. A binding
# of an old name (in a file, an override, or a saved run's operative config) is refused in one
# line naming the new one (load_config), before anything is built.
MOVED = {
    "RLConfig.max_staleness": "Asynchrony.max_staleness",
    "RLConfig.partial_rollout_tokens": "Asynchrony.partial_rollout_tokens",
    "RLConfig.fusion": "Fusion.enabled",
    "RLConfig.fusion_score_rows": "Fusion.score_rows",
    "RLConfig.migrate_rows": "Fusion.migrate_rows",
    "RLConfig.migrate_replicas": "Fusion.migrate_replicas",
    "RLConfig.infer_batch_size": "Memory.infer_batch_size",
    "RLConfig.generation_copy": "Memory.generation_copy",
    "RLConfig.offload": "Memory.offload",
    "RLConfig.pack_samples": "Memory.pack_samples",
    "RLConfig.logprob_chunk": "Memory.logprob_chunk",
    "RLConfig.dynamic_sampling": "SampleFilters.dynamic_sampling",
    "RLConfig.max_sampling_rounds": "SampleFilters.max_sampling_rounds",
    "RLConfig.overlong_buffer": "SampleFilters.overlong_buffer",
    "RLConfig.overlong_penalty": "SampleFilters.overlong_penalty",
    "RLConfig.off_policy_correction": "OffPolicy.correction",
    "RLConfig.is_cap": "OffPolicy.is_cap",
}


def moved_message(old: str) -> str:
    """The one line refusing a binding of the moved setting ``old`` (a key of :data:`MOVED`)."""
    return f"{old} moved: bind {MOVED[old]}"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Asynchrony:
    """Asynchronous RL (``RLConfig.asynchrony``): how many updates old a trained sample may be,
    and whether a batch is generated in passes across updates."""

    # Bounded staleness (jrlhf.ppo.staleness). 0: the synchronous loop (generate with the newest
    # weights, then train). k >= 1: the batch iteration i trains on is generated with the weights
    # of version max(i - k, 0) (the actor after that many updates), so generation of later
    # batches can run while earlier ones train (at the same time where the plan puts generation
    # and training on different processes); no token is ever more than k versions older than
    # the policy being updated (checked). Pair with OffPolicy.correction.
    max_staleness: int = 0
    # Partial rollouts (jrlhf.ppo.partial; needs max_staleness = k >= 1): a batch is generated
    # partial_rollout_tokens (T) tokens at a time, one pass per iteration over the k iterations
    # before it is trained, so an update lands between a long sample's passes: the sample keeps
    # its tokens and behaviour log-probs and continues under the newer weights (its prompt and
    # tokens so far re-prefilled: the KV cache is recomputed, never kept from an older policy).
    # Each pass decodes every unfinished sample of every batch in flight together. T must divide
    # TaskConfig.max_response_len and T x k must reach it (every sample ends before it trains).
    # 0 (default): each batch in one pass.
    partial_rollout_tokens: int = 0

    def validate(self) -> None:
        """One ConfigError naming the first bad field."""
        check_types(self, "Asynchrony")
        _check(self.max_staleness >= 0, "Asynchrony.max_staleness", "must be >= 0 (0: synchronous)")
        _check(
            self.partial_rollout_tokens >= 0, "Asynchrony.partial_rollout_tokens", "must be >= 0"
        )
        _check(
            not self.partial_rollout_tokens or self.max_staleness >= 1,
            "Asynchrony.partial_rollout_tokens",
            "continues samples across updates and needs Asynchrony.max_staleness >= 1",
        )


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Fusion:
    """Inter-stage fusion (``RLConfig.fusion``, jrlhf.ppo.fusion): scoring finished samples
    while generation goes on, and moving the long tail off the scoring devices."""

    # enabled: finished samples are scored (reference, reward, critic) in calls of score_rows
    # rows while generation goes on (score_rows 0: a quarter of the iteration's rows; rounded up
    # to the scoring meshes' batch shards). Same samples and scores (to float rounding);
    # time/generate then includes the scoring done during generation. With
    # Asynchrony.max_staleness >= 1 each batch is scored as it is generated, on the training
    # group where generation has processes of its own; a critic's values are taken when it
    # trains.
    enabled: bool = False
    score_rows: int = 0
    # RLHFuse's migration (needs enabled; 0: off): once no prompt waits for a decode slot and at
    # most migrate_rows samples are still decoding, their KV pages and decode state move onto
    # migrate_replicas of the generation mesh's data-parallel replicas (those the scoring meshes
    # use least) and finish there, so the scoring calls on the other devices need not wait for
    # the long tail. The same samples (the KV moves, nothing is recomputed).
    migrate_rows: int = 0
    migrate_replicas: int = 1

    def validate(self) -> None:
        """One ConfigError naming the first bad field."""
        check_types(self, "Fusion")
        _check(self.score_rows >= 0, "Fusion.score_rows", "must be >= 0 (0: derived)")
        _check(self.migrate_rows >= 0, "Fusion.migrate_rows", "must be >= 0 (0: off)")
        _check(self.migrate_replicas >= 1, "Fusion.migrate_replicas", "must be >= 1")
        _check(
            not self.migrate_rows or self.enabled,
            "Fusion.migrate_rows",
            "moves the long tail off the devices that score finished samples and needs "
            "Fusion.enabled = True",
        )


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Memory:
    """The RL trainer's memory knobs (``RLConfig.memory``; jrlhf.ppo.residency; ``python -m
    jrlhf.plan`` chooses infer_batch_size, generation_copy and offload per plan)."""

    infer_batch_size: int = 0  # rows per reference/reward/critic call; 0 scores all at once
    # generation_copy: the actor's generation-layout copy (the resharder's output) is "kept" on
    # its devices all iteration, or "dropped" when generation ends (freed for scoring and the
    # update; the reshard after the update rebuilds it, as it does anyway, so it costs no time;
    # a second generation round of dynamic sampling rebuilds it from the training copy). There
    # is no "parked" copy: every update makes the old copy stale, so it would never be read back.
    generation_copy: str = "kept"
    # offload: what lives in host memory while idle: "reference" and "reward" (parameters, on
    # device only while scoring), "actor_optimizer" and "critic_optimizer" (AdamW state, on
    # device only during the update). Each costs one copy out and one back per iteration.
    offload: tuple[str, ...] = ()
    # Train on packed rows (jrlhf.data.batch.pack_segments): each minibatch's samples laid end to
    # end in rows of max_prompt_len + max_response_len columns with segment ids, positions
    # restarting per sample, instead of one left/right-padded row each; the same loss and
    # gradients (to float rounding), fewer computed tokens when responses are short. Off by
    # default: with responses near max_response_len there is little padding to remove, and the
    # row count (bucketed, <= 8 shapes) can differ between iterations, each new one compiling.
    pack_samples: bool = False
    # > 0: the actor's train step computes log-probs and entropies this many response positions
    # at a time (jrlhf.models.logprobs.chunked_logprobs), holding at most (chunk, vocab) logits
    # in the forward and backward passes instead of (rows x max_response_len, vocab): for large
    # vocabularies, at the price of recomputing each chunk's head matmul in the backward pass.
    # 0 (default): all positions at once.
    logprob_chunk: int = 0

    def validate(self) -> None:
        """One ConfigError naming the first bad field."""
        check_types(self, "Memory")
        _check(self.infer_batch_size >= 0, "Memory.infer_batch_size", "must be >= 0")
        _check(
            self.generation_copy in GENERATION_COPIES,
            "Memory.generation_copy",
            f"unknown {self.generation_copy!r}; valid: {', '.join(GENERATION_COPIES)}",
        )
        for item in self.offload:
            _check(
                item in OFFLOADABLE,
                "Memory.offload",
                f"unknown item {item!r}; valid: {', '.join(OFFLOADABLE)}",
            )
        _check(
            len(set(self.offload)) == len(self.offload),
            "Memory.offload",
            f"lists an item twice: {self.offload!r}",
        )
        _check(self.logprob_chunk >= 0, "Memory.logprob_chunk", "must be >= 0 (0: off)")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class SampleFilters:
    """What becomes of samples before the update (``RLConfig.filters``; DAPO, Yu et al. 2025,
    with RLConfig.clip_eps_high for clip-higher and loss_agg="token-mean")."""

    # Dynamic sampling: groups (one prompt's samples_per_prompt samples) whose scores (penalty
    # included) are all equal carry no group-relative advantage and are dropped; the iteration
    # generates from the next prompts of the loader until it has prompts_per_iteration groups
    # with signal, for at most max_sampling_rounds generation rounds, and then fills up with
    # dropped groups (metrics sampling/*). Needs RLConfig.samples_per_prompt >= 2. With
    # Asynchrony.max_staleness >= 1 a batch's further rounds are generated at the iterations
    # before it trains, under their weights (jrlhf.ppo.schedules.bounded).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4
    # Soft overlong punishment (core_algos.overlong_penalty): a response longer than
    # TaskConfig.max_response_len - overlong_buffer tokens loses up to overlong_penalty from its
    # score, linearly over the buffer (a truncated response loses all of it); 0 turns it off.
    # Advantages see the penalized score, the logged "reward" the unpenalized one.
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0

    def validate(self) -> None:
        """One ConfigError naming the first bad field."""
        check_types(self, "SampleFilters")
        _check(self.max_sampling_rounds >= 1, "SampleFilters.max_sampling_rounds", "must be >= 1")
        _check(self.overlong_buffer >= 0, "SampleFilters.overlong_buffer", "must be >= 0 (0: off)")
        _check(self.overlong_penalty >= 0, "SampleFilters.overlong_penalty", "must be >= 0")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class OffPolicy:
    """Off-policy correction (``RLConfig.off_policy``; core_algos.behaviour_importance_weights)
    for samples whose behaviour policy differs from the one the update starts from (a generation
    engine with other numerics, e.g. bf16 decode and fp32 training; stale weights).

    ``correction`` "none": the PPO ratio is taken against the behaviour (generation) log-probs,
    as always. "tis" / "decoupled": the actor's own forward recomputes the proximal log-probs
    before the update (one more actor pass over the batch), the ratio and its clip are taken
    against them, and each token's loss is weighted by pi_prox / pi_behaviour, truncated at
    ``is_cap`` ("tis") or not ("decoupled"). Metrics offpolicy/*: mismatch (mean |log-prob
    difference|, k3 KL), IS clip fraction."""

    correction: str = "none"
    is_cap: float = 2.0

    def validate(self) -> None:
        """One ConfigError naming the first bad field."""
        check_types(self, "OffPolicy")
        _check(
            self.correction in OFF_POLICY_CORRECTIONS,
            "OffPolicy.correction",
            f"unknown correction {self.correction!r}; valid: {', '.join(OFF_POLICY_CORRECTIONS)}",
        )
        _check(self.is_cap >= 1, "OffPolicy.is_cap", f"must be >= 1, got {self.is_cap}")


# RLConfig's sub-configs: field -> class (each bound by its own name, e.g. Fusion.enabled).
RL_SUB_CONFIGS = {
    "asynchrony": Asynchrony,
    "fusion": Fusion,
    "memory": Memory,
    "filters": SampleFilters,
    "off_policy": OffPolicy,
}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RLConfig:
    """PPO / GRPO hyper-parameters (the stage name picks the algorithm).

    The algorithm's own fields are bound here (``RLConfig.kl_coef = 0.05``); the knobs of each
    other concern in a sub-config of its own, bound by its name, which every RLConfig built
    reads: :class:`Asynchrony`, :class:`Fusion`, :class:`Memory`, :class:`SampleFilters`,
    :class:`OffPolicy` (``Asynchrony.max_staleness = 1``)."""

    iterations: int = 40
    prompts_per_iteration: int = 32
    samples_per_prompt: int = 1  # GRPO group size (>= 2 for GRPO)
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    epochs: int = 2
    minibatch_size: int = 16
    # Registered in jrlhf.ppo.core_algos (POLICY_LOSSES, ADVANTAGE_ESTIMATORS), any stage:
    # policy_loss: "ppo" (token-level clipped ratio) or "gspo" (sequence-level ratio
    #   exp(mean token log-ratio) clipped per sequence; the paper uses clip_eps=3e-4,
    #   clip_eps_high=4e-4 and loss_agg="seq-mean-token-mean").
    # advantage_estimator: "" picks the stage's own (gae for ppo, grpo for grpo); "gae";
    #   "grpo" (group-normalized scores); "drgrpo" (group-centred, no std division; pair with
    #   loss_agg="seq-mean-token-sum-norm"); "rloo" (leave-one-out group baseline);
    #   "reinforce++" (discounted returns normalized over the batch); "reinforce++-baseline"
    #   (group-centred scores normalized over the batch). grpo, drgrpo, rloo and
    #   reinforce++-baseline need samples_per_prompt >= 2. Only gae reads critic values (the
    #   ppo stage trains its critic whichever estimator is chosen).
    policy_loss: str = "ppo"
    advantage_estimator: str = ""
    clip_eps: float = 0.2
    clip_eps_high: float = 0.0  # 0 means symmetric clipping
    # Dual clip (Ye et al. 2020): on tokens with a negative advantage the loss is bounded by
    # -A * c, so a stale sample whose ratio has exploded cannot dominate the update. On by default
    # with c = 3, as in verl and most PPO trainers (it binds only where ratio > 3, rare within a
    # trust region); must be > 1; 0 disables it.
    dual_clip_c: float = 3.0
    value_clip_eps: float = 0.2
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    kl_coef: float = 0.05
    # KL(policy || reference) estimator: k1, k2, k3 or abs. "" picks k3 when the KL is a loss term
    # (GRPO, or kl_in_loss), where k1's gradient is zero in expectation (k3's is that of
    # KL(ref || policy)), and k1 when it is a reward penalty (unbiased for the KL the return pays).
    kl_estimator: str = ""
    kl_in_loss: bool = False  # GRPO style: KL as a loss term instead of a reward penalty
    # > 0 enables the adaptive controller (Ziegler et al.). It observes the configured estimator's
    # per-token KL: the mean over sequences of each sequence's mean over its response tokens
    # (verl's choice), so the target is in nats per token, not per sequence.
    adaptive_kl_target: float = 0.0
    adaptive_kl_horizon: float = 10000.0
    entropy_coef: float = 0.0
    # How a per-token loss becomes a scalar (core_algos.aggregate_loss): token-mean,
    # seq-mean-token-sum, seq-mean-token-mean, or seq-mean-token-sum-norm (Dr. GRPO: per-sequence
    # token sums over the constant max_response_len). The same minibatch loss whatever
    # RoleConfig.microbatches.
    loss_agg: str = "token-mean"
    reward_scale: float = 1.0
    checkpoint_every: int = 0  # iterations; 0 saves only at the end
    keep_checkpoints: int = 2
    async_checkpoint: bool = True
    eval_every: int = 0
    # The sub-configs, built by gin's wrapped classes so their bindings apply to every RLConfig.
    asynchrony: Asynchrony = dataclasses.field(default_factory=Asynchrony)
    fusion: Fusion = dataclasses.field(default_factory=Fusion)
    memory: Memory = dataclasses.field(default_factory=Memory)
    filters: SampleFilters = dataclasses.field(default_factory=SampleFilters)
    off_policy: OffPolicy = dataclasses.field(default_factory=OffPolicy)

    def validate(self, stage: str | None = None) -> None:
        """One ConfigError naming the first bad field: each sub-config's own checks, then those
        across fields and sections (``stage``: the RL stage that will run, if known)."""
        for name in RL_SUB_CONFIGS:
            # RLConfig.fusion was a bool before Fusion held the switch; gin still accepts it.
            old = f"RLConfig.{name}"
            if old in MOVED and not dataclasses.is_dataclass(getattr(self, name)):
                raise ConfigError(moved_message(old))
        check_types(self, "RLConfig")
        for name in RL_SUB_CONFIGS:
            getattr(self, name).validate()
        _check(self.iterations >= 1, "RLConfig.iterations", "must be >= 1")
        _check(self.prompts_per_iteration >= 1, "RLConfig.prompts_per_iteration", "must be >= 1")
        _check(self.samples_per_prompt >= 1, "RLConfig.samples_per_prompt", "must be >= 1")
        _check(self.minibatch_size >= 1, "RLConfig.minibatch_size", "must be >= 1")
        _check(self.epochs >= 1, "RLConfig.epochs", "must be >= 1")
        rows = self.prompts_per_iteration * self.samples_per_prompt
        _check(
            rows % self.minibatch_size == 0,
            "RLConfig.minibatch_size",
            f"{self.minibatch_size} does not divide the {rows} samples of an iteration",
        )
        if stage == "grpo":
            _check(
                "critic_optimizer" not in self.memory.offload,
                "Memory.offload",
                "'critic_optimizer': GRPO trains no critic",
            )
        if stage == "grpo":
            _check(self.samples_per_prompt >= 2, "RLConfig.samples_per_prompt", "GRPO needs >= 2")
        _check(
            self.kl_estimator in ("", "k1", "k2", "k3", "abs"),
            "RLConfig.kl_estimator",
            f"unknown estimator {self.kl_estimator!r}; valid: '', 'k1', 'k2', 'k3', 'abs'",
        )
        _check(
            self.dual_clip_c == 0 or self.dual_clip_c > 1,
            "RLConfig.dual_clip_c",
            f"must be > 1 (or 0 to disable), got {self.dual_clip_c}",
        )
        _check(self.temperature > 0, "RLConfig.temperature", "must be > 0")
        _check(0 < self.top_p <= 1, "RLConfig.top_p", "must be in (0, 1]")
        _check(
            self.loss_agg in LOSS_AGG_MODES,
            "RLConfig.loss_agg",
            f"unknown aggregation {self.loss_agg!r}",
        )
        _check(self.top_k >= 0, "RLConfig.top_k", "must be >= 0 (0 disables top-k)")
        for name in ("clip_eps", "clip_eps_high", "dual_clip_c", "value_clip_eps", "kl_coef"):
            _check(getattr(self, name) >= 0, f"RLConfig.{name}", "must be >= 0")
        _check(0 <= self.gamma <= 1, "RLConfig.gamma", "must be in [0, 1]")
        _check(0 <= self.lam <= 1, "RLConfig.lam", "must be in [0, 1]")
        _check(self.adaptive_kl_horizon > 0, "RLConfig.adaptive_kl_horizon", "must be > 0")
        _check(
            not (self.asynchrony.partial_rollout_tokens and self.fusion.migrate_rows),
            "Fusion.migrate_rows",
            "moves a decoding tail off the devices that score finished samples, but partial "
            "rollouts end every pass at Asynchrony.partial_rollout_tokens and score a round only "
            "once all its samples have ended, between passes: nothing waits on a tail; set 0",
        )
        if self.fusion.enabled:
            parked = sorted(set(self.memory.offload) & {"reference", "reward"})
            _check(
                not parked,
                "Fusion.enabled",
                f"scores while generating, when Memory.offload keeps {', '.join(parked)} in host "
                "memory: offload only optimizer state with fusion",
            )
        if self.filters.dynamic_sampling:
            _check(
                self.samples_per_prompt >= 2,
                "SampleFilters.dynamic_sampling",
                "drops groups of equal scores and needs RLConfig.samples_per_prompt >= 2, "
                f"got {self.samples_per_prompt}",
            )
        for name in ("checkpoint_every", "eval_every", "adaptive_kl_target"):
            _check(getattr(self, name) >= 0, f"RLConfig.{name}", "must be >= 0")
        # 0 would let Orbax delete every step, the newest included.
        _check(self.keep_checkpoints >= 1, "RLConfig.keep_checkpoints", "must be >= 1")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Generation engine sizes (0 means derived from the rollout batch).

    ``layer_loop`` is how a decode step runs the layers: ``scan`` over the stacked weights, or
    ``unroll`` over per-layer copies made once per generate (the layer weights are then held
    twice while generating; the planner counts the copies). XLA copies each layer's weight slices
    out of the stack at every scanned step on CPU and on GPUs alike, which unrolling avoids: on
    an H200, decode steps of a Llama-3-8B shape took 2.1x less time unrolled (docs/gpu.md).
    ``auto`` unrolls on CPU, and on accelerators for each generate whose layer copies fit in
    half of every device's free memory, in single-process jobs (the processes of a
    multi-controller job would have to agree; they scan). The planner prices ``auto`` on
    accelerators as a scan: it needs no memory beyond what the plan leaves free.

    ``page_size`` is the KV cache's tokens per page. 16 (was 8): below 16 the GPU kernel cannot
    use Triton's dot, and on an H200 a 1B-shaped decode step took 1.75 ms at 16 against 4.74 ms
    at 8 (1.61 ms at 32; docs/gpu.md, runs 21-22). A page wastes at most page_size - 1 positions
    a sequence; the CPU kernel reads each sequence's own positions, whatever the page size.
    """

    num_slots: int = 0
    page_size: int = 16
    num_pages: int = 0
    chunk_steps: int = 8
    layer_loop: str = "auto"
    # A mixture-of-experts actor's rollouts record each layer's chosen experts, and every
    # update reports how often its training pass routes them differently (moe/* metrics,
    # docs/moe.md). Synchronous rollouts only (not fused, partial or asynchronous ones).
    record_routes: bool = False
    # With a stage axis in the actor's generation mesh (docs/pipelines.md): how many groups of
    # slots are in flight through the stages; 0: one per stage (every stage busy), 1: naive
    # pipelined decode (one batch, the other stages idle).
    pipeline_batches: int = 0

    def validate(self) -> None:
        check_types(self, "DecodeConfig")
        _check(self.num_slots >= 0, "DecodeConfig.num_slots", "must be >= 0 (0: derived)")
        _check(self.num_pages >= 0, "DecodeConfig.num_pages", "must be >= 0 (0: derived)")
        _check(self.page_size >= 1, "DecodeConfig.page_size", "must be >= 1")
        _check(self.chunk_steps >= 1, "DecodeConfig.chunk_steps", "must be >= 1")
        _check(
            self.pipeline_batches >= 0,
            "DecodeConfig.pipeline_batches",
            "must be >= 0 (0: one per pipeline stage of the generation mesh)",
        )
        _check(
            self.layer_loop in DECODE_LAYER_LOOPS,
            "DecodeConfig.layer_loop",
            f"must be one of {', '.join(DECODE_LAYER_LOOPS)} (got {self.layer_loop!r})",
        )


@gin.configurable
@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Multi-turn rollouts with an environment (jrlhf.envs); ``name`` empty: single-turn.

    ``name``: a registered environment (``calculator``, ``guess_number``) or ``module:attr`` (a
    class with ``reset(meta)``/``step(conversation)``, or a function of the conversation). A
    turn of the policy ends at one of ``turn_stop`` (strings that are each one token of the
    tokenizer, e.g. a closing tool tag) or ``turn_stop_ids``, or after ``max_turn_tokens``
    sampled tokens (0: no limit); the environment's observation (at most
    ``max_observation_tokens``) is appended and the policy goes on, up to ``max_turns`` turns
    (0: until the environment says done, an end-of-sequence id or TaskConfig.max_response_len,
    which bounds the whole episode). Environment code gets ``timeout_s`` per step (0: inline,
    no deadline); a failing step ends its episode, recorded; more than ``failure_limit`` of a
    rollout's episodes failing stops the run in one line.
    """

    name: str = ""
    turn_stop: tuple[str, ...] = ()
    turn_stop_ids: tuple[int, ...] = ()
    max_turn_tokens: int = 0
    max_turns: int = 0
    max_observation_tokens: int = 32
    timeout_s: float = 30.0
    failure_limit: float = 0.25

    def validate(self) -> None:
        check_types(self, "EnvConfig")
        if not self.name:
            return
        _check(
            bool(self.turn_stop or self.turn_stop_ids or self.max_turn_tokens),
            "EnvConfig.turn_stop",
            "set turn_stop, turn_stop_ids or max_turn_tokens: otherwise no turn ever ends",
        )
        _check(self.max_turn_tokens >= 0, "EnvConfig.max_turn_tokens", "must be >= 0")
        _check(self.max_turns >= 0, "EnvConfig.max_turns", "must be >= 0 (0: no cap)")
        _check(self.max_observation_tokens >= 1, "EnvConfig.max_observation_tokens", "must be >= 1")
        _check(self.timeout_s >= 0, "EnvConfig.timeout_s", "must be >= 0 (0: inline)")
        _check(0 <= self.failure_limit <= 1, "EnvConfig.failure_limit", "must be in [0, 1]")
        _check(all(t >= 0 for t in self.turn_stop_ids), "EnvConfig.turn_stop_ids", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class Config:
    run: RunConfig
    task: TaskConfig
    roles: dict[str, RoleConfig]
    sft: SFTConfig
    rm: RewardModelConfig
    dpo: DPOConfig
    rl: RLConfig
    decode: DecodeConfig
    env: EnvConfig = EnvConfig()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, default=str)


def _gin_error_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 2 and lines[1].startswith("In "):
        return f"{lines[0]} ({lines[1][3:]}: {lines[2]})"
    return lines[0] if lines else type(e).__name__


# Gin's parser reads a value with ast.literal_eval; what that cannot read (a bare name such as
# nan, inf or an unquoted string, a call such as float('nan')) it reports as "malformed node or
# string ...: <ast.Name object at 0x...>", then "Failed to parse token 'TOKEN'".
_UNPARSED_TOKEN = re.compile(r"Failed to parse token '(.*)'")
_NON_FINITE = re.compile(
    r"(?P<bare>[+-]?(?:nan|inf|infinity))"
    r"|float\(\s*(?P<q>['\"])(?P<quoted>\s*[+-]?(?:nan|inf|infinity)\s*)(?P=q)\s*\)",
    re.IGNORECASE,
)


def _unparsed_value(e: Exception) -> tuple[str, str] | None:
    """For gin's error on a value it cannot parse, the setting its line binds ("" when the line
    has none) and what is wrong with the value: (``actor/RoleConfig.learning_rate``, ``expects a
    finite number, got nan``); None for any other error."""
    found = _UNPARSED_TOKEN.search(e.msg) if isinstance(e, SyntaxError) and e.msg else None
    if found is None:
        return None
    token = found.group(1)
    setting, eq, value = (e.text or "").partition("=")
    setting, value = (setting.strip(), value.split("#", 1)[0].strip()) if eq else ("", "")
    value = value or token
    non_finite = _NON_FINITE.fullmatch(value)
    if non_finite:
        # Reported as check_types reports a number out of range (1e999 parses as inf).
        number = float(non_finite.group("bare") or non_finite.group("quoted"))
        hint = _field_hint(setting)
        why = (_type_error(number, hint) if hint is not None else None) or "expects a finite number"
        why = f"{why}, got {value}"
    else:
        why = f"{value} is not a value gin can read (it reads Python literals"
        called = re.search(rf"{re.escape(token)}\s*\(", value)
        why += f"; strings need quotes: '{token}')" if token.isidentifier() and not called else ")"
    return setting, why


def _field_hint(setting: str) -> Any:
    """The declared type of a setting ``[scope/]Section.field``, or None if it names none."""
    sections = (
        RunConfig, TaskConfig, RoleConfig, SFTConfig, RewardModelConfig, DPOConfig, RLConfig,
        *RL_SUB_CONFIGS.values(), DecodeConfig, EnvConfig,
    )  # fmt: skip
    section, _, field = setting.rpartition("/")[2].partition(".")
    for cls in sections:
        if cls.__name__ == section:
            return typing.get_type_hints(cls).get(field)
    return None


# Gin's error for a binding of a parameter its configurable does not have.
_NO_PARAMETER = re.compile(
    r"Configurable '(?:[\w.]*\.)?(\w+)' doesn't have a parameter named '(\w+)'"
)
_GIN_LOCATION = re.compile(r'file "(.*)", line (\d+)')


def _moved_binding(e: Exception) -> str | None:
    """For gin's error on a binding of a setting that moved (:data:`MOVED`), the one line that
    names its new binding, after the file and line that bound it; None for any other error."""
    found = _NO_PARAMETER.search(str(e))
    old = f"{found.group(1)}.{found.group(2)}" if found else ""
    if old not in MOVED:
        return None
    where = _GIN_LOCATION.search(str(e))  # the file an include brought in, if it was one
    prefix = f"config file {where.group(1)}, line {where.group(2)}: " if where else ""
    return prefix + moved_message(old)


def _check_scopes() -> None:
    """One line for a binding under a scope that is not a role (``actr/RoleConfig...``): gin
    would keep it and no section would ever read it, so the setting would silently not apply."""
    # gin keeps its bindings keyed by (scope, selector); it has no public way to list them.
    for scope, selector in gin.config._CONFIG:
        for part in filter(None, scope.split("/")):
            if part not in ROLES:
                near = difflib.get_close_matches(part, ROLES, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f" (roles: {', '.join(ROLES)})"
                section = selector.rpartition(".")[2]
                raise ConfigError(f"{scope}/{section}: {part!r} is not a role{hint}")


def load_config(files: list[str], bindings: list[str]) -> Config:
    """Parse gin files and bindings, build and validate every section."""
    gin.clear_config()
    for path in files:
        if not Path(path).exists():
            raise ConfigError(f"config file {path} does not exist")
    # Gin raises whatever its parser meets (SyntaxError, tokenize errors, ValueError...):
    # every one becomes a line naming the file, or the binding, that caused it.
    for path in files:
        try:
            gin.parse_config_file(path)
        except Exception as e:
            moved = _moved_binding(e)
            if moved is not None:
                raise ConfigError(moved) from None
            value = _unparsed_value(e)
            if value is not None:
                where = f"config file {path}, line {e.lineno}"
                raise ConfigError(": ".join([where, *filter(None, value)])) from None
            raise ConfigError(f"config file {path}: {_gin_error_line(e)}") from None
    for binding in bindings:
        try:
            gin.parse_config(binding)
        except Exception as e:
            moved = _moved_binding(e)
            if moved is not None:
                raise ConfigError(moved) from None
            value = _unparsed_value(e)
            if value is not None:
                raise ConfigError(f"{value[0] or f'binding {binding!r}'}: {value[1]}") from None
            raise ConfigError(f"binding {binding!r}: {_gin_error_line(e)}") from None

    _check_scopes()

    def build(section: type, scope: str = "") -> Any:
        # Gin evaluates macros and references here; a failure names the section it was for.
        try:
            with gin.config_scope(scope or None):
                return section()
        except Exception as e:
            name = f"{scope}/{section.__name__}" if scope else section.__name__
            raise ConfigError(f"{name}: {_gin_error_line(e)}") from None

    cfg = Config(
        run=build(RunConfig),
        task=build(TaskConfig),
        roles={role: build(RoleConfig, role) for role in ROLES},
        sft=build(SFTConfig),
        rm=build(RewardModelConfig),
        dpo=build(DPOConfig),
        rl=build(RLConfig),
        decode=build(DecodeConfig),
        env=build(EnvConfig),
    )
    cfg.run.validate()
    cfg.task.validate()
    for role, rc in cfg.roles.items():
        rc.validate(role)
    cfg.sft.validate()
    cfg.rm.validate()
    cfg.dpo.validate()
    cfg.decode.validate()
    cfg.env.validate()
    # A pair stage's batch holds two rows per pair; microbatches of whole pairs keep each pair's
    # rows together (a split of the rows alone could tear a pair apart, silently).
    for stage, section, name, role in (
        ("rm", cfg.rm, "RewardModelConfig", "reward"),
        ("dpo", cfg.dpo, "DPOConfig", "actor"),
    ):
        m = cfg.roles[role].microbatches
        _check(
            stage not in cfg.run.stages or section.batch_size % m == 0,
            f"{name}.batch_size",
            f"{section.batch_size} pairs do not split into {role}/RoleConfig.microbatches={m} "
            "microbatches of whole pairs",
        )
    row_len = cfg.task.max_prompt_len + cfg.task.max_response_len
    for role, rc in cfg.roles.items():
        _check(
            not rc.microbatch_tokens or rc.microbatch_tokens >= row_len,
            f"{role}/RoleConfig.microbatch_tokens",
            f"{rc.microbatch_tokens} is less than one row of TaskConfig.max_prompt_len + "
            f"max_response_len = {row_len} tokens",
        )
    if cfg.roles["critic"].pipeline_schedule == "fused":
        _check(
            "grpo" not in cfg.run.stages,
            "critic/RoleConfig.pipeline_schedule",
            "'fused' trains the critic together with the actor, and the grpo stage trains no "
            "critic (use it with the ppo stage)",
        )
        check_fused_role(cfg.roles["actor"], "actor")
    rl_stages = [s for s in cfg.run.stages if s in ("ppo", "grpo")]
    for stage in rl_stages or [None]:
        cfg.rl.validate(stage)
    asynchrony, r = cfg.rl.asynchrony, cfg.task.max_response_len
    t, k = asynchrony.partial_rollout_tokens, asynchrony.max_staleness
    _check(
        not t or (r % t == 0 and t * k >= r),
        "Asynchrony.partial_rollout_tokens",
        f"{t} must divide TaskConfig.max_response_len {r} and, times Asynchrony.max_staleness {k}, "
        "reach it (each batch's samples end in the k passes before it trains)",
    )
    buffer = cfg.rl.filters.overlong_buffer
    _check(
        buffer <= cfg.task.max_response_len,
        "SampleFilters.overlong_buffer",
        f"{buffer} exceeds TaskConfig.max_response_len {cfg.task.max_response_len}",
    )
    return cfg


def operative_config() -> str:
    return gin.config_str()
