"""Bad settings found at start-up, in one line naming the setting: mesh axis typos (with the near
miss), meshes that need more devices than exist or do not divide the model, a host device count
XLA cannot sensibly fake, a user reward function that fails on a sample; a mesh that does not fit
a checkpoint's model is a setting error, not a damaged checkpoint; and ``--check`` refuses what
the run would refuse before its first step, with the same line."""

import fcntl
import logging
import os
import socket
import time

import pytest
from run_helpers import SMALL, hold_lock

from jrlhf.cli import convert, evaluate, generate, launch, train
from jrlhf.config import ConfigError, load_config
from jrlhf.devices import MAX_HOST_DEVICES
from jrlhf.meshes import MeshSpec
from jrlhf.pipeline import run_lock
from jrlhf.pipeline.run_lock import LOCK_FILE, lock_run_dir
from jrlhf.tasks import SyntheticTask


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.mark.parametrize(
    "binding, message",
    [
        ("actr/RoleConfig.learning_rate=1e-3", "'actr' is not a role; did you mean 'actor'?"),
        ("policy/RoleConfig.train_mesh='fsdp=8'", "'policy' is not a role (roles: actor, "),
    ],
)
def test_a_binding_under_a_scope_that_is_no_role_is_refused_in_one_line(binding, message):
    """gin keeps a binding under any scope; one no role reads would silently not apply."""
    with pytest.raises(ConfigError) as e:
        load_config([], [binding])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("fsdpp=8", "`fsdpp` is not a mesh axis; did you mean `fsdp`?"),
        ("dta=8", "`dta` is not a mesh axis; did you mean `data`?"),
        ("data=2,tensr=4", "`tensr` is not a mesh axis; did you mean `tensor`?"),
        ("x=8", "`x` is not a mesh axis; the mesh axes are data, expert, fsdp, stage, tensor"),
    ],
)
def test_mesh_specs_accept_only_the_axes_the_rules_know(spec, message):
    with pytest.raises(ValueError) as e:
        MeshSpec.parse(spec)
    assert str(e.value) == message
    assert MeshSpec.parse("data=2,fsdp=2,tensor=2").size == 8


def test_a_mesh_axis_typo_in_train_names_the_binding(tmp_path, capsys):
    args = ["--check", "--run-dir", str(tmp_path / "r"), "actor/RoleConfig.train_mesh='dat=8'"]
    assert train.main(args) == 2
    assert _one_line(capsys) == (
        "error: actor/RoleConfig.train_mesh: `dat` is not a mesh axis; did you mean `data`?"
    )
    assert not (tmp_path / "r").exists()


