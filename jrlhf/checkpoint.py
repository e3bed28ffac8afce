"""Both checkpoint layouts, defined once: model checkpoints and trainer checkpoints.

**Model checkpoint** (SFT/RM stage outputs, ``python -m jrlhf.convert``)::

    DIR/model.json   {"head": ..., "config": ModelConfig}
    DIR/params/      an Orbax tree of the parameters

**Trainer checkpoint** (the RL trainer's, resumable): an Orbax ``CheckpointManager`` root, by
default ``run_dir/checkpoints``, whose steps hold the items

    meta               JSON: the trainer's resume state (iteration, loader position, KL
                       coefficient, ...) plus ``models``: {role: model description}
    {role}_params      each trained role's parameters
    {role}_opt_state   {"step", "opt_state"}: the rest of the role's train state

Parameters are an item apart from the optimizer state so that :func:`load_model` (evaluate,
convert) restores a role without knowing its optimizer. Orbax writes a step under a temporary
name and renames it once every item is committed, so an interrupted save is never listed.

Restoring builds abstract arrays carrying the *target* mesh's shardings and hands them to Orbax
as the restore target (:func:`restore_target`), so each device reads only its own shard, whatever
mesh the checkpoint was written from. An array on a mesh that lacks some process (a placement
that separates processes) is saved and restored through its copies view
(jrlhf.reshard.processes), since Orbax handles only arrays over every process. Everything
about a trainer checkpoint is read through Orbax's API (``CheckpointManager.latest_step``,
``metadata``, ``restore``), never its file names.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jrlhf.meshes.batch import to_host
from jrlhf.meshes.processes import all_processes, barrier, is_primary
from jrlhf.meshes.rules import MeshLayoutError, Rules
from jrlhf.models import hf
from jrlhf.models import lora as lora_lib
from jrlhf.models.config import ModelConfig
from jrlhf.models.lora import LoraConfig
from jrlhf.models.model_def import ModelDef, Params
from jrlhf.reshard.processes import local_part, spanning, spanning_target
from jrlhf.storage import write_atomic

log = logging.getLogger("jrlhf")


class CheckpointError(ValueError):
    """No intact checkpoint where one was expected; one line naming the directory."""


# -- model checkpoint layout -------------------------------------------------------------------
MODEL_JSON = "model.json"
PARAMS_DIR = "params"

# -- trainer checkpoint layout -----------------------------------------------------------------
CHECKPOINTS_DIR = "checkpoints"  # the trainer's checkpoint root inside a run directory
META_ITEM = "meta"
MODELS_KEY = "models"  # the key of META_ITEM describing each trained role's model
# Steps are plain integers ("4"); one name format for the writer and every reader.
STEP_NAMES = ocp.path.step.standard_name_format()


def params_item(role: str) -> str:
    """The trainer-checkpoint item holding ``role``'s parameters."""
    return f"{role}_params"


def opt_state_item(role: str) -> str:
    """The trainer-checkpoint item holding ``role``'s optimizer state and step counter."""
    return f"{role}_opt_state"


