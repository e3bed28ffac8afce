"""Property test of configuration loading: gin bindings drawn over every section (valid and
invalid values, wrong types, unknown names, broken syntax) either load, or fail with one
ConfigError line naming the field or the binding; never a traceback, never a file written."""

from __future__ import annotations

import dataclasses
import io
import re
import typing
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jrlhf.cli import train as train_cli
from jrlhf.config import (
    RL_SUB_CONFIGS,
    ROLES,
    DecodeConfig,
    DPOConfig,
    RewardModelConfig,
    RLConfig,
    RoleConfig,
    RunConfig,
    SFTConfig,
    TaskConfig,
)

SECTIONS = {
    "RunConfig": RunConfig,
    "TaskConfig": TaskConfig,
    "SFTConfig": SFTConfig,
    "RewardModelConfig": RewardModelConfig,
    "DPOConfig": DPOConfig,
    "RLConfig": RLConfig,
    "DecodeConfig": DecodeConfig,
    **{cls.__name__: cls for cls in RL_SUB_CONFIGS.values()},
}


def _fields() -> list[tuple[str, str, typing.Any]]:
    """(gin name, field name, type) of every configurable field, per-role ones scoped."""
    out = []
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out += [(f"{name}.{f.name}", f.name, hints[f.name]) for f in dataclasses.fields(cls)]
    hints = typing.get_type_hints(RoleConfig)
    for role in ROLES:
        for f in dataclasses.fields(RoleConfig):
            out.append((f"{role}/RoleConfig.{f.name}", f.name, hints[f.name]))
    return out


FIELDS = _fields()

# Gin literals of every kind; each field also gets values of its own type near its edges.
ANY_LITERAL = st.sampled_from(
    [
        "0", "1", "-1", "3", "32", "1000000000", "2.5", "32.5", "-0.5", "1e-5", "1e8", "nan",
        "inf", "True", "False", "None", "'3'", "'ten'", "''", "'fsdp=4,tensor=2'",
        "'fsdp=3'", "'tiny'", "'stage:sft'", "'stage:dpo'", "'ckpt:/nonexistent'", "'synthetic'",
        "'files'", "'ipo'", "('sft', 'rm', 'ppo')", "('sft', 'dpo')", "('grpo',)", "('nope',)",
        "()", "(('vocab_size', 64),)", "(('nope', 1),)", "(('hidden_size', 'x'),)", "[1, 2]",
        "{'a': 1}", "@nothing()", "%MACRO", "(", "'unterminated", "1 2",
    ]
)  # fmt: skip


@st.composite
def typed_value(draw, hint) -> str:
    if hint is bool:
        return draw(st.sampled_from(["True", "False"]))
    if hint is int:
        return str(draw(st.integers(-3, 70)))
    if hint is float:
        return repr(draw(st.floats(-2.0, 2.0, allow_nan=False)))
    return draw(ANY_LITERAL)


@st.composite
def binding(draw) -> str:
    kind = draw(st.sampled_from(["typed", "any", "unknown-field", "unknown-section", "syntax"]))
    name, field, hint = draw(st.sampled_from(FIELDS))
    if kind == "typed":
        return f"{name}={draw(typed_value(hint))}"
    if kind == "any":
        return f"{name}={draw(ANY_LITERAL)}"
    if kind == "unknown-field":
        return f"{name.rsplit('.', 1)[0]}.{field}x={draw(ANY_LITERAL)}"
    if kind == "unknown-section":
        return f"NoSuchConfig.{field}={draw(ANY_LITERAL)}"
    return draw(st.sampled_from([name, f"{name}==1", f"{name}=", f"={name}", f"{name}=(1,"]))


