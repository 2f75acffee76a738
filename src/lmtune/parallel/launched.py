"""Which launch a worker belongs to: torchrun's run id, and when the launch began (a restarted
worker tells its launch's checkpoints from an earlier job's of the same id by it)."""

from __future__ import annotations

import os
import time
from pathlib import Path

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # torchrun's run id, in every worker's environment


def run_id() -> str:
    """This worker's launch's run id ("" outside torchrun and lmtune's launcher)."""
    return os.environ.get(RUN_ID_ENV, "")


def launch_started() -> float | None:
    """When this worker's launch began, in wall-clock seconds (to ~10 ms), from Linux's /proc; None
    where it does not say. The launch is the nearest ancestor the launch did not start (torchrun's
    agent, lmtune's launcher): a wrapper script between it and lmtune, which torchrun starts again
    with every restart, has the run id in its environment as the workers do."""
    try:
        pid = os.getppid()
        for _ in range(32):
            if f"\0{RUN_ID_ENV}=".encode() not in _environ(pid):
                break
            pid = int(proc_stat(pid)[1])
        booted = time.time() - float(Path("/proc/uptime").read_text().split()[0])
        return booted + int(proc_stat(pid)[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def proc_stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the state on (the name before it may hold spaces): [0] the
    state, [1] the parent's pid, [19] the start in clock ticks since boot."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _environ(pid: int) -> bytes:
    """The environment ``pid`` was started with, NUL-separated (b"" where it may not be read)."""
    try:
        return b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except PermissionError:
        return b""
