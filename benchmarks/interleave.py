"""Do interleaved inference calls really overlap? ``python -m jrlhf.bench interleave``.

Builds reference, reward and critic models, places them as a plan says, and times the scoring
phase two ways on the same inputs:

- *serial*: each call is dispatched and waited for before the next one starts;
- *concurrent*: all three are dispatched back to back and then waited for, as the trainer does.

With disjoint device slices (interleave) the concurrent time can fall below the serial sum only
if the calls really run at the same time; on shared devices (flatten) XLA runs them one after
another, so the two times match. Each call's completion time, measured from the first dispatch
by threads that block on its output, gives the timeline.

Measured on the CPU backend with 8 fake devices (jax 0.10.2): dispatch returns at once, yet the
three calls complete one after another even on disjoint devices and even with single-threaded
XLA:CPU kernels, i.e. this runtime executes one computation at a time. Interleaving therefore
cannot pay off on CPU (the cost estimator's CPU profile serializes concurrent calls); on GPUs
each device has its own streams and the same dispatch pattern overlaps. Run this benchmark on the
target hardware to see the overlap factor there.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np

from benchmarks.report import add_out_argument, check_out, emit
from jrlhf.devices import ensure_host_devices


def _timeline(calls, repeats: int) -> dict:
    """Serial and concurrent wall times (medians) and the concurrent completion timeline."""
    import jax

    serial, concurrent, finish = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for fn in calls:
            jax.block_until_ready(fn())
        serial.append(time.perf_counter() - t0)

        done = [0.0] * len(calls)
        t0 = time.perf_counter()
        outs = [fn() for fn in calls]

        def wait(i, out, done=done, t0=t0):
            jax.block_until_ready(out)
            done[i] = time.perf_counter() - t0

        threads = [threading.Thread(target=wait, args=(i, o)) for i, o in enumerate(outs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        concurrent.append(time.perf_counter() - t0)
        finish.append(done)
    return {
        "serial_s": statistics.median(serial),
        "concurrent_s": statistics.median(concurrent),
        "completion_s": [statistics.median(col) for col in zip(*finish)],
    }


def measure(plan_name: str, hidden: int, layers: int, batch: int, seq: int, repeats: int) -> dict:
    import jax

    from jrlhf.meshes import get_rules, make_mesh
    from jrlhf.models import ModelDef, tiny_config
    from jrlhf.placement import INFERENCE_CALLS, strategy
    from jrlhf.ppo import batch as rl_batch
    from jrlhf.runtime.roles import make_infer

    plan = strategy(plan_name, jax.device_count())
    cfg = tiny_config(
        vocab_size=1024, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
        num_heads=8, num_kv_heads=4,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 1024, seq // 2)) for _ in range(batch)]
    responses = [list(rng.integers(3, 1024, seq // 2)) for _ in range(batch)]
    arrays = rl_batch.pack(prompts, responses, seq // 2, seq // 2)
    fns = {
        "reference_infer": ("lm", lambda m, b: rl_batch.response_logprobs(m, b, seq // 2)),
        "reward_infer": ("value", rl_batch.sequence_scores),
        "critic_infer": ("value", lambda m, b: rl_batch.response_values(m, b, seq // 2)),
    }
    calls = []
    for i, call in enumerate(INFERENCE_CALLS):
        head, fn = fns[call]
        placement = plan[call]
        mesh, rules = make_mesh(placement.mesh), get_rules(placement.rules)
        model = ModelDef(cfg, head)
        params = model.init_sharded(mesh, rules, seed=i)
        infer = make_infer(model, mesh, rules, fn)
        jax.block_until_ready(infer(params, arrays))  # compile outside the timing
        calls.append(lambda infer=infer, params=params: infer(params, arrays))
    result = _timeline(calls, repeats)
    result.update(
        plan=plan_name,
        placements={c: str(plan[c].mesh) for c in INFERENCE_CALLS},
        disjoint=plan.overlapping_inference(),
        overlap_speedup=result["serial_s"] / result["concurrent_s"],
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jrlhf.bench interleave", description=__doc__)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    ensure_host_devices()
    out = {
        name: measure(name, args.hidden, args.layers, args.batch, args.seq, args.repeats)
        for name in ("flatten", "interleave")
    }
    import jax

    out["devices"] = f"{jax.device_count()} x {jax.devices()[0].platform}"
    emit(out, args.out)
    return 0
