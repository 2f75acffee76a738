"""Fault injection for the fault-tolerance tests, off unless an LMTUNE_FAULT_* variable is set.

A killed save or a non-finite loss cannot be produced on demand from outside the process at an
exact point, so the tests ask for them through these variables. Nothing here runs otherwise.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any


def _int_from_env(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw else None


def maybe_kill_in_save(step: int) -> None:
    """LMTUNE_FAULT_KILL_IN_SAVE=k: die by SIGKILL halfway through writing checkpoint k."""
    if _int_from_env("LMTUNE_FAULT_KILL_IN_SAVE") == step:
        os.kill(os.getpid(), signal.SIGKILL)


def nan_step() -> int | None:
    """LMTUNE_FAULT_NAN_AT_STEP=k: the loss of optimizer step k becomes NaN (on rank 0)."""
    return _int_from_env("LMTUNE_FAULT_NAN_AT_STEP")


def free_bytes_override() -> int | None:
    """LMTUNE_FAULT_FREE_BYTES=n: the disk has n bytes free (where a small file system cannot be
    mounted for the disk-full test)."""
    return _int_from_env("LMTUNE_FAULT_FREE_BYTES")


def _rank_and_number(name: str) -> tuple[int, float] | None:
    raw = os.environ.get(name)
    if not raw:
        return None
    rank, number = raw.split(":")
    return int(rank), float(number)


def install_slow_or_stuck_rank(module: Any, rank: int, step: Callable[[], int]) -> None:
    """LMTUNE_FAULT_SLOW_RANK=r:s: rank r sleeps s seconds in every forward (a straggler).
    LMTUNE_FAULT_HANG=r:k: rank r sleeps forever inside the forward of step k, in the job's first
    attempt only (a hang whose stack the watchdog's report must show, and that a restart gets past)."""
    slow, hang = _rank_and_number("LMTUNE_FAULT_SLOW_RANK"), _rank_and_number("LMTUNE_FAULT_HANG")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        hang = None

    def before_forward(*_: Any) -> None:
        if slow is not None and slow[0] == rank:
            time.sleep(slow[1])
        if hang is not None and hang[0] == rank and step() == int(hang[1]):
            while True:
                time.sleep(3600)  # lmtune-fault: stuck in forward

    if slow is not None or hang is not None:
        module.register_forward_pre_hook(before_forward)
