"""Accelerator profiles fitted to bench gpu reports (jrlhf.calibration.from_bench)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jrlhf.calibration.from_bench import (
    BenchReportError,
    profile_from_bench,
    score_profile,
)
from jrlhf.cli import calibrate as calibrate_cli
from jrlhf.meshes.mesh import MeshSpec
from jrlhf.models.presets import get_preset
from jrlhf.placement import estimator as est
from jrlhf.placement.plan import CallPlacement
from jrlhf.placement.profile import PROFILE_DIR, DeviceProfile
from jrlhf.placement.workload import Workload

ROOT = Path(__file__).resolve().parents[2]
# the reports the built-in GPU profiles were fitted to (docs/gpu.md says how they were taken)
PROFILE_REPORTS = {
    "h100": [
        "h100_run10_all.json",
        "h100_run10_prefill.json",
        "h100_run14_remat_dots_no_batch.json",
        "h100_run14_remat_full.json",
        "h100_run14_remat_none.json",
        "h100_run17_plan_bf16_1b.json",
        "h100_run17_plan_bf16_300m.json",
    ],
    "h200": [
        "h200_run11_all.json",
        "h200_run11_prefill.json",
        "h200_run13_remat_none.json",
        "h200_run13_remat_dots_no_batch.json",
        "h200_run13_remat_full.json",
        "h200_run23_plan_bf16_1b.json",
        "h200_run23_plan_bf16_300m.json",
    ],
}


def _workload(cfg, rows, prompt, gen, **knobs):
    return Workload(cfg, None, cfg, None, rows, 1, prompt, gen, 1, rows, **knobs)


def _report(truth: DeviceProfile, remat: str = "none") -> dict:
    """A bench gpu report of a device that behaves exactly as ``truth`` prices it: the decode
    section at two shapes (as the bench derives a step: full generate minus a one-token one),
    the train section, the kernel's KV read rate and the ceilings."""
    decode_at = CallPlacement(MeshSpec.of(data=1, tensor=1), "dp_tp")
    train_at = CallPlacement(MeshSpec.of(fsdp=1, tensor=1), "fsdp_tp")
    models = {}
    for name in ("llama3_2_1b", "llama3_8b"):
        cfg = get_preset(name, param_dtype="bfloat16", dtype="bfloat16")
        knobs = dict(decode_slots=16, decode_page_size=16, decode_chunk_steps=32)
        one = est.generate_seconds(_workload(cfg, 16, 512, 1, **knobs), decode_at, truth)
        full = est.generate_seconds(_workload(cfg, 16, 512, 65, **knobs), decode_at, truth)
        models[name] = {
            "kernels": {
                "pallas": {
                    "prefill_and_first_token_s": one,
                    "decode_step_ms": 1e3 * (full - one) / 64,
                },
                "blocked": {"error": "not fitted: only the engine's GPU kernel is"},
            }
        }
    cfg = get_preset("llama3_2_1b", param_dtype="float32", dtype="bfloat16", remat_policy=remat)
    step = est.train_seconds(_workload(cfg, 4, 128, 384), "actor", train_at, truth)
    return {
        "backend": "gpu",
        "device": "Test GPU",
        "ceilings": {
            "matmul_bf16_tflops": truth.matmul_flops / 1e12,
            "read_gbps": truth.memory_bandwidth / 1e9,
            "host_link": {"to_host_gbps": 41.0, "from_host_gbps": 45.0},
        },
        "kernel": {
            "bf16_case": {
                "kernels": {"pallas": {"fraction_of_read_bandwidth": truth.decode_kv_efficiency}}
            }
        },
        "decode": {
            "batch": 16,
            "prompt_len": 512,
            "new_tokens": 65,
            "chunk_steps": 32,
            "models": models,
        },
        "train": {
            "model": "llama3_2_1b",
            "param_dtype": "float32",
            "compute_dtype": "bfloat16",
            "remat_policy": remat,
            "batch": 4,
            "prompt": 128,
            "sequence": 512,
            "attention": {"cudnn": {"step_median_s": step}},
        },
    }


TRUTH = DeviceProfile.load("h100").replace(
    matmul_flops=6.0e14,
    memory_bandwidth=2.5e12,
    forward_efficiency=0.7,
    decode_efficiency=0.9,
    decode_kv_efficiency=0.4,
    train_efficiency=0.45,
)


def test_fit_recovers_the_profile_that_produced_the_report():
    template = DeviceProfile.load("h100")
    fitted = profile_from_bench([("a.json", _report(TRUTH))], template)
    for field in (
        "matmul_flops",
        "memory_bandwidth",
        "forward_efficiency",
        "decode_efficiency",
        "decode_kv_efficiency",
        "train_efficiency",
    ):
        assert getattr(fitted, field) == pytest.approx(getattr(TRUTH, field), rel=1e-6), field
    assert fitted.host_bandwidth == 41e9  # the slower direction
    # what one device cannot measure is the template's
    assert fitted.intra_node_bandwidth == template.intra_node_bandwidth
    assert fitted.call_overhead_s == template.call_overhead_s
    for fit in fitted.measured["fits"].values():
        assert all(abs(p["rel_error"]) < 1e-6 for p in fit["points"])
    assert fitted.measured["template_notes"] == template.measured.get(
        "template_notes", template.notes
    )


