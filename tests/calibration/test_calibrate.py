"""Calibration: robust timing statistics, interleaved rounds, and that the fits recover a known
profile from measurements the estimator itself produces (no timing of real programs here; the
plan bench, ``python -m jrlhf.bench plan``, checks the fitted profile against the trainer)."""

import statistics

import jax
import pytest

from jrlhf.calibration import measure as cal
from jrlhf.placement import estimator as est
from jrlhf.placement.profile import DeviceProfile


def test_robust_seconds_drops_high_outliers_only():
    clean = [1.00, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97]
    # two bursts of load from another process
    assert cal.robust_seconds([*clean, 3.5, 2.9]) == pytest.approx(statistics.median(clean))
    # a plain median would move with them
    assert statistics.median([*clean, 3.5, 2.9]) > statistics.median(clean)
    # nothing is an outlier in an even spread; a low value is never dropped
    assert cal.robust_seconds([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert cal.robust_seconds([0.1, *clean]) == statistics.median([0.1, *clean])
    # too few samples or no spread: the median
    assert cal.robust_seconds([1.0, 9.0]) == 5.0
    assert cal.robust_seconds([2.0, 2.0, 2.0, 7.0]) == 2.0
    with pytest.raises(ValueError):
        cal.robust_seconds([])


def test_measure_interleaved_rounds_alternate_tasks():
    calls = []
    tasks = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    out = cal.measure_interleaved(tasks, rounds=3, repeat=2)
    # one warm-up each, then round after round over all tasks, ``repeat`` calls per task
    assert calls[:3] == ["a", "b", "c"]
    assert calls[3:] == ["a", "a", "b", "b", "c", "c"] * 3
    assert {k: v["samples"] for k, v in out.items()} == {"a": 6, "b": 6, "c": 6}
    assert all(v["seconds"] >= 0 for v in out.values())


def test_model_timings_take_rounds_on_demand(monkeypatch):
    """The calibration models' tasks are built and warmed up once; each ``round()`` runs each
    run's calls ``repeat`` times in a trainer iteration's order (generate, score, train, reshard:
    the reshard right after a train step, as in the trainer; the plan bench takes one round before
    each round of trainer iterations), ``reset()`` forgets the samples, and ``results()`` reports
    one forward and one train step per call, as the estimator prices them."""
    calls = []
    per_call = {"forward": 0.3, "train": 0.8, "generate": 0.5, "reshard": 0.01}

    def tasks(overrides, dtype, devices, microbatched=False):
        return {k: (lambda k=k, v=v: calls.append((devices, k)) or v) for k, v in per_call.items()}

    monkeypatch.setattr(cal, "model_tasks", tasks)
    monkeypatch.setattr(cal, "_samples", lambda fn, repeat: [fn() for _ in range(repeat)])
    timings = cal.ModelTimings([({}, 8), ({}, 2)], "float32", repeat=2)
    assert len(calls) == 8  # one warm-up call per task
    with pytest.raises(RuntimeError, match="no calibration round"):
        timings.results()
    calls.clear()
    timings.round()
    iteration = ["generate", "forward", "train", "reshard"]
    assert calls == [(d, k) for d in (8, 2) for _ in range(2) for k in iteration]
    timings.round()
    (_, _, seconds, spread), _ = timings.results()
    assert seconds == pytest.approx(
        {"forward": 0.1, "train": 0.8 / cal.TRAIN_STEPS, "generate": 0.5, "reshard": 0.01}
    )
    assert spread == {k: 0.0 for k in per_call}
    timings.reset()
    calls.clear()
    with pytest.raises(RuntimeError, match="no calibration round"):
        timings.results()
    assert calls == []  # nothing rebuilt or re-run by a reset


def test_model_timings_time_a_pair_after_the_kinds_of_its_run(monkeypatch):
    """A one-device run's pair of training steps on disjoint devices is timed after the run's
    other calls, and reported per step like its train time; runs without one report none."""
    calls = []
    per_call = {"forward": 0.3, "train": 0.8, "generate": 0.5, "reshard": 0.01}

    def tasks(overrides, dtype, devices, microbatched=False):
        out = dict(per_call)
        if devices == 1:
            out[cal.PAIR_KIND] = 1.2
        return {k: (lambda k=k, v=v: calls.append((devices, k)) or v) for k, v in out.items()}

    monkeypatch.setattr(cal, "model_tasks", tasks)
    monkeypatch.setattr(cal, "_samples", lambda fn, repeat: [fn() for _ in range(repeat)])
    timings = cal.ModelTimings([({}, 8), ({}, 1)], "float32", repeat=1)
    calls.clear()
    timings.round()
    iteration = ["generate", "forward", "train", "reshard"]
    assert calls == [(8, k) for k in iteration] + [(1, k) for k in (*iteration, cal.PAIR_KIND)]
    (_, _, all_devices, _), (_, _, one, _) = timings.results()
    assert cal.PAIR_KIND not in all_devices
    assert one[cal.PAIR_KIND] == pytest.approx(1.2 / cal.TRAIN_STEPS)
    # two steps of 0.2 s alone took 0.3 s at once: 0.75 of their sum
    measured = [({}, 8, all_devices), ({}, 1, one)]
    assert cal.fit_call_core_share(measured) == (pytest.approx(0.75), [0.75])
    assert cal.fit_call_core_share(measured[:1]) == (1.0, [])


def test_model_timings_time_micro_batched_steps_in_the_runs_that_ask_for_them(monkeypatch):
    """The two model sizes' runs on all devices (MICROBATCH_RUNS), and no other, also time their
    train steps split into MICROBATCHES micro-batches, after the run's iteration-ordered calls,
    reported per step like the whole steps."""
    built, calls = [], []

    def tasks(overrides, dtype, devices, microbatched=False):
        built.append(microbatched)
        out = {"forward": 0.3, "train": 0.8, "generate": 0.5, "reshard": 0.01}
        if microbatched:
            out[cal.MICROBATCH_KIND] = 1.0
        run = len(built) - 1
        return {k: (lambda k=k, v=v: calls.append((run, k)) or v) for k, v in out.items()}

    monkeypatch.setattr(cal, "model_tasks", tasks)
    monkeypatch.setattr(cal, "_samples", lambda fn, repeat: [fn() for _ in range(repeat)])
    runs = cal.model_runs()
    timings = cal.ModelTimings(runs, "float32", repeat=1)
    flagged = [runs[i] for i, m in enumerate(built) if m]
    assert flagged == [
        (cal.CALIBRATION_MODELS[i], max(1, int(8 * f))) for i, f in cal.MICROBATCH_RUNS
    ]
    assert len(flagged) == 2 and all(devices == 8 for _, devices in flagged)
    calls.clear()
    timings.round()
    first = [k for run, k in calls if run == built.index(True)]
    assert first == ["generate", "forward", "train", "reshard", cal.MICROBATCH_KIND]
    split = [s for _, _, s, _ in timings.results() if cal.MICROBATCH_KIND in s]
    assert [s[cal.MICROBATCH_KIND] for s in split] == [pytest.approx(1.0 / cal.TRAIN_STEPS)] * 2


def test_micro_batched_steps_are_timed_once_per_run_on_one_device_too():
    """On one device every fraction of a model's devices is the same run: its micro-batched
    steps are timed once per MICROBATCH_RUNS entry, not once per fraction."""
    runs = [(cal.CALIBRATION_MODELS[i], max(1, int(1 * f))) for i, f in cal.CALIBRATION_RUNS]
    split = cal._microbatched_runs(runs, n=1)
    assert len(split) == len(cal.MICROBATCH_RUNS)
    assert sorted(runs[i][0]["hidden_size"] for i in split) == sorted(
        cal.CALIBRATION_MODELS[i]["hidden_size"] for i, _ in cal.MICROBATCH_RUNS
    )


def test_micro_batched_task_is_left_out_where_its_rows_do_not_split(monkeypatch):
    """A minibatch whose micro-batches do not split over the batch shards (as 16 rows in 2 over
    the 16 shards of 32 devices; here in 16 over 4) times no micro-batched step instead of
    failing the calibration."""
    monkeypatch.setattr(cal, "MICROBATCHES", 16)  # 1-row micro-batches over 4 fsdp shards
    tasks = cal.model_tasks(cal.CALIBRATION_MODELS[0], "float32", 8, microbatched=True)
    assert cal.MICROBATCH_KIND not in tasks
    assert {"generate", "forward", "train", "reshard"} <= set(tasks)


def test_call_core_share_stays_between_one_call_and_both():
    """A pair measured faster than one call alone (or slower than both in turn) is noise: the
    share is kept within [0.5, 1], and the median of the pairs decides."""
    runs = [({}, 1, {"train": 1.0, cal.PAIR_KIND: t}) for t in (0.7, 1.5, 2.6)]
    assert cal.fit_call_core_share(runs)[0] == pytest.approx(0.75)
    assert cal.fit_call_core_share(runs[:1])[0] == 0.5
    assert cal.fit_call_core_share(runs[2:])[0] == 1.0


def test_plan_bench_takes_a_calibration_round_before_each_round_of_iterations():
    from benchmarks import plan as bench

    events = []

    class Run:
        def __init__(self, name):
            self.name = name

        def step(self):
            events.append(self.name)
            return dict.fromkeys(bench.PHASE_KEYS, 1.0)

    out, _ = bench._measure_interleaved(
        {"a": Run("a"), "b": Run("b")}, rounds=2, between=lambda: events.append("cal")
    )
    # first iterations (compiles, dropped), then per round: calibration, then every plan
    assert events == ["a", "b", "cal", "a", "b", "cal", "b", "a"]
    assert out["a"]["train"] == [1.0, 1.0]


def test_plan_bench_dtype_reaches_every_role():
    """``bench plan --dtype bfloat16 --param-dtype bfloat16`` (GPU runs) set every role's
    compute and parameter dtypes, in the trainer's config and in the workload the estimate
    prices."""
    import types

    from benchmarks import plan as bench

    args = types.SimpleNamespace(
        devices=1, hidden=64, intermediate=128, layers=2, heads=4, prompts=4, minibatch=4,
        gen_len=8, iterations=2, dtype="bfloat16", param_dtype="bfloat16", bind=[],
    )  # fmt: skip
    plan = bench.PLANS["flatten"][0](1)
    w = bench._workload(bench._bindings(args, plan, {}))
    dtypes = {role: (cfg.dtype, cfg.param_dtype) for role, (cfg, _) in w.models().items()}
    assert dtypes == dict.fromkeys(w.models(), ("bfloat16", "bfloat16"))
    args.dtype = args.param_dtype = None
    assert bench._workload(bench._bindings(args, plan, {})).actor.dtype == "float32"


def test_plan_bench_scores_the_robust_median_and_keeps_the_plain_one(monkeypatch):
    """A burst of load in one iteration (a 10 ms reshard read as 97 ms) is dropped from the
    measured side, as the calibration drops it from its own samples; the plain median's error
    is still reported."""
    import types

    from benchmarks import plan as bench

    phases = {"generate": 0.1, "score": 0.1, "train": 0.5, "reshard": 0.01}
    fake = types.SimpleNamespace(
        phase_seconds=phases,
        iteration_seconds=sum(phases.values()),
        call_seconds={},
        memory_bytes=0,
        fits=True,
        workload=None,
    )
    monkeypatch.setattr(est, "estimate", lambda plan, workload, profile: fake)
    monkeypatch.setattr(bench, "_knobs", lambda w: {})
    runs = {k: [v] * 5 for k, v in phases.items()}
    runs["reshard"] = [0.0099, 0.0967, 0.0101, 0.0100, 0.0473]
    plan = types.SimpleNamespace(placements=())
    results, summary = bench._compare({"p": (plan, None, [])}, {"p": runs}, None)
    reshard = results[0]["phases"]["reshard"]
    assert reshard["measured_s"] == pytest.approx(0.0100)
    assert summary["phase_error"]["max_abs_rel"] == pytest.approx(0.0, abs=1e-9)
    # the plain median is 10.1 ms, which the estimate misses by 1%
    assert summary["plain_median"]["phase_error"]["max_abs_rel"] == pytest.approx(0.1 / 10.1)
    assert results[0]["iteration"]["measured_s"] == pytest.approx(0.71, abs=1e-4)
    # a phase the estimate says runs nothing (an aliasing reshard): out of the errors, listed
    phases["reshard"] = 0.0
    runs["reshard"] = [2e-4] * 5
    results, summary = bench._compare({"p": (plan, None, [])}, {"p": runs}, None)
    assert results[0]["phases"]["reshard"]["rel_error"] is None
    assert summary["phase_error"]["count"] == 3
    assert summary["phase_error"]["phases_without_work"]["phases"] == [("p", "reshard", 2e-4)]
    assert bench._row(results[0]["phases"], results[0]["iteration"])["reshard"][2] is None


def _plan_report(tmp_path, profiles, fitted):
    """A ``bench plan`` report of two plans whose measurements are the estimate under
    ``fitted`` scaled by known factors, keeping ``profiles`` as a run keeps them."""
    import json

    from benchmarks import plan as bench
    from jrlhf.pipeline.plan_bench import trainer_bindings, trainer_workload

    model = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "dtype": "float32",
             "param_dtype": "float32"}  # fmt: skip
    workload = {"prompts": 8, "minibatch": 4, "gen_len": 6, "iterations": 3, "bindings": []}
    knobs = {"flatten": {}, "separate": {"actor_microbatches": 2}}
    setups, measured = {}, {}
    for name, factor in (("flatten", 1.2), ("separate", 0.9)):
        plan = bench.PLANS[name][0](8)
        bindings = trainer_bindings(model, workload, 8, plan, knobs[name])
        w = trainer_workload(bindings)
        setups[name] = (plan, w, bindings)
        phases = est.estimate(plan, w, fitted).phase_seconds
        measured[name] = {k: [factor * phases[k]] * 2 for k in bench.PHASE_KEYS}
    results, summary = bench._summarize(setups, measured, fitted, None, None)
    report = {"benchmark": "plan_estimator", "device": "8 x cpu", "model": model,
              "workload": workload, "results": results, "profiles": profiles}  # fmt: skip
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path, results, summary


def test_plan_bench_rescore_prices_a_report_again_with_its_own_refitted_profile(tmp_path):
    """``bench plan --rescore REPORT`` rebuilds every plan and workload from the report (the
    knobs included) and refits the profile from the report's calibration rounds: scored again
    with the same code, a report gives its own errors back; with a given profile, that one's."""
    import json

    from benchmarks import plan as bench

    stock = DeviceProfile.load("cpu")
    rounds = [(m["overrides"], m["devices"], m["seconds"], m["spread"])
              for m in stock.measured["models"]]  # fmt: skip
    fitted = cal.fit_measured(stock, rounds)
    # as a run stores it: the fitted profile with its rounds, which the rescore fits again
    path, results, summary = _plan_report(tmp_path, {"fitted": fitted.to_dict()}, fitted)
    again = bench.rescore(path)
    assert again["rescored"]["profile"] == "refitted from the report's calibration rounds"
    errors = again["summary"]["phase_error"]
    for key in ("median_abs_rel", "max_abs_rel", "count"):
        assert errors[key] == pytest.approx(summary["phase_error"][key])
    # measured 1.2x and 0.9x the estimate: errors of 1/6 and 1/9, four phases each
    assert errors["median_abs_rel"] == pytest.approx((1 / 6 + 1 / 9) / 2, rel=1e-6)
    assert errors["max_abs_rel"] == pytest.approx(1 / 6, rel=1e-6)
    # and scored under the built-in profile users plan with, as given on the command line
    held_out = again["summary"]["builtin_profile"]
    assert held_out["profile"] == "cpu"
    under_cpu = bench.rescore(path, "cpu")["summary"]
    assert held_out["phase_error"] == under_cpu["phase_error"]
    assert held_out["iteration_error"] == under_cpu["iteration_error"]
    for old, new in zip(results, again["results"]):
        assert new["knobs"] == old["knobs"]
        assert new["iteration"]["estimated_s"] == pytest.approx(old["iteration"]["estimated_s"])
    # a rescore keeps the profiles, so it can be rescored in turn
    twice = tmp_path / "again.json"
    twice.write_text(json.dumps(again))
    assert bench.rescore(twice)["summary"]["phase_error"] == again["summary"]["phase_error"]
    # the rounds are fitted in the dtype they computed in (the report says), not this machine's
    report = json.loads(path.read_text())
    for m in report["profiles"]["fitted"]["measured"]["models"]:
        m["dtype"] = "bfloat16"
    bf16 = tmp_path / "bf16.json"
    bf16.write_text(json.dumps(report))
    as_bf16 = bench.rescore(bf16)["results"][0]["iteration"]["estimated_s"]
    assert as_bf16 != pytest.approx(results[0]["iteration"]["estimated_s"], rel=1e-3)
    # another profile on the command line prices the same measurements differently
    slower = fitted.replace(matmul_flops=fitted.matmul_flops / 2)
    slow_path = tmp_path / "slower.json"
    slower.save(slow_path)
    by_arg = bench.rescore(path, str(slow_path))
    assert by_arg["rescored"]["profile"] == str(slow_path)
    assert by_arg["results"][0]["iteration"]["estimated_s"] > results[0]["iteration"]["estimated_s"]
    # a report made under a given profile is priced by that profile as stored (no refit)
    path, _, summary = _plan_report(tmp_path, {"given": slower.to_dict()}, fitted)
    given = bench.rescore(path)
    assert given["rescored"]["profile"] == "the report's given profile"
    assert given["results"][0]["iteration"]["estimated_s"] == pytest.approx(
        by_arg["results"][0]["iteration"]["estimated_s"]
    )


def test_plan_bench_rescore_refuses_bad_reports_by_name(tmp_path, capsys):
    import copy
    import json

    from benchmarks import plan as bench

    def refused(report, match, text=None, extra=()):
        path = tmp_path / "r.json"
        path.write_text(text if text is not None else json.dumps(report))
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            bench.main(["--rescore", str(path), *extra])
        # the message is the exit's, or argparse's last line on stderr (exit status 2)
        message = str(e.value) if e.value.code != 2 else capsys.readouterr().err.splitlines()[-1]
        assert match in message and "\n" not in message, (match, message)

    refused(None, "cannot read a JSON report", text="{not json")
    refused({"benchmark": "decode"}, "not a bench plan report")
    stock = DeviceProfile.load("cpu")
    path, _, _ = _plan_report(tmp_path, {"fitted": stock.to_dict()}, stock)
    good = json.loads(path.read_text())

    def bad(change):
        report = copy.deepcopy(good)
        change(report)
        return report

    refused(bad(lambda r: r.pop("model")), "the report lacks model")
    refused(bad(lambda r: r.update(device="0 x cpu")), "device '0 x cpu' is not 'N x PLATFORM'")
    refused(bad(lambda r: r.update(results={})), "results is not a non-empty list")
    refused(bad(lambda r: r.pop("profiles")), "stores no profile")
    refused(bad(lambda r: r["profiles"].update(fitted="x")), "profiles.fitted is not a device")
    refused(
        bad(lambda r: r["profiles"]["fitted"]["measured"]["models"][0]["seconds"].pop("train")),
        "profiles.fitted: its calibration rounds cannot be fitted (KeyError('train'))",
    )
    refused(
        bad(lambda r: r["profiles"]["fitted"]["measured"]["models"][0].update(dtype="bfloat16")),
        "calibration rounds in several dtypes ['bfloat16', 'float32']",
    )
    refused(bad(lambda r: r["results"][0].pop("knobs")), "results[0] is malformed (KeyError")
    refused(
        bad(lambda r: r["model"].update(layers=0)),
        "actor/RoleConfig.model_overrides: num_layers must be an integer >= 1 (got 0)",
    )
    refused(
        bad(lambda r: r["results"][1]["phases"]["train"].update(runs=[0.1, float("nan")])),
        "results[1] (separate) phase train has no finite, non-negative measurements",
    )
    refused(good, "--profile nosuch: unknown device profile", extra=("--profile", "nosuch"))
    # nothing to write to, or the report itself: refused before any work
    refused(good, "is a directory", extra=("--out", str(tmp_path)))
    refused(good, "is the report being rescored", extra=("--out", str(tmp_path / "r.json")))
    assert json.loads((tmp_path / "r.json").read_text()) == good


@pytest.mark.parametrize("shared", [True, False])
def test_collective_fit_recovers_bandwidth_and_latency(shared):
    n, bw, lat, cores = 8, 6e9, 4e-5, 2
    profile = DeviceProfile(
        name="t",
        memory_bytes=2**33,
        matmul_flops=5e10,
        intra_node_bandwidth=bw,
        collective_latency_s=lat,
        shared_host=shared,
        host_cores=cores,
    )
    g = est._Geometry(n, n, 1, 1, frozenset(range(n)), 1)

    def extra(received):  # the estimator's price of one all-gather
        return est._comm_s(received, 1, g, profile)

    small, large = 64 * 1024 * 7 / 8, 8 * 2**20 * 7 / 8
    got_bw, got_lat = cal.collective_fit((small, extra(small)), (large, extra(large)), n, shared)
    assert got_bw == pytest.approx(bw, rel=1e-9)
    assert got_lat == pytest.approx(lat, rel=1e-6)


def _truth_measurements(truth: DeviceProfile, dtype: str):
    """What the calibration runs would measure on a machine that behaves exactly as ``truth``
    says (the estimator's own prices of the calibration calls)."""
    out = []
    for index, fraction in cal.CALIBRATION_RUNS:
        overrides, devices = cal.CALIBRATION_MODELS[index], max(1, int(8 * fraction))
        _, plan, w = cal._calibration_setup(overrides, dtype, devices)
        edge = plan.reshard_edges()[0]
        seconds = {
            "forward": est.infer_seconds(w, "reference", plan["reference_infer"], truth),
            "train": est.train_seconds(w, "actor", plan["actor_train"], truth) / w.train_steps,
            "generate": est.generate_seconds(w, plan["actor_generate"], truth),
            "reshard": est.reshard_seconds(w, edge, plan, truth),
        }
        # and the same generation stopped after its first decode step
        short = {**overrides, "gen_len": cal.SHORT_GEN_TOKENS}
        _, _, ws = cal._calibration_setup(short, dtype, devices)
        seconds[cal.SHORT_GEN_KIND] = est.generate_seconds(ws, plan["actor_generate"], truth)
        if devices == 1:  # and its step on another device at the same time
            seconds[cal.PAIR_KIND] = est.concurrent_seconds([seconds["train"]] * 2, truth)
        if (index, fraction) in cal.MICROBATCH_RUNS:  # and its step in micro-batches
            _, _, split = cal._calibration_setup(overrides, dtype, devices, cal.MICROBATCHES)
            seconds[cal.MICROBATCH_KIND] = (
                est.train_seconds(split, "actor", plan["actor_train"], truth) / w.train_steps
            )
        out.append((overrides, devices, seconds))
    return out


@pytest.mark.parametrize("shared", [True, False])
def test_fit_profile_recovers_a_known_profile(shared):
    base = DeviceProfile(
        name="t",
        memory_bytes=2**33,
        matmul_flops=5e10,
        memory_bandwidth=3e9,
        intra_node_bandwidth=6e9,
        inter_node_bandwidth=6e9,
        call_overhead_s=2e-5,
        collective_latency_s=3e-5,
        shared_host=shared,
        host_cores=2,
    )
    truth = base.replace(
        forward_efficiency=0.6,
        forward_layer_overhead_s=2e-4,
        train_efficiency=0.45,
        train_layer_overhead_s=1.2e-3,
        decode_efficiency=2.5,
        decode_layer_overhead_s=3e-4,
        # what a generate call pays once (the short generations tell it from the steps)
        decode_call_overhead_s=2e-3,
        reshard_overhead_s=1.5e-3,
        reshard_efficiency=0.8,
        # the separated run's twin copy (the resharder's path between disjoint device sets)
        reshard_twin_shard_s=4e-5,
        # the costs that grow with tokens and context, not FLOPs (the long-prompt model's runs
        # tell them apart)
        forward_activation_efficiency=0.08,
        train_activation_efficiency=0.03,
        decode_kv_efficiency=0.1,
        # a forward's writes of its FSDP-gathered weights (the short-sequence run's gathers
        # tell them from the FLOPs)
        forward_gather_efficiency=0.4,
    )
    if shared:  # per-layer costs paid once per call, apart from those every device pays
        truth = truth.replace(
            fixed_device_exponent=0.6,
            forward_layer_overhead_once_s=1e-4,
            train_layer_overhead_once_s=6e-4,
            decode_layer_overhead_once_s=5e-5,
            # every device program's decode weight reads, added to the step's FLOPs
            decode_weight_efficiency=0.3,
            # ... and its layer copies, once a call
            decode_copy_efficiency=0.2,
            # two one-device calls at once take 0.8 x their sum
            call_core_share=0.8,
        )
    measurements = _truth_measurements(truth, "float32")
    fitted, fits = cal.fit_profile(base, measurements, "float32")
    # the micro-batched steps are equations of the train fit: slower ones move it
    slower = [
        (o, n, {k: v * (1.5 if k == cal.MICROBATCH_KIND else 1.0) for k, v in m.items()})
        for o, n, m in measurements
    ]
    moved, _ = cal.fit_profile(base, slower, "float32")
    assert (moved.train_efficiency, moved.train_layer_overhead_s) != pytest.approx(
        (fitted.train_efficiency, fitted.train_layer_overhead_s), rel=1e-3
    )
    for field in (
        "forward_efficiency",
        "forward_layer_overhead_s",
        "forward_layer_overhead_once_s",
        "train_efficiency",
        "train_layer_overhead_s",
        "train_layer_overhead_once_s",
        "decode_efficiency",
        "decode_layer_overhead_s",
        "decode_layer_overhead_once_s",
        "reshard_overhead_s",
        "reshard_efficiency",
        "reshard_copy_efficiency",
        "reshard_twin_shard_s",
        "fixed_device_exponent",
        "forward_activation_efficiency",
        "train_activation_efficiency",
        "decode_kv_efficiency",
        "forward_gather_efficiency",
        "decode_weight_efficiency",
        "decode_call_overhead_s",
        "decode_copy_efficiency",
        "call_core_share",
    ):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-4), field
    assert set(fits) - {"fixed_device_exponent", "call_core_share"} == {
        "forward",
        "train",
        "generate",
        "reshard",
    }
    # off a shared host calls on disjoint devices simply run at once: nothing to fit
    assert ("call_core_share" in fits) == shared
    # The calibration's reshards that move anything gather (nearly) their whole targets: the
    # target copy's own rate is not fitted apart from the gathers' (0: the same rate).
    assert fitted.reshard_copy_efficiency == 0.0


