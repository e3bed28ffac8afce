"""jrlhf.reshard: cached transitions, zero-redundancy layouts, memory plan, host parking."""

import contextlib
import io
import json

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jrlhf.meshes import MeshSpec, make_mesh
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from jrlhf.reshard import (
    MemoryBudgetError,
    Resharder,
    backend_compile_count,
    bytes_moved,
    bytes_per_device,
    choose_generation_mesh,
    live_bytes,
    moved_bytes_per_device,
    naive_generation_mesh,
    park_to_host,
    restore_from_host,
)
from jrlhf.reshard.resharder import Transition, path_between

# kv_heads=4 so that every tested tensor size (1, 2, 4) divides every sharded dim.
MODEL = ModelDef(tiny_config(num_heads=8, num_kv_heads=4))


def _params(mesh, rules="fsdp_tp", seed=0):
    """Random parameters put straight into their shardings (no init compile: tests stay fast)."""
    rng = np.random.default_rng(seed)
    values = jax.tree.map(
        lambda a: rng.standard_normal(a.shape).astype(a.dtype), MODEL.abstract_params
    )
    return jax.device_put(values, MODEL.shardings(mesh, rules))


def _sh(spec: str, pspec) -> NamedSharding:
    return NamedSharding(make_mesh(spec), pspec)


def _brute_force_moved(src, dst, shape, itemsize) -> int:
    """Element ownership masks per device; count target elements a device did not hold."""

    def masks(s):
        out = {}
        for d, idx in s.devices_indices_map(shape).items():
            m = np.zeros(shape, bool)
            m[idx] = True
            out[d] = m
        return out

    have, want = masks(src), masks(dst)
    none = np.zeros(shape, bool)
    return int(sum((m & ~have.get(d, none)).sum() for d, m in want.items())) * itemsize


@pytest.mark.parametrize(
    "src,dst,shape",
    [
        (("fsdp=4,tensor=2", P("fsdp", "tensor")), ("data=4,tensor=2", P(None, "tensor")), (8, 4)),
        (("fsdp=4,tensor=2", P("fsdp", "tensor")), ("data=2,tensor=4", P(None, "tensor")), (8, 8)),
        (
            ("fsdp=2,tensor=4", P("tensor", "fsdp")),
            ("data=4,tensor=2@0,2,1,3,4,6,5,7", P("tensor", None)),
            (8, 6),
        ),
        (
            ("fsdp=8", P(None, "fsdp", None)),
            ("data=2,tensor=4", P(None, None, "tensor")),
            (3, 8, 4),
        ),
        (
            ("fsdp=2,tensor=2@0:4", P("fsdp", "tensor")),
            ("data=2,tensor=2@4:8", P(None, "tensor")),
            (4, 4),
        ),
        (("fsdp=2,tensor=2@0:4", P("fsdp", "tensor")), ("tensor=2@2,3", P("tensor")), (6, 2)),
        (("data=2,tensor=4", P(None, "tensor")), ("fsdp=8", P("fsdp")), (16, 4)),
    ],
)
def test_bytes_moved_matches_element_ownership(src, dst, shape):
    s, d = _sh(*src), _sh(*dst)
    per_device = moved_bytes_per_device(s, d, shape, np.float32)
    assert sum(per_device.values()) == _brute_force_moved(s, d, shape, 4)
    tree = {"w": jax.ShapeDtypeStruct(shape, np.float32)}
    assert bytes_moved({"w": s}, {"w": d}, tree) == _brute_force_moved(s, d, shape, 4)


CHOOSER_CASES = [
    ("fsdp=4,tensor=2", 2),
    ("fsdp=4,tensor=2", 1),
    ("fsdp=4,tensor=2", 4),
    ("fsdp=2,tensor=4", 2),
    ("fsdp=2,tensor=4", 1),
    ("fsdp=8", 4),
    ("fsdp=8", 2),
    ("fsdp=2,tensor=2@4:8", 1),
]


