"""Exact resume, resume across world sizes, a killed worker, a killed save, NaN, SIGTERM, multi-node.

Each scenario is compared with an uninterrupted run of the same settings: bit-identical weights
when the world size is unchanged, fp32 rounding when it changes. Short runs (12 steps, resumed at 6)
check resume itself; long runs (300 steps, checkpoints every 35) leave time to kill a worker, a save
or the whole run in the middle.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lmtune.config import environment
from lmtune.tools.recorded import load_run
from lmtune.tools.report import _summary
from tests.conftest import (
    child_pids,
    free_port,
    lmtune_cmd,
    run_lmtune,
    train_rows,
    uneven_texts,
    write_jsonl,
)

pytestmark = pytest.mark.distributed

SHORT, SHORT_SAVE = 12, 6  # step 6 is in the middle of the first epoch (25 steps)
LONG, LONG_SAVE, RESUME_AT = 300, 35, 140  # 140 = epoch 6, step 15 of 25


def args(data: Path, out: Path, *extra: str, steps: int = LONG, save_every: int = LONG_SAVE) -> list[str]:
    settings = {
        "--data": data,
        "--output-dir": out,
        "--max-steps": steps,
        "--global-batch-size": 8,
        "--micro-batch-size": 2,
        "--save-every": save_every,
        "--keep-last": 0,
        "--lr": "1e-3",
        "--threads-per-process": 1,
        "--seed": 5,
    }
    return [
        "train",
        *(str(x) for kv in settings.items() for x in kv),
        "--record-samples",
        "--no-progress",
        *extra,
    ]


def short(data: Path, out: Path, *extra: str) -> list[str]:
    return args(data, out, *extra, steps=SHORT, save_every=SHORT_SAVE)


TWO = ("--nproc-per-node", "2")


def popen(cmd_args: list[str], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        lmtune_cmd(cmd_args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -1, f"timed out after {timeout:.0f}s\n{out}{err}"
    return proc.returncode, out + err


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def max_diff(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def samples_by_step(out: Path) -> dict[int, list[int]]:
    """Every step's example ids over all ranks, sorted: the global batch of the step.

    Within a step the order is irrelevant to the update (and a rank sorts or packs its share), so
    the order that matters is from step to step.
    """
    by_step: dict[int, list[int]] = {}
    for path in sorted((out / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], []).extend(row["ids"])
    return {s: sorted(v) for s, v in by_step.items()}


def resume_copy(src: Path, dst: Path, step: int) -> None:
    """A fresh output folder holding only one checkpoint of ``src``."""
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / f"step-{step:06d}", dst / "checkpoints" / f"step-{step:06d}")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted runs: short and long, 2 ranks and 1 process, two at a time."""
    root = tmp_path_factory.mktemp("resume")
    data = write_jsonl(root / "train.jsonl", uneven_texts(203, seed=21))
    paths = {"root": root, "data": data}
    for name in ("two", "one", "two-long", "one-long"):
        paths[name] = root / name
    procs = [popen(short(data, paths["two"], *TWO)), popen(short(data, paths["one"]))]
    for proc in procs:
        code, output = finish(proc)
        assert code == 0, output
    procs = [popen(args(data, paths["two-long"], *TWO)), popen(args(data, paths["one-long"]))]
    for proc in procs:
        code, output = finish(proc)
        assert code == 0, output
    return paths


def test_resume_on_the_same_world_size_is_bit_identical(base: dict[str, Path]) -> None:
    out = base["root"] / "resumed-two"
    resume_copy(base["two"], out, SHORT_SAVE)
    proc = run_lmtune(short(base["data"], out, *TWO))
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stdout and f"step {SHORT_SAVE}" in proc.stdout
    assert max_diff(base["two"], out) == 0.0
    full, resumed = samples_by_step(base["two"]), samples_by_step(out)
    assert sorted(resumed) == list(range(SHORT_SAVE + 1, SHORT + 1))
    assert all(resumed[s] == full[s] for s in resumed)
    losses = {r["step"]: r["loss"] for r in train_rows(base["two"])}
    assert all(r["loss"] == losses[r["step"]] for r in train_rows(out))