def test_runs_under_a_remat_policy_fit_what_its_recomputation_costs():
    truth = TRUTH.replace(remat_forward_cost=0.4)
    template = DeviceProfile.load("h100")
    plain = profile_from_bench([("a.json", _report(truth))], template)
    assert plain.remat_forward_cost == template.remat_forward_cost  # nothing to fit it from
    both = [("a.json", _report(truth)), ("b.json", _report(truth, remat="full"))]
    fitted = profile_from_bench(both, template)
    assert fitted.remat_forward_cost == pytest.approx(0.4, rel=1e-6)
    assert fitted.train_efficiency == pytest.approx(TRUTH.train_efficiency, rel=1e-6)
    with pytest.raises(ValueError, match="remat_forward_cost"):
        template.replace(remat_forward_cost=-0.5)


def test_without_a_kernel_section_the_kv_rate_is_fitted_with_the_steps():
    report = _report(TRUTH)
    del report["kernel"]
    fitted = profile_from_bench([("a.json", report)], DeviceProfile.load("h100"))
    assert fitted.decode_kv_efficiency == pytest.approx(0.4, rel=1e-4)
    assert fitted.decode_efficiency == pytest.approx(0.9, rel=1e-4)
    assert set(fitted.measured["fits"]["decode_step"]["values"]) == {
        "decode_efficiency",
        "decode_kv_efficiency",
    }


def test_unusable_reports_are_refused_by_name():
    cpu = dict(_report(TRUTH), backend="cpu")
    with pytest.raises(BenchReportError, match="from a GPU"):
        profile_from_bench([("a.json", cpu)], TRUTH)
    no_train = _report(TRUTH)
    del no_train["train"]
    with pytest.raises(BenchReportError, match="train_efficiency"):
        profile_from_bench([("a.json", no_train)], TRUTH)
    slow = _report(TRUTH)
    slow["train"]["attention"]["cudnn"]["step_median_s"] = 1e-9  # below the fixed costs
    with pytest.raises(BenchReportError, match="train_efficiency"):
        profile_from_bench([("a.json", slow)], TRUTH)


@pytest.mark.parametrize("name", sorted(PROFILE_REPORTS))
def test_builtin_gpu_profile_is_the_fit_of_its_committed_reports(name, tmp_path):
    """The built-in profile is what its documented command writes from docs/gpu/ (one home for
    the numbers: the reports)."""
    out = tmp_path / f"{name}.json"
    reports = [str(ROOT / "docs" / "gpu" / f) for f in PROFILE_REPORTS[name]]
    argv = ["--from-bench-gpu", *reports, "--device-kind", name, "--out", str(out)]
    assert calibrate_cli.main(argv) == 0
    # Equal to 12 significant digits: the fit's last bits depend on the CPU's BLAS (an AMD EPYC
    # and an Intel Xeon write profiles that differ in the 16th digit).
    assert _rounded(json.loads(out.read_text())) == _rounded(
        json.loads((PROFILE_DIR / f"{name}.json").read_text())
    )


