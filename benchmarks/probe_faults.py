"""Bad inputs and faults as a new user meets them: ``python benchmarks/probe_faults.py --out FILE``.

Runs each case as the real command line (``python -m jrlhf.train`` / ``evaluate`` / ``generate``
/ ``convert`` / ``launch``) in a subprocess with a short timeout, each in a temporary directory
of its own that holds its inputs and its run directory (copies of small shared fixtures: a data
set with its tokenizer, a tiny SFT run and a tiny PPO run with two checkpoints, built once at the
start). Every file in that directory is hashed before and after the command, and the case gets
one verdict:

``clean``      refused (exit status not 0) with one line of error (argparse's usage line aside),
               no traceback, its directory as it was;
``recovered``  a fault the command is meant to get over (a damaged newest checkpoint): exit 0;
``leftover``   a clean refusal that left new files behind (a run directory of a refused start);
``noisy``      refused without a traceback, but in more than one line;
``misread``    a clean refusal for another reason than the one the case tests (its one line
               lacks the case's ``reason``): the case does not test what it names;
``silent``     bad input accepted: exit 0 where a refusal was due (of two commands started
               together on one run directory: both ran, or one failed on the other's files
               instead of being refused up front with a line naming the holder's pid);
``timeout``    still running at its timeout (killed);
``traceback``  a Python traceback on stderr, or killed by a signal;
``damaging``   a file that was there before was changed or removed by a refused command.

Logging lines (``2026-... INFO ...``, Python's ``WARNING:jrlhf:...``, absl's) are not counted as
error lines. The JSON report lists every case (kind, command with the case directory written as
``$CASE``, exit status, seconds, verdict, the last error line) and the tallies per verdict and per
kind of case. It is
a probe, not a test: on a branch where a fault is not handled yet its case is reported as it is.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from jrlhf.checkpoint import MODEL_JSON
from jrlhf.pipeline.run_lock import LOCK_FILE
from jrlhf.tasks import SyntheticTask

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
SMALL = [
    "TaskConfig.num_heldout=16",
    "RLConfig.prompts_per_iteration=16",
    "RLConfig.minibatch_size=16",
    "RLConfig.epochs=1",
    "RunConfig.tensorboard=False",
]
# A tiny SFT-only run: what a bad binding is added to (accepted, it trains 2 steps and ends).
TINY_SFT = ["--quiet", "--config", str(CONFIGS / "sft_tiny.gin"), "SFTConfig.steps=2", *SMALL]
LOG_LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ |(WARNING|INFO|DEBUG|ERROR):[\w.]+:|[IWE]\d{4} )"
)
TRACEBACK = "Traceback (most recent call last)"
VERDICTS = (
    "clean", "recovered", "leftover", "noisy", "misread", "silent", "timeout", "traceback",
    "damaging",
)  # fmt: skip


@dataclasses.dataclass
class Ctx:
    """One case's directory, its run directory inside it, and the shared fixtures."""

    dir: Path
    fix: Path

    @property
    def run(self) -> Path:
        return self.dir / "run"

    def copy(self, fixture: str, to: str = "") -> Path:
        """A copy of fixture ``fixture`` in this case's directory (named ``to``)."""
        dest = self.dir / (to or fixture)
        shutil.copytree(self.fix / fixture, dest)
        return dest

    def write(self, name: str, text: str | bytes) -> Path:
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return path


@dataclasses.dataclass
class Case:
    """A command (or commands started together) built in the case's directory; ``expect``:
    ``refuse`` (a bad input: a one-line refusal is right), ``recover`` (exit 0 is right) or
    ``one`` (commands started together on one run directory: one may run, the others must be
    refused); ``reason``: what a refusal's one line must say for the case to test what it names
    ("": not checked)."""

    name: str
    kind: str
    build: Callable[[Ctx], list[list[str]]]
    expect: str = "refuse"
    timeout: float = 90.0
    pythonpath: bool = False  # the case directory on PYTHONPATH (user reward modules)
    reason: str = ""


def module(name: str, *args: str | Path) -> list[str]:
    return [sys.executable, "-m", f"jrlhf.{name}", *(str(a) for a in args)]


def train(*bindings: str, config: list[str] | None = None):
    """A tiny SFT start in the case's run directory with ``bindings`` added."""

    def build(c: Ctx) -> list[list[str]]:
        return [module("train", "--run-dir", c.run, *(config or TINY_SFT), *bindings)]

    return build


