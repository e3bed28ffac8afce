"""``python -m jrlhf.train [--config FILE.gin ...] [BINDING ...]``: the RLHF pipeline.

With no arguments it runs configs/default.gin: on the built-in synthetic task whose true
preference is known, SFT a tiny actor, train a tiny reward model on preference pairs, then PPO
with actor, critic, reference and reward, and print the held-out ground-truth score of the SFT
and PPO policies and the PPO policy's KL to the reference.

Bindings use gin syntax, e.g. ``RLConfig.iterations=10`` or
``'actor/RoleConfig.train_mesh="fsdp=8"'``. ``--resume`` continues a run directory exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jrlhf.config import Config, ConfigError, load_config, operative_config
from jrlhf.devices import ensure_host_devices

log = logging.getLogger("jrlhf")
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.gin"


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
    from jrlhf import data as data_lib

    t = cfg.task
    if t.name == "synthetic":
        from jrlhf.tasks import SyntheticTask

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
            import shutil

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


def setup_logging() -> None:
    """jrlhf's own messages at INFO; libraries (Orbax, absl) only when they warn."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    log.setLevel(logging.INFO)
    for noisy in ("absl", "orbax", "jax._src.xla_bridge"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m jrlhf.train", description=__doc__.split("\n\n")[0].split(": ", 1)[-1]
    )
    p.add_argument("--config", action="append", default=[], help="gin file (repeatable)")
    p.add_argument("--run-dir", help="output directory (default runs/<timestamp>)")
    p.add_argument("--resume", action="store_true", help="continue the run in --run-dir")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="multi-host: call jax.distributed.initialize() (coordinator from the environment)",
    )
    p.add_argument("bindings", nargs="*", help="gin bindings, e.g. RLConfig.iterations=10")
    return p


