"""Pods for real: the pipeline as several JAX processes on this machine (multi-controller, gloo),
against the same pipeline as one process over the same global mesh.

These tests start real processes through ``python -m jrlhf.launch`` and take minutes on two
cores, so they carry the ``multiprocess`` marker: the default suite leaves them out and CI runs
them as a step of their own (`.ci/run`; `python -m pytest -q -m multiprocess`).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from run_helpers import assert_rows_close, hold_lock, metric_rows

from jrlhf.cli import train
from jrlhf.pipeline.run_lock import LOCK_FILE

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[2]
# The default pipeline's stages, small: SFT, reward model, PPO with a checkpoint every iteration.
PIPELINE = [
    "SFTConfig.steps=8",
    "RewardModelConfig.steps=8",
    "SFTConfig.batch_size=16",
    "RewardModelConfig.batch_size=16",
    "TaskConfig.num_heldout=16",
    "RLConfig.prompts_per_iteration=16",
    "RLConfig.minibatch_size=16",
    "RLConfig.epochs=1",
    "RLConfig.iterations=3",
    "RLConfig.checkpoint_every=1",
    "RunConfig.tensorboard=False",
]
# Timings, and the sample channel's byte and key counts (only a run whose processes exchange
# samples has them; test_async_generation_and_training_processes... checks them).
SKIP = ("time", "tokens_per_sec", "sft/steps_per_s", "rm/steps_per_s", "samples/")


def launch(processes: int, devices: int, entry: str, *args: str, env_extra=None, timeout=900):
    """``python -m jrlhf.launch`` with the given command; returns the CompletedProcess."""
    # The session's XLA_FLAGS (fast compilation; the launcher sets each process's device count)
    env = dict(os.environ)
    env.update(env_extra or {})
    cmd = [
        sys.executable, "-m", "jrlhf.launch", "--processes", str(processes),
        "--devices-per-process", str(devices), "--", entry, *args,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def why(out: subprocess.CompletedProcess) -> str:
    """A failed launch's diagnosis: its processes' error and fatal-log lines from anywhere in
    stderr (a dying process's stack traces push the cause out of any tail), then the tail."""
    cause = re.compile(r"Error|error:|Check fail|DEADLINE|eartbeat|\] F\d{4}|^\[p\d\] F\d{4}")
    lines = [ln for ln in out.stderr.splitlines() if cause.search(ln) and " @ " not in ln]
    return "\n".join(lines[:40]) + "\n...\n" + out.stderr[-1500:]


def kill_then_resume(
    processes: int, devices: int, args: list[str], run_dir: Path, process: int
) -> subprocess.CompletedProcess:
    """Train as ``processes`` x ``devices`` with ``process`` dying during iteration 2 (the
    launcher must name it in its last line; the iteration-1 checkpoint stays), then
    ``--resume``, which must succeed; returns the resumed launch."""
    killed = launch(
        processes, devices, "train", *args, "RLConfig.async_checkpoint=False",
        env_extra={"JRLHF_DEBUG_EXIT_AT_ITERATION": "2", "JRLHF_DEBUG_EXIT_PROCESS": str(process)},
        timeout=600,
    )  # fmt: skip
    assert killed.returncode != 0, killed.stdout[-2000:]
    last = killed.stderr.strip().splitlines()[-1]
    assert f"process {process}" in last, killed.stderr[-3000:]
    assert (run_dir / "checkpoints" / "1").is_dir()
    resumed = launch(processes, devices, "train", *args, "--resume", timeout=600)
    assert resumed.returncode == 0, why(resumed)
    return resumed


def rows(run_dir: Path, stage: str) -> list[dict]:
    out = []
    for line in (run_dir / "logs" / stage / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append({k: v for k, v in row.items() if not k.startswith(SKIP) and v is not None})
    return out


def completions(path: Path) -> list[list[int]]:
    return [json.loads(line)["completion_ids"] for line in path.read_text().splitlines() if line]


def assert_same_metrics(a: Path, b: Path, stages=("sft", "rm", "ppo"), atol=1e-5):
    for stage in stages:
        ra, rb = rows(a, stage), rows(b, stage)
        assert len(ra) == len(rb), stage
        for x, y in zip(ra, rb):
            assert x.keys() == y.keys(), stage
            for k in x:
                np.testing.assert_allclose(x[k], y[k], rtol=1e-4, atol=atol, err_msg=f"{stage} {k}")


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: the pipeline as one process over 8 devices."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    assert train.main(["--run-dir", str(run_dir), "--quiet", *PIPELINE]) == 0
    return run_dir


def test_two_processes_equal_one_through_a_lost_process_and_resume(single, tmp_path):
    """2 processes x 4 devices: SFT, RM and PPO; process 1 dies abruptly (like kill -9) during
    iteration 2; the launcher ends the job within a bounded time naming process 1; --resume
    continues from the iteration-1 checkpoint; every metric and the held-out scores equal the
    single-process run's, and summary.json has the same keys."""
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), "--quiet", *PIPELINE]
    # Saved synchronously, the iteration-1 checkpoint is on disk before iteration 2 starts (an
    # asynchronous save may still be committing when the process dies).
    kill_then_resume(2, 4, args, run_dir, process=1)
    assert_same_metrics(single, run_dir)
    one = json.loads((single / "summary.json").read_text())
    two = json.loads((run_dir / "summary.json").read_text())
    assert one.keys() == two.keys()
    for when in ("before", "after"):
        assert one[when].keys() == two[when].keys()
        for k in one[when]:
            np.testing.assert_allclose(two[when][k], one[when][k], rtol=1e-4, atol=1e-5)
    # one writer: a single metrics file, no record twice
    steps = [r["step"] for r in rows(run_dir, "ppo") if "reward" in r]
    assert steps == [1, 2, 3]