def ppo(*bindings: str):
    """A two-iteration PPO start from the fixture SFT policy, with ``bindings`` added."""

    def build(c: Ctx) -> list[list[str]]:
        sft = c.fix / "sft_run" / "sft"
        return [module("train", "--run-dir", c.run, "--quiet", *ppo_bindings(sft), *bindings)]

    return build


def ppo_bindings(sft: Path) -> list[str]:
    return [
        "RunConfig.stages=('ppo',)",
        *(f"{role}/RoleConfig.init='ckpt:{sft}'" for role in ROLES),
        "RLConfig.iterations=2",
        "RLConfig.checkpoint_every=1",
        *SMALL,
    ]


ROLES = ("actor", "reference", "reward", "critic")


def files(edit: Callable[[Ctx, Path], list[str]] | None = None, *extra: str):
    """A tiny SFT start on the fixture data as JSONL files (a copy, which ``edit`` may damage;
    it returns bindings that replace the default ones of the same setting)."""

    def build(c: Ctx) -> list[list[str]]:
        data = c.copy("data")
        bindings = {
            "TaskConfig.name": "'files'",
            "TaskConfig.prompts": f"'{data / 'prompts.jsonl'}'",
            "TaskConfig.heldout_prompts": f"'{data / 'heldout_prompts.jsonl'}'",
            "TaskConfig.sft_data": f"'{data / 'sft.jsonl'}'",
            "TaskConfig.tokenizer": f"'{data}'",
        }
        for b in edit(c, data) if edit else []:
            key, _, value = b.partition("=")
            bindings[key] = value
        args = [f"{k}={v}" for k, v in bindings.items()]
        return [module("train", "--run-dir", c.run, *TINY_SFT, *args, *extra)]

    return build


def damage(path: Path, how: str) -> None:
    """Truncate (to a third), empty or delete ``path``."""
    if how == "truncate":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def ppo_copy_with(step_fault: str, steps: tuple[str, ...] = ("2",), item: str = ""):
    """A copy of the PPO fixture with the largest file of each of ``steps`` damaged (of its
    item ``item``, e.g. ``actor_params``: what evaluate reads; "": of the whole step)."""

    def prepare(c: Ctx) -> Path:
        run = c.copy("ppo_run", "run")
        for step in steps:
            damage(largest_file(run / "checkpoints" / step / item), step_fault)
        return run

    return prepare


def command(prepare: Callable[[Ctx], object], make: Callable[[Ctx], list[str]]):
    """A case that prepares its directory, then runs one command."""

    def build(c: Ctx) -> list[list[str]]:
        prepare(c)
        return [make(c)]

    return build


def nothing(c: Ctx) -> None:
    return None


def id_prompts(c: Ctx) -> Path:
    """A prompts file of token ids (``p.jsonl``): a model checkpoint has no tokenizer to encode
    text with, and a text prompt would be refused for that before what a case tests."""
    return c.write("p.jsonl", '{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5]}\n')


def reward_module(body: str) -> Callable[[Ctx], object]:
    """A user reward module ``probe_reward.py`` in the case directory (on PYTHONPATH)."""

    def prepare(c: Ctx) -> None:
        c.write("probe_reward.py", body)

    return prepare


def grpo_with_reward(fn: str):
    """A GRPO start (SFT first, as a user would) with ``TaskConfig.reward_fn=fn``."""

    def make(c: Ctx) -> list[str]:
        return module(
            "train", "--run-dir", c.run, "--quiet", "RunConfig.stages=('sft', 'grpo')",
            "SFTConfig.steps=2", "RLConfig.iterations=1", "RLConfig.samples_per_prompt=4",
            "RLConfig.prompts_per_iteration=8", f"TaskConfig.reward_fn='{fn}'", *SMALL,
        )  # fmt: skip

    return make


