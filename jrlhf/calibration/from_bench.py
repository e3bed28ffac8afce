"""An accelerator's device profile fitted to ``python -m jrlhf.bench gpu`` reports.

The CPU calibration (``jrlhf.calibration.measure``) times models of a few hundred thousand
parameters: on a GPU those measure kernel launches, not the rates a 7B or 70B plan is priced
with. ``bench gpu`` runs real model shapes (Llama-3.2-1B, Llama-3-8B) on one device; this module
turns its reports into a profile:

* rates straight from its ``ceilings``: ``matmul_flops`` (the bf16 matmul rate),
  ``memory_bandwidth`` (the read rate: what a decode step's weight and KV reads and an update's
  streaming are priced against), ``host_bandwidth`` (the slower direction of the host link, on
  the path ``Memory.offload`` parks state with);
* ``decode_kv_efficiency``: the paged-attention kernel's measured fraction of the read bandwidth
  (the ``kernel`` section; fitted with the decode steps where no report has one);
* efficiencies fitted so that the estimator's own prices of the measured calls match them:
  ``forward_efficiency`` to the prefill times (``prefill_and_first_token_s``: a forward over
  every prompt, priced as ``generate_seconds`` of one token), ``decode_efficiency`` to the decode
  step times (a step priced as the difference of two ``generate_seconds`` over the new tokens,
  as the bench derives it), ``train_efficiency`` to the train steps, with
  ``remat_forward_cost`` (what a remat policy's recomputation costs, in forward passes) where
  some step ran under a remat policy. Each price is linear in the inverse efficiencies
  (``a + sum_j b_j / efficiency_j``), so the fit is non-negative least squares of the relative
  errors over a kind's measurements.

``bench plan`` reports from a GPU (``--profile NAME --plans flatten`` on one device: the whole
PPO trainer) add ``decode_layer_overhead_s``, fitted last with everything else held, to the
trainer's generate phase of each timed iteration, priced at that iteration's longest response (a
synchronous rollout decodes until it ends). At tens of rows per step a decode step is bound by
per-layer launches and latencies there, which ``bench gpu``'s weight-bound decode shapes cannot
tell apart from the weight reads. Their score phases add ``call_overhead_s`` (fitted with the
forward efficiency, to the prefills and the score phases together) and their train phases
``train_step_overhead_s`` (with the train efficiency, to bench gpu's steps and the train phases
together): the fixed costs of a scoring call and of a training step in the trainer, which
dominate small models' phases (docs/gpu.md, run 23).

What one device cannot show stays as the template profile has it (the built-in profile of the
same name: its links, devices per node, memory, fixed overheads), and the notes say which fields
were measured. The inputs, the fits and every measurement's residual go under ``measured``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jrlhf.calibration.measure import _nnls
from jrlhf.meshes.mesh import MeshSpec
from jrlhf.models.presets import get_preset
from jrlhf.pipeline.plan_bench import plan_from_placements, trainer_bindings, trainer_workload
from jrlhf.placement import estimator as est
from jrlhf.placement.plan import CallPlacement
from jrlhf.placement.profile import DeviceProfile
from jrlhf.placement.workload import Workload

# The bench's placements: one device; decode under dp_tp, training under fsdp_tp.
_DECODE = CallPlacement(MeshSpec.of(data=1, tensor=1), "dp_tp")
_TRAIN = CallPlacement(MeshSpec.of(fsdp=1, tensor=1), "fsdp_tp")
# bench gpu's train split before its report recorded it (--train-prompt / --train-response)
_TRAIN_PROMPT_DEFAULT = 256
# the decode kernel the engine picks on a GPU; its rows are the ones fitted
_DECODE_KERNEL = "pallas"


class BenchReportError(ValueError):
    """A report that cannot be fitted (missing sections, a failed run, no usable rows)."""


def _workload(cfg, rows: int, prompt: int, gen: int, **knobs: Any) -> Workload:
    return Workload(
        actor=cfg,
        critic=None,
        reference=cfg,
        reward=None,
        prompts=rows,
        samples_per_prompt=1,
        prompt_len=prompt,
        gen_len=gen,
        epochs=1,
        minibatch_size=rows,
        **knobs,
    )


def _linear(price: Callable[[DeviceProfile], float], profile: DeviceProfile, fields):
    """(a, [b_j]) with price(profile with field_j = 1 / x_j) = a + sum_j b_j x_j: the price with
    every field at 1, then with each at 0.5 in turn."""
    base = profile.replace(**dict.fromkeys(fields, 1.0))
    p0 = price(base)
    b = [price(base.replace(**{f: 0.5})) - p0 for f in fields]
    return p0 - sum(b), b


def _fit(points: list[dict], fields: tuple[str, ...], profile: DeviceProfile):
    """The efficiencies (``fields``) minimizing the relative errors' squares over ``points``
    (each a ``price`` function of the profile and a ``measured_s``), and the fit's report."""
    if not points:
        raise BenchReportError(f"no measurement to fit {', '.join(fields)} to")
    rows = [(_linear(p["price"], profile, fields), p["measured_s"]) for p in points]
    lhs = np.array([[bj / m for bj in b] for (_, b), m in rows])
    rhs = np.array([1 - a / m for (a, _), m in rows])
    inverse = _nnls(lhs, rhs)
    if not (inverse > 0).all():
        zero = [f for f, x in zip(fields, inverse) if x <= 0]
        raise BenchReportError(
            f"{', '.join(zero)}: the measurements leave no time for this cost (fit at zero)"
        )
    values = {f: float(1 / x) for f, x in zip(fields, inverse)}
    return values, {"values": values, "points": _scored(points, profile.replace(**values))}


