"""Joining a multi-process job (jrlhf.runtime.distributed) and the local launcher (jrlhf.launch).

Misconfigured environments are checked in this process (nothing is started); the start-up
timeout and the launcher run real processes: coordinator on 127.0.0.1 at a free port, gloo
collectives, every wait bounded by a timeout, and only processes started here are ended.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from jrlhf.cli import bench, calibrate, convert, evaluate, generate, launch, train
from jrlhf.devices import with_host_device_count
from jrlhf.runtime import distributed, job_env
from jrlhf.runtime.job_env import DistributedError, JobSpec, Timeouts, job_spec_from_env

ROOT = Path(__file__).resolve().parents[2]
JOB_VARS = (
    job_env.COORDINATOR,
    job_env.NUM_PROCESSES,
    job_env.PROCESS_ID,
    job_env.LOCAL_DEVICE_IDS,
    job_env.INIT_TIMEOUT,
    job_env.HEARTBEAT_TIMEOUT,
    job_env.SHUTDOWN_TIMEOUT,
)
ADDR = "127.0.0.1:1234"


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update(extra)
    return env


@pytest.mark.parametrize(
    "env, names",
    [
        ({job_env.COORDINATOR: ADDR}, [job_env.NUM_PROCESSES, job_env.PROCESS_ID]),
        ({job_env.NUM_PROCESSES: "2", job_env.PROCESS_ID: "0"}, [job_env.COORDINATOR]),
        ({job_env.COORDINATOR: ADDR, job_env.NUM_PROCESSES: "2"}, [job_env.PROCESS_ID]),
        (
            {job_env.COORDINATOR: ADDR, job_env.NUM_PROCESSES: "two", job_env.PROCESS_ID: "0"},
            ["JAX_NUM_PROCESSES='two'"],
        ),
        (
            {job_env.COORDINATOR: ADDR, job_env.NUM_PROCESSES: "2", job_env.PROCESS_ID: "2"},
            ["JAX_PROCESS_ID=2", "out of range"],
        ),
        (
            {job_env.COORDINATOR: ADDR, job_env.NUM_PROCESSES: "2", job_env.PROCESS_ID: "-1"},
            ["JAX_PROCESS_ID=-1"],
        ),
        (
            {job_env.COORDINATOR: "localhost", job_env.NUM_PROCESSES: "2", job_env.PROCESS_ID: "0"},
            ["JAX_COORDINATOR_ADDRESS='localhost'", "host:port"],
        ),
        ({job_env.LOCAL_DEVICE_IDS: "0,a"}, ["JAX_LOCAL_DEVICE_IDS='0,a'"]),
    ],
)
def test_bad_job_environment_is_one_line_naming_the_variable(env, names):
    with pytest.raises(DistributedError) as e:
        job_spec_from_env(env)
    msg = str(e.value)
    assert "\n" not in msg
    for name in names:
        assert name in msg


def test_job_environment_explicit_or_detected():
    spec = job_spec_from_env(
        {
            job_env.COORDINATOR: "10.0.0.1:8476",
            job_env.NUM_PROCESSES: "4",
            job_env.PROCESS_ID: "3",
            job_env.LOCAL_DEVICE_IDS: "0,1",
        }
    )
    assert spec == JobSpec("10.0.0.1:8476", 4, 3, (0, 1)) and spec.explicit
    # None set (an empty value counts as unset): left to JAX's cluster detection.
    detected = job_spec_from_env({job_env.PROCESS_ID: ""})
    assert detected == JobSpec() and not detected.explicit


@pytest.mark.parametrize("value", ["0", "ten", "-5"])
def test_bad_timeout_is_one_line(value):
    with pytest.raises(DistributedError, match=job_env.HEARTBEAT_TIMEOUT):
        Timeouts.from_env({job_env.HEARTBEAT_TIMEOUT: value})
    assert Timeouts.from_env({job_env.INIT_TIMEOUT: "7"}) == Timeouts(init=7)


@pytest.mark.parametrize(
    "main, argv",
    [
        (train.main, "--distributed"),
        (evaluate.main, "--checkpoint nowhere --distributed"),
        (generate.main, "--hf x --prompts p --output o --max-new-tokens 1 --distributed"),
        (convert.main, "--from-hf x --to y --distributed"),
        (calibrate.main, "--out p.json --distributed"),
        (bench.main, "reshard --distributed"),
    ],
    ids=["train", "evaluate", "generate", "convert", "calibrate", "bench"],
)
def test_every_entry_point_reports_a_partial_environment(main, argv, monkeypatch, capsys):
    # Checked before anything is started, so safe in this (already initialized) process.
    for name in JOB_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(job_env.COORDINATOR, ADDR)
    assert main(argv.split()) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: ") and job_env.PROCESS_ID in err


@pytest.fixture
def transfer_address():
    """jax_cross_host_transfer_socket_address, restored after the test (it is read only when a
    backend starts, so setting it here changes nothing else)."""
    before = jax.config.read("jax_cross_host_transfer_socket_address")
    yield lambda: jax.config.read("jax_cross_host_transfer_socket_address")
    jax.config.update("jax_cross_host_transfer_socket_address", before)


def test_cross_host_transfer_address_from_the_environment(transfer_address):
    """Every process of a job of several gets its own transfer socket: a free port on loopback
    by default (coordinator on loopback), JRLHF_TRANSFER_ADDRESS's host and port when given;
    a bad port is one line naming the variable."""
    info = distributed.ProcessInfo(process_id=1, num_processes=2, coordinator="127.0.0.1:1234")
    distributed._use_cross_host_transfers(info, {})
    host, port = transfer_address().split(":")
    assert host == "127.0.0.1" and int(port) > 0
    distributed._use_cross_host_transfers(info, {distributed.TRANSFER_ADDRESS: "127.0.0.1:4567"})
    assert transfer_address() == "127.0.0.1:4567"
    with pytest.raises(DistributedError, match="JRLHF_TRANSFER_ADDRESS='h:x': the port"):
        distributed._use_cross_host_transfers(info, {distributed.TRANSFER_ADDRESS: "h:x"})


def test_unreachable_coordinator_fails_within_the_timeout():
    # Process 1 of 2 with nobody listening at the coordinator's address: one line after ~2 s
    # (JAX's own deadline would end it later with SIGABRT and a stack trace).
    addr = f"127.0.0.1:{distributed.free_port()}"
    env = _clean_env(
        **{
            job_env.COORDINATOR: addr,
            job_env.NUM_PROCESSES: "2",
            job_env.PROCESS_ID: "1",
            job_env.INIT_TIMEOUT: "2",
        }
    )
    start = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "jrlhf.evaluate", "--checkpoint", "nowhere", "--distributed"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    elapsed = time.monotonic() - start
    assert p.returncode == 1, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert "process 1 of 2" in lines[0] and addr in lines[0] and "not reachable" in lines[0]
    assert elapsed < 30


def _launch(args: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``python -m jrlhf.launch ARGS`` (split on spaces); the result and its duration."""
    start = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "jrlhf.launch", *args.split()],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return p, time.monotonic() - start