def test_reshard_fit_prices_the_copy_apart_only_where_the_runs_tell_it_apart():
    """On a shared host a reshard has two byte terms, the target copy and the gathered shards.
    The calibration's reshards gather (nearly) every target byte, so the fit keeps one rate for
    both; a run that copies without gathering lets it fit the copy's own rate. Moves between
    the same layouts alias their source: left out of the fit."""
    from jrlhf.meshes.mesh import MeshSpec
    from jrlhf.placement.plan import CALLS, CallPlacement, ExecutionPlan

    base = DeviceProfile(
        name="t", memory_bytes=2**33, matmul_flops=5e10, memory_bandwidth=3e9,
        intra_node_bandwidth=6e9, inter_node_bandwidth=6e9, call_overhead_s=2e-5,
        shared_host=True, host_cores=2,
    )  # fmt: skip
    truth = base.replace(
        reshard_overhead_s=1e-3, reshard_efficiency=0.8, reshard_copy_efficiency=2.5
    )

    def measured(w, plan):
        return est.reshard_seconds(w, plan.reshard_edges()[0], plan, truth)

    cases = []
    for index, devices in ((0, 8), (1, 8), (0, 4), (1, 4), (0, 1), (1, 1)):
        _, plan, w = cal._calibration_setup(cal.CALIBRATION_MODELS[index], "float32", devices)
        cases.append((w, plan, measured(w, plan)))
    assert [c[2] for c in cases[-2:]] == [0.0, 0.0]  # one device: aliases
    fitted, fits = cal.fit_reshard(base, cases)
    assert fitted.reshard_copy_efficiency == 0.0 and fits["copy_efficiency"] == 0.0
    # one rate between the two true ones prices the gathering runs within a percent
    for w, plan, seconds in cases[:4]:
        assert measured(w, plan) == pytest.approx(seconds)
        got = est.reshard_seconds(w, plan.reshard_edges()[0], plan, fitted)
        assert got == pytest.approx(seconds, rel=0.01)
    # a replicated training layout split over a tensor axis for generation: every device
    # holds its target shard already and only copies it
    w = cases[0][0]
    replicated = CallPlacement(MeshSpec((("data", 8), ("tensor", 1)), tuple(range(8))), "dp_tp")
    split = CallPlacement(MeshSpec((("data", 4), ("tensor", 2)), tuple(range(8))), "dp_tp")
    plan = ExecutionPlan.of(
        "split", **{c: split if c == "actor_generate" else replicated for c in CALLS}
    )
    src, dst = plan["actor_train"], plan["actor_generate"]
    assert est.reshard_gathered_bytes(w.actor, "lm", src, dst) == 0
    fitted, _ = cal.fit_reshard(base, [*cases, (w, plan, measured(w, plan))])
    for field in ("reshard_overhead_s", "reshard_efficiency", "reshard_copy_efficiency"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-6), field
    one = ExecutionPlan.of("one", **{c: CallPlacement(MeshSpec((("data", 1),), (0,)), "dp_tp")
                                     for c in CALLS})  # fmt: skip
    assert cal.fit_reshard(base, [(w, one, 1e-4)])[1] == {
        "not_fitted": "every reshard measured aliases its source"
    }