def _fit_train(
    points: list[dict], profile: DeviceProfile, trainer_points: Sequence[dict] = ()
) -> tuple[dict, dict]:
    """``train_efficiency``, where some run used a remat policy ``remat_forward_cost``, and
    with the whole trainer's train phases (``trainer_points``) ``train_step_overhead_s``.

    A step's price is a + b1 / e + b2 r / e + k o: b1 its 3 passes at efficiency 1, b2 the one
    forward a remat policy adds (0 without remat), r the remat cost, k the steps paying the
    per-step overhead o. Linear in (1 / e, r / e, o), so the same least squares of relative
    errors finds them all. bench gpu's steps alone cannot tell o from 1 / e (one shape's
    steps), so o is fitted only with the trainer's phases, which have several models and
    several steps each."""
    if not points:
        raise BenchReportError("no measurement to fit train_efficiency to")
    overhead, unit = "train_step_overhead_s", 1e-3
    base = profile.replace(train_efficiency=1.0, remat_forward_cost=0.0)
    if trainer_points:  # fitted; otherwise the template's stays in every price
        base = base.replace(**{overhead: 0.0})
    rows, rhs = [], []
    for p in [*points, *trainer_points]:
        t0 = p["price"](base)
        b1 = p["price"](base.replace(train_efficiency=0.5)) - t0
        b2 = p["price"](base.replace(remat_forward_cost=1.0)) - t0
        k = p["price"](base.replace(**{overhead: unit})) - t0
        m = p["measured_s"]
        rows.append([b1 / m, b2 / m, k / m])
        rhs.append(1 - (t0 - b1) / m)
    lhs = np.array(rows)
    used = [True, bool((lhs[:, 1] > 0).any()), bool(trainer_points)]
    x = np.zeros(3)
    x[used] = _nnls(lhs[:, used], np.array(rhs))
    if not x[0] > 0:
        raise BenchReportError(
            "train_efficiency: the measurements leave no time for this cost (fit at zero)"
        )
    values = {"train_efficiency": float(1 / x[0])}
    if used[1]:
        values["remat_forward_cost"] = float(min(2.0, x[1] / x[0]))
    if used[2]:
        values[overhead] = float(x[2] * unit)
    fitted = profile.replace(**values)
    return values, {"values": values, "points": _scored([*points, *trainer_points], fitted)}


