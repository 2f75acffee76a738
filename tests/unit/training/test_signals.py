"""What a rank says when a signal reaches it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lmtune.parallel import health
from lmtune.training.signals import StopRequest


def _beat(folder: Path, rank: int, pid: int) -> None:
    record = health._RECORD.pack(3, health.PHASES.index("forward"), pid, time.time())
    (folder / f"rank-{rank}.hb").write_bytes(record)


def test_a_signal_after_another_rank_ended_says_so_not_that_it_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher stops the job when a rank ends (the kernel's out-of-memory killer took it): the
    rank left cannot finish its step, let alone save, and said it would."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(health.HEALTH_DIR_ENV, str(tmp_path))
    _beat(tmp_path, 0, os.getpid())
    ended = subprocess.Popen(["true"])
    ended.wait()
    _beat(tmp_path, 1, ended.pid)  # reaped: its pid is gone
    stop = StopRequest()
    stop.stepping = True
    stop._handle(signal.SIGTERM, None)
    said = capsys.readouterr().err
    assert (
        said == "lmtune: SIGTERM received: rank 1 has ended, so this one stops too (the launcher says why)\n"
    )
    # Every rank alive: the step finishes and is saved, as before.
    _beat(tmp_path, 1, os.getpid())
    stop._handle(signal.SIGTERM, None)
    assert (
        capsys.readouterr().err == "lmtune: SIGTERM received: finishing this step and saving a checkpoint\n"
    )