def test_fixed_costs_on_a_shared_host_grow_with_the_device_count_from_one_device():
    """n ** fixed_device_exponent times a device's cost, from n = 1 on: on the 2-core CPU two
    fake devices already cost more than one (a lone program's ops get both cores), so the
    growth does not wait for the devices to outnumber the cores."""

    def fixed(n, shared, exponent=1.0, cores=2):
        profile = DeviceProfile(
            name="t", memory_bytes=1, matmul_flops=1.0, shared_host=shared, host_cores=cores,
            fixed_device_exponent=exponent,
        )  # fmt: skip
        g = est._Geometry(n, n, 1, 1, frozenset(range(n)), 1)
        return est._fixed_s(1.0, g, profile)

    assert [fixed(n, True) for n in (1, 2, 4, 8)] == [1.0, 2.0, 4.0, 8.0]  # the default
    assert [fixed(n, True, cores=1) for n in (1, 2, 8)] == [1.0, 2.0, 8.0]
    assert [fixed(n, False) for n in (1, 8)] == [1.0, 1.0]  # own cores per device
    # a runtime that overlaps part of the programs' costs: 8 ** 0.5 times at 8 devices
    assert [fixed(n, True, 0.5) for n in (1, 2, 8)] == pytest.approx([1.0, 2**0.5, 8**0.5])
    with pytest.raises(ValueError, match="host_cores"):
        DeviceProfile(name="t", memory_bytes=1, matmul_flops=1.0, host_cores=0)