def cases() -> list[Case]:
    """Every case, by kind."""
    out: list[Case] = []

    def add(kind: str, name: str, build, **kw) -> None:
        out.append(Case(name, kind, build, **kw))

    # ---- mistyped gin bindings and values
    for b in [
        "RunConfig.stagez=('sft',)", "SFTConfig.stepz=3", "SFTConig.steps=3", "SFTConfig.steps=0",
        "SFTConfig.steps=-1", "SFTConfig.steps='3'", "SFTConfig.steps=3.5",
        "SFTConfig.batch_size=0", "RunConfig.stages=('sft','kto')", "RunConfig.stages=()",
        "RunConfig.stages=sft", "RunConfig.placement='flaten'", "RunConfig.seed='x'",
        "TaskConfig.name='synthetc'", "TaskConfig.max_prompt_len=0",
        "actor/RoleConfig.init='tinyy'", "actor/RoleConfig.init='stage:ppo'",
        "actor/RoleConfig.init='ckpt:/nonexistent/model'",
        "actor/RoleConfig.init='hf:/nonexistent/model'", "actor/RoleConfig.param_dtype='float33'",
        "actor/RoleConfig.remat_policy='bogus'", "actor/RoleConfig.model_overrides=(('nope', 1),)",
        "actor/RoleConfig.model_overrides=(('num_layers', 0),)", "actor/RoleConfig.microbatches=0",
        "actor/RoleConfig.microbatches=3", "SFTConfig.steps=", "SFTConfig.steps==3",
        "SFTConfig.steps=(1,", "=3", "SFTConfig.steps", "actr/RoleConfig.learning_rate=1e-3",
        "DecodeConfig.page_size=0", "RunConfig.max_nonfinite_updates=-1",
        "RunConfig.host_devices=0", "TaskConfig.max_response_len=-4",
    ]:  # fmt: skip
        add("gin binding", b, train(b))
    for b in ["RLConfig.kl_coef=-1", "RLConfig.minibatch_size=7", "RLConfig.iterations=0"]:
        add("gin binding", f"ppo {b}", ppo(b))
    add("gin file", "missing --config", train(config=["--config", "/nonexistent.gin"]))

    def gin_file(text: str):
        def build(c: Ctx) -> list[list[str]]:
            path = c.write("bad.gin", text)
            return train(config=["--quiet", "--config", str(path), *SMALL])(c)

        return build

    add(
        "gin file",
        "malformed gin file",
        gin_file("RunConfig.stages = ('sft',\nSFTConfig.steps 3\n"),
    )
    add("gin file", "gin file with nan", gin_file("actor/RoleConfig.learning_rate = nan\n"))
    add("gin file", "gin file unknown name", gin_file("RunConfig.stages = ('sft',)\nFoo.bar = 1\n"))

    # ---- NaN and negative learning rates
    for b in [
        "actor/RoleConfig.learning_rate=nan", "actor/RoleConfig.learning_rate=float('nan')",
        "actor/RoleConfig.learning_rate=-1e-3", "actor/RoleConfig.learning_rate=0",
        "SFTConfig.learning_rate=nan", "SFTConfig.learning_rate=-3e-3",
        "SFTConfig.learning_rate=inf", "SFTConfig.learning_rate=1e999",
        "critic/RoleConfig.learning_rate=nan", "RewardModelConfig.learning_rate=-1",
        "DPOConfig.learning_rate=nan", "SFTConfig.learning_rate='fast'",
    ]:  # fmt: skip
        add("learning rate", b, train(b))

    # ---- meshes: typos, sizes that do not divide, more devices than there are
    for mesh in [
        "fsdpp=8", "dta=8", "dat=8", "fsdp=3", "fsdp=16", "fsdp=4,tensor=4", "fsdp=0", "fsdp:4",
        "fsdp=4@0:9", "tensor=8", "fsdp=-2",
    ]:  # fmt: skip
        add("mesh", f"train_mesh {mesh}", train(f"actor/RoleConfig.train_mesh='{mesh}'"))
    add("mesh", "train_rules unknown", train(
        "actor/RoleConfig.train_mesh='fsdp=8'", "actor/RoleConfig.train_rules='fsdp_tpp'"
    ))  # fmt: skip
    add("mesh", "train_rules without mesh", train("actor/RoleConfig.train_rules='fsdp_tp'"))
    add("mesh", "reference train_mesh", train("reference/RoleConfig.train_mesh='fsdp=8'"))
    add("mesh", "host_devices 3", train("RunConfig.host_devices=3"))
    add("mesh", "ppo generate_mesh data=16", ppo("actor/RoleConfig.generate_mesh='data=16'"))
    add("mesh", "ppo generate_mesh dat=8", ppo("actor/RoleConfig.generate_mesh='dat=8'"))
    add(
        "mesh", "host_devices 100000", train("RunConfig.host_devices=100000"), timeout=20.0
    )  # the issue's: grows without bound on main; cut short here
    # (data=3 is no fault in evaluate: rows that do not split over the data axis are padded)
    for mesh in ["fsdpp=8", "tensor=3", "data=16", "dat=8"]:
        add("mesh", f"evaluate --mesh {mesh}", command(
            lambda c: c.copy("ppo_run", "run"),
            lambda c, mesh=mesh: module("evaluate", "--checkpoint", c.run, "--mesh", mesh),
        ))  # fmt: skip
    add("mesh", "evaluate --rules nope", command(
        lambda c: c.copy("ppo_run", "run"),
        lambda c: module("evaluate", "--checkpoint", c.run, "--rules", "nope"),
    ))  # fmt: skip
    # (data=3 is no fault in generate: the slots are rounded to the data axis)
    for mesh, reason in [
        ("dat=8", "--mesh dat=8: `dat` is not a mesh axis; did you mean `data`?"),
        ("tensor=3", "--mesh tensor=3 (--rules dp_tp): parameter embedding with shape (32, 64)"),
    ]:
        add("mesh", f"generate --mesh {mesh}", command(
            lambda c: (c.copy("sft_run", "run"), id_prompts(c)),
            lambda c, mesh=mesh: module(
                "generate", "--checkpoint", c.run / "sft", "--prompts", c.dir / "p.jsonl",
                "--output", c.dir / "out.jsonl", "--max-new-tokens", "4", "--mesh", mesh,
            ),
        ), reason=reason)  # fmt: skip
    for mesh in ["fsdp=3", "fsdpp=8"]:
        add("mesh", f"convert --mesh {mesh}", command(
            lambda c: c.copy("ppo_run", "run"),
            lambda c, mesh=mesh: module(
                "convert", "--from", c.run, "--to-hf", c.dir / "hf", "--mesh", mesh
            ),
        ))  # fmt: skip

    # ---- data files: missing, malformed JSON/JSONL, empty, wrong fields
    def edit_file(name: str, text: str | bytes):
        def edit(c: Ctx, data: Path) -> list[str]:
            (data / name).write_bytes(text if isinstance(text, bytes) else text.encode())
            return []

        return edit

    good = '{"prompt": "a1 b2 c3 ="}\n'
    for name, text in [
        ("prompts.jsonl", ""),
        ("prompts.jsonl", good + '{"prompt": "a1 b2",, "x": 1}\n'),
        ("prompts.jsonl", good + '{"prompt": \n'),
        ("prompts.jsonl", '[\n  {"prompt": "a1 ="},\n  {"prompt": "b2 ="}\n]\n'),
        ("prompts.jsonl", good + '{"text": "a1 ="}\n'),
        ("prompts.jsonl", good.encode() + b'{"prompt": "caf\xe9"}\n'),
        ("prompts.jsonl", good + "\n" + good),
        ("prompts.jsonl", good + '{"prompt_ids": [1, 2, 100000]}\n'),
        ("prompts.jsonl", good + '{"prompt": ""}\n'),
        ("prompts.jsonl", good + '{"prompt_ids": "1 2"}\n'),
        ("prompts.jsonl", '"just a string"\n'),
        ("sft.jsonl", '{"prompt": "a1 ="}\n'),
        ("sft.jsonl", '{"prompt": "a1 =", "response": 3}\n'),
        ("sft.jsonl", ""),
        ("tokenizer.json", '{"model": '),
        ("tokenizer.json", ""),
        ("tokenizer_config.json", "{nope"),
    ]:
        label = text if isinstance(text, str) else text.decode("latin-1")
        add("data file", f"{name}: {label[-40:]!r}", files(edit_file(name, text)))

    def binding(value: str):
        return lambda c, data: [value.format(data=data, dir=c.dir)]

    for b in [
        "TaskConfig.prompts='{dir}/missing.jsonl'", "TaskConfig.sft_data='{dir}/missing.jsonl'",
        "TaskConfig.tokenizer='{dir}/no_tokenizer'", "TaskConfig.prompts='{data}'",
        "TaskConfig.sft_data=''", "TaskConfig.heldout_prompts='{dir}/missing.jsonl'",
        "TaskConfig.prompts='{data}/prompts.parquet'",
    ]:  # fmt: skip
        add("data file", b.replace("{dir}/", "").replace("{data}/", ""), files(binding(b)))

    def parquet_garbage(c: Ctx, data: Path) -> list[str]:
        (data / "prompts.parquet").write_text("not parquet\n")
        return [f"TaskConfig.prompts='{data / 'prompts.parquet'}'"]

    add("data file", "parquet that is not", files(parquet_garbage))

    def big_tokenizer(c: Ctx, data: Path) -> list[str]:
        tok = json.loads((data / "tokenizer.json").read_text())
        start = max(tok["model"]["vocab"].values()) + 1
        for i in range(200):
            tok["model"]["vocab"][f"extra{i}"] = start + i
        (data / "tokenizer.json").write_text(json.dumps(tok))
        return [f"actor/RoleConfig.init='ckpt:{c.fix / 'sft_run' / 'sft'}'"]

    add("data file", "tokenizer larger than the model", files(big_tokenizer))

    # ---- run directories: resume of what is not a run, starts over a run
    add("resume", "resume an empty dir", command(
        lambda c: c.run.mkdir(), lambda c: module("train", "--run-dir", c.run, "--resume")
    ))  # fmt: skip
    add("resume", "resume a missing dir", command(
        nothing, lambda c: module("train", "--run-dir", c.run, "--resume")
    ))  # fmt: skip
    add("resume", "resume a dir of other files", command(
        lambda c: (c.write("run/notes.txt", "mine\n"), c.write("run/data.csv", "1,2\n")),
        lambda c: module("train", "--run-dir", c.run, "--resume"),
    ))  # fmt: skip
    add("resume", "resume without operative_config", command(
        lambda c: (c.copy("sft_run", "run"), (c.run / "operative_config.gin").unlink()),
        lambda c: module("train", "--run-dir", c.run, "--resume", "--quiet"),
    ))  # fmt: skip
    add("resume", "resume with a garbage operative_config", command(
        lambda c: (c.copy("sft_run", "run"), c.write("run/operative_config.gin", "x = = 1\n")),
        lambda c: module("train", "--run-dir", c.run, "--resume", "--quiet"),
    ))  # fmt: skip
    add("resume", "fresh start over a run", command(
        lambda c: c.copy("sft_run", "run"),
        lambda c: module("train", "--run-dir", c.run, *TINY_SFT),
    ))  # fmt: skip
    add("resume", "resume with other stages", command(
        lambda c: c.copy("sft_run", "run"),
        lambda c: module("train", "--run-dir", c.run, "--resume", "RunConfig.stages=('rm',)"),
    ))  # fmt: skip
    add("resume", "resume a file", command(
        lambda c: c.write("run", "a file\n"),
        lambda c: module("train", "--run-dir", c.run, "--resume"),
    ))  # fmt: skip
    add("resume", "run dir is a file", command(
        lambda c: c.write("run", "a file\n"),
        lambda c: module("train", "--run-dir", c.run, *TINY_SFT),
    ))  # fmt: skip
    add("resume", "run dir under /proc", command(
        nothing, lambda c: module("train", "--run-dir", "/proc/jrlhf-probe/run", *TINY_SFT)
    ))  # fmt: skip
    add("resume", "two fresh starts at once", lambda c: [
        module("train", "--run-dir", c.run, *TINY_SFT)
    ] * 2, expect="one")  # fmt: skip

    def two_resumes(c: Ctx) -> list[list[str]]:
        c.copy("ppo_run", "run")
        damage(largest_file(c.run / "checkpoints" / "2"), "delete")
        return [module("train", "--run-dir", c.run, "--resume", "--quiet")] * 2

    add("resume", "two resumes at once", two_resumes, expect="one")

    # ---- checkpoints: missing, damaged
    for fault, done in (("truncate", "truncated"), ("delete", "deleted"), ("empty", "emptied")):
        add("checkpoint", f"resume, newest step {done}", command(
            ppo_copy_with(fault),
            lambda c: module("train", "--run-dir", c.run, "--resume", "--quiet"),
        ), expect="recover")  # fmt: skip
        add("checkpoint", f"evaluate, newest step {done}", command(
            ppo_copy_with(fault),
            lambda c: module("evaluate", "--checkpoint", c.run, "--samples", "1"),
        ), expect="recover")  # fmt: skip
    add("checkpoint", "evaluate, every step's actor damaged", command(
        ppo_copy_with("truncate", ("1", "2"), "actor_params"),
        lambda c: module("evaluate", "--checkpoint", c.run, "--samples", "1"),
    ))  # fmt: skip
    add("checkpoint", "resume, every step damaged", command(
        ppo_copy_with("truncate", ("1", "2")),
        lambda c: module("train", "--run-dir", c.run, "--resume", "--quiet"),
    ))  # fmt: skip
    add("checkpoint", "evaluate a missing checkpoint", command(
        nothing, lambda c: module("evaluate", "--checkpoint", c.dir / "nowhere")
    ))  # fmt: skip
    add("checkpoint", "evaluate a dir of other files", command(
        lambda c: c.write("run/x.txt", "x\n"), lambda c: module("evaluate", "--checkpoint", c.run)
    ))  # fmt: skip
    add("checkpoint", "evaluate an explicit damaged step", command(
        ppo_copy_with("truncate", item="actor_params"),
        lambda c: module("evaluate", "--checkpoint", c.run / "checkpoints" / "2"),
    ))  # fmt: skip

    def model_fault(fault: str, target: str):
        def prepare(c: Ctx) -> None:
            model = c.copy("sft_run", "run") / "sft"
            victim = model / "model.json" if target == "json" else largest_file(model)
            if fault == "garbage":
                victim.write_text("{not json")
            else:
                damage(victim, fault)

        return prepare

    for fault, target, reason in [
        ("garbage", "json", f"{MODEL_JSON}: malformed model description"),
        ("delete", "json", f"neither a model checkpoint ({MODEL_JSON})"),
        ("truncate", "weights", "params: damaged parameters"),
    ]:
        add("checkpoint", f"init from a model with {target} {fault}", command(
            model_fault(fault, target),
            lambda c: module(
                "train", "--run-dir", c.dir / "new", *TINY_SFT,
                f"actor/RoleConfig.init='ckpt:{c.run / 'sft'}'",
            ),
        ))  # fmt: skip
        add("checkpoint", f"generate from a model with {target} {fault}", command(
            lambda c, f=fault, t=target: (model_fault(f, t)(c), id_prompts(c)),
            lambda c: module(
                "generate", "--checkpoint", c.run / "sft", "--prompts", c.dir / "p.jsonl",
                "--output", c.dir / "out.jsonl", "--max-new-tokens", "4",
            ),
        ), reason=reason)  # fmt: skip
    add("checkpoint", "convert a missing checkpoint", command(
        nothing, lambda c: module("convert", "--from", c.dir / "nowhere", "--to-hf", c.dir / "hf")
    ))  # fmt: skip
    add("checkpoint", "convert over a non-empty dir", command(
        lambda c: (c.copy("sft_run", "run"), c.write("hf/keep.txt", "mine\n")),
        lambda c: module("convert", "--from", c.run / "sft", "--to-hf", c.dir / "hf"),
    ))  # fmt: skip
    add("checkpoint", "convert a damaged model", command(
        model_fault("truncate", "weights"),
        lambda c: module("convert", "--from", c.run / "sft", "--to-hf", c.dir / "hf"),
    ))  # fmt: skip
    for prompts, label in [
        (None, "missing"),
        ('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3,\n', "bad"),
    ]:
        add("data file", f"generate, prompts {label}", command(
            lambda c, p=prompts: (c.copy("sft_run", "run"), p and c.write("p.jsonl", p)),
            lambda c: module(
                "generate", "--checkpoint", c.run / "sft", "--prompts", c.dir / "p.jsonl",
                "--output", c.dir / "out.jsonl", "--max-new-tokens", "4",
            ),
        ))  # fmt: skip

    # ---- user reward functions
    for fn, body in [
        ("nope", None),
        ("no_such_module:reward", None),
        ("json:no_such_function", None),
        ("os:getcwd", None),
        ("probe_reward:reward", "def reward(prompt_ids, response_ids):\n    raise KeyError('x')\n"),
        ("probe_reward:reward", "def reward(prompt_ids, response_ids):\n    return 'high'\n"),
        ("probe_reward:reward", "def reward(prompt_ids, response_ids):\n    return float('nan')\n"),
        ("probe_reward:reward", "def reward(prompt_ids, response_ids)\n    return 1.0\n"),
        ("probe_reward:reward", "import no_such_dependency\n\ndef reward(p, r):\n    return 1.0\n"),
    ]:
        label = fn if body is None else f"{fn}: {body.splitlines()[-1].strip()[:40]}"
        prepare = reward_module(body) if body else nothing
        add("reward", label, command(prepare, grpo_with_reward(fn)), pythonpath=True)

    # ---- command-line arguments
    for name, args in [
        ("launch", ["--processes", "0", "--devices-per-process", "4", "--", "train", "--check"]),
        ("launch", ["--processes", "2", "--devices-per-process", "4"]),
        ("launch", ["--processes", "2", "--devices-per-process", "4", "--", "nosuchentry"]),
        ("launch", ["--processes", "2", "--devices-per-process", "0", "--", "train", "--check"]),
        ("launch", ["--processes", "abc", "--devices-per-process", "4", "--", "train"]),
        ("launch", ["--processes", "2", "--devices-per-process", "4", "--timeout", "-1", "--",
                    "train", "--check"]),
        ("launch", ["--processes", "2", "--devices-per-process", "4", "--grace", "nan", "--",
                    "train", "--check"]),
        ("train", ["--bogus-flag"]),
        ("train", ["--run-dir"]),
        ("evaluate", ["--checkpoint"]),
        ("generate", ["--checkpoint", "x", "--prompts", "p", "--output", "o",
                      "--max-new-tokens", "abc"]),
        ("bench", ["nosuchsuite"]),
    ]:  # fmt: skip
        add("arguments", f"{name} {' '.join(args)}", command(
            nothing, lambda c, n=name, a=args: module(n, *a)
        ))  # fmt: skip
    for args in [["--samples", "0"], ["--num-prompts", "-1"], ["--samples", "-2"]]:
        add("arguments", f"evaluate {' '.join(args)}", command(
            lambda c: c.copy("ppo_run", "run"),
            lambda c, a=args: module("evaluate", "--checkpoint", c.run, *a),
        ))  # fmt: skip
    for args, reason in [
        (["--max-new-tokens", "0"], "max_new_tokens"), (["--num-samples", "0"], "num_samples"),
        (["--temperature", "-1"], "temperature"), (["--top-p", "2"], "top_p"),
        (["--max-new-tokens", "4", "--page-size", "0"], "page_size"),
    ]:  # fmt: skip
        add("arguments", f"generate {' '.join(args)}", command(
            lambda c: (c.copy("sft_run", "run"), id_prompts(c)),
            lambda c, a=args: module(
                "generate", "--checkpoint", c.run / "sft", "--prompts", c.dir / "p.jsonl",
                "--output", c.dir / "out.jsonl",
                *(["--max-new-tokens", "4"] if "--max-new-tokens" not in a else []), *a,
            ),
        ), reason=reason)  # fmt: skip
    return out


