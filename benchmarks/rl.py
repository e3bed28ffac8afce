"""``python -m jrlhf.bench rl``: where an RL iteration's time goes, against the machine's limits.

One GRPO and one PPO trainer, each built as ``python -m jrlhf.train`` builds it (the task data,
the placement, the roles and ``RLTrainer`` of jrlhf.pipeline / jrlhf.ppo), run for one warm-up
iteration (it compiles) and then ``--iterations`` timed ones. The setting by default: random
Llama roles (hidden 256, 4 layers, 8 heads / 4 KV heads, MLP 704, vocab 512), 8 prompts x 4
samples of up to 64 new tokens on the synthetic task, 1 epoch of one minibatch, learning rate
1e-5, no KL (so no reference model is built: jrlhf.ppo.core_algos.uses_reference), on 1 device.
GRPO scores with the task's verifiable reward, PPO with a (random) reward model and a critic.

Per algorithm, one JSON object on stdout reports:

* per phase (generate, score, train, reshard: the trainer's own ``time/*`` metrics) the median
  seconds over the timed iterations, and their sum;
* generated tokens/s (response tokens / generate time);
* the train steps' FLOPs, analytic per trained role (actor; PPO's critic too):
  ``(6 x matmul weights + 12 x layers x hidden x sequence) x trained tokens`` (the output
  head's weights included, tied or not; not the input embedding, a gather: see
  ``jrlhf.placement.workload.train_flops_per_token``; every column of every row the step
  computes, padding included:
  fewer with ``--pack``, ``Memory.pack_samples``; ``real_tokens`` counts the non-padding), and
  XLA's cost analysis of the actor's compiled step for comparison (it counts the scanned layer
  loop's body once, so it undercounts);
* the machine's matmul peak (the best of a few large fp32 ``jnp.dot`` in this process, default
  precision like the model) and the train phase's achieved FLOP/s (all trained roles' FLOPs /
  its median time, which includes the host sync for the metrics) as a fraction of it;
* the XLA compilations during the timed iterations (0 when warm-up compiled everything), and
  the minor page faults of each (memory touched for the first time: ``host_memory_kept`` says
  whether the C allocator keeps freed memory for reuse, jrlhf.devices.keep_host_memory).

``--peers`` adds TRL's ``GRPOTrainer`` on the GRPO setting (benchmarks/rl_trl.py), in a child
process run with ``--peer-python`` (a scratch environment with trl; it is no jrlhf dependency),
starting from the same actor weights, on the same prompts, with the same verifiable reward. The
two alternate after their warm-ups (one jrlhf iteration; ``--peer-warmup`` TRL steps, default 2,
reported but not timed): one jrlhf iteration, then one TRL step, so both see the same machine
load; the GRPO object gains ``trl`` (its per-step medians) and ``jrlhf_speedup_over_trl``
(TRL's median step over jrlhf's median iteration, both wall time of the whole iteration).
``--op-profile`` adds ``op_profile``: two more iterations traced with ``jax.profiler``, their
device time by XLA op category (benchmarks/op_profile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import add_out_argument, check_out, emit

PHASES = ("generate", "score", "train", "reshard")
REPO = Path(__file__).resolve().parent.parent


def _peer_python(args) -> str:
    """The Python that runs the TRL peer: ``--peer-python``, else this one if trl imports here."""
    if args.peer_python:
        if not Path(args.peer_python).exists():
            raise SystemExit(f"bench rl: --peer-python {args.peer_python} does not exist")
        return args.peer_python
    probe = subprocess.run([sys.executable, "-c", "import trl"], capture_output=True)
    if probe.returncode:
        raise SystemExit(
            "bench rl --peers: trl does not import in this Python; install it in a scratch "
            "environment and pass --peer-python (see BUILD.md)"
        )
    return sys.executable


def _trl_peer(args, trainer, cfg, stack: contextlib.ExitStack):
    """TRL's GRPOTrainer in a child process (benchmarks/rl_trl.py) on the actor's initial
    weights and the prompts the jrlhf run will draw, in order; returns a function that runs one
    TRL step and gives its timing line."""
    from benchmarks import rl_trl
    from jrlhf.data import PromptLoader
    from jrlhf.devices import allocator_defaults
    from jrlhf.models.hf import save_hf

    tmp = stack.enter_context(tempfile.TemporaryDirectory())
    save_hf(trainer.roles["actor"].model, trainer.states["actor"].params, tmp, overwrite=True)
    loader = PromptLoader(trainer.data.train_records(), args.prompts, seed=cfg.run.seed)
    batches = [[list(map(int, r.prompt_ids)) for r in loader.next_batch()]
               for _ in range(1 + args.iterations)]  # fmt: skip
    # TRL's warm-up steps all take jrlhf's warm-up prompts; its timed steps take the timed ones
    batches = [batches[0]] * max(args.peer_warmup, 1) + batches[1:]
    spec = {
        "prompt_batches": batches,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "lr": args.lr,
        "vocab": args.vocab,
        "eos_id": int(trainer.data.eos_id),
        "pad_id": int(trainer.data.pad_id),
        "seed": cfg.run.seed,
        "threads": args.peer_threads,
    }
    Path(tmp, "peer.json").write_text(json.dumps(spec))
    # The peer keeps glibc's allocator as a TRL user has it (jrlhf.devices).
    env = allocator_defaults(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    cmd = [_peer_python(args), "-m", "benchmarks.rl_trl", tmp]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    stack.callback(proc.wait)
    stack.callback(proc.stdin.close)

    def read() -> dict:
        while True:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("the TRL peer process exited (see its stderr)")
            if line.startswith(rl_trl.MARK):
                return json.loads(line[len(rl_trl.MARK) :])

    info = read()  # {"ready": ...} once the trainer is built

    def step() -> dict:
        proc.stdin.write("run\n")
        proc.stdin.flush()
        return read()

    step.versions = {k: info[k] for k in ("trl", "transformers", "torch")}
    return step


def _bindings(args, algorithm: str) -> list[str]:
    overrides = (
        f"(('hidden_size', {args.hidden}), ('intermediate_size', {args.mlp}), "
        f"('num_layers', {args.layers}), ('num_heads', {args.heads}), "
        f"('num_kv_heads', {args.kv_heads}), ('vocab_size', {args.vocab}), "
        f"('layer_loop', '{args.layer_loop}'))"
    )
    rows = args.prompts * args.samples
    out = [
        f"RunConfig.stages=('{algorithm}',)",
        "RunConfig.placement='flatten'",
        f"RunConfig.host_devices={args.devices}",
        "RunConfig.tensorboard=False",
        "RunConfig.progress_bar=False",
        f"RoleConfig.model_overrides={overrides}",
        f"TaskConfig.max_response_len={args.new_tokens}",
        "TaskConfig.num_heldout=8",
        f"RLConfig.prompts_per_iteration={args.prompts}",
        f"RLConfig.samples_per_prompt={args.samples}",
        f"RLConfig.minibatch_size={rows}",
        "RLConfig.epochs=1",
        f"RLConfig.kl_coef={args.kl_coef}",
        f"Memory.pack_samples={args.pack}",
        f"Memory.logprob_chunk={args.logprob_chunk}",
        f"actor/RoleConfig.microbatch_tokens={args.microbatch_tokens}",
        f"critic/RoleConfig.microbatch_tokens={args.microbatch_tokens}",
        "RLConfig.checkpoint_every=0",
        "RLConfig.async_checkpoint=False",
    ]
    for role in ("actor", "critic", "reference", "reward"):
        out += [f"{role}/RoleConfig.init='tiny'", f"{role}/RoleConfig.learning_rate={args.lr}"]
    if algorithm == "grpo":
        out.append("TaskConfig.reward_fn='synthetic_ground_truth'")
    return out


def _trainer(args, algorithm: str, run_dir: Path):
    """The trainer and prompt loader, built as jrlhf.pipeline.run builds them."""
    import jax

    from jrlhf.config import DEFAULT_CONFIG, load_config
    from jrlhf.data import PromptLoader
    from jrlhf.pipeline.task_data import build_task_data
    from jrlhf.placement import effective_plan
    from jrlhf.ppo import core_algos as algos
    from jrlhf.ppo.trainer import RLTrainer
    from jrlhf.runtime.model_source import resolve_model
    from jrlhf.runtime.roles import setup_role
    from jrlhf.tasks import get_reward_fn

    cfg = load_config([str(DEFAULT_CONFIG)], _bindings(args, algorithm))
    data = build_task_data(cfg)
    plan = effective_plan(cfg, jax.device_count(), None)
    reward_fn = get_reward_fn(cfg.task.reward_fn) if cfg.task.reward_fn else None
    needed = ["actor"] + (["reference"] if algos.uses_reference(cfg.rl) else [])
    needed += (["critic"] if algorithm == "ppo" else []) + ([] if reward_fn else ["reward"])
    roles = {
        role: setup_role(cfg, role, plan, resolve_model(cfg, role, data.model_overrides, run_dir))
        for role in needed
    }
    trainer = RLTrainer(cfg, algorithm, roles, plan, data, run_dir, reward_fn=reward_fn)
    loader = PromptLoader(data.train_records(), cfg.rl.prompts_per_iteration, seed=cfg.run.seed)
    return trainer, loader, cfg


def _step_flops(trainer, batch) -> float | None:
    """FLOPs of the actor's compiled train step on ``batch``, from XLA's cost analysis."""
    from jrlhf.runtime.steps import shard_batch

    setup = trainer.roles["actor"]
    mesh, rules = setup.meshes["train"], setup.rules["train"]
    step = trainer.steps["actor"].jitted
    compiled = step.lower(trainer.states["actor"], shard_batch(batch, mesh, rules)).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jax: one dict per program
        cost = cost[0] if cost else None
    flops = (cost or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def _analytic_flops(model, seq: int, trained_tokens: int) -> float:
    """Forward + backward FLOPs of one step over ``trained_tokens`` tokens of ``seq``-long rows
    (``train_flops_per_token``)."""
    from jrlhf.placement.workload import train_flops_per_token

    return float(trained_tokens * train_flops_per_token(model.config, seq, model.head))


def _matmul_peak(n: int, repeats: int) -> float:
    """FLOP/s of the best of ``repeats`` (n x n) @ (n x n) fp32 products on the first device."""
    import jax
    import jax.numpy as jnp

    dot = jax.jit(jnp.dot)
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    jax.block_until_ready(dot(a, b))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(dot(a, b))
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure(args, algorithm: str, peak_flops: float) -> dict:
    from jrlhf.reshard import backend_compile_count
    from jrlhf.runtime.gc_freeze import WarmFreeze

    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        trainer, loader, cfg = _trainer(args, algorithm, Path(tmp))
        peer = _trl_peer(args, trainer, cfg, stack) if args.peers and algorithm == "grpo" else None
        batches = []
        step = trainer.steps["actor"]

        def recording_step(state, batch, *split):
            batches.append(batch)
            return step(state, batch, *split)

        trainer.steps["actor"] = recording_step

        def iteration() -> dict:
            records = loader.next_batch()
            return trainer.run_iteration([r.prompt_ids for r in records], [r.meta for r in records])

        t0 = time.perf_counter()
        iteration()  # warm-up: compiles every program of the iteration
        warmup_s = time.perf_counter() - t0
        freezer = WarmFreeze(cfg.run.gc_freeze, "bench rl")  # as the training loop does
        freezer.step_done()
        frozen = freezer.frozen
        stack.callback(freezer.release)
        peer_rows, peer_warmup = [], []
        if peer is not None:
            # TRL's warm-up steps: its first compiles nothing but still runs several times
            # slower than later ones, and so does its second (torch's allocator and kernels
            # settling), so one is not enough to time a steady step
            for _ in range(max(args.peer_warmup, 1)):
                peer_warmup.append(round(peer()["seconds"], 4))
        rows, walls, compiles, faults = [], [], 0, []
        for _ in range(args.iterations):
            compiles_before = backend_compile_count()
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            rows.append(iteration())
            walls.append(time.perf_counter() - t0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before)
            compiles += backend_compile_count() - compiles_before
            if peer is not None:  # alternating, so both see the same machine load
                peer_rows.append(peer())
        trainer.steps["actor"] = step
        flops_xla = _step_flops(trainer, batches[-1])
        ops = None
        if args.op_profile:  # after the timed iterations, so the trace costs them nothing
            from benchmarks.op_profile import op_profile

            ops = op_profile(iteration)
        trainer.wait_for_checkpoints()

    phases = {k: statistics.median(r[f"time/{k}"] for r in rows) for k in PHASES}
    seq = cfg.task.max_prompt_len + cfg.task.max_response_len
    # The columns the actor's step computes (fewer when packed) and the real tokens among them;
    # the last timed iteration's minibatches (the same count every iteration).
    last = batches[-len(batches) // (1 + args.iterations) :]
    trained_tokens = sum(int(b["tokens"].size) for b in last)
    real_tokens = sum(int((b["segment_ids"] > 0).sum()) for b in last)
    analytic = {role: _analytic_flops(trainer.roles[role].model, seq, trained_tokens)
                for role in trainer.trained}  # fmt: skip
    train_flops = sum(analytic.values())  # the train phase runs every trained role's step
    train_s = phases["train"]
    achieved = train_flops / train_s if train_s > 0 else float("nan")
    return {
        "roles": sorted(trainer.roles),
        "reward": "verifiable (synthetic_ground_truth)" if algorithm == "grpo" else "reward model",
        "warmup_iteration_s": round(warmup_s, 3),
        "gc_frozen_objects": frozen,
        "phase_median_s": {k: round(v, 4) for k, v in phases.items()},
        "iteration_median_s": round(
            statistics.median(sum(r[f"time/{k}"] for k in PHASES) for r in rows), 4
        ),
        # run_iteration's whole wall time: the phases plus the host work between them
        "iteration_wall_median_s": round(statistics.median(walls), 4),
        "phase_runs_s": {k: [round(r[f"time/{k}"], 4) for r in rows] for k in PHASES},
        "generated_tokens_per_s": round(statistics.median(r["tokens_per_sec"] for r in rows), 1),
        "response_len_mean": round(statistics.mean(r["response_len"] for r in rows), 2),
        "train_step": {
            "params": {role: trainer.roles[role].model.num_params() for role in trainer.trained},
            "trained_tokens": trained_tokens,
            "real_tokens": real_tokens,  # not padding
            "flops_analytic": {role: float(f) for role, f in analytic.items()},
            # XLA counts a loop body once: the layers are a lax.scan, so this is about one
            # layer's share plus embedding and head, an undercount by about the layer count.
            "actor_flops_xla_cost_analysis": flops_xla,
            "achieved_flops_per_s": round(achieved, 1),
            "fraction_of_matmul_peak": round(achieved / peak_flops, 4),
        },
        # the micro-batches each train step took (a token budget chooses them per batch)
        "actor_microbatches": [r.get("train/microbatches", 1.0) for r in rows],
        "compilations_during_timed_iterations": compiles,
        # pages this process touched for the first time per iteration (fresh memory costs about
        # 4 us a page on the 2-core CPU machine; see jrlhf.devices.keep_host_memory)
        "minor_page_faults_per_iteration": faults,
        # "alias": the generation layout is the training layout, nothing is copied
        "reshard_paths": sorted({t.path for t in trainer.resharder.transitions}),
        **({"op_profile": ops} if ops is not None else {}),
        **(_peer_summary(peer, peer_rows, statistics.median(walls), peer_warmup) if peer else {}),
    }


def _peer_summary(peer, rows: list[dict], jrlhf_wall_s: float, warmup_s: list[float]) -> dict:
    """TRL's per-step medians and the ratio of the whole iterations' wall times."""
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    step_s = med("seconds")
    trl = {
        **peer.versions,
        "step_median_s": round(step_s, 4),
        "step_runs_s": [round(r["seconds"], 4) for r in rows],
        "warmup_steps_s": warmup_s,  # not in the medians
        # _generate_and_score_completions: generation, reward and TRL's log-prob bookkeeping
        "generate_and_score_median_s": round(med("generate_and_score_s"), 4),
        "generate_median_s": round(med("generate_s"), 4),
        "train_median_s": round(
            statistics.median(r["seconds"] - r["generate_and_score_s"] for r in rows), 4
        ),
        "completion_len_mean": round(statistics.mean(r["completion_len_mean"] for r in rows), 2),
        "torch_threads": rows[0]["threads"],
    }
    return {"trl": trl, "jrlhf_speedup_over_trl": round(step_s / jrlhf_wall_s, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.bench rl",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--algorithms", default="grpo,ppo")
    p.add_argument("--devices", type=int, default=1, help="fake CPU devices without a GPU")
    p.add_argument("--iterations", type=int, default=3, help="timed, after one warm-up")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--mlp", type=int, default=704)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--kl-coef", type=float, default=0.0)
    p.add_argument(
        "--layer-loop",
        choices=("auto", "scan", "unroll"),
        default="auto",
        help="ModelConfig.layer_loop (auto: unrolled on CPU)",
    )
    p.add_argument("--logprob-chunk", type=int, default=0, help="Memory.logprob_chunk")
    p.add_argument(
        "--microbatch-tokens",
        type=int,
        default=0,
        help="RoleConfig.microbatch_tokens of actor and critic (0: one micro-batch)",
    )
    p.add_argument("--pack", action="store_true", help="Memory.pack_samples: train on packed rows")
    p.add_argument("--matmul-size", type=int, default=0, help="0: 4096 on GPU, 2048 otherwise")
    p.add_argument(
        "--peers",
        action="store_true",
        help="run TRL's GRPOTrainer on the GRPO setting in a child process, alternating",
    )
    p.add_argument(
        "--peer-python",
        default="",
        help="the Python with trl for --peers (default: this one, if trl imports here)",
    )
    p.add_argument("--peer-threads", type=int, default=0, help="torch threads (0: its default)")
    p.add_argument(
        "--peer-warmup",
        type=int,
        default=2,
        help="TRL steps run before the timed ones (its first two are several times slower)",
    )
    p.add_argument(
        "--op-profile",
        action="store_true",
        help="also trace two more iterations and report their time by XLA op",
    )
    add_out_argument(p)
    args = p.parse_args(argv)
    check_out(p, args.out)

    if args.peers:  # fail before any expensive work
        args.peer_python = _peer_python(args)
    from jrlhf.devices import ensure_host_devices

    ensure_host_devices(args.devices)  # and keep_host_memory, before the backend starts
    import jax

    from jrlhf.devices import keep_host_memory

    gpu = jax.default_backend() == "gpu"
    n = args.matmul_size or (4096 if gpu else 2048)
    peak = _matmul_peak(n, repeats=5)
    out: dict = {
        "benchmark": "rl",
        "backend": jax.default_backend(),
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "host_memory_kept": keep_host_memory(),
        "model": {
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "mlp": args.mlp,
            "vocab": args.vocab,
            "layer_loop": args.layer_loop,
        },
        "workload": {
            "prompts": args.prompts,
            "samples": args.samples,
            "max_new_tokens": args.new_tokens,
            "epochs": 1,
            "minibatches": 1,
            "lr": args.lr,
            "kl_coef": args.kl_coef,
            "pack_samples": args.pack,
            "logprob_chunk": args.logprob_chunk,
            "microbatch_tokens": args.microbatch_tokens,
            "timed_iterations": args.iterations,
        },
        "matmul_peak": {"size": n, "dtype": "float32", "flops_per_s": round(peak, 1)},
    }
    # The trainer logs its result lines on stdout's neighbours; keep stdout for the JSON.
    with contextlib.redirect_stdout(sys.stderr):
        for algorithm in args.algorithms.split(","):
            out[algorithm] = measure(args, algorithm, peak)
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
