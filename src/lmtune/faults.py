"""Fault injection for the fault-tolerance tests, off unless an LMTUNE_FAULT_* variable is set.

A killed save or a non-finite loss cannot be produced on demand from outside the process at an
exact point, so the tests ask for them through these variables. Nothing here runs otherwise.
"""

from __future__ import annotations

import os
import signal


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
