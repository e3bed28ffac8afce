"""The trainer's memory knobs (Memory.offload, Memory.generation_copy): they move state
between device and host memory and never change a number.

Each trainer is built in this process on tiny random models (no SFT stage) and runs two PPO
iterations; a run with every knob on must give the metrics of the run without, and the device
bytes (``jrlhf.reshard.memory.live_bytes``) must drop by what the knobs move out.
"""

import math
import re

import chex
import jax
import numpy as np
import pytest
from run_helpers import ROOT

from jrlhf.config import ConfigError, load_config
from jrlhf.data import PromptLoader
from jrlhf.pipeline.task_data import build_task_data
from jrlhf.placement import effective_plan
from jrlhf.ppo.trainer import RLTrainer
from jrlhf.reshard.layout import bytes_per_device
from jrlhf.reshard.memory import host_memory_kind, live_bytes
from jrlhf.runtime.model_source import resolve_model, role_models
from jrlhf.runtime.roles import setup_role

ALL_KNOBS = (
    "Memory.offload=('reference', 'reward', 'actor_optimizer', 'critic_optimizer')",
    "Memory.generation_copy='dropped'",
)
TINY = (
    "RunConfig.stages=('ppo',)",
    "RunConfig.tensorboard=False",
    "TaskConfig.num_heldout=2",  # 4 samples each: an iteration's 8 rows, its programs
    "RLConfig.prompts_per_iteration=8",
    "RLConfig.minibatch_size=4",
    "RLConfig.epochs=1",
    "RLConfig.iterations=2",
    "RLConfig.async_checkpoint=False",
    # heads a tensor axis of 8 splits (the scaled-down 70B plan below generates with tensor=8)
    *(
        f"{role}/RoleConfig.model_overrides=(('num_heads', 8), ('num_kv_heads', 8))"
        for role in ("actor", "critic", "reference", "reward")
    ),
)


def build_trainer(tmp_path, *bindings, placement="flatten"):
    """An RLTrainer as jrlhf.pipeline.run builds it, and its prompt loader."""
    # "custom": the bindings say where each call runs (RunConfig.placement among them)
    where = [] if placement == "custom" else [f"RunConfig.placement='{placement}'"]
    cfg = load_config([], [*TINY, *where, *bindings])
    data = build_task_data(cfg)
    models = role_models(cfg, data.model_overrides) if placement == "search" else None
    plan = effective_plan(cfg, 8, models)
    roles = {}
    for role in ("actor", "critic", "reference", "reward"):
        source = resolve_model(cfg, role, data.model_overrides, tmp_path)
        roles[role] = setup_role(cfg, role, plan, source)
    trainer = RLTrainer(cfg, "ppo", roles, plan, data, tmp_path)
    loader = PromptLoader(data.train_records(), cfg.rl.prompts_per_iteration, seed=cfg.run.seed)
    return trainer, loader


def run_iterations(trainer, loader, n=2):
    rows = []
    for _ in range(n):
        batch = loader.next_batch()
        metrics = trainer.run_iteration([r.prompt_ids for r in batch], [r.meta for r in batch])
        # timings differ run to run; every other metric must not
        rows.append({k: v for k, v in metrics.items() if not k.startswith(("time", "tokens_per"))})
    return rows


def tree_bytes(tree) -> int:
    """Device bytes of a tree of jax.Arrays, summed over devices (what live_bytes counts)."""
    leaves = jax.tree.leaves(tree)
    return sum(bytes_per_device([x.sharding for x in leaves], leaves).values())


@pytest.fixture(scope="module")
def plain_rows(tmp_path_factory):
    trainer, loader = build_trainer(tmp_path_factory.mktemp("plain"))
    return run_iterations(trainer, loader)


@pytest.fixture(scope="module")
def knob_trainer(tmp_path_factory):
    trainer, loader = build_trainer(tmp_path_factory.mktemp("knobs"), *ALL_KNOBS)
    return trainer, loader, run_iterations(trainer, loader)


def test_knobs_leave_the_metrics_unchanged(plain_rows, knob_trainer):
    _, _, rows = knob_trainer
    assert len(rows) == len(plain_rows) == 2
    for a, b in zip(rows, plain_rows):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-6, err_msg=k)


