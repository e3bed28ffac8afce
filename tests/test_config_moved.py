"""RLConfig's knobs grouped by concern (Asynchrony, Fusion, Memory, SampleFilters, OffPolicy):
their bindings reach every RLConfig built, each setting has one name, and a binding of an old flat
name (a file, an override, a saved run's operative config) is refused in one line naming the new
one before anything runs."""

from __future__ import annotations

import dataclasses

import pytest

from jrlhf.cli import train as train_cli
from jrlhf.config import MOVED, RL_SUB_CONFIGS, ConfigError, RLConfig, load_config
from jrlhf.pipeline.run_dir import OPERATIVE_CONFIG, resume_config


def test_every_sub_config_field_is_the_new_home_of_exactly_one_old_name():
    homes = {
        f"{cls.__name__}.{f.name}"
        for cls in RL_SUB_CONFIGS.values()
        for f in dataclasses.fields(cls)
    }
    assert sorted(MOVED.values()) == sorted(homes)
    own = {f.name for f in dataclasses.fields(RLConfig)}
    # No old name survives as an RLConfig field, except the one a sub-config took over.
    assert {old.split(".")[1] for old in MOVED} & own == {"fusion"}


def test_sub_config_bindings_reach_the_rl_config():
    cfg = load_config(
        [],
        [
            "Asynchrony.max_staleness = 2",
            "Asynchrony.partial_rollout_tokens = 8",
            "Fusion.enabled = True",
            "Fusion.score_rows = 64",
            "Memory.offload = ('actor_optimizer',)",
            "Memory.infer_batch_size = 16",
            "SampleFilters.overlong_buffer = 4",
            "OffPolicy.correction = 'tis'",
            "OffPolicy.is_cap = 3.0",
        ],
    )
    rl = cfg.rl
    assert (rl.asynchrony.max_staleness, rl.asynchrony.partial_rollout_tokens) == (2, 8)
    assert (rl.fusion.enabled, rl.fusion.score_rows, rl.fusion.migrate_rows) == (True, 64, 0)
    assert (rl.memory.offload, rl.memory.infer_batch_size) == (("actor_optimizer",), 16)
    assert rl.memory.generation_copy == "kept"  # unbound: the default
    assert (rl.filters.overlong_buffer, rl.off_policy.correction, rl.off_policy.is_cap) == (
        4,
        "tis",
        3.0,
    )


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_bound_as_an_override_is_refused_naming_the_new_one(old):
    with pytest.raises(ConfigError) as err:
        load_config([], [f"{old} = 1"])
    assert str(err.value) == f"{old} moved: bind {MOVED[old]}"


def test_the_cli_refuses_an_old_override_and_an_old_file_binding_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = train_cli.main(["--check", "--run-dir", str(run_dir), "RLConfig.max_staleness=1"])
    err = capsys.readouterr().err.strip()
    assert (rc, err) == (2, "error: RLConfig.max_staleness moved: bind Asynchrony.max_staleness")

    path = tmp_path / "old.gin"
    path.write_text("RLConfig.iterations = 3\nRLConfig.off_policy_correction = 'tis'  # old\n")
    rc = train_cli.main(["--check", "--run-dir", str(run_dir), "--config", str(path)])
    err = capsys.readouterr().err.strip()
    expected = f"config file {path}, line 2: RLConfig.off_policy_correction moved: bind "
    assert (rc, err) == (2, f"error: {expected}OffPolicy.correction")
    assert not run_dir.exists()  # refused before anything was written


def test_an_included_file_is_named_and_the_old_fusion_switch_is_refused(tmp_path):
    inner = tmp_path / "inner.gin"
    inner.write_text("\n\nRLConfig.migrate_rows = 4\n")
    outer = tmp_path / "outer.gin"
    outer.write_text(f"include '{inner}'\n")
    with pytest.raises(ConfigError) as err:
        load_config([str(outer)], [])
    expected = f"config file {inner}, line 3: RLConfig.migrate_rows moved: bind Fusion.migrate_rows"
    assert str(err.value) == expected
    # RLConfig.fusion is still a parameter (the Fusion section): gin takes a bool for it.
    for where in ([], ["RLConfig.fusion = True"]), ([str(tmp_path / "f.gin")], []):
        (tmp_path / "f.gin").write_text("RLConfig.fusion = False\n")
        with pytest.raises(ConfigError, match="^RLConfig.fusion moved: bind Fusion.enabled$"):
            load_config(*where)


def test_resuming_a_run_saved_with_flat_names_fails_in_one_line(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / OPERATIVE_CONFIG).write_text("RLConfig.iterations = 4\nRLConfig.max_staleness = 1\n")
    with pytest.raises(ConfigError) as err:
        resume_config(run_dir, [], ["RLConfig.iterations = 8"])
    saved = run_dir / OPERATIVE_CONFIG
    assert str(err.value) == (
        f"config file {saved}, line 2: RLConfig.max_staleness moved: bind Asynchrony.max_staleness"
    )
    # Saved with the new names, a resume that changes a sub-config field names it as bound.
    (run_dir / OPERATIVE_CONFIG).write_text("Asynchrony.max_staleness = 1\n")
    assert resume_config(run_dir, [], []).rl.asynchrony.max_staleness == 1
    with pytest.raises(ConfigError, match=r"^--resume: Asynchrony.max_staleness would change "):
        resume_config(run_dir, [], ["Asynchrony.max_staleness = 2"])