# -- model descriptions (model.json and the trainer meta's "models" entries) --------------------
def model_entry(model: ModelDef, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON description of ``model``: its head and ModelConfig; with LoRA also the
    adapters' config and ``base`` (``{"weights": source or None, "seed": int}``: where the
    frozen base weights come from, since a trainer checkpoint holds only the adapters)."""
    entry = {"head": model.head, "config": json.loads(model.config.to_json())}
    if model.lora is not None:
        entry["lora"] = dataclasses.asdict(model.lora)
        entry["base"] = dict(base or {"weights": None, "seed": 0})
    return entry


def base_entry(weights: str | None, seed: int) -> dict[str, Any]:
    """A LoRA model entry's ``base``: its weights' source (``hf:DIR`` or ``ckpt:DIR``, the
    directory made absolute: the checkpoint is read from elsewhere) and the seed of a random one."""
    if weights is not None:
        kind, _, where = weights.partition(":")
        weights = f"{kind}:{Path(where).absolute()}"
    return {"weights": weights, "seed": int(seed)}


def model_from_entry(entry: Mapping[str, Any]) -> ModelDef:
    """The ModelDef a :func:`model_entry` describes."""
    lora = LoraConfig(**entry["lora"]) if entry.get("lora") else None
    config = ModelConfig.from_json(json.dumps(entry["config"]))
    return ModelDef(config, entry.get("head", "lm"), lora)


def load_source_weights(
    model: ModelDef, weights: str | None, mesh: Mesh, rules: Rules | str, seed: int
) -> Params:
    """Parameters of ``model`` on ``mesh`` from ``weights`` (``hf:DIR``, ``ckpt:DIR`` of a
    model checkpoint, or None: random from ``seed``).

    A value-head model initialised from a language model (e.g. a critic from the SFT policy)
    keeps the shared backbone and starts its value head from random numbers. A LoRA model
    loads its base so and starts its adapters fresh (B zero: it computes the base exactly).
    """
    if weights is None:
        return model.init_sharded(mesh, rules, seed=seed)
    kind, _, where = weights.partition(":")
    base = model.base
    if kind == "hf":
        stored, params = hf.load_hf(where, mesh, rules, param_dtype=base.config.param_dtype)
    else:
        stored = ModelDef(base.config, read_model_json(where).head)
        params = restore_model_params(where, stored, mesh, rules)
    if stored.head != model.head or model.lora is not None:
        # Only the fresh leaves survive the program (XLA drops the rest), so the model's own
        # base is never materialised twice.
        fresh = _fresh_program(model, stored.head, mesh, rules)(jax.random.key(seed))
        heads_differ = stored.head != model.head
        params = {
            k: v
            for k, v in params.items()
            if k in model.abstract_params and not (heads_differ and k in ("lm_head", "value_head"))
        }
        params = _deep_update(params, fresh)
    return params


def _fresh_leaf(model: ModelDef, stored_head: str, keys: tuple[str, ...]) -> bool:
    """Whether the leaf at ``keys`` of ``model`` is not in a checkpoint of the base model
    with head ``stored_head``: adapters, and a head the stored model lacks."""
    return "_lora_" in keys[-1] or (
        stored_head != model.head and keys[0] in ("lm_head", "value_head")
    )


@functools.lru_cache(maxsize=16)
def _fresh_program(model: ModelDef, stored_head: str, mesh: Mesh, rules: Rules | str):
    shardings = lora_lib.select(
        model.shardings(mesh, rules), lambda keys: _fresh_leaf(model, stored_head, keys)
    )
    return jax.jit(
        lambda key: lora_lib.select(
            model.init(key), lambda keys: _fresh_leaf(model, stored_head, keys)
        ),
        out_shardings=shardings,
    )


def _deep_update(tree: dict, part: dict) -> dict:
    out = dict(tree)
    for k, v in part.items():
        out[k] = _deep_update(tree.get(k, {}), v) if isinstance(v, dict) else v
    return out


def restore_target(tree: Any, shardings: Any) -> Any:
    """Abstract arrays with ``tree``'s shapes and dtypes and the given ``shardings``: an Orbax
    restore target that reads every device's shard straight into the new layout."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )


# -- model checkpoints -------------------------------------------------------------------------
def write_model_json(directory: str | os.PathLike, model: ModelDef) -> None:
    """Write ``directory/model.json`` describing ``model``."""
    text = json.dumps(model_entry(model), indent=2, sort_keys=True)
    # Whole or absent: its presence marks the checkpoint complete.
    write_atomic(Path(directory, MODEL_JSON), text)


def read_model_json(directory: str | os.PathLike) -> ModelDef:
    """The model a model checkpoint directory describes; errors name the file."""
    path = Path(directory, MODEL_JSON)
    try:
        return model_from_entry(json.loads(path.read_text()))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found (not a jrlhf model checkpoint)") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed model description ({e})") from None


def save_model(directory: str | os.PathLike, model: ModelDef, params: Params) -> Path:
    """Save ``params`` (any sharding) with their model description; refuses to overwrite."""
    directory = Path(directory).absolute()
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory}: exists and is not empty")
    barrier(f"save_model:{directory}")  # every process has checked before any writes
    directory.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / PARAMS_DIR, spanning(params))
    checkpointer.wait_until_finished()
    # model.json last: a directory without it is an incomplete save, never mistaken for a good one.
    if is_primary():
        write_model_json(directory, model)
    barrier(f"saved_model:{directory}")
    return directory