@pytest.mark.parametrize(("source", "target"), [("two", ()), ("one", TWO)], ids=["2->1", "1->2"])
def test_resume_on_another_world_size(base: dict[str, Path], source: str, target: tuple[str, ...]) -> None:
    out = base["root"] / f"resumed-{source}-to-{(len(target) and 2) or 1}"
    resume_copy(base[source], out, SHORT_SAVE)
    proc = run_lmtune(short(base["data"], out, *target))
    assert proc.returncode == 0, proc.stderr
    assert max_diff(base[source], out) <= 1e-5
    full, resumed = samples_by_step(base[source]), samples_by_step(out)
    assert sorted(resumed) == list(range(SHORT_SAVE + 1, SHORT + 1))
    assert all(resumed[s] == full[s] for s in resumed)  # same samples, same global order
    seen = [i for s in range(1, SHORT_SAVE + 1) for i in full[s]] + [
        i for s in sorted(resumed) for i in resumed[s]
    ]
    assert len(seen) == len(set(seen)) == SHORT * 8  # within the epoch: no repeat, no gap
    # Recorded as a change of the resume, which the report names beside the last attempt's layout.
    moved = "processes 2 -> 1" if source == "two" else "processes 1 -> 2"
    assert f"changed since the checkpoint, applied from step {SHORT_SAVE + 1}: {moved}" in proc.stdout
    said = _summary(load_run(out))["strategy"]
    assert said.endswith(f"(the last attempt's; changed on resume: after step {SHORT_SAVE}: {moved})")


