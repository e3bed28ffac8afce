"""Orbax model checkpoints that restore onto any mesh.

A model checkpoint directory holds ``model.json`` (the ModelConfig and head) and ``params/`` (an
Orbax tree). Restoring builds the abstract parameter tree with the *target* mesh's shardings and
hands it to Orbax as the restore target, so each device reads only its own shard, whatever mesh
the checkpoint was written from. Trainer checkpoints (jrlhf.train) keep one such model directory
per role inside each step directory, so ``load_model`` also accepts a run's checkpoint root.
"""

from __future__ import annotations

import json
import os
import re
import shutil
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


def latest_step_dir(root: str | os.PathLike) -> Path | None:
    """The highest-numbered complete step directory under a trainer checkpoint root."""
    steps = (
        [p for p in Path(root).iterdir() if p.is_dir() and re.fullmatch(r"\d+", p.name)]
        if Path(root).is_dir()
        else []
    )
    for step_dir in sorted(steps, key=lambda p: int(p.name), reverse=True):
        if any(Path(step_dir, name, MODEL_JSON).exists() for name in os.listdir(step_dir)):
            return step_dir
    return None


def resolve_model_dir(directory: str | os.PathLike, role: str = "actor") -> Path:
    """A model checkpoint directory, or the ``role`` model of a trainer checkpoint's latest step."""
    directory = Path(directory)
    if (directory / MODEL_JSON).exists():
        return directory
    if (directory / role / MODEL_JSON).exists():
        return directory / role
    step = latest_step_dir(directory)
    if step is not None and (step / role / MODEL_JSON).exists():
        return step / role
    if not directory.exists():
        raise FileNotFoundError(f"{directory}: checkpoint directory does not exist")
    raise FileNotFoundError(
        f"{directory}: no {MODEL_JSON} here, in {role}/, or in a step directory's {role}/"
    )


def load_model(
    directory: str | os.PathLike, mesh: Mesh, rules: Rules | str, role: str = "actor"
) -> tuple[ModelDef, Params]:
    """Restore a model checkpoint (or a trainer checkpoint's ``role``) sharded onto ``mesh``."""
    model_dir = resolve_model_dir(directory, role)
    model = read_model_json(model_dir)
    return model, restore_params(model_dir / PARAMS_DIR, model, mesh, rules)


def remove_incomplete(directory: str | os.PathLike) -> None:
    """Delete a model directory that lacks model.json (an interrupted save)."""
    directory = Path(directory)
    if directory.exists() and not (directory / MODEL_JSON).exists():
        shutil.rmtree(directory)
