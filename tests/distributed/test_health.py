"""Run health on 2 CPU ranks: a stopped or stuck rank is diagnosed (which rank, which phase, its
stack where it can be had) and the job ends with exit code 3 and no process left, or restarts
under --max-restarts and finishes as if uninterrupted; a slow rank is named; without the watchdog
the shortened collective timeout still ends the job.

The jobs mostly wait (for a stall to be noticed), so they all run at once, launched by one fixture.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import assert_same_training, child_pids, free_port, lmtune_cmd, run_lmtune, train_rows

pytestmark = pytest.mark.distributed

COMMON = ["--nproc-per-node", "2", "--global-batch-size", "8", "--max-length", "64", "--no-progress"]
COMMON += ["--threads-per-process", "1", "--seed", "3"]
SLOW = {"LMTUNE_FAULT_SLOW_RANK": "1:0.15"}  # rank 1 sleeps 150 ms in every forward
FINITE = ["--max-steps", "30", "--save-every", "10"]
ENDLESS = ["--max-steps", "100000"]


@dataclass
class Job:
    out: Path
    process: subprocess.Popen[str]
    workers: dict[int, int] | None = None  # rank -> pid, for the jobs whose rank is stopped
    stopped_at: float = 0.0
    ended_at: float = 0.0
    output: str = ""


def _start(out: Path, args: list[str], env_extra: dict[str, str] | None = None) -> Job:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    command = lmtune_cmd(["train", *COMMON, *args, "--output-dir", str(out)])
    return Job(
        out, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    )


def _workers(job: Job, timeout: float = 180) -> dict[int, int]:
    """rank -> pid of the job's workers, once it has logged 3 steps."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(train_rows(job.out)) >= 3:
            workers = {}
            for pid in child_pids(job.process.pid):
                with contextlib.suppress(OSError):
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                    rank = next(e.split(b"=", 1)[1] for e in environ if e.startswith(b"RANK="))
                    workers[int(rank)] = pid
            if len(workers) == 2:
                return workers
        assert job.process.poll() is None, job.process.communicate()[0]
        time.sleep(0.3)
    raise AssertionError("the workers did not reach step 3")


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(job: Job) -> None:
    job.output, _ = job.process.communicate(timeout=400)
    job.ended_at = time.time()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    root = tmp_path_factory.mktemp("health")
    started = {
        "straggler": _start(root / "straggler", FINITE, SLOW),
        # Stuck in forward at step 15 on rank 1 (first attempt only), then restarted.
        "restarted": _start(
            root / "restarted",
            [*FINITE, "--max-restarts", "1", "--hang-timeout", "10"],
            {**SLOW, "LMTUNE_FAULT_HANG": "1:15"},
        ),
        "stop-rank-1": _start(root / "stop-rank-1", ENDLESS),  # default settings
        "stop-rank-0": _start(root / "stop-rank-0", ENDLESS),
        "no-watchdog": _start(
            root / "no-watchdog", [*ENDLESS, "--hang-timeout", "0", "--collective-timeout", "10"]
        ),
    }
    try:
        for name, rank in (("stop-rank-1", 1), ("stop-rank-0", 0), ("no-watchdog", 1)):
            job = started[name]
            job.workers = _workers(job)
            os.kill(job.workers[rank], signal.SIGSTOP)
            job.stopped_at = time.time()
        # Each job's end is taken as it happens: waiting for them one after another would date a
        # job's end by the slowest job before it.
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(_wait, started.values()))
    finally:
        for job in started.values():  # never leave a stopped process behind, whatever happened
            for pid in (job.workers or {}).values():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if job.process.poll() is None:
                job.process.kill()
    return started


