"""Convert between HF checkpoints and jrlhf (Orbax) checkpoints.

    python -m jrlhf.convert --from-hf HF_DIR --to CKPT_DIR
    python -m jrlhf.convert --from CKPT_DIR --to-hf HF_DIR [--role actor] [--tokenizer DIR]

``--from`` accepts a model checkpoint or a trainer run's checkpoint directory (its latest step's
``--role`` model is exported).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

from jrlhf import checkpoint
from jrlhf.meshes import MeshLayoutError, MeshSpec, blame_setting, make_mesh
from jrlhf.meshes.processes import is_primary, job_mesh
from jrlhf.models import ModelDef, hf
from jrlhf.runtime import distributed
from jrlhf.storage import reporting_storage_faults, settle_abandoned_tasks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jrlhf.convert", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", dest="from_hf", help="HF checkpoint directory to import")
    src.add_argument("--from", dest="from_ckpt", help="jrlhf checkpoint directory to export")
    p.add_argument("--to", help="output jrlhf checkpoint directory (with --from-hf)")
    p.add_argument("--to-hf", dest="to_hf", help="output HF directory (with --from)")
    p.add_argument("--role", default="actor", help="role to export from a trainer checkpoint")
    p.add_argument("--tokenizer", help="directory whose tokenizer files to copy into the export")
    p.add_argument("--param-dtype", choices=("float32", "bfloat16", "float16"))
    p.add_argument(
        "--mesh",
        help='mesh used while converting, e.g. "fsdp=8" (default: one device; with --distributed '
        "every device of the job)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --to-hf dir")
    distributed.add_flag(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settle_abandoned_tasks()  # a damaged checkpoint's abandoned reads end before the one line
    if args.from_hf and not args.to:
        print("error: --from-hf needs --to CKPT_DIR", file=sys.stderr)
        return 2
    if args.from_ckpt and not args.to_hf:
        print("error: --from needs --to-hf HF_DIR", file=sys.stderr)
        return 2
    # Every error about the mesh (a typo, too few devices, a model it does not divide) names
    # --mesh; a typo is found before JAX starts.
    setting = f"--mesh {args.mesh}" if args.mesh else "the default mesh"
    try:
        with blame_setting(setting):
            spec = MeshSpec.parse(args.mesh) if args.mesh else None
        distributed.setup_devices(args.distributed)
        with blame_setting(setting):
            mesh = make_mesh(spec or MeshSpec.parse(job_mesh("fsdp=1", "fsdp")))
        if args.from_hf:
            out = Path(args.to)
            if out.exists() and any(out.iterdir()):
                raise FileExistsError(f"{out}: exists and is not empty")
            model, params = hf.load_hf(args.from_hf, mesh, "fsdp_tp", param_dtype=args.param_dtype)
            with reporting_storage_faults(out):
                checkpoint.save_model(out, model, params)
            if is_primary():
                print(f"wrote {out} ({model.config.architecture}, {model.num_params():,} params)")
        else:
            out = Path(args.to_hf)
            if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
                raise FileExistsError(
                    f"--to-hf {out}: exists and is not an empty directory (pass --overwrite to "
                    "replace it)"
                )
            model, params = checkpoint.load_model(args.from_ckpt, mesh, "fsdp_tp", role=args.role)
            if args.param_dtype:
                params = jax.tree.map(lambda x: x.astype(args.param_dtype), params)
                model = ModelDef(model.config.replace(param_dtype=args.param_dtype), model.head)
            tokenizer = args.tokenizer
            if tokenizer is None:
                # A run directory keeps its tokenizer at the top; look up from the checkpoint.
                src = Path(args.from_ckpt).absolute()
                for candidate in (src, *src.parents[:3]):
                    if (candidate / "tokenizer.json").exists():
                        tokenizer = candidate
                        break
            with reporting_storage_faults(out):
                out = hf.save_hf(
                    model, params, out, tokenizer_from=tokenizer, overwrite=args.overwrite
                )
            if is_primary():
                print(f"wrote {out}")
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        # A job that cannot be joined (DistributedError) is a ValueError: one line too.
        if isinstance(e, MeshLayoutError):  # the model does not divide the mesh
            e = f"{setting}: {e}"
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