def _fit_forward(
    points: list[dict], profile: DeviceProfile, trainer_points: Sequence[dict] = ()
) -> tuple[dict, dict]:
    """``forward_efficiency`` from the prefills and, with the whole trainer's score phases
    (``trainer_points``), ``call_overhead_s`` with it: a price is a + b / e + k c (k the calls
    and host syncs it makes), linear in (1 / e, c). Without the trainer's phases the call
    overhead stays the template's (a prefill makes one call, its cost lost in the forward)."""
    if not trainer_points:
        return _fit(points, ("forward_efficiency",), profile)
    if not points:
        raise BenchReportError("no measurement to fit forward_efficiency to")
    overhead, unit = "call_overhead_s", 1e-3
    base = profile.replace(forward_efficiency=1.0, **{overhead: 0.0})
    rows, rhs = [], []
    for p in [*points, *trainer_points]:
        t0 = p["price"](base)
        b = p["price"](base.replace(forward_efficiency=0.5)) - t0
        k = p["price"](base.replace(**{overhead: unit})) - t0
        m = p["measured_s"]
        rows.append([b / m, k / m])
        rhs.append(1 - (t0 - b) / m)
    x = _nnls(np.array(rows), np.array(rhs))
    if not x[0] > 0:
        raise BenchReportError(
            "forward_efficiency: the measurements leave no time for this cost (fit at zero)"
        )
    values = {"forward_efficiency": float(1 / x[0]), overhead: float(x[1] * unit)}
    fitted = profile.replace(**values)
    return values, {"values": values, "points": _scored([*points, *trainer_points], fitted)}


def _decode_points(report: dict, where: str) -> tuple[list[dict], list[dict]]:
    """Prefill and decode-step measurements of a report's ``decode`` section, as fit points."""
    dec = report.get("decode")
    if not isinstance(dec, dict) or "models" not in dec:
        return [], []
    rows, prompt, new = dec["batch"], dec["prompt_len"], dec["new_tokens"]
    prefill, steps = [], []
    for name, row in dec["models"].items():
        run = row.get("kernels", {}).get(_DECODE_KERNEL)
        if not run or "error" in run:
            continue
        cfg = get_preset(name, param_dtype="bfloat16", dtype="bfloat16")
        # reports from before bench gpu's --page-size ran at 16
        knobs = dict(
            decode_slots=rows,
            decode_page_size=dec.get("page_size", 16),
            decode_chunk_steps=dec["chunk_steps"],
        )
        first = _workload(cfg, rows, prompt, 1, **knobs)
        full = _workload(cfg, rows, prompt, new, **knobs)
        what = f"{where}: {name}, {rows} x {prompt} tokens"
        prefill.append(
            {
                "what": f"{what}, prefill + first token",
                "measured_s": run["prefill_and_first_token_s"],
                "price": lambda p, w=first: est.generate_seconds(w, _DECODE, p),
            }
        )
        steps.append(
            {
                "what": f"{what}, decode step over {new} new tokens",
                "measured_s": run["decode_step_ms"] / 1e3,
                "price": lambda p, w=full, w1=first, n=new: (
                    (est.generate_seconds(w, _DECODE, p) - est.generate_seconds(w1, _DECODE, p))
                    / (n - 1)
                ),
            }
        )
    return prefill, steps


def _train_points(report: dict, where: str) -> list[dict]:
    """The train section's fused-attention step (the one GPU runs take), as a fit point."""
    train = report.get("train")
    if not isinstance(train, dict) or "attention" not in train:
        return []
    run = train["attention"].get("cudnn")
    if not run or "error" in run:
        return []
    prompt = train.get("prompt", _TRAIN_PROMPT_DEFAULT)  # reports before it was recorded
    cfg = get_preset(
        train["model"],
        param_dtype=train["param_dtype"],
        dtype=train["compute_dtype"],
        remat_policy=train["remat_policy"],
    )
    w = _workload(cfg, train["batch"], prompt, train["sequence"] - prompt)
    return [
        {
            "what": f"{where}: {train['model']} train step, {train['batch']} x "
            f"{train['sequence']} tokens",
            "measured_s": run["step_median_s"],
            "price": lambda p, w=w: est.train_seconds(w, "actor", _TRAIN, p),
        }
    ]


