"""Fault injection for the fault-tolerance tests, installed only when an LMTUNE_FAULT_* variable is set.

A killed save, a full disk, a non-finite loss, a slow or a stuck rank cannot be produced on demand
from outside the process at an exact point, so the tests ask for them through these variables.
Nothing of it is part of the production types: :func:`install` hooks the model and replaces two
of the checkpoint store's functions (its free-space reading and its manifest writer) in this
process, and only when asked.

- ``LMTUNE_FAULT_KILL_IN_SAVE=k``: die by SIGKILL halfway through writing checkpoint k (its files
  written, its manifest not).
- ``LMTUNE_FAULT_FREE_BYTES=n``: the disk has n bytes free (where a small file system cannot be
  mounted for the disk-full test).
- ``LMTUNE_FAULT_NAN_AT_STEP=k``: the training loss of optimizer step k becomes NaN on rank 0.
- ``LMTUNE_FAULT_SLOW_RANK=r:s``: rank r sleeps s seconds in every forward (a straggler).
- ``LMTUNE_FAULT_HANG=r:k``: rank r sleeps forever inside the forward of step k, in the job's first
  attempt only (a hang whose stack the watchdog's report must show, and that a restart gets past).
- ``LMTUNE_FAULT_SIGNAL_AT_START=r``: rank r gets SIGTERM once its run is built, before the first
  step (a preemption that reaches one rank first).
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

PREFIX = "LMTUNE_FAULT_"


def requested() -> bool:
    """Whether any fault is asked for in this process's environment."""
    return any(name.startswith(PREFIX) and value for name, value in os.environ.items())


def _int_from_env(name: str) -> int | None:
    raw = os.environ.get(PREFIX + name)
    return int(raw) if raw else None


def _rank_and_number(name: str) -> tuple[int, float] | None:
    raw = os.environ.get(PREFIX + name)
    if not raw:
        return None
    rank, number = raw.split(":")
    return int(rank), float(number)


def install(model: nn.Module, rank: int, step: Callable[[], int]) -> None:
    """Install every fault the environment asks for; ``model`` is the module whose forward computes
    the loss, ``step`` the optimizer step in progress. Nothing, unless asked."""
    if not requested():
        return
    _install_save_faults()
    _install_forward_faults(model, rank, step)
    if _int_from_env("SIGNAL_AT_START") == rank:  # installed right before fit
        os.kill(os.getpid(), signal.SIGTERM)


def _install_save_faults() -> None:
    from lmtune.checkpoint import store

    free = _int_from_env("FREE_BYTES")
    if free is not None:
        store.free_bytes = lambda folder: free
    kill_at = _int_from_env("KILL_IN_SAVE")
    if kill_at is not None:
        # The store's own binding of the manifest writer: it writes a checkpoint's last file.
        names = vars(store)
        write_manifest = names["write_manifest"]

        def kill_before_manifest(folder: Path) -> None:
            found = re.search(r"step-(\d+)", folder.name)
            if found is not None and int(found.group(1)) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            write_manifest(folder)

        names["write_manifest"] = kill_before_manifest


def _install_forward_faults(model: nn.Module, rank: int, step: Callable[[], int]) -> None:
    slow, hang = _rank_and_number("SLOW_RANK"), _rank_and_number("HANG")
    nan_at = _int_from_env("NAN_AT_STEP")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        hang = None

    def before_forward(*_: Any) -> None:
        if slow is not None and slow[0] == rank:
            time.sleep(slow[1])
        if hang is not None and hang[0] == rank and step() == int(hang[1]):
            while True:
                time.sleep(3600)  # lmtune-fault: stuck in forward

    def poison(module: nn.Module, args: Any, output: Any) -> Any:
        if module.training and rank == 0 and step() == nan_at:
            return output * float("nan")
        return output

    if slow is not None or hang is not None:
        model.register_forward_pre_hook(before_forward)
    if nan_at is not None:
        model.register_forward_hook(poison)