def _rounded(tree):
    """``tree`` with every float rounded to 12 significant digits."""
    if isinstance(tree, dict):
        return {k: _rounded(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_rounded(v) for v in tree]
    return float(f"{tree:.12g}") if isinstance(tree, float) else tree


def test_cli_names_the_bad_report(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    argv = ["--from-bench-gpu", str(bad), "--device-kind", "h100", "--out", str(tmp_path / "o")]
    assert calibrate_cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: bench gpu report {bad}") and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_score_prices_the_runs_without_fitting(tmp_path, capsys):
    report = _report(TRUTH)
    exact = score_profile([("a.json", report)], TRUTH)
    counts = {k: len(v) for k, v in exact.items()}
    assert counts == {
        "prefill": 2,
        "decode_step": 2,
        "train_step": 1,
        "trainer_generate": 0,
        "trainer_score": 0,
        "trainer_train": 0,
    }
    assert all(abs(p["rel_error"]) < 1e-9 for rows in exact.values() for p in rows)
    # a profile with half the train efficiency prices the train step higher, the rest the same
    slower = score_profile([("a.json", report)], TRUTH.replace(train_efficiency=0.225))
    assert slower["train_step"][0]["rel_error"] > 0.5
    assert slower["prefill"] == exact["prefill"]
    path = tmp_path / "a.json"
    path.write_text(json.dumps(report))
    truth = tmp_path / "truth.json"
    TRUTH.save(truth)
    assert calibrate_cli.main(["--from-bench-gpu", str(path), "--score", str(truth)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train_step"][0]["rel_error"] == pytest.approx(0, abs=1e-9)


def _plan_report(truth: DeviceProfile, device: str = "1 x gpu") -> dict:
    """A bench plan report of one device whose trainer runs exactly as ``truth`` prices it:
    three timed iterations, the last one's responses all stopping after 3 tokens."""
    from jrlhf.pipeline.plan_bench import trainer_bindings, trainer_workload
    from jrlhf.placement.plan import strategy

    model = dict(hidden=64, intermediate=128, layers=2, heads=4, dtype="bfloat16")
    workload = dict(prompts=4, minibatch=4, gen_len=32, iterations=4)
    plan = strategy("flatten", 1)
    lengths = [[20.0, 32.0], [11.5, 24.0], [2.0, 3.0]]
    runs = []
    for _, longest in lengths:
        fields = dict(workload, gen_len=int(longest))
        w = trainer_workload(trainer_bindings(model, fields, 1, plan, {}))
        runs.append(est.generate_seconds(w, plan["actor_generate"], truth))
    runs[-1] *= 3  # the dropped iteration: anything
    # scoring and training run on batches padded to the full lengths, whatever the responses
    full = est.estimate(
        plan, trainer_workload(trainer_bindings(model, workload, 1, plan, {})), truth
    )
    result = {
        "plan": "flatten",
        "placements": {call: str(p) for call, p in plan.placements},
        "knobs": {},
        "phases": {
            "generate": {"runs": runs},
            **{k: {"runs": [full.phase_seconds[k]] * len(runs)} for k in ("score", "train")},
        },
        "response_len_mean_max": lengths,
    }
    return {
        "benchmark": "plan_estimator",
        "device": device,
        "model": model,
        "workload": workload,
        "results": [result],
    }


def test_bench_plan_reports_fit_the_call_and_train_step_overheads():
    """The trainer's score phases fit the call overhead with the forward efficiency (prefills
    alone cannot tell them apart), its train phases the per-step overhead with the train
    efficiency; the residuals of every phase go to zero on reports of an exact device."""
    truth = TRUTH.replace(
        call_overhead_s=2e-3, train_step_overhead_s=5e-3, decode_layer_overhead_s=9e-5
    )
    template = DeviceProfile.load("h100").replace(call_overhead_s=1e-4, train_step_overhead_s=0.0)
    fitted = profile_from_bench(
        [("a.json", _report(truth)), ("p.json", _plan_report(truth))], template
    )
    for field in (
        "call_overhead_s",
        "train_step_overhead_s",
        "forward_efficiency",
        "train_efficiency",
        "decode_layer_overhead_s",
    ):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    fits = fitted.measured["fits"]
    assert sum("score of timed iteration" in p["what"] for p in fits["prefill"]["points"]) == 3
    assert sum("train of timed iteration" in p["what"] for p in fits["train_step"]["points"]) == 3
    assert all(abs(p["rel_error"]) < 1e-6 for fit in fits.values() for p in fit["points"])
    # without the trainer's phases, the overheads stay the template's
    alone = profile_from_bench([("a.json", _report(truth))], template)
    assert alone.call_overhead_s == 1e-4 and alone.train_step_overhead_s == 0.0


def test_bench_plan_reports_fit_the_decode_layer_overhead():
    """With the trainer's generations, a decode step's per-layer cost is fitted with the decode
    efficiency (both from data, none from the template)."""
    truth = TRUTH.replace(decode_layer_overhead_s=9e-5)
    template = DeviceProfile.load("h100")
    reports = [("a.json", _report(truth)), ("p.json", _plan_report(truth))]
    fitted = profile_from_bench(reports, template)
    assert fitted.decode_layer_overhead_s == pytest.approx(9e-5, rel=1e-6)
    assert fitted.decode_efficiency == pytest.approx(truth.decode_efficiency, rel=1e-6)
    points = fitted.measured["fits"]["decode_step"]["points"]
    assert len(points) == 2 + 2  # bench gpu's two steps; the collapsed iteration left out
    assert all(abs(p["rel_error"]) < 1e-6 for p in points)
    assert "1 bench plan report(s)" in fitted.notes
    # decode steps faster than the bandwidth allows with that per-layer cost would need weights
    # read faster than the bandwidth: the efficiency stops at 1 (and the per-layer cost gives)
    fast = _report(truth)
    for row in fast["decode"]["models"].values():
        row["kernels"]["pallas"]["decode_step_ms"] *= 0.6
    capped = profile_from_bench([("fast.json", fast), reports[1]], template)
    assert capped.decode_efficiency == 1.0
    assert 0 < capped.decode_layer_overhead_s < 9e-5
    # a CPU bench plan run is not a GPU measurement
    with pytest.raises(BenchReportError, match="backends"):
        profile_from_bench([reports[0], ("c.json", _plan_report(truth, "8 x cpu"))], template)