# ------------------------------------------------------------------------------ running


def snapshot(directory: Path) -> dict[str, str]:
    """Hash of every file under ``directory``, by relative path; a run directory's lock file
    is left out (it names its current holder, so every start or resume rewrites it: no saved
    data changes)."""
    out = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and not p.is_symlink() and p.name != LOCK_FILE:
            out[str(p.relative_to(directory))] = hashlib.sha1(p.read_bytes()).hexdigest()
    return out


def error_lines(stderr: str) -> list[str]:
    """Stderr less logging lines, argparse's usage lines and launcher prefixes' duplicates."""
    lines, usage = [], False
    for line in stderr.splitlines():
        if not line.strip() or LOG_LINE.match(line):
            continue
        if line.startswith("usage:"):
            usage = True
            continue
        if usage and line.startswith(" "):
            continue
        usage = False
        lines.append(line)
    return lines


def run_one(argv: list[str], env: dict[str, str], timeout: float) -> dict:
    start = time.monotonic()
    try:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, err = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = None
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
    return {"rc": rc, "stderr": err, "seconds": round(time.monotonic() - start, 1)}


def run_together(argvs: list[list[str]], env: dict[str, str], timeout: float) -> list[dict]:
    if len(argvs) == 1:
        return [run_one(argvs[0], env, timeout)]
    with concurrent.futures.ThreadPoolExecutor(len(argvs)) as pool:
        return list(pool.map(lambda a: run_one(a, env, timeout), argvs))


