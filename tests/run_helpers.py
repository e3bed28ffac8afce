"""What the end-to-end tests share: small run bindings, metric rows, a training subprocess, a
run directory's lock held by another process, and a storage that refuses writes.

A preemption is either real (``train_subprocess`` with JRLHF_DEBUG_EXIT_AT_ITERATION: the
process exits on the spot) or, cheaper, in the test's own process (``preempt_at``).

The runs themselves (``base_run``, ``colocated_run``) are session fixtures in conftest.py, so
every test module reuses one SFT + reward-model run and one PPO run.
"""

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SMALL = [
    "TaskConfig.num_heldout=16",
    "RLConfig.prompts_per_iteration=16",
    "RLConfig.minibatch_size=16",
    "RLConfig.epochs=1",
    "RunConfig.tensorboard=False",
]


class Preempted(BaseException):
    """A preemption in the test's own process: a BaseException, so no ``except Exception`` of
    the trainer handles it and nothing after the preemption hook runs."""


def preempt_at(monkeypatch, iteration: int) -> None:
    """Make jrlhf's preemption hook (jrlhf.runtime.preempt.exit_if_asked) raise ``Preempted``
    in RL iteration ``iteration`` (counted from 0) of this process, wherever the schedule calls
    it; undo with ``monkeypatch.undo()``."""
    from jrlhf.ppo import trainer
    from jrlhf.ppo.schedules import bounded

    def hook(i: int) -> None:
        if i == iteration:
            raise Preempted(i)

    for module in (trainer, bounded):
        monkeypatch.setattr(module, "exit_if_asked", hook)


def preempt_at_step(monkeypatch, where: str) -> None:
    """Make the supervised stages' preemption hook raise ``Preempted`` right after step
    ``where`` (``"stage:step"``, e.g. ``"sft:15"``) in this process; undo with
    ``monkeypatch.undo()``."""
    from jrlhf.pipeline import supervised

    def hook(stage: str, step: int) -> None:
        if f"{stage}:{step}" == where:
            raise Preempted(where)

    monkeypatch.setattr(supervised, "exit_at_step_if_asked", hook)


def ppo_bindings(base: Path, *extra: str) -> list[str]:
    """A 4-iteration PPO run from ``base``'s SFT policy and reward model. Its held-out
    evaluation (4 samples a prompt) scores as many rows as an iteration does (4 prompts, 16
    rows), so the scoring programs it compiles are the iterations' own: a third of a run's time
    on the 2-core machine when they differed."""
    return [
        "RunConfig.stages=('ppo',)",
        f"actor/RoleConfig.init='ckpt:{base}/sft'",
        f"reference/RoleConfig.init='ckpt:{base}/sft'",
        f"reward/RoleConfig.init='ckpt:{base}/rm'",
        f"critic/RoleConfig.init='ckpt:{base}/rm'",
        "RLConfig.iterations=4",
        "RLConfig.checkpoint_every=2",
        *SMALL,
        "TaskConfig.num_heldout=4",
        *extra,
    ]


def metric_rows(run_dir: Path, stage: str = "ppo") -> list[dict]:
    rows = []
    for line in (run_dir / "logs" / stage / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.append(
            {
                k: v
                for k, v in row.items()
                # timings, and the bytes a plan's weight transition moves, differ between plans
                if not k.startswith(("time", "reshard/"))
                and k != "tokens_per_sec"
                and v is not None
            }
        )
    return rows


def assert_rows_close(a, b, rtol=1e-4, atol=1e-5, only_in_a=("fusion/",)):
    """Metric rows equal to tolerance, key for key; keys starting with ``only_in_a`` (what a
    fused run counts of its own fusion) may be in ``a`` alone."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        ra = {k: v for k, v in ra.items() if not k.startswith(only_in_a) or k in rb}
        assert ra.keys() == rb.keys()
        for k in ra:
            np.testing.assert_allclose(ra[k], rb[k], rtol=rtol, atol=atol, err_msg=k)


def train_subprocess(args, env_extra=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    return subprocess.run(
        [sys.executable, "-m", "jrlhf.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def parity_reward(prompt_ids, response_ids) -> float:
    """A verifiable reward with no signal for about half the prompts: 0 for every sample of a
    prompt whose ids sum to an even number, scores that vary with the response otherwise."""
    if sum(prompt_ids) % 2 == 0:
        return 0.0
    return float(sum(response_ids) % 7)


def hold_lock(run_dir: Path) -> subprocess.Popen:
    """Another process holding ``run_dir``'s lock (as a run does), once it says so."""
    code = (
        "import sys, time; from pathlib import Path; from jrlhf.pipeline.run_lock import "
        "lock_run_dir; lock = lock_run_dir(Path(sys.argv[1])); print('locked', flush=True); "
        "time.sleep(600)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "locked"
    return holder


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """No file of this process can grow past ``nbytes`` in the body: a write past it fails
    part-way with a real EFBIG from the kernel, as a full disk refuses one (SIGXFSZ ignored, so
    the write fails instead of the process)."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    xfsz = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, xfsz)