def test_a_mesh_axis_typo_in_evaluate_generate_and_convert_names_the_flag(tmp_path, capsys):
    # Each is refused at the mesh, before any checkpoint is read (none exists here).
    assert evaluate.main(["--checkpoint", str(tmp_path / "run"), "--mesh", "fsdpp=8"]) == 2
    assert _one_line(capsys) == (
        "error: --mesh fsdpp=8: `fsdpp` is not a mesh axis; did you mean `fsdp`?"
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    (tmp_path / "ckpt").mkdir()
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--prompts", str(prompts)]
    args += ["--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "4", "--mesh", "dta=8"]
    assert generate.main(args) == 2
    assert _one_line(capsys) == (
        "error: --mesh dta=8: `dta` is not a mesh axis; did you mean `data`?"
    )
    args = ["--from", str(tmp_path / "ckpt"), "--to-hf", str(tmp_path / "hf"), "--mesh", "fspd=2"]
    assert convert.main(args) == 1
    assert _one_line(capsys) == (
        "error: --mesh fspd=2: `fspd` is not a mesh axis; did you mean `fsdp`?"
    )
    assert not (tmp_path / "out.jsonl").exists() and not (tmp_path / "hf").exists()


def test_a_mesh_larger_than_the_devices_names_its_setting(tmp_path, capsys):
    args = ["--run-dir", str(tmp_path / "r"), "actor/RoleConfig.train_mesh='fsdp=16'"]
    assert train.main([*args, "RunConfig.stages=('sft',)"]) == 2
    err = _one_line(capsys)
    assert err.startswith("error: actor/RoleConfig.train_mesh fsdp=16: ") and "8 devices" in err
    assert not (tmp_path / "r").exists()
    assert evaluate.main(["--checkpoint", str(tmp_path / "run"), "--mesh", "data=16"]) == 2
    err = _one_line(capsys)
    assert err.startswith("error: --mesh data=16: ") and "only 8 devices exist" in err


def test_a_mesh_the_checkpoints_model_does_not_divide_is_a_mesh_error_not_damage(
    colocated_run, tmp_path, capsys, caplog
):
    # colocated_run's trainer checkpoint has intact steps 2 and 4; its actor's embedding (64
    # wide) does not split over fsdp=3.
    args = ["--from", str(colocated_run), "--to-hf", str(tmp_path / "hf"), "--mesh", "fsdp=3"]
    with caplog.at_level(logging.WARNING, logger="jrlhf"):
        assert convert.main(args) == 1
    err = _one_line(capsys)
    assert err.startswith("error: --mesh fsdp=3: ") and "not divisible by mesh axis 'fsdp'" in err
    assert "damaged" not in err and "intact" not in err
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]  # no walk back
    assert not (tmp_path / "hf").exists()
    # evaluate and generate restore the same way: the same kind of line, naming --mesh.
    args = ["--checkpoint", str(colocated_run), "--mesh", "data=2,tensor=3"]
    assert evaluate.main(args) == 2
    err = _one_line(capsys)
    assert err.startswith("error: --mesh data=2,tensor=3 (--rules dp_tp): parameter ")
    assert "not divisible by mesh axis 'tensor'" in err and "intact" not in err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    args += ["--prompts", str(prompts), "--output", str(tmp_path / "o.jsonl")]
    assert generate.main([*args, "--max-new-tokens", "2"]) == 2
    err = _one_line(capsys)
    assert err.startswith("error: --mesh data=2,tensor=3 (--rules dp_tp): parameter ")
    assert not [r for r in caplog.records if "damaged" in r.getMessage()]


def test_host_devices_beyond_what_xla_can_fake_are_refused_in_one_line(tmp_path, capsys):
    too_many = MAX_HOST_DEVICES + 1
    args = ["--check", "--run-dir", str(tmp_path / "r"), f"RunConfig.host_devices={too_many}"]
    assert train.main(args) == 2
    err = _one_line(capsys)
    assert err.startswith("error: RunConfig.host_devices: must be in 1..") and str(too_many) in err
    assert train.main([*args[:-1], f"RunConfig.host_devices={MAX_HOST_DEVICES}"]) == 0
    capsys.readouterr()
    # The launcher refuses before starting any process (argparse's usage line and one error).
    with pytest.raises(SystemExit) as e:
        launch.main(["--processes", "2", "--devices-per-process", str(too_many), "--", "train"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(
        f"--devices-per-process must be at most {MAX_HOST_DEVICES}, got {too_many}"
    )


@pytest.mark.parametrize("flag", ["--grace", "--max-time"])
@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_launcher_times_that_are_not_finite_seconds_are_refused(flag, value, capsys):
    """A NaN --grace was accepted (it compares false with every deadline, so nothing would be
    ended); each is refused before any process starts."""
    argv = ["--processes", "2", "--devices-per-process", "2", flag, value, "--", "train"]
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"{flag} must be a finite number of seconds >= 0, got {float(value)}")


@pytest.mark.parametrize("entry", ["nosuchentry", "jrlhf.nosuch", "tests.nosuch"])
def test_launcher_refuses_an_entry_point_that_does_not_exist(entry, capsys):
    """Each process printed Python's own error and the launcher its line; now one line, before
    any process starts."""
    argv = ["--processes", "2", "--devices-per-process", "2", "--", entry]
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{entry}: no module " in last and last.endswith("or a module path)"), last


# -- --check builds what the run builds before its first step ---------------------------------
def _data(tmp_path):
    data = tmp_path / "data"
    files = SyntheticTask(seed=0).write_jsonl(
        data, num_prompts=32, num_heldout=16, num_sft=8, num_pairs=8
    )
    return data, files


def _same_refusal_from_check_and_run(args, capsys, rc=2) -> str:
    """--check and the run refuse ``args`` with the same one line and exit status; the run
    leaves no run directory."""
    assert train.main(["--check", *args]) == rc
    checked = _one_line(capsys)
    assert train.main(["--quiet", *args]) == rc
    assert _one_line(capsys) == checked
    return checked


@pytest.mark.parametrize(
    "binding,start,after_sft",
    [
        (
            "actor/RoleConfig.train_mesh='fsdp=3'",
            "error: actor/RoleConfig.train_mesh fsdp=3 [fsdp_tp]: parameter embedding with shape "
            "(32, 64): dim 1 ('embed', size 64) is not divisible by mesh axis 'fsdp' of size 3",
            False,
        ),
        (
            "actor/RoleConfig.train_mesh='fsdp=16'",
            "error: actor/RoleConfig.train_mesh fsdp=16: needs device 15 but only 8 devices exist",
            False,
        ),
        (
            "reward/RoleConfig.infer_mesh='tensor=8'",
            # the run meets the reward model's mesh in its second stage, after SFT
            "error: reward/RoleConfig.infer_mesh tensor=8 [fsdp_tp]: parameter ",
            True,
        ),
    ],
)
def test_check_refuses_a_mesh_the_run_would_refuse(binding, start, after_sft, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["--run-dir", str(run_dir), binding, "SFTConfig.steps=2", "RewardModelConfig.steps=2"]
    assert _same_refusal_from_check_and_run(args, capsys).startswith(start)
    assert (run_dir / "sft" / "model.json").exists() == after_sft


def test_check_reads_and_validates_the_data_files(tmp_path, capsys):
    data, files = _data(tmp_path)
    run_dir = tmp_path / "run"
    files_task = [
        "--run-dir", str(run_dir), "RunConfig.stages=('sft',)", "SFTConfig.steps=2",
        "TaskConfig.name='files'", f"TaskConfig.tokenizer='{data}'",
        f"TaskConfig.sft_data='{files['sft']}'",
    ]  # fmt: skip
    ok = [*files_task, f"TaskConfig.prompts='{files['prompts']}'"]
    assert train.main(["--check", *ok]) == 0
    assert capsys.readouterr().out.startswith("config ok: new run in ")
    missing = [*files_task, f"TaskConfig.prompts='{data / 'nope.jsonl'}'"]
    assert "nope.jsonl" in _same_refusal_from_check_and_run(missing, capsys)
    bad = data / "bad.jsonl"
    bad.write_text(files["prompts"].read_text().splitlines()[0] + '\n{"prompt": \n')
    err = _same_refusal_from_check_and_run([*files_task, f"TaskConfig.prompts='{bad}'"], capsys)
    assert f"{bad}:2" in err
    assert not run_dir.exists()


USER_REWARDS = """
import math

def boom(prompt_ids, response_ids, meta):
    raise ValueError("boom")

def nan_score(batch):
    return [math.nan] * len(batch)

def fine(prompt_ids, response_ids, meta):
    return float(len(response_ids))
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    name = f"start_rewards_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize(
    "fn,what", [("boom", "raised ValueError: boom on sample 0"), ("nan_score", "returned nan")]
)
def test_a_reward_function_failing_on_a_sample_is_found_before_sft(
    fn, what, reward_module, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    args = [
        "--run-dir", str(run_dir), "RunConfig.stages=('sft', 'grpo')", "SFTConfig.steps=2",
        f"TaskConfig.reward_fn='{reward_module}:{fn}'", "RLConfig.samples_per_prompt=2", *SMALL,
    ]  # fmt: skip
    err = _same_refusal_from_check_and_run(args, capsys, rc=1)
    assert err.startswith(f"error: TaskConfig.reward_fn: reward function '{reward_module}:{fn}' ")
    assert what in err and "at start-up" in err
    assert not run_dir.exists()  # refused before SFT: nothing trained, nothing left
    ok = [*args[:4], f"TaskConfig.reward_fn='{reward_module}:fine'", *args[5:]]
    assert train.main(["--check", *ok]) == 0


def test_check_refuses_a_training_batch_that_does_not_split_over_its_mesh(tmp_path, capsys):
    # The flatten plan trains on fsdp=4,tensor=2: 4 batch shards. The run meets a batch of 6
    # rows at the stage's first step; --check before anything, naming the setting.
    args = ["--run-dir", str(tmp_path / "run"), "RunConfig.stages=('sft',)", "SFTConfig.steps=2"]
    assert train.main(["--check", *args, "SFTConfig.batch_size=6"]) == 2
    err = _one_line(capsys)
    assert err.startswith("error: SFTConfig.batch_size 6: 6 rows do not split into ")
    assert "over the 4 batch shards of the actor train mesh fsdp=4,tensor=2" in err
    assert train.main(["--quiet", *args, "SFTConfig.batch_size=6"]) == 2
    assert "not divisible by the batch mesh axes" in _one_line(capsys)
    assert not (tmp_path / "run").exists()
    # Micro-batches count too (16 rows in 3 x 4 pieces), in every stage that trains.
    ppo = ["RunConfig.stages=('sft', 'ppo')", "actor/RoleConfig.microbatches=3"]
    assert train.main(["--check", *args[:2], *ppo, "SFTConfig.batch_size=12"]) == 2
    assert _one_line(capsys).startswith(
        "error: RLConfig.minibatch_size 16: 16 rows do not split into "
        "actor/RoleConfig.microbatches=3 micro-batch(es) over the 4 batch shards"
    )
    fits = ["SFTConfig.batch_size=12", "RLConfig.minibatch_size=12"]
    assert train.main(["--check", *args[:2], *ppo, *fits, "RLConfig.prompts_per_iteration=24"]) == 0


@pytest.mark.parametrize(
    "binding,message",
    [
        # NumPy refused it deep in the task's data, in a line naming nothing
        ("RunConfig.seed=-1", "RunConfig.seed: must be >= 0"),
        # drawn at every start, --check included: a billion would never finish
        ("TaskConfig.num_sft_examples=1000000000", "TaskConfig.num_sft_examples: must be <= "),
        ("TaskConfig.num_heldout=1000000000", "TaskConfig.num_heldout: must be <= "),
    ],
)
def test_values_that_building_the_data_cannot_take_are_refused_first(binding, message, capsys):
    assert train.main(["--check", binding]) == 2
    assert _one_line(capsys).startswith(f"error: {message}")


def test_check_refuses_an_rl_iteration_the_planners_memory_model_puts_over_the_devices(capsys):
    # 4,096 prompts of 4,096 response tokens scored in one call: about 140 GiB of activations a
    # device by the estimator, against the CPU profile's share of the host.
    big = ["RLConfig.prompts_per_iteration=4096", "RLConfig.minibatch_size=4096"]
    assert train.main(["--check", *big, "TaskConfig.max_response_len=4096"]) == 2
    err = _one_line(capsys)
    assert err.startswith("error: RunConfig.placement 'flatten': plan 'flatten' does not fit in ")
    assert "reference_infer: needs " in err and "RLConfig.prompts_per_iteration" in err
    assert train.main(["--check", *big]) == 0  # 16 response tokens fit


def test_check_refuses_scoring_chunks_that_do_not_split_over_a_scoring_mesh(capsys):
    # The run would build its scoring calls only after SFT, reward-model training and loading
    # every role's weights.
    assert train.main(["--check", "Memory.infer_batch_size=6"]) == 2
    assert _one_line(capsys) == (
        "error: Memory.infer_batch_size 6: does not split over the 4 batch shards of the "
        "reference infer mesh fsdp=4,tensor=2@0,1,2,3,4,5,6,7 [fsdp_tp] of "
        "RunConfig.placement='flatten' (set reference/RoleConfig.infer_mesh to choose another)"
    )
    assert train.main(["--check", "Memory.infer_batch_size=8"]) == 0


def test_check_refuses_a_run_directory_another_run_holds_without_taking_it(tmp_path, capsys):
    """--check of a new run or a resume in a directory another process holds says so in the
    start's own line, naming the holder; it takes no lock and writes nothing (the holder's
    record stays), and a free directory checks ok."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = ["--run-dir", str(run_dir), "RunConfig.stages=('sft',)", *SMALL]
    holder = hold_lock(run_dir)
    try:
        record = (run_dir / LOCK_FILE).read_text()
        assert train.main(["--check", *args]) == 2
        err = _one_line(capsys)
        assert f"is in use by another run (pid {holder.pid} on host {socket.gethostname()};" in err
        # The start refuses with the same line.
        assert train.main(args) == 2
        assert _one_line(capsys) == err
        assert (run_dir / LOCK_FILE).read_text() == record
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert train.main(["--check", *args]) == 0
    assert capsys.readouterr().out.startswith(f"config ok: new run in {run_dir} ")
    assert [p.name for p in run_dir.iterdir()] == [LOCK_FILE]
    assert (run_dir / LOCK_FILE).read_text() == record  # not taken: the last holder's record
    # Where no run ever started there is no lock file, and --check makes none.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert train.main(["--check", "--run-dir", str(fresh), *args[2:]]) == 0
    assert not any(fresh.iterdir())
    capsys.readouterr()


def test_a_start_is_not_refused_for_the_instant_a_check_looks_at_its_lock(tmp_path, monkeypatch):
    """--check looks at a run directory's lock by taking it shared for an instant; a start at
    that instant waits it out instead of being refused."""
    (tmp_path / LOCK_FILE).write_text("pid 1 on host h\n")
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # as the check holds it
    sleep, waits = time.sleep, []

    def check_ends(seconds):  # the check lets go while the start waits
        if not waits:
            os.close(fd)
        waits.append(seconds)
        sleep(seconds)

    monkeypatch.setattr(run_lock.time, "sleep", check_ends)
    with lock_run_dir(tmp_path):
        assert f"pid {os.getpid()} " in (tmp_path / LOCK_FILE).read_text()
    assert waits  # it met the check's lock


def test_a_peer_creating_the_run_directory_first_does_not_keep_a_failed_start(
    tmp_path, capsys, monkeypatch
):
    # In a job of several processes each looks whether the run directory is new, and one may
    # create it while another is still at the barrier. Each must have looked before: a process
    # that looked after would take the failed start for a resumed run, skip the discard that
    # its peers wait for (a collective), and leave the directory behind.
    run_dir = tmp_path / "run"

    def peer_creates_it(name):
        if name == "run_dir":
            run_dir.mkdir()

    monkeypatch.setattr(train, "barrier", peer_creates_it)
    data, files = _data(tmp_path)
    args = [
        "--run-dir", str(run_dir), "RunConfig.stages=('sft',)", "SFTConfig.steps=2",
        "TaskConfig.name='files'", f"TaskConfig.tokenizer='{data}'",
        f"TaskConfig.sft_data='{files['sft']}'", f"TaskConfig.prompts='{data / 'nope.jsonl'}'",
    ]  # fmt: skip
    assert train.main(args) == 2
    assert "nope.jsonl" in _one_line(capsys)
    assert not run_dir.exists()
