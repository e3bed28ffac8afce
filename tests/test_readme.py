"""Every command of README.md runs, and every command of the docs names what exists.

README's shell commands are taken from its fenced code blocks and checked cheaply: the module of
each ``python -m jrlhf.X`` exists and parses the command's options (its argument parser runs,
nothing after it), every ``--config`` file exists, and a training command's gin files and
bindings load (``jrlhf.cli.train.load_run_config``: the checks a run makes before it touches a
device). The default training job, README's first command, then runs for real in a short form.
The docs (docs/*.md, BUILD.md) are checked more lightly: every ``python -m jrlhf.X`` and
``python -m benchmarks.X`` names a module (and a benchmark suite) that exists, every
``configs/*.gin`` they name exists, and their relative links resolve.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import runpy
import shlex
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "BUILD.md"]
# README's first two code blocks, byte for byte: .ci/run runs the second.
INSTALL_AND_TRAIN = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python -m jrlhf.train"
)
INSTALL_AND_TEST = (
    "python3 -m venv .venv && . .venv/bin/activate && "
    'pip install -e ".[test]" && python -m pytest -q'
)


def shell_commands(text: str) -> list[list[str]]:
    """The commands of ``text``'s fenced bash blocks, each as argv: continuation lines joined,
    comments dropped, ``a && b`` split in two."""
    commands = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv: list[str] = []
            for token in [*shlex.split(line, comments=True), "&&"]:
                if token == "&&":
                    if argv:
                        commands.append(argv)
                    argv = []
                else:
                    argv.append(token)
    return commands


def jrlhf_commands(text: str) -> list[tuple[str, list[str]]]:
    """(module, arguments) of every ``python -m jrlhf...`` command of ``text``'s code blocks."""
    out = []
    for argv in shell_commands(text):
        if argv[:2] in (["python", "-m"], ["python3", "-m"]) and argv[2].startswith("jrlhf"):
            out.append((argv[2], argv[3:]))
    return out


class _Parsed(Exception):
    """Raised in place of an entry point's work once its argument parser has run."""

    def __init__(self, namespace: argparse.Namespace):
        super().__init__()
        self.namespace = namespace


def parse_only(module: str, args: list[str]) -> argparse.Namespace | None:
    """Run ``python -m module args`` as far as its (first) argument parser, in this process:
    the parser's result, or None for an entry point that exits before parsing (a usage line).
    A bad option fails here as it would on the command line (SystemExit 2)."""
    original = argparse.ArgumentParser.parse_args

    def stop_after(self, *a, **kw):
        raise _Parsed(original(self, *a, **kw))

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.setattr(argparse.ArgumentParser, "parse_args", stop_after)
        # The bench entry point sets the host allocator up for the benchmark it starts: not here.
        mp.setattr("jrlhf.cli.bench.keep_host_memory", lambda: None)
        mp.setattr(sys, "argv", [module, *args])
        warnings.simplefilter("ignore", RuntimeWarning)  # a module run again as __main__
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=False)
        except _Parsed as parsed:
            return parsed.namespace
        except SystemExit as e:
            assert not e.code, f"python -m {module} {shlex.join(args)}: exits with {e.code}"
    return None


def check_command(module: str, args: list[str]) -> None:
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    for i, arg in enumerate(args[:-1]):
        if arg == "--config":
            assert (ROOT / args[i + 1]).is_file(), f"{module}: no config file {args[i + 1]}"
    if module == "jrlhf.launch":
        own, command = args[: args.index("--")], args[args.index("--") + 1 :]
        parse_only(module, [*own, "--", *command])
        return check_command(f"jrlhf.{command[0]}", command[1:])
    ns = parse_only(module, args)
    if module == "jrlhf.train" and not ns.resume:  # a resume needs its run directory
        from jrlhf.cli.train import load_run_config
        from jrlhf.config import ConfigError

        try:
            load_run_config(ns)
        except (ConfigError, ValueError) as e:
            pytest.fail(f"python -m jrlhf.train {shlex.join(args)}: {e}")


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)\n```", README.read_text(), flags=re.S)
    assert blocks[:2] == [INSTALL_AND_TRAIN, INSTALL_AND_TEST]
    assert README.read_text().index(INSTALL_AND_TRAIN) < README.read_text().index("\n## ")
    assert INSTALL_AND_TEST.split("&& ", 1)[1] in (ROOT / ".ci" / "run").read_text()


def in_scratch_checkout(monkeypatch, tmp_path):
    """Work in an empty directory with the checkout's configs/: a run directory a command names
    (runs/my-run) may exist in the real checkout, where someone followed the tour."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)


def test_readme_commands_parse(monkeypatch, tmp_path):
    in_scratch_checkout(monkeypatch, tmp_path)
    commands = jrlhf_commands(README.read_text())
    assert len(commands) >= 10
    for module, args in commands:
        check_command(module, args)


def test_docs_commands_parse(monkeypatch, tmp_path):
    """The same checks for the commands of the docs' code blocks."""
    in_scratch_checkout(monkeypatch, tmp_path)
    for doc in DOCS:
        for module, args in jrlhf_commands(doc.read_text()):
            check_command(module, args)


def test_docs_name_what_exists():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # benchmarks/ is beside the package, not installed
    for doc in [README, *DOCS]:
        text = doc.read_text()
        for module in re.findall(r"python3? -m ((?:jrlhf|benchmarks)(?:\.\w+)*)", text):
            if module.rsplit(".", 1)[-1].isupper():  # a placeholder: python -m jrlhf.X
                continue
            assert importlib.util.find_spec(module) is not None, f"{doc.name}: no module {module}"
        for suite in re.findall(r"jrlhf\.bench (\w+)", text):
            if suite != "SUITE":
                assert (ROOT / "benchmarks" / f"{suite}.py").is_file(), f"{doc.name}: {suite}"
        for config in re.findall(r"\bconfigs/[\w/.-]+\.gin", text):
            assert (ROOT / config).is_file(), f"{doc.name}: no {config}"
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (doc.parent / link).exists(), f"{doc.name}: broken link {link}"


# README's first command with its stages shortened: every stage runs, on the same 8 devices and
# meshes (fsdp=4 x tensor=2 training, data=4 x tensor=2 generation), for a step or an iteration.
# About 15 s of one core, nearly all of it compilation; on one device it would save only ~3 s.
def test_readme_training_command_is_the_default_job_the_session_runs_short(base_run, colocated_run):
    """README's first command is the default job (``python -m jrlhf.train``: configs/default.gin),
    which the session's shared runs execute in a short form through the same entry point
    (tests/conftest.py: ``base_run`` its SFT and reward-model stages, ``colocated_run`` its PPO
    from them): they leave what README says a run leaves."""
    module, args = jrlhf_commands(README.read_text())[0]
    assert (module, args) == ("jrlhf.train", [])
    for stage in ("sft", "rm"):
        assert (base_run / stage).is_dir() and (
            base_run / "logs" / stage / "metrics.jsonl"
        ).is_file()
    summary = json.loads((colocated_run / "summary.json").read_text())
    assert {"gt_score", "kl_to_ref"} <= summary["before"].keys() & summary["after"].keys()
    assert (colocated_run / "checkpoints").is_dir() and (colocated_run / "run.png").is_file()
    assert (colocated_run / "logs" / "ppo" / "metrics.jsonl").is_file()
    assert list(colocated_run.glob("*.gin")), "no operative config"
