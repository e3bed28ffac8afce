"""Peak activation memory of pipelined train steps (jrlhf.models.pipeline: GPipe and 1F1B)
against the unpipelined step on the same 8 devices.

Compiles the trainer's real SFT train step (``make_train_step``, scanned layers) for abstract
state on fake CPU devices and prints XLA's memory analysis per device (temp: activations,
gradients, gathered weights; args: the state's shard), for stage counts 1, 2, 4, several
pipeline micro-batch counts and both schedules, with and without remat, one JSON object a
line. Nothing runs.

    python -m benchmarks.pipeline_memory            # (sets 8 fake CPU devices itself)
"""

from __future__ import annotations

import json
import os

if "jax" not in os.sys.modules:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.fsdp_memory import train_compiled
from jrlhf.meshes.mesh import MeshSpec
from jrlhf.models.config import tiny_config
from jrlhf.models.pipeline import bubble_fraction

ROWS = 32
CASES = (
    # (mesh, pipeline micro-batches)
    ("fsdp=4,tensor=2", 0),
    ("stage=2,fsdp=2,tensor=2", 2),
    ("stage=2,fsdp=2,tensor=2", 4),
    ("stage=2,fsdp=2,tensor=2", 8),
    ("stage=2,fsdp=2,tensor=2", 16),
    ("stage=4,fsdp=2", 4),
    ("stage=4,fsdp=2", 8),
    ("stage=4,fsdp=2", 16),
)


def model_config(remat: str, micro: int, schedule: str = "gpipe"):
    return tiny_config(
        pipeline_schedule=schedule,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=1024,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
        layer_loop="scan",
        remat_policy=remat,
        pipeline_microbatches=micro,
    )


def main():
    for remat in ("none", "full"):
        for mesh, micro in CASES:
            stages = MeshSpec.parse(mesh).shape.get("stage", 1)
            for schedule in ("gpipe", "1f1b") if stages > 1 else ("-",):
                measure(mesh, micro, stages, remat, schedule)


def measure(mesh: str, micro: int, stages: int, remat: str, schedule: str):
    cfg = model_config(remat, micro, "gpipe" if schedule == "-" else schedule)
    analysis = train_compiled(cfg, mesh, ROWS).memory_analysis()
    row = dict(
        mesh=mesh,
        rows=ROWS,
        remat=remat,
        schedule=schedule,
        pipeline_microbatches=micro if stages > 1 else None,
        bubble=round(bubble_fraction(stages, micro or 1, schedule), 3),
        temp_mib=round(analysis.temp_size_in_bytes / 2**20, 2),
        args_mib=round(analysis.argument_size_in_bytes / 2**20, 2),
    )
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
