"""The launcher's rendezvous tells its workers the round every node joined: a restarted job's ranks
meet in the store under the same namespace on every node, whichever node's process failed. And a
node's launcher that ends before the ranks met tells the other nodes' ranks waiting there."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch._C._distributed_c10d import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from lmtune.config.environment import RDZV_ROUND, RDZV_STORE
from lmtune.errors import UserError
from lmtune.parallel import rendezvous
from lmtune.parallel.distributed import DistEnv, _all_arrived, _attempt_store, say_round_ended
from lmtune.parallel.failure_report import RestartNotes


def test_each_round_joined_is_written_for_the_workers_started_next(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (RDZV_ROUND, RDZV_STORE):  # what the handler writes is removed after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    params = RendezvousParameters(
        rendezvous.backend(), "localhost:0", "round-test", 1, 1, join_timeout=30, is_host=True
    )
    handler = get_rendezvous_handler(params)
    try:
        assert handler.get_backend() == rendezvous.BACKEND and handler.get_run_id() == "round-test"
        first = handler.next_rendezvous()
        assert (first.rank, first.world_size) == (0, 1)
        assert os.environ[RDZV_ROUND] == "0"
        assert (
            os.environ[RDZV_STORE]
            == f"{first.bootstrap_store_info.master_addr}:{first.bootstrap_store_info.master_port}"
        )
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


def _restart_after_a_report(notes: RestartNotes, report: dict[str, object], left: int, most: int) -> None:
    """Local rank 0 reported ``report`` and ended with its exit code; torch's agent restarts."""
    (notes.error_dir / "rank-0.json").write_text(json.dumps(report))
    exitcode = report["exit_code"]
    assert isinstance(exitcode, int)
    notes.filter(_failed(exitcode))
    notes.filter(_restarting(left, most))


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
    _restart_after_a_report(notes, report, 2, 2)
    assert said == [
        "local rank 0 of this node lost its connection to another rank (a rank or a node of the job "
        "ended first); every process starts again from the newest checkpoint (--max-restarts: restart 1 of 2)"
    ]
    assert not (tmp_path / "rank-0.json").exists()
    _restart_after_a_report(notes, {**report, "lost": False, "message": "bad data"}, 1, 2)
    assert said[1].startswith("local rank 0 of this node failed with exit code 1; ")
    assert (tmp_path / "rank-0.json").exists()  # its own message: the launcher says it if the job ends


def test_a_user_error_is_not_announced_as_a_restart(tmp_path: Path) -> None:
    """The agent logs a restart before the launcher sees the worker's user error and ends the job:
    no restart line (the job is not restarted; the error is said once, as the job ends)."""
    said: list[str] = []
    notes = RestartNotes(False, said.append, tmp_path)
    _restart_after_a_report(
        notes, {"message": "the nodes' settings differ", "exit_code": 2, "lost": False}, 1, 1
    )
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


def _rank(rank: int) -> DistEnv:
    return DistEnv(rank, 0, 2, 1, torch.device("cpu"), "gloo")


def _workers_store(monkeypatch: pytest.MonkeyPatch) -> TCPStore:
    """The store a launcher's agent hosts for its workers, and the environment it gives them."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv(RDZV_ROUND, "3")
    monkeypatch.setenv(RDZV_STORE, f"127.0.0.1:{server.port}")
    return server


def _meet(rank: int, join_s: float, said: list[BaseException | None]) -> None:
    join = timedelta(seconds=join_s)
    try:
        _all_arrived(_attempt_store(_rank(rank), join), _rank(rank), join, "there")
        said.append(None)
    except UserError as e:
        said.append(e)


def test_ranks_go_on_once_all_arrived(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _workers_store(monkeypatch)  # noqa: F841  (held while the ranks meet)
    said: list[BaseException | None] = []
    other = threading.Thread(target=_meet, args=(1, 30, said))
    other.start()
    _meet(0, 30, said)
    other.join(30)
    assert said == [None, None]


def test_a_launcher_ending_before_the_ranks_met_ends_the_others_wait_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1's node's launcher was stopped before its rank reached the store: rank 0, which waits
    there with a join timeout of minutes, ends within a second, with that launcher's line."""
    server = _workers_store(monkeypatch)  # noqa: F841
    threading.Timer(0.3, say_round_ended, args=("node 1 was stopped by SIGTERM",)).start()
    said: list[BaseException | None] = []
    started = time.monotonic()
    _meet(0, 120, said)
    assert time.monotonic() - started < 30
    assert [str(e) for e in said] == ["node 1 was stopped by SIGTERM"]


def test_the_ranks_that_never_came_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _workers_store(monkeypatch)  # noqa: F841
    join = timedelta(seconds=1)
    with pytest.raises(RuntimeError, match=r"^rank 1 never joined$"):
        _all_arrived(_attempt_store(_rank(0), join), _rank(0), join, "there")


def test_the_store_closing_before_the_ranks_met_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _workers_store(monkeypatch)
    said: list[BaseException | None] = []
    waiting = threading.Thread(target=_meet, args=(1, 120, said))
    waiting.start()
    time.sleep(0.3)
    del server  # its host (node 0's launcher) ended
    waiting.join(30)
    assert not waiting.is_alive() and len(said) == 1
    assert "the job's store at there closed before its 2 processes met" in str(said[0])


def test_saying_the_round_ended_without_a_store_or_round_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RDZV_STORE, raising=False)
    say_round_ended("nobody hears this")
    monkeypatch.setenv(RDZV_STORE, "127.0.0.1:1")  # a store that is gone: nothing to tell
    monkeypatch.setenv(RDZV_ROUND, "0")
    say_round_ended("nobody hears this either")