def test_four_processes_ppo_and_resume_on_another_process_count(single, tmp_path):
    """PPO as 4 processes x 2 devices from the single run's SFT and reward models equals the
    single run's PPO; then one process over 8 devices resumes it for a fourth iteration."""
    run_dir = tmp_path / "run"
    start = [
        "RunConfig.stages=('ppo',)",
        f"actor/RoleConfig.init='ckpt:{single}/sft'",
        f"reference/RoleConfig.init='ckpt:{single}/sft'",
        f"reward/RoleConfig.init='ckpt:{single}/rm'",
        f"critic/RoleConfig.init='ckpt:{single}/rm'",
    ]
    out = launch(4, 2, "train", "--run-dir", str(run_dir), "--quiet", *PIPELINE, *start)
    assert out.returncode == 0, why(out)
    assert_same_metrics(single, run_dir, stages=("ppo",))
    more = [*PIPELINE, *start, "RLConfig.iterations=4"]
    assert train.main(["--run-dir", str(run_dir), "--quiet", "--resume", *more]) == 0
    assert [r["step"] for r in rows(run_dir, "ppo") if "reward" in r] == [1, 2, 3, 4]


def test_grpo_evaluate_export_and_generate_as_two_processes(single, tmp_path):
    """GRPO, evaluation onto another mesh, HF export and the generate CLI, each as 2 processes,
    give what one process gives. The GRPO run is multi-turn (the calculator task's tool, which
    process 0 steps and broadcasts), fuses scoring into generation and migrates each rollout's
    last 24 rows onto one replica of the generation mesh (2 devices of one process): the other
    process keeps driving the tail's loop."""
    grpo = [
        "--config", "configs/calculator_grpo.gin",
        "RunConfig.stages=('grpo',)",
        "actor/RoleConfig.init='tiny'",
        "RLConfig.samples_per_prompt=4",
        "RLConfig.prompts_per_iteration=8",
        "RLConfig.minibatch_size=16",
        "RLConfig.iterations=2",
        "TaskConfig.num_heldout=8",
        "RunConfig.tensorboard=False",
        "Fusion.enabled=True",
        "Fusion.migrate_rows=24",
        "DecodeConfig.chunk_steps=2",  # rows finish over several chunks: a tail to migrate
    ]  # fmt: skip
    two, one = tmp_path / "grpo2", tmp_path / "grpo1"
    out = launch(2, 4, "train", "--run-dir", str(two), "--quiet", *grpo)
    assert out.returncode == 0, why(out)
    assert train.main(["--run-dir", str(one), "--quiet", *grpo]) == 0
    assert_same_metrics(one, two, stages=("grpo",))
    rows = [json.loads(x) for x in (two / "logs/grpo/metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "fusion/migrated_rows" in r]
    assert len(rows) == 2 and min(r["fusion/migrated_rows"] for r in rows) > 0, rows
    assert min(r["env/tool_calls"] for r in rows) > 0, rows

    # evaluate the PPO run's policy on a mesh it was not trained on: 4 devices, 2 per process
    mesh = "data=2,tensor=2@2:6"
    ev = [f"--checkpoint={single}", f"--mesh={mesh}", "--samples=2"]
    out = launch(2, 4, "evaluate", *ev, f"--output={tmp_path / 'eval2.json'}")
    assert out.returncode == 0, why(out)
    from jrlhf.cli import evaluate

    assert evaluate.main([*ev, f"--output={tmp_path / 'eval1.json'}"]) == 0
    e2 = json.loads((tmp_path / "eval2.json").read_text())
    e1 = json.loads((tmp_path / "eval1.json").read_text())
    for k in ("gt_score", "reward", "kl_to_ref", "response_len", "num_samples"):
        np.testing.assert_allclose(e2[k], e1[k], rtol=1e-4, atol=1e-5, err_msg=k)

    # export: the files written by two processes equal one process's
    out = launch(2, 4, "convert", f"--from={single}", f"--to-hf={tmp_path / 'hf2'}")
    assert out.returncode == 0, why(out)
    from jrlhf.cli import convert

    assert convert.main([f"--from={single}", f"--to-hf={tmp_path / 'hf1'}"]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "hf2" / name).read_bytes() == (tmp_path / "hf1" / name).read_bytes()

    # generate from the export: same completions as one process
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [1, 5 + i, 7]}) + "\n" for i in range(6)))
    gen = [f"--hf={tmp_path / 'hf1'}", f"--prompts={prompts}", "--max-new-tokens=8", "--greedy"]
    out = launch(2, 4, "generate", *gen, f"--output={tmp_path / 'gen2.jsonl'}")
    assert out.returncode == 0, why(out)
    from jrlhf.cli import generate

    assert generate.main([*gen, f"--output={tmp_path / 'gen1.jsonl'}"]) == 0
    g2 = [
        json.loads(x)["completion_ids"]
        for x in (tmp_path / "gen2.jsonl").read_text().split("\n")
        if x
    ]
    g1 = [
        json.loads(x)["completion_ids"]
        for x in (tmp_path / "gen1.jsonl").read_text().split("\n")
        if x
    ]
    assert g2 == g1 and len(g1) == 6