def prepare_run_dir(cfg: Config, run_dir: str | None, resume: bool) -> Path:
    path = Path(run_dir or cfg.run.run_dir or "")
    if not str(path) or str(path) == ".":
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = Path("runs") / f"run-{stamp}"
    if path.exists() and any(path.iterdir()) and not resume:
        raise ConfigError(
            f"run directory {path} already holds a run: pass --resume to continue it, or choose "
            "another --run-dir"
        )
    if resume and not path.exists():
        raise ConfigError(f"--resume: run directory {path} does not exist")
    path.mkdir(parents=True, exist_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = args.config or [str(DEFAULT_CONFIG)]
    bindings = list(args.bindings)
    try:
        cfg = load_config(files, bindings)
        if args.distributed:
            import jax

            jax.distributed.initialize()
        else:
            ensure_host_devices(cfg.run.host_devices)
        run_dir = prepare_run_dir(cfg, args.run_dir, args.resume or cfg.run.resume)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging()
    try:
        return run(cfg, run_dir, quiet=args.quiet)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(cfg: Config, run_dir: Path, quiet: bool = False) -> int:
    """Run every configured stage in order; returns a process exit code."""
    import jax

    from jrlhf import metrics as metrics_lib
    from jrlhf.ppo.trainer import RLTrainer
    from jrlhf.roles import RoleSetup, resolve_model, resolve_plan, role_meshes
    from jrlhf.stages import run_reward_model, run_sft

    (run_dir / "operative_config.gin").write_text(operative_config())
    (run_dir / "config.json").write_text(cfg.to_json())
    data = build_task_data(cfg)
    if data.save_tokenizer is not None:
        data.save_tokenizer(run_dir)
    log.info(
        "devices: %d x %s; run directory %s", jax.device_count(), jax.devices()[0].platform, run_dir
    )
    plan = resolve_plan(cfg, jax.device_count())
    plan.validate(jax.device_count())
    (run_dir / "plan.gin").write_text(plan.to_gin(f"plan used by this run ({cfg.run.placement})"))
    rows = "; ".join(f"{call} {mesh} [{rules}]" for call, mesh, rules in plan.rows())
    log.info("execution plan %r: %s", plan.name, rows)

    def setup(role: str, init: str, head: str) -> tuple[RoleSetup, str | None]:
        rc = cfg.roles[role]
        model, source = resolve_model(init, rc, head, data.model_overrides, run_dir)
        meshes, rules = role_meshes(cfg, role, plan)
        s = RoleSetup(role, rc, model, meshes, rules)
        for phase in meshes:
            s.shardings(phase)  # fails now, naming the parameter, if a layout cannot divide
        log.info("%s: %s params; %s", role, f"{model.num_params():,}", s.describe())
        return s, source

    def logger_for(stage: str):
        # One metrics.jsonl + TensorBoard directory per stage, so a resumed RL stage can drop
        # the iterations it will redo without touching the supervised stages' records.
        return metrics_lib.MetricsLogger(
            run_dir / "logs" / stage, use_tensorboard=cfg.run.tensorboard
        )

    summary: dict[str, Any] = {}
    for stage in cfg.run.stages:
        logger = logger_for(stage)
        try:
            if stage == "sft":
                actor, source = setup("actor", _stage_init(cfg, "actor", "sft"), "lm")
                run_sft(actor, source, data, cfg, run_dir, logger, cfg.run.seed)
            elif stage == "rm":
                reward, source = setup("reward", _stage_init(cfg, "reward", "rm"), "value")
                run_reward_model(reward, source, data, cfg, run_dir, logger, cfg.run.seed)
            else:
                summary = run_rl(cfg, stage, run_dir, data, logger, setup, RLTrainer, quiet)
        finally:
            logger.close()
    if summary:
        stage_logs = run_dir / "logs" / summary["stage"]
        png = metrics_lib.plot_run(stage_logs / "metrics.jsonl", run_dir / "run.png")
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        before, after = summary["before"], summary["after"]
        key = "gt_score" if "gt_score" in after else "reward"
        label = "ground-truth score" if key == "gt_score" else "reward-model score"
        print(
            f"held-out {label}: before RL {before[key]:.3f} -> after {summary['stage']} "
            f"{after[key]:.3f} (KL to reference {after['kl_to_ref']:.3f}); plot: {png}"
        )
    return 0


def _stage_init(cfg: Config, role: str, stage: str) -> str:
    """The model a supervised stage starts from: the role's init unless it names this stage."""
    init = cfg.roles[role].init
    return "tiny" if init == f"stage:{stage}" else init


def run_rl(cfg, stage, run_dir, data, logger, setup, trainer_cls, quiet) -> dict[str, Any]:
    from jrlhf import metrics as metrics_lib
    from jrlhf.data import PromptLoader
    from jrlhf.tasks import get_reward_fn

    roles, sources = {}, {}
    needed = ["actor", "reference"] + (["critic"] if stage == "ppo" else [])
    reward_fn = get_reward_fn(cfg.task.reward_fn) if cfg.task.reward_fn else None
    if reward_fn is None:
        needed.append("reward")
    heads = {"actor": "lm", "reference": "lm", "critic": "value", "reward": "value"}
    for role in needed:
        roles[role], sources[role] = setup(role, cfg.roles[role].init, heads[role])
    trainer = trainer_cls(cfg, stage, roles, sources, data, run_dir, reward_fn=reward_fn)
    loader = PromptLoader(data.train_prompts, cfg.rl.prompts_per_iteration, seed=cfg.run.seed)
    resumed = trainer.restore()
    if resumed is not None:
        loader.load_state_dict(resumed)
        logger.truncate_after(trainer.iteration)
        log.info("resumed %s at iteration %d", stage, trainer.iteration)
    summary_path = run_dir / f"{stage}_before.json"
    if summary_path.exists():
        before = json.loads(summary_path.read_text())
    else:
        before = trainer.evaluate(data.heldout_prompts, samples=4)
        summary_path.write_text(json.dumps(before))
    bar = metrics_lib.ProgressBar(
        cfg.rl.iterations,
        initial=trainer.iteration,
        disable=quiet or not cfg.run.progress_bar,
        desc=stage,
    )
    while trainer.iteration < cfg.rl.iterations:
        metrics = trainer.run_iteration(loader.next_batch())
        logger.log(trainer.iteration, metrics)
        bar.update(trainer.iteration, metrics)
        every = cfg.rl.checkpoint_every
        if (every and trainer.iteration % every == 0) or trainer.iteration == cfg.rl.iterations:
            trainer.save(loader.state_dict())
    bar.close()
    trainer.wait_for_checkpoints()
    after = trainer.evaluate(data.heldout_prompts, samples=4)
    logger.log(trainer.iteration, {f"eval/{k}": v for k, v in after.items()})
    return {"stage": stage, "before": before, "after": after, "iterations": trainer.iteration}


if __name__ == "__main__":
    sys.exit(main())
