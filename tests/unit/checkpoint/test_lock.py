"""Taking over the lock of a run that is gone: what the warning says of it."""

from __future__ import annotations

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from lmtune.checkpoint.layout import LOCK_FILE
from lmtune.checkpoint.rundir import acquire
from lmtune.parallel import failure_report


def _gone_run(folder: Path, **extra: object) -> None:
    """The lock a process left when it was killed (its pid is gone)."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    folder.mkdir()
    holder = {"host": socket.gethostname(), "pid": ended.pid, "pid_started": None, "started": time.time()}
    (folder / LOCK_FILE).write_text(json.dumps({**holder, "run_id": "", "token": "t", **extra}))


def _warnings(folder: Path) -> list[str]:
    said: list[str] = []
    acquire(folder, "", said.append).release()
    return said


def test_a_run_the_out_of_memory_killer_took_is_named_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone process the kernel kills leaves the shell's "Killed" and a stale lock; the run after
    it says what most likely happened, when the killer's counts rose since that lock was taken."""
    monkeypatch.setattr(failure_report, "oom_kills", lambda: (7, 2))
    _gone_run(tmp_path / "killed", oom_kills=[6, 2])
    [said] = _warnings(tmp_path / "killed")
    assert said.startswith("taking over the lock of a run that is gone (pid ")
    assert (
        "; the kernel's out-of-memory killer has ended a process since it started, most likely that run"
        in said
    )
    assert "--micro-batch-size" in said and "`lmtune plan`" in said
    # The same counts: gone for another reason (kill -9, a reboot); a lock of an earlier lmtune
    # has none to compare.
    for name, extra in (("same", {"oom_kills": [7, 2]}), ("older", {})):
        _gone_run(tmp_path / name, **extra)
        [said] = _warnings(tmp_path / name)
        assert said.startswith("taking over the lock") and "out-of-memory" not in said
    # Counts of another shape (a cgroup that came or went): nothing is claimed.
    _gone_run(tmp_path / "other", oom_kills=[1])
    assert "out-of-memory" not in _warnings(tmp_path / "other")[0]


def test_a_lock_with_counts_of_the_wrong_kind_is_refused(tmp_path: Path) -> None:
    from lmtune.errors import UserError

    _gone_run(tmp_path / "bad", oom_kills=["many"])
    with pytest.raises(UserError, match=r"an unreadable lock file \(values of the wrong kind\)"):
        acquire(tmp_path / "bad", "", lambda message: None)