SUB_CONFIGS = "|".join(cls.__name__ for cls in RL_SUB_CONFIGS.values())
NAMES_A_FIELD = re.compile(rf"(^binding .|\w+Config[.:]|^config file |^({SUB_CONFIGS})\.)")


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(bindings=st.lists(binding(), min_size=1, max_size=3))
def test_drawn_bindings_load_or_fail_in_one_line_naming_the_field(bindings, tmp_path):
    run_dir = tmp_path / "run"
    before = sorted(Path(tmp_path).rglob("*"))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = train_cli.main(["--check", "--run-dir", str(run_dir), *bindings])
    lines = err.getvalue().splitlines()
    if rc == 0:
        assert not lines and out.getvalue().startswith("config ok"), (bindings, err.getvalue())
    else:
        assert rc == 2, (bindings, rc)
        assert len(lines) == 1 and lines[0].startswith("error: "), (bindings, lines)
        assert NAMES_A_FIELD.search(lines[0][len("error: ") :]), (bindings, lines)
    assert sorted(Path(tmp_path).rglob("*")) == before, bindings  # nothing written


def test_each_reported_case_is_one_line_naming_the_field(tmp_path, capsys):
    cases = {
        'RLConfig.iterations="3"': "RLConfig.iterations: expects an int",
        'SFTConfig.steps="ten"': "SFTConfig.steps: expects an int",
        "SFTConfig.batch_size=32.5": "SFTConfig.batch_size: expects an int",
        "RLConfig.keep_checkpoints=0": "RLConfig.keep_checkpoints: must be >= 1",
        "RewardModelConfig.steps=0": "RewardModelConfig.steps: must be >= 1",
        "DecodeConfig.page_size=0": "DecodeConfig.page_size: must be >= 1",
        "DecodeConfig.layer_loop='unrolled'": "DecodeConfig.layer_loop: must be one of auto,",
        # A value gin cannot parse names the setting, not Python's AST node.
        "RLConfig.kl_coef=nan": "RLConfig.kl_coef: expects a finite number, got nan",
        "actor/RoleConfig.learning_rate=float('nan')": (
            "actor/RoleConfig.learning_rate: expects a finite number, got float('nan')"
        ),
        "SFTConfig.learning_rate=-Infinity": "SFTConfig.learning_rate: expects a finite number",
        "RunConfig.seed=nan": "RunConfig.seed: expects an int, got nan",
        "RunConfig.placement=flatten": (
            "RunConfig.placement: flatten is not a value gin can read (it reads Python literals; "
            "strings need quotes: 'flatten')"
        ),
        "RLConfig.kl_coef=1e999": "RLConfig.kl_coef: expects a finite number",
        "Asynchrony.max_staleness=-1": "Asynchrony.max_staleness: must be >= 0",
        "OffPolicy.is_cap=nan": "OffPolicy.is_cap: expects a finite number, got nan",
        "RLConfig.memory=3": "RLConfig.memory: expects @Memory(), got 3",
        "actor/RoleConfig.model_overrides=(('nope', 1),)": "model_overrides: unknown model field",
        "actor/RoleConfig.model_overrides=(('num_layers', 0),)": "num_layers must be an integer >=",
        "critic/RoleConfig.model_overrides=(('num_kv_heads', -2),)": "num_kv_heads must be an",
        "reward/RoleConfig.model_overrides=(('sliding_window', -1),)": "sliding_window must be an",
        "actor/RoleConfig.model_overrides=(('rms_norm_eps', 0.0),)": "rms_norm_eps must be a",
    }
    for b, expected in cases.items():
        rc = train_cli.main(["--check", "--run-dir", str(tmp_path / "run"), b])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err and expected in err, (b, err)
        assert "object at 0x" not in err, (b, err)
    assert not (tmp_path / "run").exists()


def test_a_value_gin_cannot_parse_in_a_config_file_names_its_line_and_setting(tmp_path, capsys):
    path = tmp_path / "lr.gin"
    path.write_text("SFTConfig.steps = 3\nactor/RoleConfig.learning_rate = nan  # tried\n")
    rc = train_cli.main(["--check", "--run-dir", str(tmp_path / "run"), "--config", str(path)])
    err = capsys.readouterr().err.strip()
    expected = f"config file {path}, line 2: actor/RoleConfig.learning_rate: expects a finite"
    assert rc == 2 and err == f"error: {expected} number, got nan", err
    assert not (tmp_path / "run").exists()
