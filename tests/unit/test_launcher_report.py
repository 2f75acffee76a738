"""What the launcher says when a rank dies without a message of its own (killed, crashed): the
rank that ended first and how, then the ranks it stopped because of it."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmtune.parallel.launch import _failed


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
    assert _failed(error, tmp_path, hung=False) == 1
    assert capsys.readouterr().err.splitlines() == [
        "lmtune: rank 1 was killed by SIGKILL",
        "lmtune: rank 2 failed with exit code 3",
        "lmtune: the launcher then stopped rank(s) 0",
    ]