@pytest.mark.parametrize("rank", [1, 0])
def test_a_stopped_rank_is_named_and_the_job_ends_with_exit_3(jobs: dict[str, Job], rank: int) -> None:
    job = jobs[f"stop-rank-{rank}"]
    assert job.workers is not None
    assert job.process.returncode == 3, job.output
    assert job.ended_at - job.stopped_at < 60, job.output
    assert f"the job is stuck: rank {rank} is stopped by a signal, and nothing has advanced for" in job.output
    assert f"rank {rank} (pid {job.workers[rank]}): step" in job.output and "SIGSTOP" in job.output
    report = (job.out / "hang-report.txt").read_text()
    other = report.split(f"--- rank {1 - rank}")[1].split("--- rank")[0]
    assert "train_step" in other  # its stack: waiting in the step's collective (all-reduce, DDP's backward)
    assert "(no stack: the process is stopped or gone)" in report.split(f"--- rank {rank}")[1]
    assert not any(_alive(pid) for pid in job.workers.values())


def test_a_slow_rank_is_named_once(jobs: dict[str, Job]) -> None:
    job = jobs["straggler"]
    assert job.process.returncode == 0, job.output
    assert job.output.count("is a straggler") == 1 and "rank 1 is a straggler" in job.output
    rows = train_rows(job.out)
    assert sum(r["step_time_max_rank"] == 1 for r in rows) >= 25
    # Five 2-rank jobs share the cores here: a step of the fast rank can be delayed as long as the
    # slow one's sleep. Most steps must show the gap, not every one.
    gaps = [r["step_time_max_s"] >= r["step_time_min_s"] + 0.1 for r in rows[1:]]
    assert sum(gaps) >= len(gaps) - 3, [(r["step_time_min_s"], r["step_time_max_s"]) for r in rows]


def test_a_stuck_rank_shows_its_stack_and_a_restart_finishes_the_run(jobs: dict[str, Job]) -> None:
    job = jobs["restarted"]
    assert job.process.returncode == 0, job.output
    assert "the job is stuck: rank 1 stopped advancing first" in job.output
    assert "step 15, phase forward" in job.output
    stack = (job.out / "hang-report.txt").read_text().split("--- rank 1")[1]
    assert "before_forward" in stack and "faults.py" in stack  # where it sleeps
    assert (
        "every process starts again from the newest checkpoint (--max-restarts: restart 1 of 1)" in job.output
    )
    assert "resuming from" in job.output
    final = load_file(job.out / "final" / "model.safetensors")
    assert_same_training(final, load_file(jobs["straggler"].out / "final" / "model.safetensors"))


def test_without_the_watchdog_the_collective_timeout_ends_the_job(jobs: dict[str, Job]) -> None:
    job = jobs["no-watchdog"]
    assert job.workers is not None
    assert job.process.returncode == 3, job.output  # a hang, found by the timeout: one line, no traceback
    assert job.ended_at - job.stopped_at < 45, job.output
    assert "waited 10 s for the other ranks in a collective and gave up (--collective-timeout)" in job.output
    assert "Traceback" not in job.output and "killed by SIGKILL" not in job.output, job.output
    assert not (job.out / "hang-report.txt").exists()
    assert not any(_alive(pid) for pid in job.workers.values())