def test_a_reshard_between_the_same_layouts_is_an_alias_priced_at_zero():
    """Training and generation layouts that put the same slices on the same devices (here
    ``fsdp=1,tensor=2`` under fsdp_tp and ``data=1,tensor=2`` under dp_tp) need no move: the
    resharder aliases the training copy (its ``alias`` path), and the estimate charges no time
    and no generation copy. A layout that differs is charged both."""
    from jrlhf.meshes.mesh import MeshSpec, make_mesh
    from jrlhf.models.model_def import ModelDef
    from jrlhf.placement.plan import CALLS, CallPlacement, ExecutionPlan
    from jrlhf.reshard import Resharder

    cfg, _, w = cal._calibration_setup(cal.CALIBRATION_MODELS[0], "float32", 2)
    train = CallPlacement(MeshSpec((("fsdp", 1), ("tensor", 2)), (0, 1)), "fsdp_tp")
    profile = DeviceProfile(
        name="t", memory_bytes=2**33, matmul_flops=5e10, memory_bandwidth=2e9,
        intra_node_bandwidth=4e9, shared_host=True, reshard_overhead_s=1e-3,
    )  # fmt: skip
    model = ModelDef(cfg, "lm")
    tree = jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
        model.abstract_params,
        model.shardings(make_mesh(train.mesh), train.rules),
    )
    cases = ((("data", 1), ("tensor", 2)), True), ((("data", 2), ("tensor", 1)), False)
    for gen_axes, same in cases:
        gen = CallPlacement(MeshSpec(gen_axes, (0, 1)), "dp_tp")
        plan = ExecutionPlan.of("p", **{c: gen if c == "actor_generate" else train for c in CALLS})
        (edge,) = plan.reshard_edges()
        assert est.same_layout(cfg, "lm", train, gen) is same
        transition = Resharder().plan(tree, model.shardings(make_mesh(gen.mesh), gen.rules))
        assert (transition.path == "alias") is same
        seconds = est.reshard_seconds(w, edge, plan, profile)
        copy = dict((what, b) for what, _, _, b in est._resident_parts(w, plan, profile))
        if same:
            assert seconds == 0.0 and copy["actor generation copy"] == 0
        else:
            assert seconds > 1e-3 and copy["actor generation copy"] > 0
