"""The launcher's rendezvous tells its workers the round every node joined: a restarted job's ranks
meet in the store under the same namespace on every node, whichever node's process failed."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

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


def _failed(exitcode: int) -> logging.LogRecord:
    """torch's record of local rank 0's end."""
    return _record("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s", exitcode, 0, 1, "x")


def _restarting(left: int, most: int) -> logging.LogRecord:
    """torch's record of a restart its agent begins for this node's own failure."""
    msg = "[%s] Worker group %s. %s/%s attempts left; will restart worker group"
    return _record(msg, "d", "FAILED", left, most)


def test_both_nodes_say_the_restart_the_one_whose_process_failed_and_the_other(tmp_path: Path) -> None:
    said: list[str] = []
    failed_here, other = (
        RestartNotes(False, said.append, tmp_path),
        RestartNotes(False, said.append, tmp_path),
    )
    failed_here.filter(_failed(-9))
    failed_here.filter(_restarting(1, 1))
    other.filter(
        _record("[%s] Detected %s new nodes from group_rank=%s; will restart worker group", "d", 1, 0)
    )
    assert said == [
        "local rank 0 of this node was killed by SIGKILL; every process starts again from the newest "
        "checkpoint (--max-restarts: restart 1 of 1)",
        "another node's process ended (or a node joined the job); every process starts again from the "
        "newest checkpoint",
    ]


def test_a_rank_that_lost_its_peer_on_another_node_is_said_as_such_and_its_report_forgotten(
    tmp_path: Path,
) -> None:
    """The rank failed (exit 1) because another node's had ended: its restart line says so, and its
    report goes, so that a failure of the next attempt is not taken for another node's."""
    said: list[str] = []
    notes = RestartNotes(False, said.append, tmp_path)
    report = {"message": "rank 0 lost its connection", "exit_code": 1, "lost": True}
    (tmp_path / "rank-0.json").write_text(json.dumps(report))
    notes.filter(_failed(1))
    notes.filter(_restarting(2, 2))
    assert said == [
        "local rank 0 of this node lost its connection to another rank (a rank or a node of the job "
        "ended first); every process starts again from the newest checkpoint (--max-restarts: restart 1 of 2)"
    ]
    assert not (tmp_path / "rank-0.json").exists()
    (tmp_path / "rank-0.json").write_text(json.dumps({**report, "lost": False, "message": "bad data"}))
    notes.filter(_failed(1))
    notes.filter(_restarting(1, 2))
    assert said[1].startswith("local rank 0 of this node failed with exit code 1; ")
    assert (tmp_path / "rank-0.json").exists()  # its own message: the launcher says it if the job ends


def test_a_user_error_is_not_announced_as_a_restart(tmp_path: Path) -> None:
    """The agent logs a restart before the launcher sees the worker's user error and ends the job:
    no restart line (the job is not restarted; the error is said once, as the job ends)."""
    said: list[str] = []
    notes = RestartNotes(False, said.append, tmp_path)
    report = {"message": "the nodes' settings differ", "exit_code": 2, "lost": False}
    (tmp_path / "rank-0.json").write_text(json.dumps(report))
    notes.filter(_failed(2))
    notes.filter(_restarting(1, 1))
    assert said == []


def test_under_torchrun_a_restart_that_did_not_meet_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    from lmtune.parallel.distributed import _why_not_met

    monkeypatch.delenv(RDZV_ROUND, raising=False)
    plain = "check that every process was started and can reach it"
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    said = _why_not_met()
    assert said.startswith(plain) and "torchrun counts restarts per node" in said
    monkeypatch.setenv(RDZV_ROUND, "1")  # lmtune's launcher: the round is shared, no such cause
    assert _why_not_met() == plain
    monkeypatch.delenv(RDZV_ROUND)
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert _why_not_met() == plain
