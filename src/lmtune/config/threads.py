"""How the CPU's idle compute threads wait, decided before PyTorch loads (its OpenMP runtime reads
the setting once, when it starts).

OpenMP threads that finish a parallel region early spin before they sleep. On a quiet machine
that is what makes small kernels fast; on a busy one a spinning thread burns the time slice its
partner needs to reach the same barrier. Measured on 2 cores (13M Llama, fp32): with 6 busy
processes a step ran 15x slower than quiet with spinning and 5.3x with passive waiting (fair share
is 4x); with one busy process, 891 against 1,448 tokens/s; quiet, passive waiting cost 10% (fp32)
to 18% (bf16). So: passive waiting when other threads are runnable at start, the runtime's default
otherwise, and what the user set is kept.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

WAIT_ENV = "OMP_WAIT_POLICY"
DECIDED_ENV = "LMTUNE_THREAD_WAIT"  # how lmtune decided: run.json says it; child processes keep it
_USER_SETTINGS = (WAIT_ENV, "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
_SAMPLES, _GAP_S = 5, 0.002
_PASSIVE = "passive ("  # how a decision for passive waiting reads


def choose_thread_wait() -> None:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` for this process and those it starts when other threads
    compete for the CPUs now; a no-op once torch is imported (too late to matter)."""
    if "torch" not in sys.modules:
        os.environ.update(decide_thread_wait(os.environ, runnable_others))


def decide_thread_wait(environ: Mapping[str, str], others: Callable[[], int | None]) -> dict[str, str]:
    """The variables to set: none where a parent lmtune process decided already (so every rank of
    a job waits alike), the user's choice recorded where there is one, else by ``others()``."""
    if DECIDED_ENV in environ:
        return {}
    chosen = [f"{name}={environ[name]}" for name in _USER_SETTINGS if name in environ]
    if chosen:
        return {DECIDED_ENV: f"{', '.join(chosen)} (set by you)"}
    count = others()
    if count is None:
        return {DECIDED_ENV: "the OpenMP default (the system's runnable threads are unknown here)"}
    if count > 0:
        plural = "s" if count > 1 else ""
        return {
            WAIT_ENV: "PASSIVE",
            DECIDED_ENV: f"{_PASSIVE}{count} other runnable thread{plural} at start)",
        }
    return {DECIDED_ENV: "the OpenMP default (spin, then sleep; no other runnable thread at start)"}


def thread_wait() -> str:
    """How this process's compute threads wait, and why (run.json, the start line, doctor)."""
    return os.environ.get(DECIDED_ENV) or (
        f"{WAIT_ENV}={os.environ[WAIT_ENV]}" if WAIT_ENV in os.environ else "the OpenMP default"
    )


def busy_at_start() -> bool:
    """Whether lmtune found other threads competing for the CPUs when this job started (and so set
    passive waiting); a policy the user set does not count."""
    return os.environ.get(DECIDED_ENV, "").startswith(_PASSIVE)


def spinning_among_others() -> str | None:
    """Where nothing decided how threads wait (the Python API: torch was imported before lmtune
    could) and other threads compete for the CPUs now, what to do about it; else None."""
    if DECIDED_ENV in os.environ or any(name in os.environ for name in _USER_SETTINGS):
        return None
    count = runnable_others()
    if not count:
        return None
    threads = f"{count} other runnable thread{'s compete' if count > 1 else ' competes'}"
    return (
        f"warning: {threads} for the CPUs, and "
        "PyTorch's OpenMP threads spin while they wait (steps ran 3x to 25x slower than with passive "
        "waiting on 2 cores, as the others' load grew); set OMP_WAIT_POLICY=PASSIVE in the environment "
        "before Python imports torch (`lmtune train` decides it itself)"
    )


def runnable_others(loadavg: Path = Path("/proc/loadavg")) -> int | None:
    """Threads other than this one runnable now (the median of a few instant counts, so a
    passing process does not decide); None where the system does not say (not Linux)."""
    counts = []
    for i in range(_SAMPLES):
        try:
            running = loadavg.read_text().split()[3].split("/")[0]
            counts.append(int(running) - 1)  # this thread, reading, is one of them
        except (OSError, IndexError, ValueError):
            return None
        if i + 1 < _SAMPLES:
            time.sleep(_GAP_S)
    return max(0, int(statistics.median(counts)))