def restore_params(
    params_dir: str | os.PathLike, model: ModelDef, mesh: Mesh, rules: Rules | str
) -> Params:
    """Restore an Orbax parameter tree of ``model`` onto ``mesh`` laid out by ``rules``; a
    damaged tree is a CheckpointError naming the directory."""
    target = restore_target(model.abstract_params, model.shardings(mesh, rules))
    try:
        restored = ocp.StandardCheckpointer().restore(
            Path(params_dir).absolute(), spanning_target(target)
        )
    except Exception as e:  # Orbax and tensorstore raise many types for a damaged tree
        raise CheckpointError(
            f"{params_dir}: damaged parameters ({type(e).__name__}: {str(e).splitlines()[0][:300]})"
        ) from None
    return local_part(restored, target)


def restore_model_params(
    directory: str | os.PathLike, model: ModelDef, mesh: Mesh, rules: Rules | str
) -> Params:
    """The parameters of a model checkpoint directory, restored onto ``mesh``."""
    return restore_params(Path(directory) / PARAMS_DIR, model, mesh, rules)


# -- trainer checkpoints -----------------------------------------------------------------------
def trainer_checkpoint_manager(
    run_dir: str | os.PathLike, *, max_to_keep: int | None, async_save: bool
) -> ocp.CheckpointManager:
    """The RL trainer's checkpoint manager, rooted at ``run_dir/checkpoints``."""
    return ocp.CheckpointManager(
        (Path(run_dir) / CHECKPOINTS_DIR).absolute(),
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            step_name_format=STEP_NAMES,
        ),
    )


