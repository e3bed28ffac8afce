"""Orbax model checkpoints that restore onto any mesh.

A model checkpoint directory holds ``model.json`` (the ModelConfig and head) and ``params/`` (an
Orbax tree). Restoring builds the abstract parameter tree with the *target* mesh's shardings and
hands it to Orbax as the restore target, so each device reads only its own shard, whatever mesh
the checkpoint was written from. Trainer checkpoints (the RL trainer, an Orbax CheckpointManager)
hold ``{role}_params`` items and a ``meta`` item describing each role's model, so ``load_model``
also accepts a run's checkpoint root or one of its step directories.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from jrlhf.meshes.rules import Rules
from jrlhf.models.config import ModelConfig
from jrlhf.models.model_def import ModelDef, Params

MODEL_JSON = "model.json"
PARAMS_DIR = "params"


def write_model_json(directory: str | os.PathLike, model: ModelDef) -> None:
    data = {"head": model.head, "config": json.loads(model.config.to_json())}
    Path(directory, MODEL_JSON).write_text(json.dumps(data, indent=2, sort_keys=True))


def read_model_json(directory: str | os.PathLike) -> ModelDef:
    path = Path(directory, MODEL_JSON)
    try:
        data = json.loads(path.read_text())
        return ModelDef(ModelConfig.from_json(json.dumps(data["config"])), data.get("head", "lm"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not found (not a jrlhf model checkpoint)") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed model description ({e})") from None


def save_model(directory: str | os.PathLike, model: ModelDef, params: Params) -> Path:
    """Save ``params`` (any sharding) with their model description; refuses to overwrite."""
    directory = Path(directory).absolute()
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory}: exists and is not empty")
    directory.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory / PARAMS_DIR, params)
    checkpointer.wait_until_finished()
    # model.json last: a directory without it is an incomplete save, never mistaken for a good one.
    if jax.process_index() == 0:
        write_model_json(directory, model)
    return directory


def restore_params(
    params_dir: str | os.PathLike, model: ModelDef, mesh: Mesh, rules: Rules | str
) -> Params:
    shardings = model.shardings(mesh, rules)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        model.abstract_params,
        shardings,
    )
    return ocp.StandardCheckpointer().restore(Path(params_dir).absolute(), target)


META_ITEM = "meta"


def _read_json_item(step_dir: Path, item: str) -> dict:
    path = step_dir / item / "metadata"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable checkpoint metadata ({e})") from None


def _is_step_dir(path: Path) -> bool:
    return path.is_dir() and (path / META_ITEM).is_dir() and (path / "commit_success.txt").exists()


def latest_step_dir(root: str | os.PathLike) -> Path | None:
    """The highest-numbered complete step of a trainer checkpoint root (or ``root/checkpoints``).

    Orbax writes a step under a temporary name and renames it when every item is committed, so
    an interrupted save never shows up here.
    """
    for base in (Path(root), Path(root) / "checkpoints"):
        if not base.is_dir():
            continue
        steps = [p for p in base.iterdir() if re.fullmatch(r"\d+", p.name) and _is_step_dir(p)]
        if steps:
            return max(steps, key=lambda p: int(p.name))
    return None


def model_in_step(step_dir: Path, role: str) -> ModelDef:
    models = _read_json_item(step_dir, META_ITEM).get("models", {})
    if role not in models:
        raise ValueError(f"{step_dir}: no {role!r} model in this checkpoint (has {sorted(models)})")
    entry = models[role]
    return ModelDef(ModelConfig.from_json(json.dumps(entry["config"])), entry.get("head", "lm"))


def load_model(
    directory: str | os.PathLike, mesh: Mesh, rules: Rules | str, role: str = "actor"
) -> tuple[ModelDef, Params]:
    """Restore a model checkpoint, or ``role`` from a trainer run's latest complete step, onto
    ``mesh`` (any mesh: the restore target carries the new shardings)."""
    directory = Path(directory)
    if (directory / MODEL_JSON).exists():
        model = read_model_json(directory)
        return model, restore_params(directory / PARAMS_DIR, model, mesh, rules)
    step_dir = directory if _is_step_dir(directory) else latest_step_dir(directory)
    if step_dir is None:
        if not directory.exists():
            raise FileNotFoundError(f"{directory}: checkpoint directory does not exist")
        raise FileNotFoundError(
            f"{directory}: neither a model checkpoint ({MODEL_JSON}) nor a trainer checkpoint "
            "with a complete step"
        )
    model = model_in_step(step_dir, role)
    return model, restore_params(step_dir / f"{role}_params", model, mesh, rules)
