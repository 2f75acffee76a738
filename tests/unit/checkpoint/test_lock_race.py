"""Taking over a stale lock is race-free: when several processes find the same dead holder at the
same moment, exactly one of them ends up holding the folder (8 processes x 50 trials)."""

from __future__ import annotations

import json
import multiprocessing
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from lmtune.checkpoint.layout import LOCK_FILE

TAKERS, TRIALS = 8, 50


def _take(root: Path, trials: int, start: Any, checked: Any, results: Any) -> None:
    """One contender: at each trial, try to take the trial's folder the moment all are ready.
    Checking the holder is made to take 0-4 ms, as a busy machine may: the window in which another
    contender could slip in between the look and the take."""
    import random
    import time

    from lmtune.checkpoint import lock, rundir
    from lmtune.errors import UserError

    checking = lock._alive

    def slow_alive(holder: Any) -> bool:
        time.sleep(random.random() * 0.004)
        return checking(holder)

    lock._alive = slow_alive  # in this forked contender only
    for trial in range(trials):
        start.wait()
        try:
            rundir.acquire(root / f"trial-{trial}", "", lambda message: None)  # held: never released here
            results.put((trial, True))
        except UserError:
            results.put((trial, False))
        checked.wait()


def test_many_takers_of_a_stale_lock_leave_one_holder(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "pid_started": None, "started": 0.0}
    for trial in range(TRIALS):
        (tmp_path / f"trial-{trial}").mkdir()
        lock = tmp_path / f"trial-{trial}" / LOCK_FILE
        lock.write_text(json.dumps({**stale, "run_id": "", "token": "gone"}))
    ctx = multiprocessing.get_context("fork")
    start, checked = ctx.Barrier(TAKERS + 1), ctx.Barrier(TAKERS + 1)
    results = ctx.Queue()
    takers = [
        ctx.Process(target=_take, args=(tmp_path, TRIALS, start, checked, results)) for _ in range(TAKERS)
    ]
    for p in takers:
        p.start()
    holders = []
    try:
        for trial in range(TRIALS):
            start.wait(timeout=60)
            outcomes = [results.get(timeout=60) for _ in range(TAKERS)]
            assert all(t == trial for t, _ in outcomes)
            holders.append(sum(held for _, held in outcomes))
            checked.wait(timeout=60)
    finally:
        for p in takers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert holders == [1] * TRIALS, f"trials with other than one holder: {[h for h in holders if h != 1]}"