def test_doctor_passes_on_two_ranks(tmp_path: Path) -> None:
    args = ["doctor", "--nproc-per-node", "2", "--output-dir", str(tmp_path / "out"), "--data", "sample"]
    proc = run_lmtune([*args, "--model", "tiny", "--cache-dir", str(tmp_path / "cache")], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in (
        "versions",
        "devices",
        "matmul peak",
        "all-reduce",
        "output folder",
        "free disk",
        "data",
        "clocks",
    ):
        assert f"ok    {check}" in proc.stdout, check
    assert "sums right" in proc.stdout and "(ranks 0, 1)" in proc.stdout
    # Each rank runs the threads train's would: the cores shared among the node's processes.
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert re.search(rf"(ok|warn) +CPU threads +{threads} threads?, waiting", proc.stdout), proc.stdout


def _on_two_nodes(
    command: str,
    per_node: tuple[list[str], list[str]],
    envs: tuple[dict[str, str], ...] = ({}, {}),
    cwds: tuple[Path | None, Path | None] = (None, None),
) -> list[tuple[int, str]]:
    """Two launchers of ``command`` on loopback, as two nodes, each with its own arguments (and
    environment variables, and working folder)."""
    port = free_port()
    nodes = []
    for node in (0, 1):
        args = [command, "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **envs[node]}
        nodes.append(
            subprocess.Popen(
                lmtune_cmd([*args, *per_node[node]]),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=cwds[node],
            )
        )
    outputs = [p.communicate(timeout=300)[0] for p in reversed(nodes)][::-1]
    return [(p.returncode, output) for p, output in zip(nodes, outputs, strict=True)]


def _doctor_on_two_nodes(tmp_path: Path, folders: tuple[str, str]) -> list[tuple[int, str]]:
    """Each node with its own --output-dir, and lmtune's default cache under it."""
    return _on_two_nodes(
        "doctor",
        (["--output-dir", str(tmp_path / folders[0])], ["--output-dir", str(tmp_path / folders[1])]),
        tuple({"LMTUNE_CACHE_DIR": str(tmp_path / folder / "cache")} for folder in folders),
    )


def test_a_node_that_never_joins_is_said_at_once_and_ends_the_wait(tmp_path: Path) -> None:
    """The launchers' rendezvous has LMTUNE_JOIN_TIMEOUT for a bound too, and says what it waits for."""
    port = free_port()
    args = ["doctor", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    env = {**os.environ, "LMTUNE_JOIN_TIMEOUT": "5"}
    proc = subprocess.run(lmtune_cmd(args), capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"lmtune: waiting for 2 nodes at 127.0.0.1:{port}\n"), proc.stderr
    assert f"2 nodes did not all meet at 127.0.0.1:{port} within 5s (LMTUNE_JOIN_TIMEOUT)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_node_started_without_node_0_waits_the_join_timeout_and_no_longer() -> None:
    """Node 1 alone: nothing at the endpoint, then a program there that accepts and never answers
    (where torch's store client would wait without end). Each ends with exit 2 and one line."""
    import socket

    def node_1(port: int) -> tuple[subprocess.CompletedProcess[str], float]:
        args = ["doctor", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        env = {**os.environ, "LMTUNE_JOIN_TIMEOUT": "5"}
        started = time.monotonic()
        proc = subprocess.run(lmtune_cmd(args), capture_output=True, text=True, env=env, timeout=120)
        return proc, time.monotonic() - started

    port = free_port()
    proc, took = node_1(port)
    assert proc.returncode == 2 and took < 45, (took, proc.stderr)
    assert f"--rdzv-endpoint 127.0.0.1:{port}: this node could not reach the job's rendezvous" in proc.stderr
    # Node 0 refused (its folder's lock, a setting): said there, so named here as a cause to read.
    assert "a node 0 that was started stopped before the job began: its own output says why" in proc.stderr
    assert "frame #" not in proc.stderr and len(proc.stderr.splitlines()) <= 3, proc.stderr  # no C++ log
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        proc, took = node_1(port)
    assert proc.returncode == 2 and took < 60, (took, proc.stderr)
    assert f"error: the job's 2 nodes did not meet at 127.0.0.1:{port} within 20s" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_rendezvous_port_in_use_is_said_in_one_line() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["doctor", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        proc = subprocess.run(lmtune_cmd(args), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"--rdzv-endpoint 127.0.0.1:{port}: this node could not host the job's rendezvous" in proc.stderr
    assert "choose another port" in proc.stderr and "Traceback" not in proc.stderr


def test_nodes_started_with_different_settings_stop_with_the_differences_named(tmp_path: Path) -> None:
    """One node's config says --max-steps 3, the other's 6: without the check, the first would stop
    stepping and the second wait for it until the collective timeout."""
    common = [
        "--data",
        "sample",
        "--global-batch-size",
        "8",
        "--no-progress",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    ran = _on_two_nodes("train", ([*common, "--max-steps", "3"], [*common, "--max-steps", "6"]))
    assert [code for code, _ in ran] == [2, 2], ran
    said = "given different settings: --max-steps 3 on rank 0, 6 on rank 1"
    assert any(said in output for _, output in ran), ran


def test_nodes_that_see_other_output_folders_stop_before_they_write(tmp_path: Path) -> None:
    """A relative --output-dir from two working folders (or a node-local disk): each node kept its
    own checkpoints, a resume failed on files rank 0 had written elsewhere, and node 1's unfinished
    saves were left as "not one lmtune made"."""
    args = ["--data", "sample", "--global-batch-size", "8", "--max-steps", "2", "--output-dir", "out"]
    cwds = (tmp_path / "node-0", tmp_path / "node-1")
    for cwd in cwds:
        cwd.mkdir()
    ran = _on_two_nodes("train", (args, args), cwds=cwds)
    assert [code for code, _ in ran] == [2, 2], ran
    said = "--output-dir out: rank(s) 1 ("
    assert all(said in output and "see another folder than rank 0" in output for _, output in ran), ran
    assert not [p for cwd in cwds for p in cwd.iterdir()]  # nothing written, nothing left


def test_doctor_on_two_nodes_passes_and_names_the_node_that_sees_another_output_folder(
    tmp_path: Path,
) -> None:
    shared = _doctor_on_two_nodes(tmp_path, ("shared", "shared"))
    assert [code for code, _ in shared] == [0, 0], shared
    table = next(output for _, output in shared if "lmtune doctor" in output)  # where rank 0 runs
    assert "ok    output folder" in table and "2 ranks" in table
    # No --cache-dir: the cache train would use on every node, lmtune's default, is checked.
    assert "ok    cache folder (lmtune's default)" in table
    apart = _doctor_on_two_nodes(tmp_path, ("node-0", "node-1"))
    assert [code for code, _ in apart] == [2, 2], apart
    table = next(output for _, output in apart if "lmtune doctor" in output)
    assert (
        "FAIL  output folder" in table
        and "rank(s) 1 (" in table
        and "see another folder than rank 0" in table
    )
    assert "FAIL  cache folder (lmtune's default)" in table and "or train --cache-per-node" in table


def test_restarts_of_a_one_process_job_train_once(tmp_path: Path) -> None:
    """--max-restarts with one process runs it under the launcher with WORLD_SIZE 1; its worker
    trained as a launcher again (each worker launched another, without end)."""
    args = [
        "train",
        "--max-restarts",
        "1",
        "--max-steps",
        "1",
        "--global-batch-size",
        "8",
        "--save-every",
        "0",
    ]
    proc = run_lmtune([*args, "--no-progress", "--output-dir", str(tmp_path / "out")], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("lmtune: preset tiny") == 1 and "saved the model" in proc.stdout


_JOINING = """
import os, sys, time
from datetime import timedelta
from lmtune.errors import UserError
from lmtune.parallel.distributed import _all_arrived, _attempt_store, process_group, read_dist_env

env = read_dist_env("cpu")
if env.rank == 1:  # meets the others in the store, then stops before the group connects
    store = _attempt_store(env, timedelta(seconds=30))
    _all_arrived(store, env, timedelta(seconds=30), "here")
    time.sleep(120)
try:
    with process_group(env):
        sys.exit("joined a group of one")
except UserError as e:
    sys.exit(f"error: {e}")
"""


def test_a_process_stopped_before_the_group_connects_ends_the_join_in_its_timeout() -> None:
    """A rank stopped at start (SIGSTOP) after it reached the store held the others in gloo's
    connect for the collectives' 30 minutes, without a word: the join's bound covers it too."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    env |= {"LOCAL_WORLD_SIZE": "2", "LMTUNE_JOIN_TIMEOUT": "5"}
    ranks = [{**env, "RANK": str(r), "LOCAL_RANK": str(r)} for r in (0, 1)]
    stopped = subprocess.Popen([sys.executable, "-c", _JOINING], env=ranks[1], stderr=subprocess.DEVNULL)
    try:
        started = time.monotonic()
        first = subprocess.run(
            [sys.executable, "-c", _JOINING], env=ranks[0], capture_output=True, text=True, timeout=120
        )
        took = time.monotonic() - started
    finally:
        stopped.kill()
        stopped.wait()
    assert first.returncode == 1 and took < 40, (took, first.stderr)
    assert f"error: the job's 2 processes did not all meet at 127.0.0.1:{port} within 5s" in first.stderr
