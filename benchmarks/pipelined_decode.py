"""``python -m benchmarks.pipelined_decode``: pipelined decode throughput, as one JSON object.

On ``--devices`` devices (default 4; on a CPU host they are fake XLA devices sharing its cores,
so only the tick and bubble counts mean anything there), a random Llama decodes the same
prompts greedily on three generation meshes of equal device count:

* ``stage=S`` with ``EngineConfig.pipeline_batches = S``: the delayed inter-batch pipeline
  (jrlhf.decode.pipelined), every stage busy at every tick but the chunk's fill and drain;
* ``stage=S`` with ``pipeline_batches = 1``: naive pipelined decode, one batch in flight;
* ``tensor=S``: the layers whole on every device, the heads split.

Each is timed after a warm-up call (compiles excluded), best of ``--repeats``: tokens/s, and for
the staged runs the ticks, each stage's busy ticks and the bubble (idle stage-ticks over all).
Every run's tokens are checked against the tensor-parallel run's (``same_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _flags(devices: int) -> None:
    """Fake ``devices`` CPU devices where JAX has not started yet (a CPU host)."""
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
        "XLA_FLAGS", ""
    ):
        flag = f"--xla_force_host_platform_device_count={devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def measure(
    devices: int = 4,
    batch: int = 16,
    prompt_len: int = 16,
    new_tokens: int = 32,
    hidden: int = 256,
    layers: int = 8,
    chunk_steps: int = 16,
    repeats: int = 3,
) -> dict:
    """The three runs' figures (see the module's docstring) as a dict."""
    import jax
    import numpy as np

    from jrlhf.decode import DecodeEngine, EngineConfig, SamplingParams
    from jrlhf.meshes import make_mesh
    from jrlhf.models.config import tiny_config
    from jrlhf.models.model_def import ModelDef

    model = ModelDef(
        tiny_config(
            vocab_size=4096, hidden_size=hidden, intermediate_size=4 * hidden, num_layers=layers,
            num_heads=max(devices, 8), num_kv_heads=max(devices, 8), eos_token_id=None,
        )
    )  # fmt: skip
    params = jax.jit(model.init)(jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 4096, size=prompt_len).tolist() for _ in range(batch)]
    sp = SamplingParams(greedy=True, stop_ids=(), max_new_tokens=new_tokens)
    config = EngineConfig(
        num_slots=batch, page_size=16, max_prompt_len=prompt_len, max_new_tokens=new_tokens,
        chunk_steps=chunk_steps, max_prefill_rows=batch,
    )  # fmt: skip
    runs = {
        f"stage={devices},batches={devices}": (f"stage={devices}", devices),
        f"stage={devices},batches=1": (f"stage={devices}", 1),
        f"tensor={devices}": (f"data=1,tensor={devices}", 0),
    }
    out: dict = {
        "devices": devices,
        "backend": jax.default_backend(),
        "shape": dict(batch=batch, prompt_len=prompt_len, new_tokens=new_tokens, hidden=hidden,
                      layers=layers, chunk_steps=chunk_steps),
    }  # fmt: skip
    tokens = {}
    for name, (mesh_text, groups) in runs.items():
        mesh = make_mesh(mesh_text)
        engine = DecodeEngine(model, mesh, "dp_tp", EngineConfig(**{
            **config.__dict__, "pipeline_batches": groups,
        }))  # fmt: skip
        placed = jax.device_put(params, model.shardings(mesh, "dp_tp"))
        engine.generate(placed, prompts, sp)  # compiles
        best, result = float("inf"), None
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = engine.generate(placed, prompts, sp)
            best = min(best, time.perf_counter() - t0)
        row = {"seconds": best, "tokens_per_s": int(result.lengths.sum()) / best}
        row.update({k: v for k, v in result.stats.items() if k.startswith("pipeline_")})
        out[name] = row
        tokens[name] = result.completion_ids
    ref = tokens[f"tensor={devices}"]
    for name in runs:
        out[name]["same_tokens"] = tokens[name] == ref
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--chunk-steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    _flags(args.devices)
    result = measure(
        args.devices, args.batch, args.prompt_len, args.new_tokens, args.hidden, args.layers,
        args.chunk_steps, args.repeats,
    )  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