def test_resume_mid_run_on_another_world_size_keeps_the_data_order(base: dict[str, Path]) -> None:
    """Later in a long run, across epochs: the sample order is the same, whatever the world size."""
    out = base["root"] / "resumed-long-2-to-1"
    resume_copy(base["two-long"], out, RESUME_AT)
    proc = run_lmtune(args(base["data"], out))
    assert proc.returncode == 0, proc.stderr
    full, resumed = samples_by_step(base["two-long"]), samples_by_step(out)
    assert all(resumed[s] == full[s] for s in range(RESUME_AT + 1, LONG + 1))
    per_epoch = 25 * 8
    seen = [i for s in range(1, LONG + 1) for i in (full if s <= RESUME_AT else resumed)[s]]
    for epoch in range(LONG * 8 // per_epoch):
        assert len(set(seen[epoch * per_epoch : (epoch + 1) * per_epoch])) == per_epoch


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(base: dict[str, Path]) -> None:
    """Also under --overwrite, which the restart applied again: it deleted the job's own
    checkpoints and trained from step 1."""
    out = base["root"] / "killed"
    proc = popen(args(base["data"], out, *TWO, "--max-restarts", "1", "--overwrite"))
    deadline = time.monotonic() + 120
    while len(train_rows(out)) < 120:
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before the kill"
        time.sleep(0.05)
    workers = child_pids(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    code, output = finish(proc)
    assert code == 0, output
    assert "resuming from" in output
    # The restart is said, with its cause (the log only began again).
    restart = "rank 1 was killed by SIGKILL; every process starts again from the newest checkpoint"
    assert f"{restart} (--max-restarts: restart 1 of 1)" in output
    assert (
        "a restart goes on from the newest checkpoint (--overwrite and --resume: the first start's)" in output
    )
    assert "removed the earlier run's" not in output
    assert max_diff(base["two-long"], out) == 0.0
    assert [r["step"] for r in train_rows(out)] == list(range(1, LONG + 1))


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(base: dict[str, Path]) -> None:
    out = base["root"] / "killed-save"
    proc = run_lmtune(args(base["data"], out), env_extra={"LMTUNE_FAULT_KILL_IN_SAVE": "70"})
    assert proc.returncode == -signal.SIGKILL
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == [".step-000070.tmp", "step-000035"]
    # A visible checkpoint whose files do not match its manifest stops the run: no silent fallback.
    broken = out / "checkpoints" / "step-000060"
    shutil.copytree(out / "checkpoints" / "step-000035", broken)
    (broken / "optimizer.pt").write_bytes(b"truncated")
    proc = run_lmtune(args(base["data"], out))
    assert proc.returncode == 2, proc.stderr
    assert "step-000060, is damaged: optimizer.pt has 9 bytes" in proc.stderr
    assert "--resume " + str(out / "checkpoints" / "step-000035") in proc.stderr
    assert "removed" in proc.stderr and ".step-000070.tmp" in proc.stderr  # the unfinished save
    assert "Traceback" not in proc.stderr
    proc = run_lmtune(args(base["data"], out, "--resume", str(out / "checkpoints" / "step-000035")))
    assert proc.returncode == 0, proc.stderr
    assert "resuming from" in proc.stdout and "step-000035" in proc.stdout
    assert max_diff(base["one-long"], out) == 0.0
    assert (broken / "optimizer.pt").read_bytes() == b"truncated"  # left as it was


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def test_the_launcher_stopped_by_sigterm_or_killed_loses_nothing(base: dict[str, Path]) -> None:
    """SIGTERM: checkpoint and exit 0. SIGKILL: no worker outlives it, a second job is refused while
    it runs, and the rerun takes the stale lock over and ends as if uninterrupted."""
    out = base["root"] / "launcher-signals"
    proc = popen(args(base["data"], out, *TWO))
    while len(train_rows(out)) < 50:
        assert proc.poll() is None, finish(proc)[1]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    assert code == 0, output
    assert "stopped by SIGTERM with a checkpoint of step" in output
    stopped = json.loads((out / "run.json").read_text())["result"]["steps"]
    assert (out / "checkpoints" / f"step-{stopped:06d}").is_dir()

    proc = popen(args(base["data"], out, *TWO))
    while len(train_rows(out)) < stopped + 40:
        assert proc.poll() is None, finish(proc)[1]
        time.sleep(0.05)
    second = run_lmtune(args(base["data"], out, *TWO), timeout=60)
    assert second.returncode == 2 and f"another run is using it (pid {proc.pid}" in second.stderr
    workers = child_pids(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 5
    while _alive(workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(workers) == [], "workers outlived their launcher"

    rerun = run_lmtune(args(base["data"], out, *TWO))
    assert rerun.returncode == 0, rerun.stderr
    assert "taking over the lock of a run that is gone" in rerun.stderr
    assert max_diff(base["two-long"], out) == 0.0
    assert [r["step"] for r in train_rows(out)] == list(range(1, LONG + 1))


def test_a_user_error_is_not_retried_by_max_restarts(base: dict[str, Path]) -> None:
    bad = base["root"] / "bad.jsonl"
    bad.write_text(base["data"].read_text() + '{"text": "lone \\ud800 surrogate"}\n')
    cache = base["root"] / "restart-cache"
    proc = run_lmtune(
        args(bad, base["root"] / "user-error", *TWO, "--max-restarts", "3"),
        env_extra={"LMTUNE_CACHE_DIR": str(cache)},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{bad}:204: holds an unpaired UTF-16 surrogate" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(list(cache.rglob("*.error-*"))) == 1  # one attempt tokenized it, no restart did


def test_non_finite_loss_stops_naming_the_step_or_is_skipped(base: dict[str, Path]) -> None:
    stop = run_lmtune(
        args(base["data"], base["root"] / "nan-stop"), env_extra={"LMTUNE_FAULT_NAN_AT_STEP": "40"}
    )
    assert stop.returncode == 1
    assert "error: non-finite loss or gradient norm at step 40" in stop.stderr
    assert "Traceback" not in stop.stderr
    assert (last := base["root"] / "nan-stop" / "checkpoints" / "step-000035").is_dir()
    assert f"the newest checkpoint, {last}, is finite, though the run may have diverged" in stop.stderr
    skip_out = base["root"] / "nan-skip"
    skip = run_lmtune(
        args(base["data"], skip_out, *TWO, "--on-nan", "skip"), env_extra={"LMTUNE_FAULT_NAN_AT_STEP": "40"}
    )
    assert skip.returncode == 0, skip.stderr
    assert json.loads((skip_out / "run.json").read_text())["result"]["skipped_steps"] == 1
    assert [r["step"] for r in train_rows(skip_out) if r["skipped"]] == [40]


def test_sigterm_saves_and_the_rerun_finishes_the_same(base: dict[str, Path]) -> None:
    out = base["root"] / "sigterm"
    proc = popen(args(base["data"], out))
    while len(train_rows(out)) < 50:
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc)
    assert code == 0, output
    assert "SIGTERM received" in output and "run the same command again to resume" in output
    stopped = json.loads((out / "run.json").read_text())["result"]
    assert (
        stopped["stopped_by"] == "signal" and (out / "checkpoints" / f"step-{stopped['steps']:06d}").is_dir()
    )
    assert not (out / "final").exists()
    proc2 = run_lmtune(args(base["data"], out))
    assert proc2.returncode == 0, proc2.stderr
    assert max_diff(base["one-long"], out) == 0.0


def test_a_signal_to_one_rank_before_training_stops_every_rank_with_nothing_saved(
    base: dict[str, Path],
) -> None:
    """A preemption that reaches one worker first, while the run is being built: every rank stops
    before its first step (none waits in a collective for it), and the job exits as a signalled one."""
    out = base["root"] / "early-signal"
    proc = run_lmtune(
        args(base["data"], out, *TWO), timeout=180, env_extra={"LMTUNE_FAULT_SIGNAL_AT_START": "1"}
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "the workers were stopped by SIGTERM before training began; nothing to save" in proc.stderr
    assert proc.stderr.count("before training began") == 1, proc.stderr  # the launcher's, not each rank's
    assert train_rows(out) == [] and not (out / "checkpoints").exists()


def test_two_nodes_on_loopback_match_one_node(base: dict[str, Path]) -> None:
    port = free_port()
    out = base["root"] / "two-nodes"
    node = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "loopback-test"]
    # Both nodes write to one output folder, as nodes do on a shared file system.
    nodes = [popen(short(base["data"], out, *node, "--node-rank", str(r))) for r in (0, 1)]
    # Node 1 first: node 0 hosts the rendezvous store, and its launcher may wait in the elastic
    # agent's exit barrier (up to 300 s) after training is done; give it room to end by itself.
    node1 = finish(nodes[1], timeout=180)
    results = [finish(nodes[0], timeout=420), node1]
    for node_rank, (code, output) in enumerate(results):
        assert code == 0, f"node {node_rank}:\n{output}\nother node:\n{results[1 - node_rank][1]}"
    # The node without rank 0 (either: ranks follow the order the nodes joined in) ends with a line.
    elsewhere = f"this node's ranks finished at step {SHORT}; rank 0's node printed the summary"
    assert [elsewhere in output for _, output in results].count(True) == 1, results
    one_node = [r["loss"] for r in train_rows(base["two"])]
    assert [r["loss"] for r in train_rows(out)] == pytest.approx(one_node, abs=1e-6)
    assert max_diff(base["two"], out) <= 1e-6
    # The same command again: nothing to do, said by rank 0's node; the other says it had nothing
    # left either (it said nothing after "waiting for 2 nodes").
    again = [popen(short(base["data"], out, *node, "--node-rank", str(r))) for r in (0, 1)]
    node1 = finish(again[1], timeout=180)
    results = [finish(again[0], timeout=420), node1]
    assert [code for code, _ in results] == [0, 0], results
    assert [elsewhere in output for _, output in results].count(True) == 1, results
    assert [f"holds this run, finished at step {SHORT}" in output for _, output in results].count(True) == 1


def test_a_worker_killed_before_two_nodes_meet_restarts_both_nodes_as_one_job(base: dict[str, Path]) -> None:
    """--max-restarts on two nodes: node 1's worker is killed while it starts, before the process
    group forms. Only node 1's restart count goes up (torch counts per node), yet both nodes' ranks
    meet again at once, under the round they share, and train as the uninterrupted job did (they
    waited under different names until the join timeout, then failed)."""
    port = free_port()
    out = base["root"] / "two-nodes-restart"
    node = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart-test"]
    node += ["--max-restarts", "1"]
    joined = {environment.JOIN_TIMEOUT: "60"}  # the old failure: both nodes give up after it
    nodes = [popen(short(base["data"], out, *node, "--node-rank", str(r)), **joined) for r in (0, 1)]
    deadline = time.monotonic() + 60
    while not (workers := child_pids(nodes[1].pid)):
        assert time.monotonic() < deadline and nodes[1].poll() is None, finish(nodes[1])[1]
        time.sleep(0.05)
    os.kill(workers[0], signal.SIGKILL)  # seconds before its imports end and the group forms
    (code1, said1), (code0, said0) = finish(nodes[1], timeout=240), finish(nodes[0], timeout=120)
    assert code1 == 0 and code0 == 0, f"node 1:\n{said1}\nnode 0:\n{said0}"
    assert "local rank 0 of this node was killed by SIGKILL; every process starts again" in said1
    assert "another node's process ended (or a node joined the job)" in said0
    one_node = [r["loss"] for r in train_rows(base["two"])]
    assert [r["loss"] for r in train_rows(out)] == pytest.approx(one_node, abs=1e-6)
    assert max_diff(base["two"], out) <= 1e-6


def test_a_node_with_no_restarts_left_ends_the_job_and_the_other_node_says_so(base: dict[str, Path]) -> None:
    """Each node's agent counts its own workers' failures: node 1 has none left (here it was given
    none), so a kill there ends the job while node 0 meets again to restart it. Node 0 then ends with
    a line naming the cause, not a RendezvousClosedError traceback."""
    port = free_port()
    out = base["root"] / "two-nodes-closed"
    node = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "closed-test"]
    restarts = {0: ["--max-restarts", "1"], 1: []}
    nodes = [popen(args(base["data"], out, *node, "--node-rank", str(r), *restarts[r])) for r in (0, 1)]
    while len(train_rows(out)) < 40:  # past the first checkpoint
        for proc in nodes:
            assert proc.poll() is None, finish(proc)[1]
        time.sleep(0.05)
    os.kill(child_pids(nodes[1].pid)[0], signal.SIGKILL)
    (code1, said1), (code0, said0) = finish(nodes[1], timeout=120), finish(nodes[0], timeout=120)
    assert code1 == 1 and "was killed by SIGKILL" in said1, said1
    assert code0 == 1 and "Traceback" not in said0, said0
    assert "another node ended the job while this node was starting it again" in said0, said0


@pytest.mark.parametrize("signalled", [1, 0])
def test_a_launcher_stopped_before_the_ranks_met_ends_the_other_node_at_once(
    base: dict[str, Path], signalled: int
) -> None:
    """One node's launcher gets SIGTERM while its rank starts, before the process group forms. Node 1
    signalled: node 0's rank, waiting for it, ends in seconds with that node's line (it waited out
    the join timeout in gloo's connect, then said the processes did not meet), and node 0 does not
    start the job again under --max-restarts for a node that is gone. Node 0 signalled (it hosts
    the rendezvous): node 1 says it lost it (it said to start node 0, as if never started)."""
    port = free_port()
    out = base["root"] / f"two-nodes-stopped-early-{signalled}"
    node = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"early-stop-{signalled}"]
    node += ["--max-restarts", "1"]
    joined = {environment.JOIN_TIMEOUT: "300"}
    nodes = [popen(short(base["data"], out, *node, "--node-rank", str(r)), **joined) for r in (0, 1)]
    deadline = time.monotonic() + 60
    while not any(
        b"lmtune" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in child_pids(nodes[signalled].pid)
    ):
        assert time.monotonic() < deadline and nodes[signalled].poll() is None, finish(nodes[signalled])[1]
        time.sleep(0.05)
    nodes[signalled].send_signal(signal.SIGTERM)  # seconds before its rank's imports end
    code, said = finish(nodes[signalled], timeout=60)
    assert code == 128 + signal.SIGTERM and "stopped by SIGTERM" in said, said
    code, said = finish(nodes[1 - signalled], timeout=120)
    if signalled == 1:
        assert code == 2, said
        assert "node 1 was stopped by SIGTERM before the job's processes met; nothing was trained" in said
    else:
        assert code == 1, said
        lost = f"this node lost the job's rendezvous at 127.0.0.1:{port} after its ranks started: node 0"
        assert lost in said
    assert "starts again from the newest checkpoint" not in said and "Traceback" not in said, said
    assert not (out / "checkpoints").exists()


def test_a_signal_to_one_nodes_launcher_stops_every_node_with_a_checkpoint(base: dict[str, Path]) -> None:
    """One machine's launcher gets SIGTERM (preempted): every rank stops at the same step, saved, and
    the other node's launcher leaves at once with a line of its own, not after torch's exit
    barrier has waited 300 s for the signalled agent."""
    port = free_port()
    out = base["root"] / "two-nodes-signal"
    node = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "signal-test"]
    nodes = [popen(args(base["data"], out, *node, "--node-rank", str(r))) for r in (0, 1)]
    while len(train_rows(out)) < 20:
        for proc in nodes:
            assert proc.poll() is None, finish(proc)[1]
        time.sleep(0.05)
    nodes[1].send_signal(signal.SIGTERM)
    signalled = finish(nodes[1], timeout=120)
    other = finish(nodes[0], timeout=60)
    assert signalled[0] == 0 and other[0] == 0, f"signalled:\n{signalled[1]}\nother:\n{other[1]}"
    step = json.loads((out / "run.json").read_text())["result"]["steps"]
    assert f"stopped by SIGTERM with a checkpoint of step {step}" in signalled[1]
    # The other node says it in rank 0's words or, where rank 0 is not, in its launcher's.
    assert (
        f"the job was stopped by a signal with a checkpoint of step {step}" in other[1]
        or f"stopped at step {step}; run the same command again to resume" in other[1]
    ), other[1]
    assert (out / "checkpoints" / f"step-{step:06d}").is_dir()
    assert not (out / ".lmtune.lock").exists()  # node 0's launcher held it and gave it back


def test_export_writes_a_loadable_model(base: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = base["two"] / "checkpoints" / f"step-{SHORT_SAVE:06d}"
    out = base["root"] / "exported"
    proc = run_lmtune(["export", str(ckpt), str(out)])
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    saved = load_file(ckpt / "model.safetensors")
    state: dict[str, Any] = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    bad = run_lmtune(["export", str(base["root"] / "nope"), str(out)])
    assert bad.returncode == 2 and "no such checkpoint folder" in bad.stderr


def test_a_finished_multi_process_run_run_again_touches_nothing(base: dict[str, Path]) -> None:
    """The same command on a finished 2-rank run, with its checkpoints and without any: both say
    so and exit 0, every file as it was."""
    without = base["root"] / "finished-without-checkpoints"
    shutil.copytree(base["two"], without, ignore=shutil.ignore_patterns("checkpoints"))
    for out in (base["two"], without):
        before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
        proc = run_lmtune(short(base["data"], out, *TWO))
        assert proc.returncode == 0, proc.stderr
        assert f"finished at step {SHORT}" in proc.stdout, proc.stdout
        assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()} == before