def verdict(case: Case, results: list[dict], changed: list[str], created: list[str]) -> str:
    """One case's verdict (see the module docstring)."""
    if any(TRACEBACK in r["stderr"] or (r["rc"] is not None and r["rc"] < 0) for r in results):
        return "damaging" if changed and case.expect == "refuse" else "traceback"
    if case.expect == "refuse" and changed:
        return "damaging"
    if any(r["rc"] is None for r in results):
        return "timeout"
    ok = [r for r in results if r["rc"] == 0]
    refused = [r for r in results if r["rc"] != 0]
    if case.expect == "recover":
        return "recovered" if len(ok) == len(results) else one_line(refused, created)
    if case.expect == "one":
        # Refused up front, naming the run that holds the directory (its pid), not failing
        # later on what the other one wrote: else the second writer was not stopped.
        named = all("pid" in (error_lines(r["stderr"]) or [""])[-1] for r in refused)
        if len(ok) > 1 or not named:
            return "silent"
        return one_line(refused, [])
    if ok:
        return "silent"
    found = one_line(refused, created)
    if found == "clean" and not all(
        case.reason in (error_lines(r["stderr"]) or [""])[-1] for r in refused
    ):
        return "misread"
    return found


def one_line(refused: list[dict], created: list[str]) -> str:
    if any(len(error_lines(r["stderr"])) > 1 for r in refused):
        return "noisy"
    return "leftover" if created else "clean"


