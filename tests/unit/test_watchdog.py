"""The launcher's watchdog names the rank the others wait for."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lmtune.parallel.health import _RECORD, PHASES, Watchdog


def _beat(folder: Path, rank: int, step: int, phase: str, at: float, pid: int | None = None) -> None:
    record = _RECORD.pack(step, PHASES.index(phase), pid or os.getpid(), at)
    (folder / f"rank-{rank}.hb").write_bytes(record)


def test_the_rank_behind_is_named_whatever_beat_first(tmp_path: Path) -> None:
    """Rank 1 hangs in step 15's forward. On a crowded machine rank 0 finished its forward and beat
    "backward" (then waited in the all-reduce) before rank 1 was scheduled to beat "forward": by
    time alone, rank 0 looked first."""
    now = time.time()
    _beat(tmp_path, 0, 15, "backward", now - 60)
    _beat(tmp_path, 1, 15, "forward", now - 58)
    watchdog = Watchdog(tmp_path, tmp_path, floor_s=10, on_hang=lambda: None)
    diagnosis = watchdog.check(now)
    assert diagnosis is not None
    assert "the job is stuck: rank 1 stopped advancing first, 58 s ago in step 15, phase forward" in diagnosis


def test_a_rank_a_step_behind_is_named(tmp_path: Path) -> None:
    now = time.time()
    _beat(tmp_path, 0, 14, "optimizer", now - 30)
    _beat(tmp_path, 1, 15, "data", now - 40)
    diagnosis = Watchdog(tmp_path, tmp_path, floor_s=10, on_hang=lambda: None).check(now)
    assert (
        diagnosis is not None
        and "rank 0 stopped advancing first, 30 s ago in step 14, phase optimizer" in diagnosis
    )


def test_a_stopped_rank_is_the_cause_whoever_beat_last(tmp_path: Path) -> None:
    """Rank 1 stopped (SIGSTOP) in step 98's backward, where rank 0 had beaten a moment before: it
    was named with "rank 0 was first", which contradicted it."""
    import signal
    import subprocess

    stopped = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        time.sleep(0.2)
        now = time.time()
        _beat(tmp_path, 0, 98, "backward", now - 31)
        _beat(tmp_path, 1, 98, "backward", now - 30, pid=stopped.pid)
        diagnosis = Watchdog(tmp_path, tmp_path, floor_s=10, on_hang=lambda: None).check(now)
    finally:
        stopped.kill()
        stopped.wait()
    assert diagnosis is not None
    assert diagnosis.startswith(
        "the job is stuck: rank 1 is stopped by a signal, and nothing has advanced for 31 s, since step 98"
    )
    assert "was first" not in diagnosis


def test_samples_on_rank_0_are_behind_the_evaluation_that_waits_for_them(tmp_path: Path) -> None:
    """A step's samples (rank 0 alone, one beat, 3 minutes' grace) come before its evaluation, in
    which the other ranks beat and then wait for rank 0: no hang while rank 0 samples."""
    now = time.time()
    _beat(tmp_path, 0, 40, "sample", now - 45)
    _beat(tmp_path, 1, 40, "eval", now - 40)
    assert Watchdog(tmp_path, tmp_path, floor_s=30, on_hang=lambda: None).check(now) is None


def test_each_nodes_watchdog_adds_its_view_to_the_jobs_report(tmp_path: Path) -> None:
    """Two nodes' launchers wrote one shared hang-report.txt, the last writer's view alone: the
    culprit, seen by the other node, was not in it. A report of an earlier run is replaced."""
    import subprocess
    import threading

    out = tmp_path / "out"
    out.mkdir()
    (out / "hang-report.txt").write_text("lmtune hang report\nan earlier run's\n")
    old = time.time() - 100
    os.utime(out / "hang-report.txt", (old, old))
    now = time.time()
    for node, rank in ((0, 0), (1, 1)):
        beats = tmp_path / f"node-{node}"
        beats.mkdir()
        rank_process = subprocess.Popen(["sleep", "60"])  # its stack is asked for with a signal
        _beat(beats, rank, 15, "forward" if rank else "backward", now - 60 + rank, pid=rank_process.pid)
        ended = threading.Event()
        try:
            Watchdog(beats, out, floor_s=10, on_hang=ended.set, started=now - 1).run(ended)
        finally:
            rank_process.kill()
            rank_process.wait()
    report = (out / "hang-report.txt").read_text()
    assert report.startswith("lmtune hang report\n") and "an earlier run's" not in report
    assert "rank 0 stopped advancing first" in report and "rank 1 stopped advancing first" in report
