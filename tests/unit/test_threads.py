"""A CPU process's threads: the cores shared among a machine's processes, the user's
OMP_NUM_THREADS followed (it was overridden without a word), torchrun's own 1 set aside."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmtune.parallel import distributed
from lmtune.parallel.distributed import DistEnv, cpu_threads_per_process, threads_note

ONE = DistEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend=None
)
TWO = replace(ONE, world_size=2, local_world_size=2, backend="gloo")


@pytest.mark.parametrize(
    ("env", "omp", "requested", "threads", "said"),
    [
        (ONE, None, 0, 8, None),  # the cores, unsaid
        (TWO, None, 0, 4, None),  # shared evenly
        (ONE, "1", 0, 1, "threads: 1 per process (OMP_NUM_THREADS=1)"),  # the user's, said
        (TWO, "3", 0, 3, "threads: 3 per process (OMP_NUM_THREADS=3)"),
        (TWO, "1", 0, 4, "OMP_NUM_THREADS=1, which torchrun sets for several processes, set aside"),
        (ONE, "2", 6, 6, None),  # --threads-per-process decides
        (TWO, None, 8, 8, "--threads-per-process 8: 16 threads on this machine's 8 cores oversubscribe"),
        (ONE, "many", 0, 8, "(OMP_NUM_THREADS=many is no count of threads: set aside)"),
        (replace(TWO, local_world_size=16), None, 0, 1, None),  # more processes than cores: theirs to say
        (ONE, "12", 0, 12, "OMP_NUM_THREADS=12: 12 threads on this machine's 8 cores oversubscribe"),
    ],
)
def test_threads_follow_the_flag_the_users_omp_setting_or_the_shared_cores(
    monkeypatch: pytest.MonkeyPatch,
    env: DistEnv,
    omp: str | None,
    requested: int,
    threads: int,
    said: str | None,
) -> None:
    monkeypatch.setattr(distributed, "available_cores", lambda: 8)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert cpu_threads_per_process(env, requested) == threads
    note = threads_note(env, requested, threads)
    assert (note is None) if said is None else (note is not None and said in note)