def save_trainer_state(
    manager: ocp.CheckpointManager,
    step: int,
    meta: Mapping[str, Any],
    states: Mapping[str, Any],
    models: Mapping[str, ModelDef],
    bases: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Save step ``step``: ``meta`` (JSON-serialisable resume state) plus, for every role of
    ``states`` (train states with ``step``, ``params`` and ``opt_state``), its trainable
    parameters (``ModelDef.trainable``: all, or a LoRA model's adapters), optimizer state and
    model description (with ``bases[role]`` for a LoRA model: :func:`model_entry`).
    Asynchronous if the manager is."""
    bases = bases or {}
    entries = {role: model_entry(models[role], bases.get(role)) for role in states}
    meta = {**meta, MODELS_KEY: entries}
    args = {META_ITEM: ocp.args.JsonSave(meta)}
    for role, state in states.items():
        # A LoRA role's item holds its adapters (and value head) only: the base is frozen, and
        # comes back from its source (the model entry's "base") on resume and on load.
        trained = models[role].trainable(state.params)
        args[params_item(role)] = ocp.args.StandardSave(spanning(trained))
        args[opt_state_item(role)] = ocp.args.StandardSave(
            spanning({"step": state.step, "opt_state": state.opt_state})
        )
    manager.save(step, args=ocp.args.Composite(**args))


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def _finite(tree: Any) -> bool:
    # One program per device set (roles restored together may sit on different meshes): leaf
    # by leaf, every shape and layout compiled a program of its own.
    groups: dict[frozenset, list[jax.Array]] = {}
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact):
            groups.setdefault(frozenset(x.sharding.device_set), []).append(x)
    return all(bool(to_host(_all_finite(leaves))) for leaves in groups.values())


def restore_newest_intact(
    manager: ocp.CheckpointManager, restore: Callable[[int], Any], what: str
) -> tuple[int, Any] | None:
    """``(step, restore(step))`` for the newest step of ``manager`` that restores and holds only
    finite values; None when it has no steps.

    A step that fails (a truncated or missing file, a non-finite value) is logged as a warning
    naming it and the problem, and the next older step is tried; the bad step stays on disk,
    untouched. When every step fails, the error names the newest one's problem.
    """
    steps = sorted(manager.all_steps(), reverse=True)
    problems = []
    for step in steps:
        try:
            value, problem = restore(step), None
            if not _finite(value):
                problem = "non-finite values"
        except MeshLayoutError:
            # The mesh does not fit the model: every step would fail alike, and none is damaged.
            raise
        except Exception as e:  # Orbax and tensorstore raise many types for a damaged step
            value, problem = None, f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        # Every process takes the same branch, whichever of them saw the problem.
        if all_processes(problem is None):
            return step, value
        problem = problem or "unreadable on another process"
        problems.append(problem)
        log.warning("%s: step %d of %s is damaged (%s); trying an older step", what, step,
                    manager.directory, problem)  # fmt: skip
    if steps:
        raise CheckpointError(
            f"{what}: no intact step in {manager.directory} (steps {steps}; newest: {problems[0]})"
        )
    return None


DAMAGED_SUFFIX = ".damaged"  # a step set aside by a resume that fell back past it


def _set_aside_newer(manager: ocp.CheckpointManager, step: int) -> None:
    """Rename the steps newer than ``step`` (damaged: a resume fell back past them) to
    ``<step>.damaged``, kept for inspection but no longer a step, so the resumed run can save
    those step numbers again."""
    newer = [s for s in manager.all_steps() if s > step]
    if not newer:
        return
    barrier("set_aside:start")
    if is_primary():
        for s in newer:
            path = Path(STEP_NAMES.find_step(manager.directory, s).path)
            target = path.with_name(path.name + DAMAGED_SUFFIX)
            n = 1
            while target.exists():
                target, n = path.with_name(f"{path.name}{DAMAGED_SUFFIX}-{n}"), n + 1
            path.rename(target)
            log.warning("set aside damaged step %d as %s", s, target)
    barrier("set_aside:done")
    manager.reload()


def restore_trainer_state(
    manager: ocp.CheckpointManager, targets: Mapping[str, Any], what: str = "resume"
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Restore the newest intact step: ``(meta, states)``, or None when there is none (a damaged
    newest step falls back to the one before, with a warning: :func:`restore_newest_intact`).

    ``targets``: per role, an abstract train state (dataclass with ``step``, ``params`` and
    ``opt_state``, leaves from :func:`restore_target`; ``params`` the trainable part, as
    :func:`save_trainer_state` saved it); each restored state is the target with its fields
    replaced, so it lands on the target's shardings.
    """
    args = {META_ITEM: ocp.args.JsonRestore()}
    for role, target in targets.items():
        args[params_item(role)] = ocp.args.StandardRestore(spanning_target(target.params))
        args[opt_state_item(role)] = ocp.args.StandardRestore(
            spanning_target({"step": target.step, "opt_state": target.opt_state})
        )

    def restore(step: int) -> dict[str, Any]:
        restored = manager.restore(step, args=ocp.args.Composite(**args))
        return {item: restored[item] for item in args}

    found = restore_newest_intact(manager, restore, what)
    if found is None:
        return None
    step, restored = found
    _set_aside_newer(manager, step)
    states = {}
    for role, target in targets.items():
        opt = local_part(
            restored[opt_state_item(role)], {"step": target.step, "opt_state": target.opt_state}
        )
        params = local_part(restored[params_item(role)], target.params)
        states[role] = dataclasses.replace(
            target, step=opt["step"], params=params, opt_state=opt["opt_state"]
        )
    return dict(restored[META_ITEM]), states


def _reader(root: Path) -> ocp.CheckpointManager:
    """A manager that only reads the trainer checkpoint at ``root`` (creates nothing)."""
    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, step_name_format=STEP_NAMES
    )
    return ocp.CheckpointManager(root.absolute(), options=options)


def _is_trainer_step(manager: ocp.CheckpointManager, step: int) -> bool:
    # A step of some other Orbax manager has no meta item (Orbax records each step's items).
    return META_ITEM in (manager.metadata(step).item_handlers or {})


def _latest_trainer_step(root: str | os.PathLike) -> tuple[Path, int] | None:
    """(checkpoint root, step) of the latest complete step under ``root`` or
    ``root/checkpoints``."""
    for base in (Path(root), Path(root) / CHECKPOINTS_DIR):
        if not base.is_dir():
            continue
        with _reader(base) as manager:
            step = manager.latest_step()
            if step is not None and _is_trainer_step(manager, step):
                return base, step
    return None


def _step_of_dir(path: Path) -> int | None:
    """The step number when ``path`` is a complete step directory of a trainer checkpoint."""
    if not path.is_dir():
        return None
    try:
        step = ocp.path.step.step_metadata_of_checkpoint_path(path, STEP_NAMES).step
    except ValueError:
        return None
    with _reader(path.parent) as manager:
        return step if _is_trainer_step(manager, step) else None


def latest_step_dir(root: str | os.PathLike) -> Path | None:
    """The directory of the latest complete step of a trainer checkpoint root (or of a run
    directory's ``checkpoints/``); None when there is none. A save cut off mid-write is never
    returned."""
    found = _latest_trainer_step(root)
    if found is None:
        return None
    base, step = found
    return Path(STEP_NAMES.find_step(base, step).path)


def _trainer_step(path: Path) -> tuple[Path, int] | None:
    step = _step_of_dir(path)
    return (path.parent, step) if step is not None else _latest_trainer_step(path)


def _restore_meta(manager: ocp.CheckpointManager, step: int) -> dict[str, Any]:
    args = ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
    return dict(manager.restore(step, args=args)[META_ITEM])


def read_trainer_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The ``meta`` item of a trainer checkpoint (a step directory, its root or a run
    directory: then the latest complete step)."""
    found = _trainer_step(Path(path))
    if found is None:
        raise FileNotFoundError(f"{path}: no trainer checkpoint with a complete step")
    base, step = found
    with _reader(base) as manager:
        return _restore_meta(manager, step)


def load_model(
    directory: str | os.PathLike, mesh: Mesh, rules: Rules | str, role: str = "actor"
) -> tuple[ModelDef, Params]:
    """Restore a model checkpoint, or ``role`` from a trainer checkpoint (a step directory, its
    root or a run directory: then the latest complete step), onto ``mesh`` (any mesh: the
    restore target carries the new shardings). A LoRA role comes back merged into its base (the
    plain model, whose export to HF is the merged weights)."""
    directory = Path(directory)
    if (directory / MODEL_JSON).exists():
        model = read_model_json(directory)
        return model, restore_model_params(directory, model, mesh, rules)
    found = _trainer_step(directory)
    if found is None:
        if not directory.exists():
            raise FileNotFoundError(f"{directory}: checkpoint directory does not exist")
        raise FileNotFoundError(
            f"{directory}: neither a model checkpoint ({MODEL_JSON}) nor a trainer checkpoint "
            "with a complete step"
        )
    base, step = found
    explicit = _step_of_dir(directory) is not None  # a step named by its directory: that one

    def restore(step: int) -> tuple[ModelDef, Params]:
        models = _restore_meta(manager, step).get(MODELS_KEY, {})
        if role not in models:
            raise ValueError(f"{base}: step {step} has no {role!r} model (it has {sorted(models)})")
        model = model_from_entry(models[role])
        shardings = model.shardings(mesh, rules)
        target = restore_target(model.abstract_params, shardings)
        target = model.trainable(target)
        item = params_item(role)
        args = ocp.args.Composite(**{item: ocp.args.StandardRestore(spanning_target(target))})
        params = local_part(manager.restore(step, args=args)[item], target)
        if model.lora is None:
            return model, params
        # The adapters on their base, merged: evaluate, generate and export see a plain model.
        source = models[role]["base"]
        full = load_source_weights(model, source["weights"], mesh, rules, source["seed"])
        return model.base, model.merge_sharded(model.with_trainable(full, params), mesh, rules)

    with _reader(base) as manager:
        if explicit:
            try:
                return restore(step)
            except ValueError:
                raise
            except Exception as e:
                raise CheckpointError(
                    f"{directory}: step {step} is damaged ({type(e).__name__}: "
                    f"{str(e).splitlines()[0][:300]})"
                ) from None
        return restore_newest_intact(manager, restore, f"{role} from {base}")[1]