def _assert_prefixed(p: subprocess.CompletedProcess) -> None:
    for line in p.stdout.splitlines():
        assert re.match(r"\[p[01]\] ", line), line
    for line in p.stderr.splitlines():
        assert re.match(r"\[(p[01]|launch)\] ", line), line


@pytest.mark.multiprocess  # real JAX processes through jrlhf.launch: the CI step of their own
def test_launcher_runs_one_job_over_every_process():
    p, _ = _launch(
        "--processes 2 --devices-per-process 2 --timeout 30 --cores-per-process 1 "
        "-- tests.launch_helper sum"
    )
    assert p.returncode == 0, p.stdout + p.stderr
    _assert_prefixed(p)
    # Gloo's C++ logging shares the processes' stdout and may leave part of a line unfinished
    # ("... Expected number of connected peer ranks is : " + a later "1"), so a result line may
    # start after such a fragment.
    results = re.findall(r"^\[p(\d)\] .*?process (\d) of 2: (devices .*)$", p.stdout, re.M)
    assert sorted((a, b) for a, b, _ in results) == [("0", "0"), ("1", "1")], p.stdout
    # 2 x 2 devices, device d holding d: both processes computed 0 + 1 + 2 + 3 together.
    # ... and each read its own copy of a value computed on its default device (1.5, not 3.0).
    want = "devices 4 local 2 sum 6.0 processes [0, 1] own 1.5"
    assert {rest for _, _, rest in results} == {want}
    # --cores-per-process 1: process i runs on core i (modulo the cores there are)
    cores = dict(re.findall(r"^\[p\d\] .*?process (\d) cores (\[.*\])$", p.stdout, re.M))
    total = os.cpu_count()
    assert cores == {"0": "[0]", "1": f"[{1 % total}]"}, p.stdout