# configs/ppo_tiny.gin's PPO stage from tiny random models, the actor (1F1B) and the critic
# (GPipe) trained over two pipeline stages: on 2 processes x 4 devices, one stage a process.
UNSTAGED = [
    "--config", "configs/ppo_tiny.gin",
    "RunConfig.stages=('ppo',)",
    *[f"{role}/RoleConfig.init='tiny'" for role in ("actor", "reference", "reward", "critic")],
    *PIPELINE[4:8],
    "RLConfig.iterations=2",
    "RunConfig.tensorboard=False",
]  # fmt: skip
STAGES = [
    *UNSTAGED,
    *[f"{role}/RoleConfig.train_mesh='stage=2,fsdp=2,tensor=2'" for role in ("actor", "critic")],
    "critic/RoleConfig.infer_mesh='stage=2,fsdp=4'",  # its values scored over the stages too
    "actor/RoleConfig.pipeline_schedule='1f1b'",  # the critic keeps GPipe
]  # fmt: skip


def test_pipeline_stages_on_a_process_each_equal_one_process(tmp_path):
    """The actor (1F1B) and the critic (GPipe; its scoring too) train over 2 pipeline stages,
    each stage the 4 devices of one process (the activations cross processes by collective
    permutes): every metric equals the one-process run of the same job without stages (the
    default meshes over all 8 devices), so stages and their crossing processes change no
    number."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert train.main(["--run-dir", str(one), "--quiet", *UNSTAGED]) == 0
    out = launch(2, 4, "train", "--run-dir", str(two), "--quiet", *STAGES)
    assert out.returncode == 0, why(out)
    assert "train: {'stage': 2, 'fsdp': 2, 'tensor': 2} [0, 1, 2, 3, 2048" in out.stderr
    assert "critic/RoleConfig.infer_mesh = 'stage=2,fsdp=4'" in (two / "plan.gin").read_text()
    # every metric but the bytes a weight transition moves, which follow the layouts
    assert_rows_close(metric_rows(two), metric_rows(one))
    assert len([r for r in rows(two, "ppo") if "reward" in r]) == 2


SEPARATE = [*PIPELINE, "RunConfig.placement='separate'"]


@pytest.fixture(scope="module")
def separate_single(tmp_path_factory):
    """The reference for separated placement: the ``separate`` plan (generation on devices 0-3,
    everything else on 4-7) as one process over 8 devices."""
    run_dir = tmp_path_factory.mktemp("separate1") / "run"
    assert train.main(["--run-dir", str(run_dir), "--quiet", *SEPARATE]) == 0
    return run_dir


def test_separated_processes_equal_one_process(separate_single, tmp_path):
    """``separate`` as 2 processes x 4 devices puts generation on process 0's devices and SFT,
    RM, scoring and training on process 1's: the actor's weights cross processes after every
    update (cross-host transfer in the resharder), checkpoints go through the copies view, and
    every metric (rewards, losses, KL, bytes moved) equals the one-process run's. (Killing a
    process of a separated layout and resuming: the asynchronous and group tests below.)"""
    run_dir = tmp_path / "run"
    out = launch(2, 4, "train", "--run-dir", str(run_dir), "--quiet", *SEPARATE)
    assert out.returncode == 0, why(out)
    assert_same_metrics(separate_single, run_dir)
    ppo = [r for r in rows(run_dir, "ppo") if "reward" in r]
    assert [r["step"] for r in ppo] == [1, 2, 3]
    assert all(r["reshard/bytes"] > 0 for r in ppo)
    one = json.loads((separate_single / "summary.json").read_text())
    two = json.loads((run_dir / "summary.json").read_text())
    for k in one["after"]:
        np.testing.assert_allclose(two["after"][k], one["after"][k], rtol=1e-4, atol=1e-5)
    # the measured transition (process 0 receives the actor), printed for docs/performance.md
    times = [
        json.loads(line)["time/reshard"]
        for line in (run_dir / "logs" / "ppo" / "metrics.jsonl").read_text().splitlines()
        if "time/reshard" in line
    ]
    print(f"separated 2x4: reshard bytes {ppo[0]['reshard/bytes']:.0f}, seconds {times}")


def test_a_separating_plan_the_transfer_cannot_run_is_refused_in_one_line(tmp_path):
    """Training the actor on process 0's 4 devices and generating on devices 3 and 4 (one of
    each process): the weights would cross processes onto a mesh that shares a device with the
    training mesh without being part of it, which JAX's shard-for-shard transfer cannot do:
    refused before any work, naming the mesh, not a traceback."""
    bindings = [
        "RunConfig.stages=('ppo',)",
        "RunConfig.placement='flatten'",
        "actor/RoleConfig.train_mesh='fsdp=4@0:4'",
        "actor/RoleConfig.generate_mesh='data=2@3,4'",
        *[f"{role}/RoleConfig.init='tiny'" for role in ("actor", "reference", "reward", "critic")],
        *PIPELINE,
    ]
    out = launch(2, 4, "train", "--run-dir", str(tmp_path / "run"), "--quiet", *bindings)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert errors and "actor_generate mesh data=2@3,4" in errors[0], out.stderr[-2000:]
    assert "shard for shard" in errors[0]
    # every process refused and left by itself (none ended by the launcher), and the new run's
    # directory went with them
    assert "; ended" not in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_run_directory_in_use_is_refused_by_every_process(tmp_path):
    """Process 0 takes the run directory's lock for the job; when another run holds it, every
    process refuses in one line naming the holder, and nothing is written."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = hold_lock(run_dir)
    try:
        out = launch(2, 4, "train", "--run-dir", str(run_dir), "--quiet", *PIPELINE, timeout=300)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert out.returncode == 2, out.stderr[-2000:]
    # Each process refuses with the same line; the launcher shows the first to exit and folds
    # what the others write after it into its count (so one or two such lines, by timing).
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert errors and all(f"(pid {holder.pid} on host" in e for e in errors), errors
    last = out.stderr.strip().splitlines()[-1]
    assert "exited with 2" in last and "; ended" not in last, out.stderr[-2000:]
    assert [p.name for p in run_dir.iterdir()] == [LOCK_FILE]