def test_chooser_moves_no_more_than_naive_order():
    rows = []
    for train, gen_tensor in CHOOSER_CASES:
        spec = MeshSpec.parse(train)
        chosen, naive = (
            choose_generation_mesh(spec, gen_tensor),
            naive_generation_mesh(spec, gen_tensor),
        )
        assert sorted(chosen.device_ids()) == sorted(spec.device_ids())
        assert chosen.shape == {"data": spec.size // gen_tensor, "tensor": gen_tensor}
        train_sh = MODEL.shardings(make_mesh(spec), "fsdp_tp")
        b_chosen = bytes_moved(
            train_sh, MODEL.shardings(make_mesh(chosen), "dp_tp"), MODEL.abstract_params
        )
        b_naive = bytes_moved(
            train_sh, MODEL.shardings(make_mesh(naive), "dp_tp"), MODEL.abstract_params
        )
        rows.append((train, str(chosen), b_chosen, b_naive))
        assert b_chosen <= b_naive, (train, gen_tensor, b_chosen, b_naive)
        t_train = spec.shape.get("tensor", 1)
        if t_train % gen_tensor == 0:
            # Zero redundancy: every generation shard contains the training shard, so going back
            # to training is a local slice with nothing crossing devices.
            gen_sh = MODEL.shardings(make_mesh(chosen), "dp_tp")
            assert bytes_moved(gen_sh, train_sh, MODEL.abstract_params) == 0
    print("\ntrain -> gen (chosen order) | bytes chosen | bytes naive")
    for r in rows:
        print(f"{r[0]} -> {r[1]} | {r[2]} | {r[3]}")
    assert any(c < n for _, _, c, n in rows)


def test_chooser_is_hybridflow_stride():
    chosen = choose_generation_mesh(MeshSpec.parse("fsdp=2,tensor=4"), 2)
    # Training tensor index i = device % 4; generation tensor index must be i // 2.
    assert chosen.device_ids() == (0, 2, 1, 3, 4, 6, 5, 7)
    with pytest.raises(ValueError, match="does not divide"):
        choose_generation_mesh(MeshSpec.parse("fsdp=2,tensor=4"), 3)


def _assert_same(a, b):
    chex.assert_trees_all_equal(a, b)


def _round_trips(train_spec, gen_spec, n_round_trips=5, donate=True):
    train_mesh, gen_mesh = make_mesh(train_spec), make_mesh(gen_spec)
    train_sh, gen_sh = MODEL.shardings(train_mesh, "fsdp_tp"), MODEL.shardings(gen_mesh, "dp_tp")
    params = _params(train_mesh, seed=3)
    reference = jax.device_get(params)
    resharder = Resharder()
    events_after_first = None
    for k in range(n_round_trips):
        gen = resharder(params, gen_sh, donate=donate)
        for leaf, want in zip(jax.tree.leaves(gen), jax.tree.leaves(gen_sh), strict=True):
            assert leaf.sharding == want
        _assert_same(reference, gen)
        params = resharder(gen, train_sh, donate=donate)
        if k == 0:
            events_after_first = backend_compile_count()
    for leaf, want in zip(jax.tree.leaves(params), jax.tree.leaves(train_sh), strict=True):
        assert leaf.sharding == want
    _assert_same(reference, params)
    assert backend_compile_count() == events_after_first, "a later transition compiled"
    assert len(resharder.transitions) == 2
    for t in resharder.transitions:
        assert t.compiles == 1 and t.runs == n_round_trips
    assert resharder.compile_count == 2
    return resharder


def test_same_devices_round_trips_are_bit_identical_and_compile_once():
    train = MeshSpec.parse("fsdp=2,tensor=4")
    resharder = _round_trips(train, choose_generation_mesh(train, 2))
    assert {t.path for t in resharder.transitions} == {"jit"}


def test_same_devices_naive_order_round_trips():
    _round_trips(
        MeshSpec.parse("fsdp=4,tensor=2"), MeshSpec.parse("data=2,tensor=4"), 2, donate=False
    )


def test_disjoint_devices_round_trips():
    resharder = _round_trips(
        MeshSpec.parse("fsdp=2,tensor=2@0:4"), MeshSpec.parse("data=2,tensor=2@4:8"), 5
    )
    assert {t.path for t in resharder.transitions} == {"device_put+jit"}
    # Nothing the target devices need is already there: every target byte crosses.
    for t in resharder.transitions:
        assert t.bytes_moved == sum(bytes_per_device(t.dst, t.avals).values())


@pytest.mark.parametrize(
    "train, gen, out_path, back_path",
    [
        ("fsdp=2,tensor=2@0:4", "data=1,tensor=2@4:6", "stack+device_put", "device_put+stack"),
        ("fsdp=2@0:2", "data=2,tensor=2@4:8", "device_put+stack", "stack+device_put"),
    ],
)
def test_disjoint_devices_of_different_counts_round_trip(train, gen, out_path, back_path):
    """Training on 4 devices and generation on 2 others (or 2 and 4): the larger side lays the
    layout out stacked, and every transfer is shard for shard (what JAX can do between
    processes); values exact, each direction compiled once, the bytes what crosses."""
    resharder = _round_trips(MeshSpec.parse(train), MeshSpec.parse(gen), 3)
    paths = [t.path for t in resharder.transitions]
    assert paths == [out_path, back_path]
    for t in resharder.transitions:
        dst = sum(bytes_per_device(t.dst, t.avals).values())
        src = sum(bytes_per_device(t.src, t.avals).values())
        if t.path == "stack+device_put":  # every target slice crosses once
            assert t.bytes_moved == dst
        else:  # the source layout once per group of target devices
            assert t.bytes_moved == src * (len(t.dst[0].device_set) // len(t.src[0].device_set))


def test_onto_some_of_the_source_devices_takes_the_stack_path():
    """A migration's tail: from a mesh onto a replica submesh of it (devices 2, 3, 6, 7 of 8).
    The target layout is laid out twice over the source devices, its first copy on the
    target's, and those shards become the target array: no transfer JAX refuses between
    processes; values exact, compiled once, the bytes those the target lacks."""
    src = make_mesh(MeshSpec.parse("fsdp=4,tensor=2"))
    devices = np.array(jax.devices(), dtype=object)[[2, 3, 6, 7]].reshape(2, 2)
    dst = jax.sharding.Mesh(devices, ("data", "tensor"))
    params = _params(src, seed=5)
    reference = jax.device_get(params)
    target = MODEL.shardings(dst, "dp_tp")
    resharder = Resharder()
    for _ in range(2):
        out = resharder(params, target)
        for leaf, want in zip(jax.tree.leaves(out), jax.tree.leaves(target), strict=True):
            assert leaf.sharding == want
        _assert_same(reference, out)
    (t,) = resharder.transitions
    assert t.path == "stack" and t.compiles == 1 and t.runs == 2
    assert 0 < t.bytes_moved <= sum(bytes_per_device(t.dst, t.avals).values())


def test_disjoint_devices_whose_counts_do_not_divide_take_jax_device_put_in_one_process():
    train, gen = make_mesh(MeshSpec.parse("fsdp=2@0:2")), make_mesh(MeshSpec.parse("tensor=3@2:5"))
    x = jax.device_put(np.zeros((6, 6), np.float32), NamedSharding(train, P("fsdp")))
    t = Resharder().plan(x, NamedSharding(gen, P(None, "tensor")))
    assert t.path == "device_put"  # one process: JAX's own device_put does it


def test_counts_that_do_not_divide_relay_between_processes(monkeypatch):
    """Training on 2 devices and generation on 3 others, as if each side were processes of its
    own (JAX then copies shard for shard only): the tree goes through a relay layout on
    gcd(2, 3) = 1 device of the source, both ways; values exact, each leg compiled once and
    never again, the bytes those its two legs move (tests/e2e/test_multiprocess.py runs it
    between real processes)."""
    monkeypatch.setattr(Transition, "_crosses_processes", lambda self: True)
    train, gen = make_mesh(MeshSpec.parse("fsdp=2@0:2")), make_mesh(MeshSpec.parse("data=3@2:5"))
    train_sh, gen_sh = MODEL.shardings(train, "fsdp_tp"), MODEL.shardings(gen, "dp_tp")
    params = _params(train, seed=4)
    reference = jax.device_get(params)
    resharder = Resharder()
    for _ in range(2):
        out = resharder(params, gen_sh, donate=True)
        assert jax.tree.leaves(out)[0].sharding == jax.tree.leaves(gen_sh)[0]
        _assert_same(reference, out)
        params = resharder(out, train_sh, donate=True)
        _assert_same(reference, params)
    for t in resharder.transitions:
        assert t.path == "relay" and t.runs == 2 and t.compiles == 2  # one per leg
        assert [leg.path for leg in t._legs] == ["stack", "device_put+stack"]
        assert t.bytes_moved == sum(leg.bytes_moved for leg in t._legs)
        assert t.memory_report()["peak_bytes"] > 0
    # the relay device holds the whole tree; the target gets it once per device of its own
    there, back = resharder.transitions
    tree = sum(a.size * a.dtype.itemsize for a in there.avals)
    assert there._legs[1].bytes_moved == 3 * tree and back._legs[1].bytes_moved == 2 * tree


def test_bfloat16_parameters_reshard_on_both_paths():
    """bfloat16 trees (``RoleConfig.param_dtype='bfloat16'``) plan, compile and move like
    float32 ones: the transition key keeps the dtype by name (its array-protocol string is a
    void type)."""
    train_mesh = make_mesh("fsdp=2,tensor=2@0:4")
    params = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), _params(train_mesh, seed=5))
    reference = jax.device_get(params)
    for gen_spec in ("data=2,tensor=2@0:4", "data=2,tensor=2@4:8"):
        gen_sh = MODEL.shardings(make_mesh(gen_spec), "dp_tp")
        gen = Resharder()(params, gen_sh, donate=False)
        for leaf in jax.tree.leaves(gen):
            assert leaf.dtype == jax.numpy.bfloat16
        chex.assert_trees_all_equal(jax.device_get(gen), reference)