def _is_plan_report(report: dict) -> bool:
    return report.get("benchmark") == "plan_estimator"


def _plan_results(report: dict) -> list[tuple[dict, dict, int, dict, Any]]:
    """(model, workload, devices, result, plan) for every plan of a ``bench plan`` report; none
    for another report."""
    if not _is_plan_report(report):
        return []
    model, workload = report["model"], report["workload"]
    devices = int(str(report.get("device", "1")).split(" x ")[0])
    return [
        (
            model,
            workload,
            devices,
            result,
            plan_from_placements(result["plan"], result["placements"]),
        )
        for result in report.get("results", [])
    ]


def _trainer_generate_points(report: dict, where: str) -> list[dict]:
    """A ``bench plan`` report's generate phases as fit points: every timed iteration of every
    plan whose report lists the responses' lengths, priced at its longest response. Iterations
    whose longest response is under half the limit are left out: their generate is mostly the
    prompts' forward, and their policy has collapsed to stopping at once."""
    points = []
    for model, workload, devices, result, plan in _plan_results(report):
        lengths = result.get("response_len_mean_max")
        if not lengths:
            continue  # reports before lengths were recorded
        at = plan["actor_generate"]
        runs = result["phases"]["generate"]["runs"]
        for i, (seconds, (_, longest)) in enumerate(zip(runs, lengths), start=1):
            if 2 * longest < workload["gen_len"]:
                continue
            fields = dict(workload, gen_len=int(longest))
            w = trainer_workload(trainer_bindings(model, fields, devices, plan, result["knobs"]))
            points.append(
                {
                    "what": f"{where}: {result['plan']}, {model['layers']} x {model['hidden']}, "
                    f"generate of timed iteration {i} (longest response {int(longest)})",
                    "measured_s": seconds,
                    "price": lambda p, w=w, at=at: est.generate_seconds(w, at, p),
                }
            )
    return points


def _trainer_phase_points(report: dict, where: str, phase: str) -> list[dict]:
    """A ``bench plan`` report's ``phase`` ("score" or "train") of every timed iteration of
    every plan as fit points, priced as the estimator prices that phase of the plan. The
    trainer scores and trains on batches padded to the task's full prompt and response
    lengths, so every iteration is priced at the workload's, whatever its responses."""
    points = []
    for model, workload, devices, result, plan in _plan_results(report):
        w = trainer_workload(trainer_bindings(model, workload, devices, plan, result["knobs"]))
        for i, seconds in enumerate(result["phases"].get(phase, {}).get("runs", []), start=1):
            points.append(
                {
                    "what": f"{where}: {result['plan']}, {model['layers']} x {model['hidden']}, "
                    f"{phase} of timed iteration {i}",
                    "measured_s": seconds,
                    "price": lambda p, w=w, plan=plan: est.estimate(plan, w, p).phase_seconds[
                        phase
                    ],
                }
            )
    return points


