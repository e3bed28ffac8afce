"""Does XLA gather FSDP weights one scanned layer at a time, or the whole model at once?

Compiles the trainer's real train step (``make_train_step``) and scoring forward (``make_infer``)
for small scanned models on fake CPU devices, at several layer counts, and prints XLA's memory
analysis next to the estimator's working-memory terms. If temp memory grows by about one layer's
gathered weights per added layer, the whole model is gathered; if it stays flat, one layer is.

    python -m benchmarks.fsdp_memory            # (sets 8 fake CPU devices itself)
"""

from __future__ import annotations

import os

if "jax" not in os.sys.modules:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from jrlhf.meshes.batch import shard_batch
from jrlhf.meshes.mesh import MeshSpec, make_mesh
from jrlhf.models.config import tiny_config
from jrlhf.models.model_def import ModelDef
from jrlhf.pipeline.supervised import sft_loss_fn
from jrlhf.ppo import batch as rl_batch
from jrlhf.runtime.roles import make_infer
from jrlhf.runtime.steps import (
    OptimizerConfig,
    TrainState,
    make_optimizer,
    make_train_step,
    state_shardings,
)

P, R = 8, 8


def model_config(layers: int, **kw):
    base = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=layers,
        num_heads=8,
        num_kv_heads=8,
        remat_policy="dots_no_batch",
    )
    base.update(kw)
    return tiny_config(**base)


def _batch(cfg, rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, cfg.vocab_size, P)) for _ in range(rows)]
    responses = [list(rng.integers(1, cfg.vocab_size, R)) for _ in range(rows)]
    arrays = rl_batch.pack(prompts, responses, P, R, 0)
    return {k: arrays[k] for k in ("tokens", "positions", "segment_ids", "response_tokens", "mask")}


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shardings
    )


def train_analysis(cfg, mesh_spec: str, rows: int, microbatches: int = 1):
    """XLA's memory analysis of the compiled train step (abstract state, nothing allocated)."""
    return train_compiled(cfg, mesh_spec, rows, microbatches).memory_analysis()


def train_compiled(cfg, mesh_spec: str, rows: int, microbatches: int = 1):
    """The trainer's train step compiled for abstract state (nothing allocated)."""
    model = ModelDef(cfg, "lm")
    mesh = make_mesh(MeshSpec.parse(mesh_spec))
    opt = make_optimizer(OptimizerConfig())
    shardings = state_shardings(model, opt, mesh, "fsdp_tp")
    abstract_state = jax.eval_shape(
        lambda p: TrainState(np.int32(0), p, opt.init(p)), model.abstract_params
    )
    state = _abstract(abstract_state, shardings)
    step = make_train_step(model, opt, sft_loss_fn(P), mesh, "fsdp_tp", microbatches=microbatches)
    batch = shard_batch(_batch(cfg, rows), mesh, "fsdp_tp")
    return step.jitted.lower(state, batch).compile()


def infer_analysis(cfg, mesh_spec: str, rows: int):
    """XLA's memory analysis of the compiled scoring forward (reference log-probs)."""
    model = ModelDef(cfg, "lm")
    mesh = make_mesh(MeshSpec.parse(mesh_spec))
    params = _abstract(model.abstract_params, model.shardings(mesh, "fsdp_tp"))
    infer = make_infer(model, mesh, "fsdp_tp", lambda m, b: rl_batch.response_logprobs(m, b, P))
    fields = ("tokens", "positions", "segment_ids", "response_tokens")
    batch = shard_batch(
        {k: v for k, v in _batch(cfg, rows).items() if k in fields}, mesh, "fsdp_tp"
    )
    return infer.jitted.lower(params, batch).compile().memory_analysis()


def layer_bytes(cfg) -> int:
    from jrlhf.placement.workload import itemsize, layer_matmul_params

    return layer_matmul_params(cfg) * itemsize(cfg.param_dtype)


def main():
    rows = 16
    print(f"rows {rows}, seq {P + R}; MiB; temp = XLA temp_size, args = argument_size")
    print("kind  mesh               layers  layer_w  whole_w  temp    args   temp/layer_w")
    for mesh_spec in ("fsdp=8", "fsdp=4,tensor=2"):
        for layers in (2, 4, 8):
            cfg = model_config(layers)
            lw = layer_bytes(cfg) / 2**20
            whole = ModelDef(cfg, "lm")
            whole_w = sum(
                int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                for s in jax.tree.leaves(whole.abstract_params)
            )
            for kind, analysis in (("train", train_analysis), ("infer", infer_analysis)):
                m = analysis(cfg, mesh_spec, rows)
                temp = m.temp_size_in_bytes / 2**20
                args = m.argument_size_in_bytes / 2**20
                print(
                    f"{kind:5} {mesh_spec:18} {layers:6}  {lw:7.2f}  {whole_w / 2**20:7.2f}"
                    f"  {temp:6.2f}  {args:6.2f}  {temp / lw:6.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