def test_donate_consumes_source_and_keep_does_not():
    mesh = make_mesh("fsdp=4,tensor=2")
    gen_sh = MODEL.shardings(make_mesh("data=4,tensor=2"), "dp_tp")
    params = _params(mesh)
    resharder = Resharder()
    out, kept = resharder.switch(params, gen_sh, keep="device")
    assert kept is params and not any(x.is_deleted() for x in jax.tree.leaves(params))
    _assert_same(params, out)
    out2, kept = resharder.switch(params, gen_sh, keep="none")
    assert kept is None and all(x.is_deleted() for x in jax.tree.leaves(params))
    _assert_same(out, out2)
    with pytest.raises(ValueError, match="keep="):
        resharder.switch(out2, gen_sh, keep="disk")


def test_same_layout_is_an_alias_that_copies_nothing():
    """fsdp=1,tensor=4 under fsdp_tp and data=1,tensor=4 under dp_tp put the same slice of every
    parameter on the same device: the transition compiles nothing, moves nothing, takes no
    memory of its own, and returns the source's own buffers under the target shardings. A step
    that donates the source then deletes the alias too (the trainer rebuilds it after every
    update); ``switch(keep="host")``, which frees the source, copies instead."""
    params = _params(make_mesh("fsdp=1,tensor=4@0:4"), seed=4)
    reference = jax.device_get(params)
    gen_sh = MODEL.shardings(make_mesh("data=1,tensor=4@0:4"), "dp_tp")
    assert jax.tree.leaves(gen_sh) != [x.sharding for x in jax.tree.leaves(params)]
    resharder = Resharder()
    before = backend_compile_count()
    for donate in (False, True):
        transition = resharder.plan(params, gen_sh, donate=donate)
        assert transition.path == "alias" and transition.compiles == 0
        assert transition.bytes_moved == 0
        report = transition.memory_report()
        assert report["peak_bytes"] == report["source_bytes_per_device"] > 0
        out = transition.run(params)
        assert not any(x.is_deleted() for x in jax.tree.leaves(params))
        for x, y, s in zip(jax.tree.leaves(params), jax.tree.leaves(out), jax.tree.leaves(gen_sh)):
            assert y.sharding == s
            for a, b in zip(x.addressable_shards, y.addressable_shards, strict=True):
                assert a.data.unsafe_buffer_pointer() == b.data.unsafe_buffer_pointer()
        _assert_same(reference, out)
    assert backend_compile_count() == before
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 2, t), donate_argnums=0)
    # fresh parameters: the ones above were read on the host, and NumPy views pin the buffers
    fresh = _params(make_mesh("fsdp=1,tensor=4@0:4"), seed=4)
    alias = resharder(fresh, gen_sh)
    new = step(fresh)
    assert all(x.is_deleted() for x in jax.tree.leaves(alias))
    out, parked = resharder.switch(new, gen_sh, keep="host")
    assert all(x.is_deleted() for x in jax.tree.leaves(new))
    _assert_same(jax.tree.map(lambda x: x * 2, reference), out)
    _assert_same(jax.device_get(out), restore_from_host(parked))
    # an alias is never made between different layouts
    assert Resharder().plan(out, MODEL.shardings(make_mesh("fsdp=4@0:4"), "fsdp_tp")).path == "jit"