# PPO from tiny random models (no SFT/RM stages), separated, with bounded staleness 1.
ASYNC = [
    "RunConfig.stages=('ppo',)",
    "RunConfig.placement='separate'",
    *[f"{role}/RoleConfig.init='tiny'" for role in ("actor", "reference", "reward", "critic")],
    *PIPELINE[4:],
    "Asynchrony.max_staleness=1",
    "OffPolicy.correction='tis'",
]


def test_async_generation_and_training_processes_equal_one_process_through_a_resume(tmp_path):
    """max_staleness=1 with ``separate`` on 2 processes x 4 devices: process 0 only generates
    and process 1 only scores and trains, each at its own pace, meeting once per iteration.
    Process 1 dies during iteration 2; the resume trains on the batch saved with the iteration-1
    checkpoint; every metric (staleness included) equals the one-process run of the same
    schedule, where nothing overlaps."""
    one = tmp_path / "one"
    assert train.main(["--run-dir", str(one), "--quiet", *ASYNC]) == 0
    run_dir = tmp_path / "two"
    args = ["--run-dir", str(run_dir), "--quiet", *ASYNC]
    kill_then_resume(2, 4, args, run_dir, process=1)
    assert_same_metrics(one, run_dir, stages=("ppo",))
    ppo = [r for r in rows(run_dir, "ppo") if "reward" in r]
    assert [r["step"] for r in ppo] == [1, 2, 3]
    assert [r["staleness/max"] for r in ppo] == [0, 1, 1]
    # the two sides each timed their own part: generation on process 0, training on process 1
    raw = (run_dir / "logs" / "ppo" / "metrics.jsonl").read_text().splitlines()
    timed = [r for r in map(json.loads, raw) if "reward" in r]
    assert all("time/generate" in r and "time/train" in r for r in timed), timed[-1].keys()
    # Samples crossed as arrays (the data plane); the coordination service carried a small
    # header and result per iteration and holds only messages in flight (every key is deleted
    # once read).
    assert sum(r["samples/data_bytes"] for r in timed) > 0
    for r in timed:
        assert 0 < r["samples/control_bytes"] < 8192 and r["samples/stored_keys"] <= 4, r


