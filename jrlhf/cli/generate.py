"""``python -m jrlhf.generate``: sample completions for a JSONL file of prompts.

    python -m jrlhf.generate (--hf DIR | --checkpoint DIR) --prompts FILE.jsonl
        --max-new-tokens N [--greedy | --temperature T --top-p P --top-k K]
        [--num-samples S] [--seed SEED] [--mesh "data=2,tensor=4"] --output OUT.jsonl

Input lines are ``{"prompt": "text"}`` (needs the checkpoint's tokenizer.json),
``{"messages": [{"role": "user", "content": "..."}]}`` (rendered with the checkpoint's chat
template, generation prompt added) or ``{"prompt_ids": [1, 2, 3]}``, read and validated by
:func:`jrlhf.data.load_prompts` like the trainer's prompt files (blank lines are skipped).
Each output line carries ``prompt_index``, ``sample_index``, ``completion_ids``, ``logprobs``
(raw policy log-probs), ``sampling_logprobs`` and ``text`` when a tokenizer exists, in input
order (samples of a prompt together). Input problems are reported as one line, with the line
number, before any model is loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jrlhf import data
from jrlhf.checkpoint import load_model
from jrlhf.decode.engine import DecodeEngine, EngineConfig, round_slots
from jrlhf.decode.kernels import KERNELS
from jrlhf.decode.sampling import SamplingParams
from jrlhf.meshes import MeshLayoutError, MeshSpec, blame_setting, make_mesh
from jrlhf.meshes.processes import barrier, is_primary, job_mesh
from jrlhf.models.hf import load_hf
from jrlhf.ppo.rollout import Rollout
from jrlhf.runtime import distributed
from jrlhf.storage import atomic_file, describe_os_error, settle_abandoned_tasks


class InputError(ValueError):
    """A problem with the command line or the prompts file (reported as one line)."""


def read_prompts(path: str | Path, tokenizer: data.Tokenizer | None) -> list[list[int]]:
    """The prompts file's token ids, parsed and validated by jrlhf.data (errors name the line).

    Blank lines are skipped (the file is often written by hand); a text prompt needs
    ``tokenizer``.
    """
    try:
        records = data.load_prompts(path, tokenizer, skip_blank_lines=True)
    except (ValueError, FileNotFoundError) as e:
        raise InputError(str(e)) from None
    return [r.prompt_ids for r in records]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", help="HF checkpoint directory (config.json + safetensors)")
    src.add_argument("--checkpoint", help="jrlhf Orbax model checkpoint directory")
    p.add_argument("--prompts", required=True, help="input JSONL")
    p.add_argument("--output", required=True, help="output JSONL")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-ids", default=None, help="comma-separated; default: the model's EOS")
    p.add_argument(
        "--mesh",
        help='generation mesh, e.g. "data=2,tensor=4" (default: one device; with --distributed '
        "every device of the job)",
    )
    p.add_argument("--rules", default="dp_tp")
    p.add_argument("--num-slots", type=int, default=0, help="default: min(prompts x samples, 64)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=0)
    p.add_argument("--chunk-steps", type=int, default=16)
    p.add_argument("--kernel", default="auto", choices=KERNELS)
    distributed.add_flag(p)
    return p


def run(args: argparse.Namespace) -> int:
    """Generate for parsed arguments; raises InputError for user errors."""
    model_dir = Path(args.hf or args.checkpoint)
    # Text prompts are encoded with the checkpoint's tokenizer; the prompts are read before the
    # checkpoint is checked so that a bad input file is reported first.
    tokenizer = data.Tokenizer.from_dir_if_present(model_dir) if model_dir.is_dir() else None
    prompts = read_prompts(args.prompts, tokenizer)
    if not model_dir.is_dir():
        raise InputError(f"{model_dir}: checkpoint directory not found")
    try:
        stop_ids = (
            None
            if args.stop_ids is None
            else tuple(int(t) for t in args.stop_ids.split(",") if t.strip())
        )
        sampling = SamplingParams(
            greedy=args.greedy,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            num_samples=args.num_samples,
            seed=args.seed,
            stop_ids=stop_ids,
            max_new_tokens=args.max_new_tokens,
        )
    except ValueError as e:
        raise InputError(str(e)) from None

    # Every error about the mesh (a typo, too few devices, a model it does not divide) names it.
    setting = f"--mesh {args.mesh}" if args.mesh else "the default mesh"
    try:
        with blame_setting(setting):
            mesh = make_mesh(MeshSpec.parse(args.mesh or job_mesh("data=1,tensor=1", "data")))
    except ValueError as e:
        raise InputError(str(e)) from None
    with blame_setting(f"{setting} (--rules {args.rules})", MeshLayoutError):
        if args.hf:
            model_def, params = load_hf(args.hf, mesh, args.rules)
        else:
            model_def, params = load_model(args.checkpoint, mesh, args.rules)

    want = args.num_slots or min(len(prompts) * args.num_samples, 64)
    num_slots = round_slots(want, mesh, args.rules)
    longest = max(len(p) for p in prompts)
    engine_cfg = EngineConfig(
        num_slots=num_slots,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_prompt_len=longest,
        max_new_tokens=args.max_new_tokens,
        chunk_steps=args.chunk_steps,
        max_prefill_rows=min(num_slots, 16),
        kernel=args.kernel,
    )
    # The trainer's rollout without a scorer: generation only, sampled as the command line says.
    rollout = Rollout(DecodeEngine(model_def, mesh, args.rules, engine_cfg))
    _, result = rollout.generate(params, prompts, sampling)
    out_path = Path(args.output)
    if not is_primary():  # every process holds the same completions; process 0 writes them
        barrier("generate:written")
        return 0
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: a full disk leaves no truncated output behind.
        with atomic_file(out_path) as tmp, tmp.open("w") as f:
            for i, ids in enumerate(result.completion_ids):
                p = int(result.prompt_index[i])
                line = {
                    "prompt_index": p,
                    "sample_index": i % args.num_samples,
                    "completion_ids": ids,
                    "logprobs": [float(x) for x in result.raw_logprobs[i]],
                    "sampling_logprobs": [float(x) for x in result.sampling_logprobs[i]],
                }
                if tokenizer is not None:
                    line["text"] = tokenizer.decode(ids)
                f.write(json.dumps(line) + "\n")
    except OSError as e:  # a full disk, a read-only directory, an --output that is a directory
        barrier("generate:written")
        print(f"error: cannot write --output {describe_os_error(e)}", file=sys.stderr)
        return 1
    s = result.stats
    print(
        f"wrote {len(result.completion_ids)} completions to {out_path} "
        f"({s['generated_tokens']} tokens in {s['seconds']:.2f}s, "
        f"kernel {rollout.engine.kernel_name})",
        file=sys.stderr,
    )
    barrier("generate:written")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for input errors)."""
    args = _parser().parse_args(argv)
    settle_abandoned_tasks()  # a damaged checkpoint's abandoned reads end before the one line
    try:
        distributed.setup_devices(args.distributed)
        return distributed.end_process(run(args))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)
    except (ValueError, OSError) as e:
        # Checkpoint and shape problems (CheckpointError is a ValueError) and a job that cannot
        # be joined (DistributedError) stay one line too.
        print(f"error: {e}", file=sys.stderr)
        return distributed.end_process(2)


if __name__ == "__main__":
    sys.exit(main())