def run_case(case: Case, index: int, root: Path, fix: Path, base_env: dict[str, str]) -> dict:
    ctx = Ctx(root / f"case{index:03d}", fix)
    ctx.dir.mkdir()
    env = dict(base_env)
    if case.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ctx.dir), env.get("PYTHONPATH")]))
    row: dict = {"name": case.name, "kind": case.kind, "expect": case.expect}
    try:
        argvs = case.build(ctx)
    except Exception as e:  # a probe that cannot set its case up is reported, not fatal
        return {**row, "verdict": "setup failed", "error": f"{type(e).__name__}: {e}"}
    before = snapshot(ctx.dir)
    results = run_together(argvs, env, case.timeout)
    after = snapshot(ctx.dir)
    changed = sorted(k for k in before if after.get(k) != before[k])
    created = sorted(set(after) - set(before))
    row["verdict"] = verdict(case, results, changed, created)
    row["commands"] = [
        " ".join(a.replace(str(ctx.dir), "$CASE") for a in argv[1:]) for argv in argvs
    ]
    row["rc"] = [r["rc"] for r in results]
    row["seconds"] = [r["seconds"] for r in results]
    lines = [error_lines(r["stderr"]) for r in results]
    row["error_lines"] = [len(x) for x in lines]
    row["last_error"] = [x[-1][:300].replace(str(ctx.dir), "$CASE") if x else "" for x in lines]
    if changed:
        row["changed"] = changed[:10]
    if created:
        row["created"] = created[:10]
    if row["verdict"] not in ("clean", "recovered"):  # what to look at
        row["stderr_tail"] = [r["stderr"][-1500:].replace(str(ctx.dir), "$CASE") for r in results]
    return row


