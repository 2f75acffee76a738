"""What the launcher says when a rank dies without a message of its own (killed, crashed): the
rank that ended first and how, then the ranks it stopped because of it."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmtune.parallel import failure_report
from lmtune.parallel.failure_report import failed


def _failure(exitcode: int, timestamp: int) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)


def test_the_first_rank_to_end_is_named_with_its_signal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped, killed = -int(signal.SIGTERM), -int(signal.SIGKILL)
    # Rank 0 was stopped by the launcher in the same second rank 1 was killed.
    error = SimpleNamespace(
        failures={0: _failure(stopped, 100), 1: _failure(killed, 100), 2: _failure(3, 101)}
    )
    assert failed(error, tmp_path, hung=False) == 1
    assert capsys.readouterr().err.splitlines() == [
        "lmtune: rank 1 was killed by SIGKILL",
        "lmtune: rank 2 failed with exit code 3",
        "lmtune: the launcher then stopped rank(s) 0",
    ]


def test_a_rank_the_out_of_memory_killer_took_is_named_with_what_to_lower(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    vmstat, events = tmp_path / "vmstat", tmp_path / "memory.events"
    vmstat.write_text("pgfault 123\noom_kill 4\nnr_dirty 0\n")
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n")
    counters = ((vmstat, "oom_kill"), (events, "oom_kill"), (tmp_path / "absent", "oom_kill"))
    monkeypatch.setattr(failure_report, "_OOM_COUNTERS", counters)
    before = failure_report.oom_kills()
    assert before == (4, 1)
    assert not failure_report.out_of_memory_kills(before)
    events.write_text("low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\n")  # in this container's cgroup
    assert failure_report.out_of_memory_kills(before)
    killed = SimpleNamespace(failures={0: _failure(-int(signal.SIGTERM), 100), 1: _failure(-9, 100)})
    advice = "; to fit, try fewer --nproc-per-node (now 2; each holds the model and its optimizer)"
    assert failed(killed, tmp_path, hung=False, memory_advice=advice) == 2  # as memory run out in a rank
    said = capsys.readouterr().err.splitlines()
    assert said[:2] == ["lmtune: rank 1 was killed by SIGKILL", "lmtune: the launcher then stopped rank(s) 0"]
    assert said[2] == (
        "error: the kernel's out-of-memory killer killed a process while the job ran: the job needs more "
        f"memory than the machine (or its memory limit) has{advice}"
    )
    # SIGKILL with no such kill counted is said as before, and so is another way to end.
    assert failed(killed, tmp_path, hung=False) == 1
    assert len(capsys.readouterr().err.splitlines()) == 2
    crashed = SimpleNamespace(failures={0: _failure(-int(signal.SIGSEGV), 100)})
    assert failed(crashed, tmp_path, hung=False, memory_advice=advice) == 1
    assert capsys.readouterr().err.splitlines() == ["lmtune: rank 0 was killed by SIGSEGV"]