def _fit_decode_with_overhead(
    points: list[dict], fields: tuple[str, ...], profile: DeviceProfile
) -> tuple[dict, dict]:
    """The decode efficiencies (``fields``, at most 1) and ``decode_layer_overhead_s``
    minimizing the relative errors' squares over ``points``: a price is a + sum_j b_j /
    efficiency_j + k overhead, linear in (1 / efficiency_j, overhead), so non-negative least
    squares again."""
    overhead = "decode_layer_overhead_s"
    base = profile.replace(**dict.fromkeys(fields, 1.0), **{overhead: 0.0})
    unit = 1e-4
    lhs, rhs = [], []
    for p in points:
        t0 = p["price"](base)
        b = [p["price"](base.replace(**{f: 0.5})) - t0 for f in fields]
        k = p["price"](base.replace(**{overhead: unit})) - t0
        m = p["measured_s"]
        lhs.append([bj / m for bj in b] + [k / m])
        rhs.append(1 - (t0 - sum(b)) / m)
    lhs, rhs = np.array(lhs), np.array(rhs)
    # An efficiency above 1 (weights read faster than the measured bandwidth) would buy the
    # small models' fit with the large ones' weight reads: cap each at 1 (x_j = 1 / e_j >= 1)
    # by fixing it there and solving for the rest.
    capped = np.zeros(len(fields) + 1, bool)
    while True:
        free = ~capped
        x = np.ones(len(fields) + 1)
        x[-1] = 0.0
        x[free] = _nnls(lhs[:, free], rhs - lhs[:, capped] @ np.ones(int(capped.sum())))
        over = [j for j in range(len(fields)) if free[j] and x[j] < 1.0]
        if not over:
            break
        capped[over] = True
    if not (x[: len(fields)] > 0).all():
        zero = [f for f, xi in zip(fields, x) if xi <= 0]
        raise BenchReportError(
            f"{', '.join(zero)}: the measurements leave no time for this cost (fit at zero)"
        )
    values = {f: float(1 / xi) for f, xi in zip(fields, x)}
    values[overhead] = float(x[-1] * unit)
    return values, {"values": values, "points": _scored(points, profile.replace(**values))}


def _kernel_row(report: dict) -> dict | None:
    """The paged-attention kernel's row of a report's ``kernel`` section (bf16 decode shape)."""
    kernel = report.get("kernel")
    if not isinstance(kernel, dict):
        return None
    return kernel.get("bf16_case", {}).get("kernels", {}).get(_DECODE_KERNEL)


def _median(values: list[float], field: str) -> float:
    if not values:
        raise BenchReportError(f"no report has a ceilings measurement for {field}")
    return float(statistics.median(values))


def _points(reports: Sequence[tuple[str, dict]]) -> dict[str, list[dict]]:
    """Every report's measurements as fit points, by kind."""
    out = {
        "prefill": [],
        "decode_step": [],
        "train_step": [],
        "trainer_generate": [],
        "trainer_score": [],
        "trainer_train": [],
    }
    for label, report in reports:
        prefill, steps = _decode_points(report, label)
        out["prefill"] += prefill
        out["decode_step"] += steps
        out["train_step"] += _train_points(report, label)
        out["trainer_generate"] += _trainer_generate_points(report, label)
        out["trainer_score"] += _trainer_phase_points(report, label, "score")
        out["trainer_train"] += _trainer_phase_points(report, label, "train")
    return out


def _scored(points: list[dict], profile: DeviceProfile) -> list[dict]:
    out = []
    for p in points:
        e = p["price"](profile)
        out.append(
            {
                "what": p["what"],
                "measured_s": p["measured_s"],
                "estimated_s": e,
                "rel_error": (e - p["measured_s"]) / p["measured_s"],
            }
        )
    return out


def score_profile(reports: Sequence[tuple[str, dict]], profile: DeviceProfile) -> dict:
    """``profile``'s prices of the reports' prefills, decode steps and train steps against
    their measured times, fitting nothing: a held-out check of a fitted profile on runs of
    other shapes. kind -> [{what, measured_s, estimated_s, rel_error}]."""
    return {kind: _scored(points, profile) for kind, points in _points(reports).items()}