def test_parked_state_leaves_the_devices(knob_trainer):
    """Going from the reshard phase (optimizer state on its way out, copy present) through
    the phases: live device bytes drop by exactly the bytes of what each phase parks."""
    assert host_memory_kind() is not None  # CPU has pinned_host: the memory-kind path
    trainer, _, _ = knob_trainer
    res = trainer.residency
    res.fetch_all()  # everything on device, as without knobs
    everything = live_bytes()
    opt = {r: tree_bytes(trainer.states[r].opt_state) for r in ("actor", "critic")}
    frozen = {
        "reference": tree_bytes(trainer.scorer.reference.params),
        "reward": tree_bytes(trainer.scorer.reward_model.params),
    }
    copy = tree_bytes(trainer.gen_params)

    res.enter("generate")  # frozen models and optimizer state out; the copy stays
    assert everything - live_bytes() == sum(opt.values()) + sum(frozen.values())
    assert live_bytes("pinned_host") >= sum(opt.values()) + sum(frozen.values())
    res.enter("score")  # frozen models back; the generation copy dropped
    assert everything - live_bytes() == sum(opt.values()) + copy
    res.enter("train")  # frozen models out again, optimizer state in
    assert everything - live_bytes() == sum(frozen.values()) + copy
    res.fetch_all()
    assert live_bytes() == everything
    assert set(res.parked) == set()


def test_dropped_copy_is_rebuilt_for_a_second_generation_round(knob_trainer):
    trainer, _, _ = knob_trainer
    res = trainer.residency
    res.fetch_all()
    before = jax.tree.map(np.asarray, trainer.gen_params)
    res.enter("score")
    assert "actor" not in trainer.moved
    res.enter("generate")
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, trainer.gen_params), before)


def test_knobs_follow_the_asynchronous_schedule(plain_rows, tmp_path):
    """With max_staleness=1 on one process the knobs still move state at each phase: the first
    iteration trains on batch 0 from version 0, the synchronous run's numbers, and the second
    on a one-version-old batch that was generated with the copy rebuilt."""
    trainer, loader = build_trainer(tmp_path, *ALL_KNOBS, "Asynchrony.max_staleness=1")

    def draw():
        batch = loader.next_batch()
        return [r.prompt_ids for r in batch], [r.meta for r in batch]

    rows = [trainer.run_async_iteration(draw) for _ in range(2)]
    for k, v in plain_rows[0].items():
        np.testing.assert_allclose(rows[0][k], v, rtol=1e-6, atol=1e-6, err_msg=k)
    assert rows[1]["staleness/max"] == 1 and rows[1].keys() >= plain_rows[1].keys()
    assert all(np.isfinite(v) for v in rows[1].values())


