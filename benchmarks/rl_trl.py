"""The TRL peer of ``bench rl --peers``: TRL's ``GRPOTrainer`` on the GRPO setting of the benchmark.

Run by benchmarks/rl.py as a child process (``python -m benchmarks.rl_trl DIR``) with the peer's
Python (``--peer-python``), so TRL, torch and their versions never become jrlhf dependencies and
torch's thread pool never shares a process with XLA's. It imports only the standard library,
torch, transformers, tokenizers, datasets, trl and the NumPy-only jrlhf.tasks reward.

``DIR`` holds what the parent wrote: the actor's initial weights in HF format (the same weights
jrlhf starts from), ``peer.json`` (the prompts of every iteration in order, the token ids of EOS
and padding, the vocabulary size and the hyper-parameters). Token ids map one to one onto words
``t0 .. t{V-1}`` of a word-level tokenizer, so TRL sees exactly jrlhf's prompt ids and its
completions are scored by the same verifiable reward (the synthetic task's ground truth).

Protocol: the child trains ``GRPOTrainer`` for as many steps as there are prompt batches; before
each step it waits for a line on stdin (so the parent can alternate its own iterations with the
peer's, both under the same machine load) and after it prints one JSON line (after ``MARK``):
the step's seconds, the part spent in ``_generate_and_score_completions`` (generation, reward,
log-prob passes) and in ``_generate`` alone, the completion length, and torch's thread count.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

# Starts every line meant for the parent (the trainer prints its logs on stdout too).
MARK = "JRLHF-PEER "


def _tokenizer(vocab: int, eos_id: int, pad_id: int):
    """A word-level tokenizer whose word ``t{i}`` is token ``i``: no merges, no added tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token=f"t{pad_id}"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=f"t{eos_id}",
        pad_token=f"t{pad_id}",
        padding_side="left",
    )


def _reward(prompts, completion_ids, **kwargs):
    """The synthetic task's ground truth of each (prompt ids, completion ids)."""
    from jrlhf.tasks.rewards import synthetic_ground_truth

    del kwargs
    return [
        synthetic_ground_truth([int(w[1:]) for w in p.split()], list(c))
        for p, c in zip(prompts, completion_ids)
    ]


def main(directory: str) -> int:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    spec = json.loads((Path(directory) / "peer.json").read_text())
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    batches = spec["prompt_batches"]
    tokenizer = _tokenizer(spec["vocab"], spec["eos_id"], spec["pad_id"])
    texts = [" ".join(f"t{i}" for i in p) for batch in batches for p in batch]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.generation_config.eos_token_id = spec["eos_id"]
    model.generation_config.pad_token_id = spec["pad_id"]
    prompts_per_step = len(batches[0])
    rows = prompts_per_step * spec["samples"]

    class Lockstep(TrainerCallback):
        """Waits for the parent before each step and reports it after."""

        def on_step_begin(self, args, state, control, **kw):
            if not sys.stdin.readline():
                raise SystemExit(0)  # the parent went away
            timing.update(t0=time.perf_counter(), gen_score=0.0, generate=0.0)

        def on_step_end(self, args, state, control, **kw):
            line = {
                "seconds": time.perf_counter() - timing["t0"],
                "generate_and_score_s": timing["gen_score"],
                "generate_s": timing["generate"],
                "completion_len_mean": timing.get("completion_len", float("nan")),
                "threads": torch.get_num_threads(),
            }
            print(MARK + json.dumps(line), flush=True)

    timing: dict = {}
    with tempfile.TemporaryDirectory() as out:
        config = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=rows,
            gradient_accumulation_steps=1,
            num_generations=spec["samples"],
            max_completion_length=spec["new_tokens"],
            num_iterations=1,
            beta=0.0,  # no KL: TRL builds no reference model
            learning_rate=spec["lr"],
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            temperature=1.0,
            max_steps=len(batches),
            shuffle_dataset=False,  # the prompts in the parent's order
            use_cpu=not torch.cuda.is_available(),
            bf16=False,
            fp16=False,
            # TRL defaults to activation checkpointing; jrlhf's tiny model runs without it, and
            # so does the peer (its faster setting here).
            gradient_checkpointing=False,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=spec["seed"],
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=_reward,
            args=config,
            train_dataset=Dataset.from_dict({"prompt": texts}),
            processing_class=tokenizer,
            callbacks=[Lockstep()],
        )
        gen_score, generate = trainer._generate_and_score_completions, trainer._generate

        def timed_gen_score(*a, **kw):
            t0 = time.perf_counter()
            out = gen_score(*a, **kw)
            timing["gen_score"] += time.perf_counter() - t0
            mask = out.get("completion_mask")
            if mask is not None:
                timing["completion_len"] = float(mask.sum(dim=1).float().mean())
            return out

        def timed_generate(*a, **kw):
            t0 = time.perf_counter()
            out = generate(*a, **kw)
            timing["generate"] += time.perf_counter() - t0
            return out

        trainer._generate_and_score_completions = timed_gen_score
        trainer._generate = timed_generate
        versions = {"trl": trl.__version__, "transformers": transformers.__version__}
        versions["torch"] = torch.__version__
        print(MARK + json.dumps({"ready": True, **versions}), flush=True)
        trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
