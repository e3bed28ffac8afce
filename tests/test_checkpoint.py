"""jrlhf.checkpoint: the trainer checkpoint written, listed, resumed and loaded onto another mesh,
and the model checkpoint layout."""

import json

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jrlhf import checkpoint
from jrlhf.meshes import make_mesh
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef


@flax.struct.dataclass
class State:
    """Stands for runtime.steps.TrainState: the fields the checkpoint layout reads."""

    step: jax.Array
    params: dict
    opt_state: dict


@pytest.fixture(scope="module")
def model():
    return ModelDef(tiny_config(vocab_size=32, num_layers=1), "lm")


def _state(model, mesh, seed):
    params = model.init_sharded(mesh, "fsdp_tp", seed=seed)
    opt = {"mu": jax.tree.map(jnp.zeros_like, params), "count": jnp.int32(seed)}
    return State(jnp.int32(seed), params, opt)


def _assert_tree_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_trainer_checkpoint_round_trip(tmp_path, model):
    mesh = make_mesh("fsdp=4,tensor=2")
    manager = checkpoint.trainer_checkpoint_manager(tmp_path, max_to_keep=2, async_save=True)
    states = {}
    for step in (1, 2, 3):
        states[step] = _state(model, mesh, step)
        meta = {"iteration": step, "loader": {"epoch": 0, "index": 4 * step, "seed": 0}}
        checkpoint.save_trainer_state(
            manager, step, meta, {"actor": states[step]}, {"actor": model}
        )
    manager.wait_until_finished()
    assert manager.all_steps() == [2, 3]  # max_to_keep

    # A save cut off mid-write (Orbax's temporary name) is never a step.
    (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-9" / "actor_params").mkdir(parents=True)
    step_dir = checkpoint.latest_step_dir(tmp_path)
    assert step_dir == tmp_path / "checkpoints" / "3"
    assert checkpoint.latest_step_dir(tmp_path / "checkpoints") == step_dir

    # Resume onto another layout: the restored state lands on the target's shardings.
    other = make_mesh("fsdp=2,tensor=2@4:8")
    shardings = State(
        jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec()),
        model.shardings(other, "fsdp_tp"),
        {
            "mu": model.shardings(other, "fsdp_tp"),
            "count": jax.sharding.NamedSharding(other, jax.sharding.PartitionSpec()),
        },
    )
    targets = {"actor": checkpoint.restore_target(states[3], shardings)}
    fresh = checkpoint.trainer_checkpoint_manager(tmp_path, max_to_keep=2, async_save=False)
    meta, restored = checkpoint.restore_trainer_state(fresh, targets)
    assert meta["iteration"] == 3 and meta["loader"]["index"] == 12
    assert meta["models"]["actor"] == checkpoint.model_entry(model)
    assert isinstance(restored["actor"], State)
    _assert_tree_equal(restored["actor"], states[3])
    q = restored["actor"].params["layers"]["attn"]["q_kernel"]
    assert {d.id for d in q.sharding.device_set} == {4, 5, 6, 7}

    # load_model reads a role from the latest step, a given step, or a run directory.
    loaded_model, params = checkpoint.load_model(tmp_path, other, "dp_tp")
    assert loaded_model == model
    _assert_tree_equal(params, states[3].params)
    _, params = checkpoint.load_model(tmp_path / "checkpoints" / "2", other, "dp_tp")
    _assert_tree_equal(params, states[2].params)
    assert checkpoint.read_trainer_meta(tmp_path / "checkpoints" / "2")["iteration"] == 2
    with pytest.raises(ValueError, match=r"step 3 has no 'critic' model \(it has \['actor'\]\)"):
        checkpoint.load_model(tmp_path, other, "dp_tp", role="critic")


def test_no_trainer_checkpoint(tmp_path, model):
    empty = checkpoint.trainer_checkpoint_manager(tmp_path / "run", max_to_keep=1, async_save=False)
    assert checkpoint.restore_trainer_state(empty, {}) is None
    assert checkpoint.latest_step_dir(tmp_path / "run") is None
    assert checkpoint.latest_step_dir(tmp_path / "missing") is None
    # Steps of some other Orbax manager (no meta item) are not trainer steps.
    with ocp.CheckpointManager((tmp_path / "other").absolute()) as other:
        other.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"x": jnp.ones(2)})))
    assert checkpoint.latest_step_dir(tmp_path / "other") is None
    mesh = make_mesh("fsdp=1")
    with pytest.raises(FileNotFoundError, match="neither a model checkpoint"):
        checkpoint.load_model(tmp_path / "other", mesh, "fsdp_tp")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load_model(tmp_path / "missing", mesh, "fsdp_tp")
    with pytest.raises(FileNotFoundError, match="no trainer checkpoint"):
        checkpoint.read_trainer_meta(tmp_path / "other" / "1")


def test_model_checkpoint_layout(tmp_path, model):
    mesh = make_mesh("fsdp=4,tensor=2")
    params = model.init_sharded(mesh, "fsdp_tp", seed=5)
    out = checkpoint.save_model(tmp_path / "m", model, params)
    assert sorted(p.name for p in out.iterdir()) == [checkpoint.MODEL_JSON, checkpoint.PARAMS_DIR]
    stored = json.loads((out / checkpoint.MODEL_JSON).read_text())
    assert stored == checkpoint.model_entry(model)
    loaded_model, loaded = checkpoint.load_model(out, make_mesh("data=2@2:4"), "dp_tp")
    assert loaded_model == model
    _assert_tree_equal(loaded, params)
    with pytest.raises(FileExistsError, match="not empty"):
        checkpoint.save_model(out, model, params)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / checkpoint.MODEL_JSON).write_text("{}")
    with pytest.raises(ValueError, match=r"model\.json: malformed model description"):
        checkpoint.read_model_json(tmp_path / "bad")


def test_a_step_with_a_non_finite_value_is_passed_over(tmp_path):
    """restore_newest_intact takes the newest step whose values are all finite, whatever meshes
    its leaves sit on (checked one device set at a time), and keeps the bad step on disk."""
    meshes = make_mesh("fsdp=4@0:4"), make_mesh("fsdp=4@4:8")
    spec = jax.sharding.PartitionSpec("fsdp")

    def tree(bad: bool):
        x = np.arange(8, dtype=np.float32)
        y = np.ones((4, 2), np.float32)
        if bad:
            y[3, 1] = np.nan
        return {
            "a": jax.device_put(x, jax.sharding.NamedSharding(meshes[0], spec)),
            "b": jax.device_put(y, jax.sharding.NamedSharding(meshes[1], spec)),
            "step": jnp.int32(0),  # not a float: not checked
        }

    trees = {1: tree(False), 2: tree(True)}
    manager = ocp.CheckpointManager(tmp_path)
    for step, value in trees.items():
        manager.save(step, args=ocp.args.StandardSave(value))
    manager.wait_until_finished()
    step, value = checkpoint.restore_newest_intact(manager, trees.get, "test")
    assert step == 1 and value is trees[1]
    assert sorted(manager.all_steps()) == [1, 2]