def profile_from_bench(
    reports: Sequence[tuple[str, dict]], template: DeviceProfile
) -> DeviceProfile:
    """``template`` with its rates and efficiencies fitted to ``reports`` ((label, bench gpu
    JSON) pairs, e.g. file names: they label the fit's points). The template's notes (where
    its other numbers come from) move to ``measured["template_notes"]``."""
    backends = {
        str(r.get("device", "")).rpartition(" x ")[2] if _is_plan_report(r) else r.get("backend")
        for _, r in reports
    }
    if backends != {"gpu"}:
        raise BenchReportError(f"bench gpu reports from a GPU are needed (backends: {backends})")
    ceilings = [r["ceilings"] for _, r in reports if isinstance(r.get("ceilings"), dict)]
    links = [c["host_link"] for c in ceilings if isinstance(c.get("host_link"), dict)]
    profile = template.replace(
        matmul_flops=_median([c["matmul_bf16_tflops"] * 1e12 for c in ceilings], "matmul"),
        memory_bandwidth=_median([c["read_gbps"] * 1e9 for c in ceilings], "read bandwidth"),
    )
    if links:
        profile = profile.replace(
            host_bandwidth=statistics.median(
                min(x["to_host_gbps"], x["from_host_gbps"]) * 1e9 for x in links
            )
        )
    prefill, steps, train, generate, scores, trains = _points(reports).values()
    fits = {}
    # A decode step's KV reads run at the paged-attention kernel's own measured rate where a
    # report has it (the kernel section, on random pools of a decode shape). Fitting that rate
    # too from the decode runs, whose contexts barely differ, trades it against the weight
    # reads: weights then "stream" faster than the read bandwidth.
    kernel = [
        row["fraction_of_read_bandwidth"]
        for _, r in reports
        if isinstance(row := _kernel_row(r), dict) and row.get("fraction_of_read_bandwidth")
    ]
    decode_fields = ("decode_efficiency",)
    if kernel:
        profile = profile.replace(decode_kv_efficiency=float(statistics.median(kernel)))
    else:
        decode_fields += ("decode_kv_efficiency",)
    # the prefill first (with the trainer's score phases, the call overhead with it): a decode
    # step's price (a difference of two generations) does not depend on the forward's
    # efficiency, and training's next does not depend on any decode field
    values, fits["prefill"] = _fit_forward(prefill, profile, scores)
    profile = profile.replace(**values)
    values, fits["train_step"] = _fit_train(train, profile, trains)
    profile = profile.replace(**values)
    if any(_is_plan_report(r) for _, r in reports):
        if not generate:
            raise BenchReportError(
                "the bench plan reports have no generate phase to fit (none lists response "
                "lengths, or every longest response is under half the limit)"
            )
        # the trainer's generations and bench gpu's decode steps together: the decode
        # efficiencies and the per-layer cost of a step, so the fit depends on no template
        # value of either
        values, fits["decode_step"] = _fit_decode_with_overhead(
            steps + generate, decode_fields, profile
        )
    else:
        values, fits["decode_step"] = _fit(steps, decode_fields, profile)
    profile = profile.replace(**values)
    devices = sorted({r.get("device", "?") for _, r in reports if not _is_plan_report(r)})
    measured = ["matmul_flops", "memory_bandwidth"]
    measured += [field for fit in fits.values() for field in fit["values"]]
    if kernel:
        measured.append("decode_kv_efficiency (the paged-attention kernel's read rate)")
    if links:
        measured.append("host_bandwidth")
    plans = sum(_is_plan_report(r) for _, r in reports)
    sources = f"{len(reports) - plans} bench gpu report(s)"
    if plans:
        sources += f" and {plans} bench plan report(s) (the whole trainer)"
    notes = (
        f"Fitted by python -m jrlhf.plan.calibrate --from-bench-gpu to {sources} "
        f"from {', '.join(devices)}: {', '.join(measured)} (residuals under "
        "measured.fits). The rest (links, memory, fixed overheads, what one device cannot "
        "measure) is the template profile's: see measured.template_notes."
    )
    template_notes = template.measured.get("template_notes", template.notes)
    return profile.replace(
        notes=notes,
        measured={
            "reports": [label for label, _ in reports],
            "ceilings": ceilings,
            "fits": fits,
            "template_notes": template_notes,
        },
    )
