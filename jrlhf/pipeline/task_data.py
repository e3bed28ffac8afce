"""Task data: the token ids every stage reads, loaded or synthesized once per run.

Every data problem (a missing file, a malformed line, a tokenizer the model cannot hold) surfaces
here, before any model is built.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jrlhf import data as data_lib
from jrlhf.config import Config, ConfigError
from jrlhf.tasks import SyntheticTask


@dataclasses.dataclass
class TaskData:
    """Everything the stages read: token ids plus how to judge a response, if known."""

    train_prompts: list[list[int]]
    heldout_prompts: list[list[int]]
    sft_records: list[Any]
    preference_records: list[Any]
    pad_id: int
    eos_id: int | None
    model_overrides: dict[str, Any]
    ground_truth: Callable[[Sequence[int], Sequence[int]], float] | None = None
    save_tokenizer: Callable[[Path], Any] | None = None


def build_task_data(cfg: Config) -> TaskData:
    """Load or synthesize the data; every problem surfaces here, before any model is built."""
    t = cfg.task
    if t.name == "synthetic":
        task = SyntheticTask(seed=cfg.run.seed)
        if task.max_prompt_len > t.max_prompt_len or task.max_response_len > t.max_response_len:
            raise ConfigError(
                f"TaskConfig: the synthetic task needs max_prompt_len >= {task.max_prompt_len} "
                f"and max_response_len >= {task.max_response_len}"
            )
        return TaskData(
            train_prompts=task.prompts(4096, "train"),
            heldout_prompts=task.prompts(t.num_heldout, "heldout"),
            sft_records=task.sft_examples(t.num_sft_examples),
            preference_records=task.preference_pairs(t.num_preference_pairs),
            pad_id=task.pad_id,
            eos_id=task.eos_id,
            model_overrides=task.model_overrides(),
            ground_truth=task.score,
            save_tokenizer=task.save_tokenizer,
        )
    tokenizer = data_lib.Tokenizer.from_file(t.tokenizer) if t.tokenizer else None
    vocab = tokenizer.vocab_size if tokenizer else None
    lens = dict(max_prompt_len=t.max_prompt_len, vocab_size=vocab)
    train = data_lib.load_prompts(t.prompts, tokenizer, **lens)
    heldout = (
        data_lib.load_prompts(t.heldout_prompts, tokenizer, **lens) if t.heldout_prompts else []
    )
    full = dict(lens, max_response_len=t.max_response_len)
    sft = data_lib.load_sft(t.sft_data, tokenizer, **full) if t.sft_data else []
    prefs = (
        data_lib.load_preferences(t.preference_data, tokenizer, **full) if t.preference_data else []
    )
    if "sft" in cfg.run.stages and not sft:
        raise ConfigError("TaskConfig.sft_data: the sft stage needs demonstrations")
    if "rm" in cfg.run.stages and not prefs:
        raise ConfigError("TaskConfig.preference_data: the rm stage needs preference pairs")
    overrides = {"vocab_size": vocab} if vocab else {}
    pad = tokenizer.pad_id if tokenizer and tokenizer.pad_id is not None else 0
    eos = tokenizer.eos_id if tokenizer else None
    if eos is not None:
        overrides["eos_token_id"] = eos
    save = None
    if tokenizer is not None:

        def save(directory, src=Path(t.tokenizer)):
            src_dir = src if src.is_dir() else src.parent
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (src_dir / name).exists():
                    shutil.copy2(src_dir / name, Path(directory) / name)

    return TaskData(
        train_prompts=[r.prompt_ids for r in train],
        heldout_prompts=[r.prompt_ids for r in heldout] or [r.prompt_ids for r in train][:64],
        sft_records=list(sft),
        preference_records=list(prefs),
        pad_id=pad,
        eos_id=eos,
        model_overrides=overrides,
        save_tokenizer=save,
    )