# Four processes x 2 devices with generation on processes of its own, GRPO with DAPO's dynamic
# sampling on a verifiable reward (a random actor gives most prompts no signal, so batches take
# more rounds), fusion, partial rollouts and a LoRA actor; the one-process run of the same plan
# is the reference (the schedule and its numbers are the same, nothing overlaps).
GROUPS = [
    "RunConfig.stages=('grpo',)",
    "RunConfig.placement='separate'",
    *[f"{role}/RoleConfig.init='tiny'" for role in ("actor", "reference")],
    *PIPELINE[4:],
    "TaskConfig.reward_fn='synthetic_ground_truth'",
    "RLConfig.samples_per_prompt=4",
    "SampleFilters.dynamic_sampling=True",
    "SampleFilters.max_sampling_rounds=3",
    "Fusion.enabled=True",
    "Asynchrony.max_staleness=2",
    "Asynchrony.partial_rollout_tokens=6",  # half a response a pass
    "OffPolicy.correction='tis'",
    # a LoRA actor: the training group merges the adapters and the merged kernels cross
    "actor/RoleConfig.lora_rank=4",
    "actor/RoleConfig.learning_rate=1e-3",
]


def test_generation_and_training_groups_of_two_processes_equal_one_process(tmp_path):
    """4 processes x 2 devices, ``separate``: generation on processes 0-1, scoring and training
    on 2-3, each group reading its host values among its own processes; a LoRA actor (merged
    by the training group before its weights cross); max_staleness=2 with partial rollouts
    (samples continue across updates on the generating group), dynamic sampling (the training
    group scores each round as it arrives and asks for more rounds) and fusion. Process 2 dies
    during iteration 2; --resume continues from the iteration-1 checkpoint; every metric equals
    the one-process run's, and every batch is trained once, in order, within the bound."""
    one = tmp_path / "one"
    assert train.main(["--run-dir", str(one), "--quiet", *GROUPS]) == 0
    run_dir = tmp_path / "four"
    args = ["--run-dir", str(run_dir), "--quiet", *GROUPS]
    resumed = kill_then_resume(4, 2, args, run_dir, process=2)
    assert "generation on processes [0, 1], the rest on [2, 3]" in resumed.stderr
    assert_same_metrics(one, run_dir, stages=("grpo",))
    grpo = [r for r in rows(run_dir, "grpo") if "reward" in r]
    assert [r["step"] for r in grpo] == [1, 2, 3]
    assert max(r["staleness/max"] for r in grpo) == 2  # the bound is reached, never passed
    assert all(r["partial/passes_max"] >= 1 for r in grpo)
    assert max(r["sampling/rounds"] for r in grpo) >= 2  # batches took more rounds


