"""``python -m jrlhf.bench reshard``: actor train <-> generate transition vs a plain copy.

Prints one JSON object: median transition seconds each way next to a plain jitted copy of the same
output bytes on the same devices, their ratio, bytes moved for the chosen (zero-redundancy) and
the naive generation device order, XLA compilations, the memory plan and host-parking figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.report import add_out_argument, check_out, emit
from jrlhf.devices import ensure_host_devices

CHOOSER_CASES = (
    ("fsdp=4,tensor=2", 2),
    ("fsdp=4,tensor=2", 4),
    ("fsdp=4,tensor=2", 1),
    ("fsdp=2,tensor=4", 2),
    ("fsdp=2,tensor=4", 1),
    ("fsdp=8", 4),
)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jrlhf.bench reshard", description=__doc__)
    p.add_argument("--train", default="fsdp=2,tensor=4", help="training mesh spec")
    p.add_argument("--gen-tensor", type=int, default=2, help="generation tensor size")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--budget-mib", type=float, default=None, help="per-device memory budget")
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)
    return args


def _timed(fn, *args):
    import jax

    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print one JSON object; returns the exit status."""
    args = _parse(list(argv or []))
    ensure_host_devices(8)

    import jax
    import numpy as np

    from jrlhf.meshes import MeshSpec, make_mesh
    from jrlhf.models.config import ModelConfig
    from jrlhf.models.model_def import ModelDef
    from jrlhf.reshard import (
        Resharder,
        backend_compile_count,
        bytes_moved,
        choose_generation_mesh,
        live_bytes,
        naive_generation_mesh,
        park_to_host,
        restore_from_host,
    )

    cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
    )
    model = ModelDef(cfg)
    train_spec = MeshSpec.parse(args.train)
    gen_spec = choose_generation_mesh(train_spec, args.gen_tensor)
    naive_spec = naive_generation_mesh(train_spec, args.gen_tensor)
    train_sh = model.shardings(make_mesh(train_spec), "fsdp_tp")
    gen_sh = model.shardings(make_mesh(gen_spec), "dp_tp")
    naive_sh = model.shardings(make_mesh(naive_spec), "dp_tp")

    params = model.init_sharded(make_mesh(train_spec), "fsdp_tp")
    reference = jax.device_get(params)
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    resharder = Resharder(budget_bytes=budget)
    compiles0 = backend_compile_count()
    t_plan = time.perf_counter()
    fwd = resharder.plan(params, gen_sh)
    gen_abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        model.abstract_params,
        gen_sh,
    )
    back = resharder.plan(gen_abstract, train_sh)
    t_plan = time.perf_counter() - t_plan

    # Plain copies of the same output bytes on the same devices (no donation, a real copy).
    copy_gen = jax.jit(lambda t: t, in_shardings=(gen_sh,), out_shardings=gen_sh)
    copy_train = jax.jit(lambda t: t, in_shardings=(train_sh,), out_shardings=train_sh)
    gen = fwd.run(params)
    jax.block_until_ready(copy_gen(gen))
    jax.block_until_ready(copy_train(params))
    jax.block_until_ready(back.run(gen))
    compiles_warm = backend_compile_count()

    times: dict[str, list[float]] = {"to_gen": [], "copy_gen": [], "to_train": [], "copy_train": []}
    for _ in range(args.repeats):
        # Interleaved so that noise from other processes hits all four alike.
        dt, gen2 = _timed(fwd.run, params)
        times["to_gen"].append(dt)
        dt, c = _timed(copy_gen, gen)
        times["copy_gen"].append(dt)
        del c
        dt, train2 = _timed(back.run, gen2)
        times["to_train"].append(dt)
        dt, c = _timed(copy_train, params)
        times["copy_train"].append(dt)
        del c, gen2, train2
    compiles_timed = backend_compile_count() - compiles_warm

    # Ten more transitions through the cached Resharder entry point, donating as a trainer would.
    p = params
    for _ in range(5):
        g = resharder(p, gen_sh, donate=True)
        p = resharder(g, train_sh, donate=True)
    identical = all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(p))
    )

    # Host parking of the training copy during generation (only the training copy is live now).
    del gen, params, g
    before = live_bytes()
    t0 = time.perf_counter()
    parked = park_to_host(p)
    t_park = time.perf_counter() - t0
    during = live_bytes()
    t0 = time.perf_counter()
    p = restore_from_host(parked)
    jax.block_until_ready(p)
    t_restore = time.perf_counter() - t0
    after = live_bytes()

    # Chosen vs naive generation order for several training meshes, from the shardings alone.
    table = []
    for train, gen_tensor in CHOOSER_CASES:
        spec = MeshSpec.parse(train)
        src = model.shardings(make_mesh(spec), "fsdp_tp")
        row = {"train": train, "gen_tensor": gen_tensor}
        for name, mk in (("chosen", choose_generation_mesh), ("naive", naive_generation_mesh)):
            dst = model.shardings(make_mesh(mk(spec, gen_tensor)), "dp_tp")
            row[f"bytes_{name}"] = bytes_moved(src, dst, model.abstract_params)
        row["gen_mesh_chosen"] = str(choose_generation_mesh(spec, gen_tensor))
        table.append(row)

    med = {k: statistics.median(v) for k, v in times.items()}
    model_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.abstract_params))
    result = {
        "benchmark": "reshard",
        "device": f"{jax.devices()[0].platform} x{jax.device_count()}",
        "model_params": model.num_params(),
        "model_bytes": int(model_bytes),
        "train_mesh": str(train_spec),
        "gen_mesh_chosen": str(gen_spec),
        "gen_mesh_naive": str(naive_spec),
        "path": fwd.path,
        "repeats": args.repeats,
        "seconds": {k: round(v, 5) for k, v in med.items()},
        "ratio_to_gen_vs_copy": round(med["to_gen"] / med["copy_gen"], 3),
        "ratio_to_train_vs_copy": round(med["to_train"] / med["copy_train"], 3),
        "ratio_round_trip_vs_copies": round(
            (med["to_gen"] + med["to_train"]) / (med["copy_gen"] + med["copy_train"]), 3
        ),
        "bytes_moved": {
            "to_gen_chosen": fwd.bytes_moved,
            "to_gen_naive": bytes_moved(train_sh, naive_sh, model.abstract_params),
            "to_train_chosen": back.bytes_moved,
            "to_train_naive": bytes_moved(naive_sh, train_sh, model.abstract_params),
        },
        "compiles": {
            "resharder_total": resharder.compile_count,
            # (to_gen, to_train) x (keep source, donate source): donation changes the program.
            "cached_transitions": len(resharder.transitions),
            "backend_events_during_timed_runs": compiles_timed,
            "backend_events_total": backend_compile_count() - compiles0,
        },
        "chooser_table": table,
        "plan_seconds": round(t_plan, 3),
        "memory_plan": {"to_gen": fwd.memory_report(), "to_train": back.memory_report()},
        "bit_identical_after_round_trips": identical,
        "host_parking": {
            "path": parked.path,
            "live_device_bytes_before": before,
            "live_device_bytes_parked": during,
            "live_device_bytes_restored": after,
            "park_seconds": round(t_park, 4),
            "restore_seconds": round(t_restore, 4),
        },
    }
    emit(result, args.out)
    return 0
