"""The effective plan: one placement per run, from the strategy or the search with RoleConfig
meshes merged in; the rules table; the config checks that keep rules and meshes together."""

import logging
import re

import pytest

from jrlhf import config
from jrlhf.cli import train
from jrlhf.meshes import PHASE_RULES, RULE_SETS, get_rules
from jrlhf.placement import CALLS, STAGE_CALLS, effective_plan, strategy


def load(*bindings):
    return config.load_config([str(config.DEFAULT_CONFIG)], list(bindings))


@pytest.mark.parametrize("name", ["flatten", "interleave", "separate"])
def test_strategies_are_effective_plans_unchanged(name):
    plan = effective_plan(load(f"RunConfig.placement='{name}'"), 8)
    assert plan.placements == strategy(name, 8).placements
    assert plan.name == name
    # the reward model's supervised stage runs where the reward model scores
    assert plan.for_role("reward", "train") == plan["reward_infer"]


def test_role_config_meshes_override_the_plan_with_their_rules():
    cfg = load(
        "RunConfig.placement='separate'",
        "critic/RoleConfig.infer_mesh='fsdp=2@6:8'",
        "reward/RoleConfig.train_mesh='data=4'",
        "reward/RoleConfig.train_rules='replicated'",
    )
    plan = effective_plan(cfg, 8)
    base = strategy("separate", 8)
    assert plan.name == "separate+custom"
    assert str(plan["critic_infer"].mesh) == "fsdp=2@6,7"
    assert plan["critic_infer"].rules == PHASE_RULES["infer"]
    assert plan.for_role("reward", "train").rules == "replicated"
    for call in CALLS:
        if call != "critic_infer":
            assert plan[call] == base[call]
    # the critic now scores off its training devices: its weights follow a reshard edge
    assert [(e.role, e.src, e.dst) for e in plan.reshard_edges()] == [
        ("actor", "actor_train", "actor_generate"),
        ("critic", "critic_train", "critic_infer"),
    ]
    assert [e.role for e in base.reshard_edges()] == ["actor"]


def test_plan_gin_round_trips_to_the_same_effective_plan(tmp_path):
    cfg = load("RunConfig.placement='interleave'", "reward/RoleConfig.train_mesh='fsdp=4@4:8'")
    plan = effective_plan(cfg, 8)
    gin_file = tmp_path / "plan.gin"
    gin_file.write_text(plan.to_gin())
    again = effective_plan(config.load_config([str(config.DEFAULT_CONFIG), str(gin_file)], []), 8)
    assert again.rows() == plan.rows()
    assert {call for call, _, _ in plan.rows()} == set(CALLS) | set(STAGE_CALLS)


@pytest.mark.parametrize(
    "binding,message",
    [
        ("actor/RoleConfig.generate_rules='dp_tp'", "actor/RoleConfig.generate_rules: needs"),
        ("reference/RoleConfig.train_mesh='fsdp=8'", "the reference has no train phase"),
        ("actor/RoleConfig.infer_mesh='fsdp=8'", "the actor has no infer phase"),
        ("RunConfig.placement='colocated'", "RunConfig.placement: use one of"),
    ],
)
def test_rules_without_mesh_and_phantom_phases_are_errors(binding, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        load(binding)


def test_a_plan_slice_beyond_the_devices_is_one_line():
    cfg = load("RunConfig.placement='custom'", "actor/RoleConfig.train_mesh='fsdp=4@8:12'")
    with pytest.raises(
        ValueError,
        match="^actor/RoleConfig.train_mesh fsdp=4@8,9,10,11: needs device 11 but only 8 devices",
    ):
        effective_plan(cfg, 8)


def test_one_rules_table_covers_the_decode_state():
    """Slots and their KV pages are split alike in every rule set (no decode-only table)."""
    for rules in RULE_SETS.values():
        table = dict(get_rules(rules))
        assert table["kv_pages"] == table["slots"]
    assert "pages" not in dict(get_rules("fsdp_tp"))


def test_custom_placement_log_and_plan_gin_equal_what_ran(tmp_path, caplog):
    """placement='custom' with a RoleConfig mesh: plan.gin and the logged plan name the mesh the
    actor was really built on (the SFT stage trains it there)."""
    run_dir = tmp_path / "run"
    bindings = [
        "RunConfig.placement='custom'",
        "RunConfig.stages=('sft',)",
        "SFTConfig.steps=1",
        "SFTConfig.batch_size=8",
        "RunConfig.tensorboard=False",
        "actor/RoleConfig.train_mesh='fsdp=2,tensor=2@4:8'",
    ]
    with caplog.at_level(logging.INFO, logger="jrlhf"):
        assert train.main(["--run-dir", str(run_dir), "--quiet", *bindings]) == 0
    text = (run_dir / "plan.gin").read_text()
    assert "actor/RoleConfig.train_mesh = 'fsdp=2,tensor=2@4,5,6,7'" in text
    logged = [r.getMessage() for r in caplog.records]
    plan_line = next(m for m in logged if m.startswith("execution plan"))
    assert "actor_train fsdp=2,tensor=2@4,5,6,7 [fsdp_tp]" in plan_line
    actor_line = next(m for m in logged if m.startswith("actor:"))
    assert "train: {'fsdp': 2, 'tensor': 2} [4, 5, 6, 7]" in actor_line
    # the written plan, loaded as a config, is the plan that ran
    cfg = config.load_config([str(config.DEFAULT_CONFIG), str(run_dir / "plan.gin")], [])
    assert effective_plan(cfg, 8).describe().split(": ", 1)[1] == plan_line.split(": ", 1)[1]
