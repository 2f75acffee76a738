"""The launcher's rendezvous tells its workers the round every node joined: a restarted job's ranks
meet in the store under the same namespace on every node, whichever node's process failed."""

from __future__ import annotations

import logging
import os

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from lmtune.config.environment import RDZV_ROUND
from lmtune.parallel import rendezvous
from lmtune.parallel.failure_report import RestartNotes


def test_each_round_joined_is_written_for_the_workers_started_next(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RDZV_ROUND, raising=False)
    params = RendezvousParameters(
        rendezvous.backend(), "localhost:0", "round-test", 1, 1, join_timeout=30, is_host=True
    )
    handler = get_rendezvous_handler(params)
    try:
        assert handler.get_backend() == rendezvous.BACKEND and handler.get_run_id() == "round-test"
        first = handler.next_rendezvous()
        assert (first.rank, first.world_size) == (0, 1)
        assert os.environ[RDZV_ROUND] == "0"
        handler.next_rendezvous()  # a restart: torch's agent meets again before starting workers
        assert os.environ[RDZV_ROUND] == "1"
        assert handler.num_nodes_waiting() == 0 and not handler.is_closed()
    finally:
        handler.shutdown()
    assert rendezvous.backend() == rendezvous.BACKEND  # registering again is harmless


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("torch", logging.INFO, __file__, 1, msg, args, None)


def test_both_nodes_say_the_restart_the_one_whose_process_failed_and_the_other() -> None:
    said: list[str] = []
    failed_here, other = RestartNotes(False, said.append), RestartNotes(False, said.append)
    failed_here.filter(_record("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", -9, 0, 1, "x"))
    failed_here.filter(
        _record("[%s] Worker group %s. %s/%s attempts left; will restart worker group", "d", "FAILED", 1, 1)
    )
    other.filter(
        _record("[%s] Detected %s new nodes from group_rank=%s; will restart worker group", "d", 1, 0)
    )
    assert said == [
        "local rank 0 of this node was killed by SIGKILL; every process starts again from the newest "
        "checkpoint (--max-restarts: restart 1 of 1)",
        "another node's process ended (or a node joined the job); every process starts again from the "
        "newest checkpoint",
    ]
