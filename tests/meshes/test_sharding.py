"""Meshes and rule sets: same logits on every layout, shardings exactly as the rules say."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import VOCAB, hf_checkpoint
from jax.sharding import PartitionSpec as P

from jrlhf.meshes import MeshSpec, get_rules, make_mesh
from jrlhf.models import ModelDef, hf, tiny_config

LAYOUTS = [
    ("fsdp=8", "fsdp_tp"),
    ("data=2,tensor=4", "dp_tp"),
    ("fsdp=2,tensor=4", "fsdp_tp"),
    ("fsdp=2,tensor=2@4:8", "fsdp_tp"),
]


def test_same_logits_on_every_mesh():
    path = hf_checkpoint("llama3")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (8, 24)))
    model, params = hf.load_hf(path, make_mesh("fsdp=1"), "fsdp_tp")
    reference = np.asarray(jax.jit(model.apply)(params, tokens))
    for spec, rules in LAYOUTS:
        mesh = make_mesh(spec)
        _, sharded = hf.load_hf(path, mesh, rules)
        devices = {d.id for leaf in jax.tree.leaves(sharded) for d in leaf.sharding.device_set}
        assert devices == {d.id for d in mesh.devices.flat}, spec
        out = np.asarray(jax.jit(model.apply)(sharded, tokens))
        assert np.abs(out - reference).max() < 1e-5, spec


# Hand-written expectations for tiny_config (vocab 256, embed 64, 4 heads, 2 kv heads, mlp 128).
GOLDEN = {
    ("fsdp=2,tensor=2", "fsdp_tp"): {
        "embedding": P("tensor", "fsdp"),
        "lm_head": P("fsdp", "tensor"),
        "final_norm/scale": P(None),
        "layers/input_norm/scale": P(None, None),
        "layers/post_attn_norm/scale": P(None, None),
        "layers/attn/q_kernel": P(None, "fsdp", "tensor", None),
        "layers/attn/k_kernel": P(None, "fsdp", "tensor", None),
        "layers/attn/v_kernel": P(None, "fsdp", "tensor", None),
        "layers/attn/o_kernel": P(None, "tensor", None, "fsdp"),
        "layers/mlp/gate_kernel": P(None, "fsdp", "tensor"),
        "layers/mlp/up_kernel": P(None, "fsdp", "tensor"),
        "layers/mlp/down_kernel": P(None, "tensor", "fsdp"),
    },
    ("data=4,tensor=2", "dp_tp"): {
        "embedding": P("tensor", None),
        "lm_head": P(None, "tensor"),
        "final_norm/scale": P(None),
        "layers/input_norm/scale": P(None, None),
        "layers/post_attn_norm/scale": P(None, None),
        "layers/attn/q_kernel": P(None, None, "tensor", None),
        "layers/attn/k_kernel": P(None, None, "tensor", None),
        "layers/attn/v_kernel": P(None, None, "tensor", None),
        "layers/attn/o_kernel": P(None, "tensor", None, None),
        "layers/mlp/gate_kernel": P(None, None, "tensor"),
        "layers/mlp/up_kernel": P(None, None, "tensor"),
        "layers/mlp/down_kernel": P(None, "tensor", None),
    },
    ("fsdp=8", "fsdp_tp"): {
        "embedding": P(None, "fsdp"),
        "lm_head": P("fsdp", None),
        "final_norm/scale": P(None),
        "layers/input_norm/scale": P(None, None),
        "layers/post_attn_norm/scale": P(None, None),
        "layers/attn/q_kernel": P(None, "fsdp", None, None),
        "layers/attn/k_kernel": P(None, "fsdp", None, None),
        "layers/attn/v_kernel": P(None, "fsdp", None, None),
        "layers/attn/o_kernel": P(None, None, None, "fsdp"),
        "layers/mlp/gate_kernel": P(None, "fsdp", None),
        "layers/mlp/up_kernel": P(None, "fsdp", None),
        "layers/mlp/down_kernel": P(None, None, "fsdp"),
    },
}


def _flat(tree):
    return {
        "/".join(str(k.key) for k in path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.mark.parametrize("layout", sorted(GOLDEN))
def test_golden_sharding_table(layout):
    spec, rules = layout
    mesh = make_mesh(spec)
    model = ModelDef(tiny_config())
    params = model.init_sharded(mesh, rules, seed=0)
    actual = {name: leaf.sharding.spec for name, leaf in _flat(params).items()}
    assert actual == GOLDEN[layout]
    # Created directly sharded: each device holds only its piece of a sharded parameter.
    q = params["layers"]["attn"]["q_kernel"]
    shard_shape = q.addressable_shards[0].data.shape
    assert np.prod(shard_shape) * len(mesh.devices.flat) >= q.size
    if "tensor" in mesh.shape:
        assert shard_shape[2] == q.shape[2] // mesh.shape["tensor"]


def test_value_head_shardings():
    model = ModelDef(tiny_config(), head="value")
    shardings = _flat(model.shardings(make_mesh("fsdp=2,tensor=2"), "fsdp_tp"))
    assert shardings["value_head"].spec == P("fsdp", None)
    assert "lm_head" not in shardings


def test_mesh_errors_are_one_line():
    with pytest.raises(ValueError, match=r"needs device ids 0\.\.15 but only 8 devices exist"):
        make_mesh("data=4,tensor=4")
    with pytest.raises(ValueError, match="multiply to 4 but the slice has 2 devices"):
        make_mesh("data=2,tensor=2@0:2")
    with pytest.raises(ValueError, match="cannot parse axis"):
        MeshSpec.parse("data:2")
    with pytest.raises(ValueError, match="unknown rule set 'fsdp_pp'"):
        get_rules("fsdp_pp")


def test_indivisible_dimension_names_parameter_shape_and_axis():
    model = ModelDef(tiny_config(num_kv_heads=2))
    with pytest.raises(ValueError) as err:
        model.shardings(make_mesh("tensor=4"), "fsdp_tp")
    msg = str(err.value)
    assert "layers/attn/k_kernel" in msg and "(2, 64, 2, 16)" in msg and "'tensor'" in msg
    assert "\n" not in msg


def test_partitioned_devices_are_disjoint():
    a = make_mesh("fsdp=4@0:4")
    b = make_mesh("data=2,tensor=2@4:8")
    assert not set(a.devices.flat) & set(b.devices.flat)
    model = ModelDef(tiny_config())
    pa = model.init_sharded(a, "fsdp_tp", seed=3)
    pb = model.init_sharded(b, "dp_tp", seed=3)
    chex.assert_trees_all_equal(pa, pb)