def build_fixtures(fix: Path, env: dict[str, str]) -> None:
    """The data set, a tiny SFT run and a two-iteration PPO run from it (checkpoints 1 and 2)."""
    SyntheticTask(seed=0).write_jsonl(
        fix / "data", num_prompts=64, num_heldout=16, num_sft=64, num_pairs=64
    )
    steps = [
        module("train", "--run-dir", fix / "sft_run", *TINY_SFT, "SFTConfig.steps=4"),
        module("train", "--run-dir", fix / "ppo_run", "--quiet",
               *ppo_bindings(fix / "sft_run" / "sft")),
    ]  # fmt: skip
    for argv in steps:
        p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"probe: building a fixture failed: {' '.join(argv)}\n{p.stderr}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, help="write the JSON report here too")
    p.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    p.add_argument(
        "--only", default="", help="run only cases whose kind or name has one of these (a,b,...)"
    )
    p.add_argument("--keep", action="store_true", help="keep the cases' directories")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    args = p.parse_args(argv)
    if args.out is not None and not args.out.parent.is_dir():
        p.error(f"--out {args.out}: folder {args.out.parent} does not exist")
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    wanted = args.only.split(",")
    todo = [c for c in cases() if any(w in c.kind or w in c.name for w in wanted)]
    if args.list:
        for c in todo:
            print(f"{c.kind:14} {c.expect:8} {c.name}")
        print(f"{len(todo)} cases")
        return 0
    root = Path(tempfile.mkdtemp(prefix="jrlhf-probe-"))
    env = dict(os.environ)
    env.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(root / "xla-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        TOKENIZERS_PARALLELISM="false",
    )
    env.pop("XLA_FLAGS", None)  # each command asks for its own devices, as a user's would
    try:
        start = time.monotonic()
        build_fixtures(root / "fixtures", env)
        print(f"probe: fixtures in {time.monotonic() - start:.0f} s", file=sys.stderr)
        rows: list[dict] = [{}] * len(todo)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {
                pool.submit(run_case, c, i, root, root / "fixtures", env): i
                for i, c in enumerate(todo)
            }
            for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
                row = future.result()
                rows[futures[future]] = row
                print(f"probe: {done}/{len(todo)} {row['verdict']:9} {row['kind']}: "
                      f"{row['name']}", file=sys.stderr)  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    tally = collections.Counter(r["verdict"] for r in rows)
    by_kind: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in rows:
        by_kind[r["kind"]][r["verdict"]] += 1
    report = {
        "cases": len(rows),
        "tally": {v: tally[v] for v in (*VERDICTS, "setup failed") if tally[v]},
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "seconds": round(time.monotonic() - start, 1),
        "results": rows,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out is not None:
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(text + "\n")
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