def test_run_rejects_a_tree_with_other_shardings():
    params = _params(make_mesh("fsdp=4,tensor=2"))
    other = _params(make_mesh("fsdp=8"))
    plan = Resharder().plan(params, MODEL.shardings(make_mesh("data=4,tensor=2"), "dp_tp"))
    with pytest.raises(ValueError, match="does not match the planned source"):
        plan.run(other)


def test_host_parking_frees_device_memory_and_restores():
    mesh = make_mesh("fsdp=4,tensor=2")
    params = _params(mesh, seed=1)
    reference = jax.device_get(params)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    # Physical bytes: replicated leaves (norms) occupy every device.
    nbytes = sum(bytes_per_device(shardings, params).values())
    before = live_bytes()
    parked = park_to_host(params)
    during = live_bytes()
    assert before - during == nbytes == parked.nbytes
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    assert parked.path in ("memory_kind:pinned_host", "memory_kind:unpinned_host", "numpy")
    restored = restore_from_host(parked)
    assert live_bytes() - during == nbytes
    _assert_same(reference, restored)
    for x, s in zip(jax.tree.leaves(restored), jax.tree.leaves(shardings), strict=True):
        assert x.sharding == s


def test_host_parking_numpy_fallback_and_clear_error(monkeypatch):
    import jrlhf.reshard.memory as memory

    monkeypatch.setattr(memory, "host_memory_kind", lambda device=None: None)
    params = _params(make_mesh("fsdp=8"))
    reference = jax.device_get(params)
    with pytest.raises(RuntimeError, match="no host memory kind"):
        memory.park_to_host(params, allow_numpy_fallback=False)
    parked = memory.park_to_host(params)
    assert parked.path == "numpy" and all(x.is_deleted() for x in jax.tree.leaves(params))
    _assert_same(reference, memory.restore_from_host(parked))


