"""python -m jrlhf.bench gpu --small on the CPU: every section runs and agrees with itself; and the
model-FLOP count MFU is reported against, checked against a count of the parameter tree."""

from __future__ import annotations

import json

import jax
import numpy as np

from benchmarks import gpu as bench
from jrlhf.cli import bench as bench_cli
from jrlhf.models.config import ModelConfig
from jrlhf.models.model_def import ModelDef
from jrlhf.models.presets import get_preset
from jrlhf.placement.workload import train_flops_per_token


def test_bench_gpu_small_runs_every_section(tmp_path, capsys):
    assert "gpu" in bench_cli.SUITES
    out_file = tmp_path / "gpu.json"
    argv = ["--small", "--out", str(out_file)]
    assert bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(out_file.read_text()) == out
    assert out["backend"] == jax.default_backend() and "no GPU" in out["note"]
    assert not [s for s in bench.SECTIONS if "error" in out[s]], out
    assert out["ceilings"]["read_gbps"] > 0 and out["ceilings"]["matmul_bf16_tflops"] > 0
    link = out["ceilings"]["host_link"]  # parked and restored as Memory.offload does
    assert link["path"] in ("memory_kind:pinned_host", "memory_kind:unpinned_host", "numpy")
    assert link["to_host_gbps"] > 0 and link["from_host_gbps"] > 0
    kernels = out["kernel"]["bf16_case"]["kernels"]
    assert set(kernels) == {"pallas_interpret", "blocked", "reference"}
    for row in kernels.values():  # bf16 output rounding, nothing more
        assert row["rel_err_vs_float32_reference"] < 4e-3
    assert max(out["kernel"]["float32_test_case_rel_err"].values()) < 1e-6
    tiny = out["decode"]["models"]["tiny"]
    assert set(tiny["kernels"]) == {"blocked", "reference"}
    assert out["decode"]["page_size"] == 16
    for row in tiny["kernels"].values():
        assert row["decode_step_ms"] > 0 and row["fraction_of_read_roofline"] >= 0
    # two pure-JAX kernels in float32 arithmetic on a tiny model: the same greedy tokens
    assert tiny["agreement"]["blocked vs reference"]["identical_sequences"] == "4/4"
    train = out["train"]
    assert set(train["attention"]) == {"einsum"}
    run = train["attention"]["einsum"]
    assert run["skipped_updates"] == 0 and np.isfinite(run["loss_first_last"]).all()
    attn = out["attention"]  # no GPU: the einsum form alone, against itself
    assert set(attn["variants"]) == {"einsum"} and "no GPU" in attn["note"]
    assert attn["variants"]["einsum"]["forward_backward_ms"] > 0
    assert max(attn["variants"]["einsum"]["max_rel_diff_vs_einsum"].values()) == 0
    assert (
        train["model_flops_per_step"]
        == train_flops_per_token(bench._model_config("tiny"), train["sequence"])
        * train["tokens_per_step"]
    )


def _matmul_weights(cfg: ModelConfig) -> int:
    """Entries of every 2-D weight of the LM's parameter tree but the input embedding (a gather),
    plus the output head when it is the tied embedding: the weights a token multiplies by."""
    leaves = jax.tree_util.tree_leaves_with_path(ModelDef(cfg).abstract_params)
    total = 0
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if leaf.ndim >= 2 and "embed" not in name and "norm" not in name:
            total += int(np.prod(leaf.shape))
    return total + (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)


def test_train_flops_per_token_counts_every_matmul_weight():
    for cfg in (get_preset("llama3_2_1b"), get_preset("llama3_8b"), bench._model_config("tiny")):
        seq = 1024
        attention = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq
        assert train_flops_per_token(cfg, seq) == 6 * _matmul_weights(cfg) + attention
