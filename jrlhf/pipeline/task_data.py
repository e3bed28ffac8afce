"""Task data: the token ids every stage reads, loaded or synthesized once per run.

Every data problem (a missing file, a malformed line, a tokenizer the model cannot hold, a
prompt without the meta its reward function reads) surfaces here, before any model is built.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jrlhf import data as data_lib
from jrlhf.config import Config, ConfigError
from jrlhf.envs import EnvSetup, load_environment
from jrlhf.meshes.mesh import blame_setting
from jrlhf.tasks import BUILTIN_TASKS, get_reward_fn
from jrlhf.tasks.rewards import check_reward_fn, missing_meta


@dataclasses.dataclass
class TaskData:
    """Everything the stages read: token ids plus how to judge a response, if known.

    ``train_meta[i]`` / ``heldout_meta[i]`` are the extra fields of prompt i's record (what a
    reward function reads, e.g. a reference answer); ``{}`` for every prompt when not given.
    ``heldout_preference_records`` are pairs no stage trains on (what the dpo stage evaluates
    on): built only for a run with a dpo stage, or read from TaskConfig.heldout_preference_data.
    A built-in task draws ``sft_records`` only for a run with an sft stage and
    ``preference_records`` only for one with an rm or dpo stage (empty otherwise).
    """

    train_prompts: list[list[int]]
    heldout_prompts: list[list[int]]
    sft_records: list[Any]
    preference_records: list[Any]
    pad_id: int
    eos_id: int | None
    model_overrides: dict[str, Any]
    ground_truth: Callable[[Sequence[int], Sequence[int]], float] | None = None
    save_tokenizer: Callable[[Path], Any] | None = None
    train_meta: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    heldout_meta: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    decode: Callable[[Sequence[int]], str] | None = None  # ids -> text, for reward functions
    heldout_preference_records: list[Any] = dataclasses.field(default_factory=list)
    tokenizer: data_lib.Tokenizer | None = None  # text <-> ids (environments' observations)
    # Every id generation stops at (a checkpoint's end ids: generation_config.json's list, e.g.
    # <|im_end|> and <|endoftext|>); () means (eos_id,).
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.stop_ids and self.eos_id is not None:
            self.stop_ids = (int(self.eos_id),)
        # Every prompt gets a meta entry, so prompts and meta always index alike.
        for split in ("train", "heldout"):
            prompts, meta = getattr(self, f"{split}_prompts"), getattr(self, f"{split}_meta")
            if not meta:
                setattr(self, f"{split}_meta", [{} for _ in prompts])
            elif len(meta) != len(prompts):
                raise ValueError(f"{len(meta)} {split}_meta entries for {len(prompts)} prompts")

    def train_records(self) -> list[data_lib.PromptRecord]:
        """The training prompts with their meta: what the PromptLoader batches."""
        return [data_lib.PromptRecord(p, m) for p, m in zip(self.train_prompts, self.train_meta)]


def tokenizer_model_overrides(tokenizer: data_lib.Tokenizer | None) -> dict[str, Any]:
    """Model fields a tokenizer imposes on ``tiny`` models: its vocabulary and end ids (one id,
    or all of a checkpoint's, :attr:`~jrlhf.data.Tokenizer.end_ids`)."""
    if tokenizer is None:
        return {}
    overrides: dict[str, Any] = {"vocab_size": tokenizer.vocab_size}
    ends = tokenizer.end_ids
    if ends:
        overrides["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    return overrides


def task_model_overrides(cfg: Config) -> dict[str, Any]:
    """The model fields the task imposes (``TaskData.model_overrides``) without loading its data:
    what the planner needs to size ``tiny`` roles."""
    if cfg.task.name in BUILTIN_TASKS:
        return BUILTIN_TASKS[cfg.task.name](seed=cfg.run.seed).model_overrides()
    if cfg.task.tokenizer:
        return tokenizer_model_overrides(data_lib.Tokenizer.from_file(cfg.task.tokenizer))
    return {}


@functools.lru_cache(maxsize=16)
def _drawn_prompts(task_cls: type, seed: int, n: int, split: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(p) for p in task_cls(seed=seed).prompts(n, split))


def _builtin_prompts(name: str, seed: int, n: int, split: str) -> list[list[int]]:
    """A built-in task's first ``n`` prompts of ``split``: a function of the task and its seed,
    drawn once per process (4096 training prompts take about half a second, at every start of an
    in-process run: tests, benchmarks, notebooks) and handed out as fresh lists."""
    return [list(p) for p in _drawn_prompts(BUILTIN_TASKS[name], int(seed), int(n), split)]


@functools.lru_cache(maxsize=16)
def _drawn_records(name: str, seed: int, kind: str, n: int, split: str) -> tuple[Any, ...]:
    """A built-in task's first ``n`` demonstrations (``kind="sft"``) or preference pairs of
    ``split``: like its prompts, a function of the task and its seed, drawn once per process
    (2,048 of each took about a second, at every start of an in-process run or --check). The
    records are frozen; callers get a fresh list of them."""
    task = BUILTIN_TASKS[name](seed=seed)
    return tuple(task.sft_examples(n) if kind == "sft" else task.preference_pairs(n, split))


def build_task_data(cfg: Config) -> TaskData:
    """Load or synthesize the data; every problem surfaces here, before any model is built."""
    t = cfg.task
    if t.name in BUILTIN_TASKS:
        task = BUILTIN_TASKS[t.name](seed=cfg.run.seed)
        if task.max_prompt_len > t.max_prompt_len or task.max_response_len > t.max_response_len:
            raise ConfigError(
                f"TaskConfig: the {t.name} task needs max_prompt_len >= {task.max_prompt_len} "
                f"and max_response_len >= {task.max_response_len}"
            )
        train_prompts = _builtin_prompts(t.name, cfg.run.seed, 4096, "train")
        heldout_prompts = _builtin_prompts(t.name, cfg.run.seed, t.num_heldout, "heldout")
        # Tasks with reference answers give each prompt its answer (what answer_match reads).
        meta_of = getattr(task, "prompt_meta", lambda prompts: [])
        # Demonstrations and pairs are drawn only for the stages that read them: drawing them
        # costs a second or two at every start of an RL-only run. Each has its own random
        # stream, so what is drawn does not depend on what else is.
        stages, seed = set(cfg.run.stages), int(cfg.run.seed)
        sft, pairs, heldout_pairs = [], [], []
        if "sft" in stages:
            sft = list(_drawn_records(t.name, seed, "sft", t.num_sft_examples, "train"))
        if stages & {"rm", "dpo"}:
            pairs = list(_drawn_records(t.name, seed, "pairs", t.num_preference_pairs, "train"))
        if "dpo" in stages:
            heldout_pairs = list(
                _drawn_records(t.name, seed, "pairs", t.num_heldout_pairs, "heldout")
            )
        builtin = TaskData(
            train_prompts=train_prompts,
            heldout_prompts=heldout_prompts,
            sft_records=sft,
            preference_records=pairs,
            pad_id=task.pad_id,
            eos_id=task.eos_id,
            model_overrides=task.model_overrides(),
            ground_truth=task.score,
            save_tokenizer=task.save_tokenizer,
            train_meta=meta_of(train_prompts),
            heldout_meta=meta_of(heldout_prompts),
            decode=task.tokenizer().decode,
            heldout_preference_records=heldout_pairs,
            tokenizer=task.tokenizer(),
        )
        _check_reward_meta(cfg, {f"the {t.name} task's prompts": builtin.train_meta})
        _check_reward_fn(cfg, builtin)
        environment_setup(cfg, builtin)
        return builtin
    with blame_setting("TaskConfig.tokenizer", (FileNotFoundError, ValueError)):
        tokenizer = data_lib.Tokenizer.from_file(t.tokenizer) if t.tokenizer else None
    vocab = tokenizer.vocab_size if tokenizer else None
    lens = dict(max_prompt_len=t.max_prompt_len, vocab_size=vocab)
    train = data_lib.load_prompts(t.prompts, tokenizer, **lens)
    heldout = (
        data_lib.load_prompts(t.heldout_prompts, tokenizer, **lens) if t.heldout_prompts else []
    )
    _check_reward_meta(cfg, {train.source: [r.meta for r in train]})
    if heldout:
        _check_reward_meta(cfg, {heldout.source: [r.meta for r in heldout]})
    else:
        heldout = train.records[:64]  # without held-out prompts, evaluate on the first ones
    full = dict(lens, max_response_len=t.max_response_len)
    sft = data_lib.load_sft(t.sft_data, tokenizer, **full) if t.sft_data else []
    prefs, heldout_prefs = (
        data_lib.load_preferences(path, tokenizer, **full) if path else []
        for path in (t.preference_data, t.heldout_preference_data)
    )
    if "sft" in cfg.run.stages and not sft:
        raise ConfigError("TaskConfig.sft_data: the sft stage needs demonstrations")
    for stage in ("rm", "dpo"):
        if stage in cfg.run.stages and not prefs:
            raise ConfigError(
                f"TaskConfig.preference_data: the {stage} stage needs preference pairs"
            )
    overrides = tokenizer_model_overrides(tokenizer)
    pad = tokenizer.pad_id if tokenizer and tokenizer.pad_id is not None else 0
    eos = tokenizer.eos_id if tokenizer else None
    save = None
    if tokenizer is not None:

        def save(directory, src=Path(t.tokenizer)):
            src_dir = src if src.is_dir() else src.parent
            for name in data_lib.tokenizer.TOKENIZER_FILES:
                if (src_dir / name).exists():
                    shutil.copy2(src_dir / name, Path(directory) / name)

    files = TaskData(
        train_prompts=[r.prompt_ids for r in train],
        heldout_prompts=[r.prompt_ids for r in heldout],
        sft_records=list(sft),
        preference_records=list(prefs),
        pad_id=pad,
        eos_id=eos,
        model_overrides=overrides,
        save_tokenizer=save,
        train_meta=[r.meta for r in train],
        heldout_meta=[r.meta for r in heldout],
        decode=tokenizer.decode if tokenizer else None,
        heldout_preference_records=list(heldout_prefs),
        tokenizer=tokenizer,
        stop_ids=tokenizer.end_ids if tokenizer else (),
    )
    _check_reward_fn(cfg, files)
    environment_setup(cfg, files)
    return files


def environment_setup(cfg: Config, data: TaskData) -> EnvSetup | None:
    """The run's environment (``EnvConfig``) resolved against its tokenizer, None without one;
    a name that does not resolve, or a turn stop string that is not one token, is one line
    naming the setting (build_task_data calls this before any model is built)."""
    e = cfg.env
    if not e.name:
        return None
    try:
        factory = load_environment(e.name)
    except ValueError as err:  # its message names EnvConfig.name
        raise ConfigError(str(err)) from None
    stop_ids = list(e.turn_stop_ids)
    vocab = data.tokenizer.vocab_size if data.tokenizer is not None else None
    for text in e.turn_stop:
        token = data.tokenizer.token_to_id(text) if data.tokenizer is not None else None
        if token is None:
            where = "the tokenizer" if data.tokenizer is not None else "a run without a tokenizer"
            raise ConfigError(
                f"EnvConfig.turn_stop: {text!r} is not one token of {where} (a turn ends at "
                "single tokens; use turn_stop_ids for ids)"
            )
        stop_ids.append(token)
    for token in stop_ids:
        if vocab is not None and token >= vocab:
            raise ConfigError(
                f"EnvConfig.turn_stop_ids: {token} is outside the vocabulary of {vocab}"
            )
    tok = data.tokenizer
    return EnvSetup(
        e.name, factory, tuple(stop_ids), e.max_turn_tokens, e.max_turns, e.timeout_s,
        e.failure_limit, tok.encode if tok is not None else None, data.decode,
        e.max_observation_tokens,
    )  # fmt: skip


def _check_reward_fn(cfg: Config, data: TaskData) -> None:
    """The user's reward function scores a few dummy samples of ``data`` (jrlhf.tasks.rewards.
    check_reward_fn) now, before any stage: not only once the RL stage starts."""
    if cfg.task.reward_fn:
        check_reward_fn(
            cfg.task.reward_fn,
            data.train_prompts,
            data.train_meta,
            data.decode,
            data.eos_id,
            cfg.task.max_response_len,
            cfg.task,
        )


def _check_reward_meta(cfg: Config, meta_by_source: dict[str, list[dict[str, Any]]]) -> None:
    """Fail now, naming the record, if a prompt lacks meta the reward function reads."""
    if not cfg.task.reward_fn:
        return
    fn = get_reward_fn(cfg.task.reward_fn, cfg.task)
    for source, metas in meta_by_source.items():
        for i, meta in enumerate(metas):
            missing = missing_meta(fn, meta)
            if missing:
                raise ConfigError(
                    f"TaskConfig.reward_fn: {cfg.task.reward_fn!r} reads {', '.join(missing)} "
                    f"from each prompt's meta, which record {i + 1} of {source} lacks"
                )