@pytest.mark.parametrize(
    "binding, message",
    [
        ("Memory.generation_copy='parked'", "Memory.generation_copy: unknown 'parked'"),
        ("Memory.offload=('ref',)", "Memory.offload: unknown item 'ref'"),
        ("Memory.offload=('reward', 'reward')", "Memory.offload: lists an item twice"),
    ],
)
def test_bad_knobs_are_refused_in_one_line(binding, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config([], [*TINY, binding])


def test_grpo_has_no_critic_optimizer_to_offload():
    bindings = [*TINY, "RunConfig.stages=('grpo',)", "RLConfig.samples_per_prompt=2"]
    with pytest.raises(ConfigError, match="GRPO trains no critic"):
        load_config([], [*bindings, "Memory.offload=('critic_optimizer',)"])


# ------------------------------------------------------- the 4 x 70B plan, scaled down to CPU
PLAN_70B = ROOT / "docs" / "plans" / "ppo_4x70b_64xh100.gin"


def scale_mesh(text: str, factor: int) -> str:
    """'fsdp=16,tensor=4@ids' on 64 devices -> the same layout on 64 / factor devices: the data
    axes shrink first, then tensor; device d becomes d // factor (whole nodes of ``factor``
    devices map to one device, in the plan's order)."""
    axes, ids = text.split("@")
    sizes = [(name, int(n)) for name, n in (a.split("=") for a in axes.split(","))]
    shrink, out = factor, {}
    for name, n in sorted(sizes, key=lambda a: a[0] == "tensor"):
        k = math.gcd(n, shrink)
        out[name], shrink = n // k, shrink // k
    assert shrink == 1, text
    new_ids = list(dict.fromkeys(int(d) // factor for d in ids.split(",")))
    assert len(new_ids) == math.prod(out.values()), text
    return ",".join(f"{name}={out[name]}" for name, _ in sizes) + "@" + ",".join(map(str, new_ids))


def scaled_plan_bindings(factor: int = 8) -> list[str]:
    """The written plan's bindings (meshes scaled down, every knob as written)."""
    out = []
    for line in PLAN_70B.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, value = (x.strip() for x in line.split("=", 1))
        if key.endswith("_mesh"):
            value = repr(scale_mesh(value.strip("'"), factor))
        out.append(f"{key}={value}")
    return out


def test_the_70b_plan_runs_scaled_down_and_matches_a_plain_run(plain_rows, tmp_path):
    """The plan `python -m jrlhf.plan` writes for four 70B models on 64 H100s (docs/multihost.md's
    command; docs/plans.md), on 8 CPU devices with tiny models: the same mesh shapes per call
    scaled by 8, the same batch and memory knobs (scoring chunk, micro-batches, remat policy,
    generation copy, offload). The trainer accepts it, and its metrics are the plain flatten
    run's (other shardings and remat change only float rounding)."""
    bindings = scaled_plan_bindings()
    knobs = [b for b in bindings if re.match(r"(\w+/)?(Memory|RoleConfig)\.(?!.*_(mesh|rules))", b)]
    assert any("remat_policy" in b for b in knobs) and any("generation_copy" in b for b in knobs)
    trainer, loader = build_trainer(tmp_path, *bindings, placement="custom")
    assert trainer.cfg.roles["actor"].generate_mesh.startswith("data=1,tensor=8@")
    rows = run_iterations(trainer, loader)
    assert len(rows) == len(plain_rows)
    for a, b in zip(rows, plain_rows):
        assert a.keys() == b.keys()
        for k in a:
            if k == "reshard/bytes":  # a property of the layouts, not of the numbers
                continue
            np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_generation_with_replicated_kv_heads_runs_in_the_trainer(plain_rows, tmp_path):
    """The 405B plans' generation layout (jrlhf.placement.candidates: query heads over a tensor
    size above the KV heads' split, KV heads replicated) in the trainer, on 8 CPU devices: it
    reshards into it and generates, and its first iteration is the plain run's.
    tests/decode/test_decode.py checks the engine with fewer KV heads than tensor shards."""
    bindings = [
        "actor/RoleConfig.generate_mesh='data=1,tensor=8'",
        "actor/RoleConfig.generate_rules='dp_tp_kv_replicated'",
    ]
    trainer, loader = build_trainer(tmp_path, *bindings, placement="custom")
    attn = trainer.gen_params["layers"]["attn"]
    assert all(axis is None for axis in attn["k_kernel"].sharding.spec)  # replicated
    assert "tensor" in attn["q_kernel"].sharding.spec
    (row,) = run_iterations(trainer, loader, n=1)
    for k, v in plain_rows[0].items():
        if k != "reshard/bytes":  # a property of the layouts
            np.testing.assert_allclose(row[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_a_generation_layout_equal_to_the_training_layout_is_not_copied(plain_rows, tmp_path):
    """The actor trains on fsdp=1 x tensor=8 (fsdp_tp) and generates on data=1 x tensor=8
    (dp_tp): the same slice of every weight on every device. The resharder aliases the training
    parameters instead of copying them; each update donates them, and the reshard after it
    hands generation the new ones. No generation copy is on the devices, and the metrics are
    the plain run's."""
    bindings = [
        "actor/RoleConfig.train_mesh='fsdp=1,tensor=8'",
        "actor/RoleConfig.generate_mesh='data=1,tensor=8'",
    ]
    trainer, loader = build_trainer(tmp_path, *bindings, placement="custom")
    rows = run_iterations(trainer, loader)
    paths = {t.describe(): t.path for t in trainer.resharder.transitions}
    assert list(paths.values()) == ["alias"], paths
    for gen, train in zip(
        jax.tree.leaves(trainer.gen_params), jax.tree.leaves(trainer.states["actor"].params)
    ):
        assert gen.sharding.mesh.axis_names == ("data", "tensor")
        assert gen.addressable_shards[0].data.unsafe_buffer_pointer() == (
            train.addressable_shards[0].data.unsafe_buffer_pointer()
        )
    for a, b in zip(rows, plain_rows, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if k != "reshard/bytes":  # a property of the layouts
                np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)
        assert a["reshard/bytes"] == 0
