"""Which launch a worker belongs to: torchrun's run id, and when the launch began (a restarted
worker tells its launch's checkpoints from an earlier job's of the same id by it); and a worker
never outliving its launcher."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path

from lmtune.config import environment

RUN_ID_ENV = "TORCHELASTIC_RUN_ID"  # torchrun's run id, in every worker's environment
_PR_SET_PDEATHSIG = 1


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


def die_with_launcher() -> None:
    """A worker ends when the process that started it dies (a launcher killed by SIGKILL or the
    OOM killer), instead of training on under init and writing into a folder a rerun may use."""
    parent = os.getppid()
    # lmtune's launcher names itself: one that died before this process read its parent would be
    # taken for the init (or subreaper) that adopted it, and this rank would train on alone. (A
    # name inherited from elsewhere, of a live process, is not this worker's launcher: passed over.)
    given = os.environ.get(environment.LAUNCHER_PID, "")
    if given.isdigit() and int(given) != parent and _dead(int(given)):
        os._exit(1)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: watch the parent instead
        ok = False
    if os.getppid() != parent:  # the launcher died before the request above took effect
        os._exit(1)
    if not ok:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os._exit(1)

        threading.Thread(target=watch, name="lmtune-parent-watch", daemon=True).start()


def _dead(pid: int) -> bool:
    try:
        return proc_stat(pid)[0] in ("Z", "X")  # a zombie: its parent has not read its end yet
    except (OSError, IndexError):
        return Path("/proc/self").is_dir()  # gone (where /proc tells)