@pytest.mark.multiprocess  # real JAX processes through jrlhf.launch: the CI step of their own
def test_weights_cross_between_process_meshes_whose_counts_do_not_divide():
    """2 processes x 6 devices: trees move 6 -> 4 -> 6 devices (twice) and 3 -> 2 between the
    processes through the resharder's relay layout (gcd 2, then 1), every shard equal to NumPy
    on both sides, each transition built once; the bytes are the relay's: the whole tree to
    each of the target's groups of gcd devices."""
    p, _ = _launch(
        "--processes 2 --devices-per-process 6 --timeout 60 -- tests.launch_helper relay"
    )
    assert p.returncode == 0, p.stdout + p.stderr
    results = re.findall(r"^\[p(\d)\] .*?process (\d) relay ok (.*)$", p.stdout, re.M)
    assert sorted((a, b) for a, b, _ in results) == [("0", "0"), ("1", "1")], p.stdout
    # w (12 x 8 float32, 384 bytes) and b (5 float32, 20 bytes): the relay layout (w split
    # over gcd devices, b on each) goes to every group of gcd target devices: 6 -> 4 to 2
    # groups of 2 (2 x 424 bytes), 4 -> 6 to 3 groups of 2, 3 -> 2 to 2 groups of 1 (2 x 404).
    for _, _, report in results:
        legs = re.findall(r"\('(\w+)', (\d+), (\d+)\)", report)
        assert [(p_, int(r), int(b)) for p_, r, b in legs] == [
            ("relay", 2, 848),
            ("relay", 2, 1272),
            ("relay", 1, 808),
        ], report


@pytest.mark.multiprocess  # real JAX processes through jrlhf.launch: the CI step of their own
def test_launcher_ends_the_others_when_one_fails():
    p, elapsed = _launch(
        "--processes 2 --devices-per-process 1 --timeout 30 --grace 2 -- tests.launch_helper exit3"
    )
    assert p.returncode == 3, p.stdout + p.stderr
    _assert_prefixed(p)
    # What process 0 says on its way out (JAX: "SIGTERM caught") is counted, not shown.
    assert (
        p.stderr.strip()
        .splitlines()[-1]
        .startswith("[launch] process 1 exited with 3; ended 1 other process")
    )
    assert "[p0]" not in p.stderr
    # Process 0 would have slept 120 s: the launcher ended it (and reaped it) long before.
    assert elapsed < 45
    pid = int(re.search(r"^\[p0\] .*?pid (\d+)$", p.stdout, re.M).group(1))  # Gloo: as above
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.multiprocess  # real JAX processes through jrlhf.launch: the CI step of their own
def test_a_refusal_ends_every_process_by_itself():
    """Every process refuses in one line (process 1 a second later): they wait for one another,
    leave the coordination service together and exit 2 by themselves, process 0 last; the
    launcher ends none of them and shows no page of errors from a peer cut off."""
    p, _ = _launch(
        "--processes 2 --devices-per-process 1 --timeout 60 -- tests.launch_helper refuse"
    )
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.strip().splitlines()
    said = [line for line in lines if "error:" in line]
    assert said == [f"[p{i}] error: Nothing.setting=1 is refused" for i in (0, 1)], p.stderr
    assert lines[-1] == "[launch] process 1 exited with 2", p.stderr
    assert launch.REFUSAL_GRACE_S > distributed.REFUSAL_LINGER_S


