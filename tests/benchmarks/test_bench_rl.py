"""python -m jrlhf.bench rl on a tiny setting: one JSON object with the phase, throughput, FLOP,
compile and op-profile keys."""

from __future__ import annotations

import importlib.util
import json

import pytest

from benchmarks import rl as bench
from jrlhf.cli import bench as bench_cli


def test_bench_rl_prints_json(capsys):
    assert "rl" in bench_cli.SUITES
    tiny = ["--hidden", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--mlp", "64"]
    rc = bench.main(
        [*tiny, "--new-tokens", "12", "--prompts", "2", "--iterations", "1",
         "--algorithms", "grpo", "--matmul-size", "128", "--op-profile"]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)  # stdout holds the JSON alone
    assert out["matmul_peak"]["flops_per_s"] > 0
    grpo = out["grpo"]
    assert grpo["roles"] == ["actor"]  # no KL: no reference; GRPO: no critic
    assert set(grpo["phase_median_s"]) == {"generate", "score", "train", "reshard"}
    assert grpo["generated_tokens_per_s"] > 0
    step = grpo["train_step"]
    assert step["flops_analytic"]["actor"] > 0 and step["achieved_flops_per_s"] > 0
    # Against the peak beside it, to its 4 decimals (on a machine with a fast matmul a tiny
    # model's fraction rounds to 0: "> 0" would depend on the machine's speed).
    fraction = step["achieved_flops_per_s"] / out["matmul_peak"]["flops_per_s"]
    assert step["fraction_of_matmul_peak"] == pytest.approx(fraction, abs=5.01e-5)
    assert {"actor_flops_xla_cost_analysis", "achieved_flops_per_s"} <= set(step)
    assert grpo["compilations_during_timed_iterations"] == 0
    assert grpo["actor_microbatches"] == [1.0]  # no --microbatch-tokens: one a step
    assert grpo["gc_frozen_objects"] > 0  # frozen after the warm-up, as the training loop does
    # flatten on the tests' 8 devices: FSDP training, data-parallel generation
    assert grpo["reshard_paths"] == ["jit"]
    ops = grpo["op_profile"]  # two more iterations, traced: their time by XLA op
    assert ops["calls"] == 2 and ops["op_ms_per_call"] > 0 and ops["categories"], ops
    assert sum(c["share"] for c in ops["categories"].values()) <= 1.001


def test_bench_rl_peers_fail_fast_without_trl(tmp_path):
    """--peers names what is missing in one line, before building anything."""
    missing = str(tmp_path / "no-python")
    with pytest.raises(SystemExit, match="--peer-python .*no-python does not exist"):
        bench.main(["--peers", "--peer-python", missing])
    if importlib.util.find_spec("trl") is None:
        with pytest.raises(SystemExit, match="trl does not import"):
            bench.main(["--peers"])
