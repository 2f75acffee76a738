"""lmtune's own environment variables, read strictly: a value that is set (not empty) and not valid
is a one-line error naming the variable, never a silent default. (The ``LMTUNE_FAULT_*`` variables
of the test-only fault injection are read where they are used.)"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from lmtune.errors import UserError, brief

CACHE_DIR = "LMTUNE_CACHE_DIR"
CACHE_WAIT_TIMEOUT = "LMTUNE_CACHE_WAIT_TIMEOUT"
JOIN_TIMEOUT = "LMTUNE_JOIN_TIMEOUT"
LOCK_TOKEN = "LMTUNE_LOCK_TOKEN"
ERROR_DIR = "LMTUNE_ERROR_DIR"
HEALTH_DIR = "LMTUNE_HEALTH_DIR"
# Set by the launcher for its workers: the rendezvous round every node joined (parallel.rendezvous).
RDZV_ROUND = "LMTUNE_RDZV_ROUND"
# And the address of the store the workers of that round meet in (host:port).
RDZV_STORE = "LMTUNE_RDZV_STORE"
# And its own process id: a worker whose launcher died before it looked is not left training.
LAUNCHER_PID = "LMTUNE_LAUNCHER_PID"
SET_FOR_WORKERS = (RDZV_ROUND, RDZV_STORE, LAUNCHER_PID)
VERBOSE = "LMTUNE_VERBOSE"  # show other packages' warnings (lmtune.config.verbosity)
# The CPU bf16 paths (lmtune.model.paths), each auto | fp32 | bf16: overrides the decided path.
CPU_PRODUCTS = "LMTUNE_CPU_PRODUCTS"
CPU_ATTENTION = "LMTUNE_CPU_ATTENTION"
_TOKEN = re.compile(r"[0-9a-f]{32}")


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None  # empty is unset, as shells and XDG variables have it


def _bad(name: str, value: str, expected: str) -> UserError:
    return UserError(f"environment variable {name}={brief(value)}: expected {expected}")


def join_timeout_s() -> float:
    """How long the job's processes, and the nodes' launchers, wait for each other to start."""
    return seconds(JOIN_TIMEOUT, 300.0)


def seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds, or ``default`` when unset."""
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise _bad(name, raw, "a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise _bad(name, raw, "a positive, finite number of seconds")
    return value


def folder(name: str, must_exist: bool) -> Path | None:
    """A folder path (created later when ``must_exist`` is False), or None when unset."""
    raw = _raw(name)
    if raw is None:
        return None
    if "\0" in raw:
        raise _bad(name, raw, "a folder path")
    path = Path(raw).expanduser()
    if path.exists() and not path.is_dir():
        raise _bad(name, raw, "a folder (it names something that is not one)")
    if must_exist and not path.is_dir():
        raise _bad(name, raw, "an existing folder")
    if (problem := folder_problem(path)) is not None:
        raise _bad(name, raw, f"a folder lmtune can write ({problem})")
    return path


def folder_problem(path: Path) -> str | None:
    """Why lmtune could not create or write the folder ``path`` (not created here), or None."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:  # a relative path's parents end at the working folder, which exists
        return None
    if not existing.is_dir():
        return f"{existing} is not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return (
            f"{existing} is not writable" if existing == path else f"{existing} does not let it create {path}"
        )
    return None


def token(name: str) -> str | None:
    """A token lmtune's launcher made (32 hex digits), or None when unset."""
    raw = _raw(name)
    if raw is not None and not _TOKEN.fullmatch(raw):
        raise _bad(name, raw, "the 32 hex digits lmtune's launcher sets (unset it)")
    return raw


def switch(name: str) -> bool:
    """A yes/no variable: 1, true or yes; 0, false or no; unset is no."""
    raw = _raw(name)
    if raw is None:
        return False
    if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise _bad(name, raw, "1 or 0 (true or false)")
    return raw.lower() in ("1", "true", "yes")


def cpu_path(name: str) -> str | None:
    """fp32 or bf16 as ``name`` forces a CPU bf16 path, or None (unset or auto: decided)."""
    raw = _raw(name)
    if raw is not None and raw not in ("auto", "fp32", "bf16"):
        raise _bad(name, raw, "auto, fp32 or bf16")
    return None if raw in (None, "auto") else raw


def check_environment() -> None:
    """Every LMTUNE_* variable checked at once, before a command does anything."""
    seconds(CACHE_WAIT_TIMEOUT, 1.0)
    seconds(JOIN_TIMEOUT, 1.0)
    folder(CACHE_DIR, must_exist=False)
    folder(ERROR_DIR, must_exist=True)
    folder(HEALTH_DIR, must_exist=True)
    token(LOCK_TOKEN)
    switch(VERBOSE)
    cpu_path(CPU_PRODUCTS)  # read by a bf16 run only, checked for every one: a typo is not ignored
    cpu_path(CPU_ATTENTION)


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE (or its older name) tells the hub client to stay offline."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def hub_reachable(timeout_s: float = 5.0) -> bool:
    """One quick connection to the hub's host; offline mode counts as out of reach. Without it,
    the hub client retries for most of a minute before it says the hub is out of reach."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if hub_offline():
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname or "", url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False