@pytest.mark.multiprocess  # real JAX processes through jrlhf.launch: the CI step of their own
def test_launcher_folds_what_a_survivor_writes_after_its_peer_died():
    """Process 1 is killed; process 0 then fails with a traceback, as a survivor of a killed
    peer does: the launcher shows none of it, and counts it in its one line."""
    p, _ = _launch(
        "--processes 2 --devices-per-process 1 --timeout 30 --grace 5 "
        "-- tests.launch_helper survivor"
    )
    assert p.returncode == 137, p.stdout + p.stderr
    _assert_prefixed(p)
    lines = p.stderr.strip().splitlines()
    assert not [line for line in lines if line.startswith("[p0]")], p.stderr
    folded = re.fullmatch(
        r"\[launch\] process 1 was killed by SIGKILL(; ended 1 other process)? \((\d+) lines "
        r"the other processes wrote to stderr after it not shown\)",
        lines[-1],
    )
    assert folded and int(folded.group(2)) >= 10, p.stderr  # the traceback's 17 lines


def test_launcher_command_and_environment():
    assert launch.split_command(["--processes", "2", "--", "train", "--", "x"]) == (
        ["--processes", "2"],
        ["train", "--", "x"],
    )
    # The flag goes before an entry point's own "--", so that it is still read as an option.
    assert launch.child_command("train", ["--quiet", "--", "A.b=1"])[2:] == [
        "jrlhf.train",
        "--quiet",
        "--distributed",
        "--",
        "A.b=1",
    ]
    assert launch.child_command("plan.calibrate", [])[2:] == [
        "jrlhf.plan.calibrate",
        "--distributed",
    ]
    assert launch.child_command("tests.launch_helper", ["sum"])[2] == "tests.launch_helper"
    flags = "--a=1 --xla_force_host_platform_device_count=8"
    env = launch.child_env({"XLA_FLAGS": flags}, 1, 2, ADDR, 3, 9)
    assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=3"
    assert (env[job_env.COORDINATOR], env[job_env.NUM_PROCESSES], env[job_env.PROCESS_ID]) == (
        ADDR,
        "2",
        "1",
    )
    assert env[job_env.INIT_TIMEOUT] == "9"
    assert with_host_device_count("", 2) == "--xla_force_host_platform_device_count=2"
    assert launch.describe_status(1, -9) == "process 1 was killed by SIGKILL"
    assert launch.exit_status(-9) == 137


def test_launcher_core_sets_per_process():
    """--cores: one set of host cores per process (groups of processes on cores of their own);
    a spec that does not fit the processes or the host is refused in one line."""
    assert launch.core_sets("0;0;1;1", 4, 2) == [{0}, {0}, {1}, {1}]
    assert launch.core_sets("0-2,5;3", 2, 8) == [{0, 1, 2, 5}, {3}]
    for spec, processes, why in (
        ("0;1", 4, "2 entries for 4 processes"),
        ("0;2", 2, "'2' is not within this host's cores 0-1"),
        ("0;x", 2, "'x' is not a core or a range"),
        ("1-0;0", 2, "'1-0' is not within"),
    ):
        with pytest.raises(ValueError, match=re.escape(why)):
            launch.core_sets(spec, processes, 2)


def test_free_ports_are_drawn_below_the_ephemeral_range():
    """A listener's port is chosen at start-up and bound later: drawn below the range the OS
    gives outgoing connections, no connection can take it meanwhile (CI once lost a job to
    "bind: Address already in use" on a port from that range)."""
    path = Path(distributed._EPHEMERAL_RANGE)
    if not path.exists():
        pytest.skip("no ephemeral port range to read on this OS")
    low = int(path.read_text().split()[0])
    ports = [distributed.free_port() for _ in range(20)]
    assert all(distributed._LOWEST_PORT <= p < low for p in ports), (ports, low)
    assert len(set(ports)) > 1  # drawn, not the same port for every caller
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # and free