# Generation on process 0, scoring (reference, reward, critic inference) on process 1, training
# on processes 2-3: three groups of calls, the last two one training group whose host reads go
# between its processes; weights cross between meshes of 4 and 2 devices (stacked layouts).
THREE_WAY = [
    *ASYNC[:1],
    "RunConfig.placement='custom'",
    *ASYNC[2:],
    "actor/RoleConfig.generate_mesh='data=2@0:2'",
    *[f"{role}/RoleConfig.infer_mesh='fsdp=2@2:4'" for role in ("reference", "reward", "critic")],
    "reward/RoleConfig.train_mesh='fsdp=2@2:4'",
    *[f"{role}/RoleConfig.train_mesh='fsdp=2,tensor=2@4:8'" for role in ("actor", "critic")],
]


def test_generation_scoring_and_training_on_one_one_and_two_processes_equal_one_process(
    tmp_path,
):
    """4 processes x 2 devices: generation on process 0, scoring on 1, training on 2-3, with
    max_staleness=1; the actor's weights go from 4 training devices to 2 generation devices and
    the critic's from 4 to 2 scoring devices. Process 0, the whole generating group (and the
    coordinator), dies during iteration 2 right after generating; the launcher names it, the
    others end, and --resume continues from the iteration-1 checkpoint: every metric equals the
    one-process run's, every batch trained once, in order."""
    one = tmp_path / "one"
    assert train.main(["--run-dir", str(one), "--quiet", *THREE_WAY]) == 0
    run_dir = tmp_path / "four"
    args = ["--run-dir", str(run_dir), "--quiet", *THREE_WAY]
    out = kill_then_resume(4, 2, args, run_dir, process=0)
    assert "generation on processes [0], the rest on [1, 2, 3]" in out.stderr
    assert_same_metrics(one, run_dir, stages=("ppo",))
    ppo = [r for r in rows(run_dir, "ppo") if "reward" in r]
    assert [r["step"] for r in ppo] == [1, 2, 3] and all(r["reshard/bytes"] > 0 for r in ppo)