def test_memory_plan_reports_peak_and_enforces_budget():
    params = _params(make_mesh("fsdp=2,tensor=4"))
    gen_sh = MODEL.shardings(
        make_mesh(choose_generation_mesh(MeshSpec.parse("fsdp=2,tensor=4"), 2)), "dp_tp"
    )
    plan = Resharder().plan(params, gen_sh, donate=True)
    report = plan.memory_report()
    assert report["method"] in ("xla_memory_analysis", "shardings")
    # Source and target both live on every device during the move.
    assert (
        report["peak_bytes"]
        >= report["source_bytes_per_device"] + report["target_bytes_per_device"]
    )
    budget = report["peak_bytes"] - 1
    with pytest.raises(MemoryBudgetError, match=r"needs .* MiB per device at peak .* budget"):
        Resharder(budget_bytes=budget)(params, gen_sh, donate=True)
    assert not any(x.is_deleted() for x in jax.tree.leaves(params)), "refused before running"
    reference = jax.device_get(params)
    out = Resharder(budget_bytes=report["peak_bytes"])(params, gen_sh, donate=True)
    _assert_same(reference, out)


def test_benchmark_prints_json():
    buf = io.StringIO()
    from benchmarks import reshard as bench

    argv = ["--vocab", "256", "--hidden", "64", "--intermediate", "128", "--layers", "2"]
    with contextlib.redirect_stdout(buf):
        assert bench.main([*argv, "--repeats", "1"]) == 0
    result = json.loads(buf.getvalue())
    assert result["bit_identical_after_round_trips"] is True
    assert result["compiles"]["backend_events_during_timed_runs"] == 0
    b = result["bytes_moved"]
    assert b["to_gen_chosen"] < b["to_gen_naive"] and b["to_train_chosen"] == 0
    assert (
        result["host_parking"]["live_device_bytes_parked"]
        < result["host_parking"]["live_device_bytes_before"]
    )


@pytest.mark.parametrize(
    "src,dst,crosses,path",
    [
        (range(8), range(8), False, "jit"),
        (range(4), range(4, 8), True, "device_put+jit"),
        (range(8), range(4), True, "stack"),  # a part of the source whose count divides it
        (range(8), range(3), True, "device_put"),  # a part whose count does not: refused
        (range(8), range(4, 10), True, "device_put"),  # sharing some devices: refused
        (range(4), range(4, 6), True, "stack+device_put"),
        (range(2), range(2, 6), True, "device_put+stack"),
        (range(3), range(3, 5), True, "relay"),
        (range(3), range(3, 5), False, "device_put"),  # in one process device_put moves less
    ],
)
def test_the_path_between_device_sets_is_chosen_by_their_overlap_and_counts(
    src, dst, crosses, path
):
    # The one rule the resharder, the plan's start-up check (roles._check_edge) and the
    # estimator's reshard prices ask.
    assert path_between(frozenset(src), frozenset(dst), crosses) == path
