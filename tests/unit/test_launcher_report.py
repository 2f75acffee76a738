"""What the launcher says when a rank dies without a message of its own (killed, crashed): the
rank that ended first and how, then the ranks it stopped because of it."""

from __future__ import annotations

import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmtune.parallel import failure_report
from lmtune.parallel.failure_report import failed


def _failure(exitcode: int, timestamp: int) -> SimpleNamespace:
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)


def test_the_first_rank_to_end_is_named_with_its_signal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped, killed = -int(signal.SIGTERM), -int(signal.SIGKILL)
    # Rank 0 was stopped by the launcher in the same second rank 1 was killed.
    error = SimpleNamespace(
        failures={0: _failure(stopped, 100), 1: _failure(killed, 100), 2: _failure(3, 101)}
    )
    assert failed(error, tmp_path, hung=False) == 1
    assert capsys.readouterr().err.splitlines() == [
        "lmtune: rank 1 was killed by SIGKILL",
        "lmtune: rank 2 failed with exit code 3",
        "lmtune: the launcher then stopped rank(s) 0",
        f"lmtune: {failure_report.RESUMES}",
    ]


def test_a_rank_the_out_of_memory_killer_took_is_named_with_what_to_lower(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    vmstat, events = tmp_path / "vmstat", tmp_path / "memory.events"
    vmstat.write_text("pgfault 123\noom_kill 4\nnr_dirty 0\n")
    events.write_text("low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\n")
    counters = ((vmstat, "oom_kill"), (events, "oom_kill"), (tmp_path / "absent", "oom_kill"))
    monkeypatch.setattr(failure_report, "_OOM_COUNTERS", counters)
    before = failure_report.oom_kills()
    assert before == (4, 1)
    assert not failure_report.out_of_memory_kills(before)
    events.write_text("low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\n")  # in this container's cgroup
    assert failure_report.out_of_memory_kills(before)
    killed = SimpleNamespace(failures={0: _failure(-int(signal.SIGTERM), 100), 1: _failure(-9, 100)})
    advice = "; to fit, try fewer --nproc-per-node (now 2; each holds the model and its optimizer)"
    assert failed(killed, tmp_path, hung=False, memory_advice=advice) == 2  # as memory run out in a rank
    said = capsys.readouterr().err.splitlines()
    assert said[:2] == ["lmtune: rank 1 was killed by SIGKILL", "lmtune: the launcher then stopped rank(s) 0"]
    assert said[2] == (
        "error: the kernel's out-of-memory killer killed a process while the job ran: the job needs more "
        f"memory than the machine (or its memory limit) has{advice}"
    )
    # SIGKILL with no such kill counted is said as before, and so is another way to end.
    assert failed(killed, tmp_path, hung=False) == 1
    assert capsys.readouterr().err.splitlines()[2] == f"lmtune: {failure_report.RESUMES}"
    crashed = SimpleNamespace(failures={0: _failure(-int(signal.SIGSEGV), 100)})
    assert failed(crashed, tmp_path, hung=False, memory_advice=advice) == 1
    resumes = f"lmtune: {failure_report.RESUMES}"
    assert capsys.readouterr().err.splitlines() == ["lmtune: rank 0 was killed by SIGSEGV", resumes]


def test_a_rank_that_lost_its_peer_names_the_peer_as_the_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A collective that failed because another rank had gone is not this rank's fault: said in a
    line (it was a 30-line gloo traceback and "rank 0 failed with exit code 1"), or, where this node's
    launcher saw the rank that ended, that rank."""
    from lmtune.parallel.failure_report import lost_connection
    from lmtune.parallel.launch import report_error

    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:3502"
    )
    said = lost_connection(gloo, 0)
    assert said is not None and said.startswith(
        "rank 0 lost its connection to another rank of the job (Connection"
    )
    assert lost_connection(RuntimeError("CUDA error: an illegal memory access"), 0) is None
    monkeypatch.setenv("LMTUNE_ERROR_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    report_error(said, 1, lost=True)
    only = SimpleNamespace(failures={0: _failure(1, 100)})  # the rank that ended is on another node
    assert failed(only, tmp_path, hung=False) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: {said}"]
    here = SimpleNamespace(failures={0: _failure(1, 100), 1: _failure(-int(signal.SIGKILL), 100)})
    assert failed(here, tmp_path, hung=False) == 1
    resumes = f"lmtune: {failure_report.RESUMES}"
    assert capsys.readouterr().err.splitlines() == ["lmtune: rank 1 was killed by SIGKILL", resumes]


def test_a_collective_that_timed_out_is_said_as_a_hang_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank stopped (SIGSTOP) past --collective-timeout: the others' gloo error was a 35-line
    traceback, then "rank 1 was killed by SIGKILL" (the launcher's own clean-up): one line, exit 3."""
    from lmtune.parallel.failure_report import collective_timed_out
    from lmtune.parallel.launch import report_error

    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for "
        "recv operation to complete"
    )
    said = collective_timed_out(gloo, 0)
    assert said is not None and said.startswith(
        "rank 0 waited 10 s for the other ranks in a collective and gave up (--collective-timeout)"
    )
    nccl = RuntimeError("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9)")
    assert (collective_timed_out(nccl, 1) or "").startswith("rank 1 waited for the other ranks")
    assert collective_timed_out(RuntimeError("Connection closed by peer"), 0) is None
    monkeypatch.setenv("LMTUNE_ERROR_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    report_error(said, 3)
    stalled = SimpleNamespace(failures={0: _failure(3, 100), 1: _failure(-int(signal.SIGKILL), 131)})
    assert failed(stalled, tmp_path, hung=False) == 3
    assert capsys.readouterr().err.splitlines() == [f"error: {said}"]


def test_under_torchrun_a_node_without_rank_0_says_how_its_ranks_ended(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """lmtune's launcher prints it for its node; under torchrun the node's first rank does (it was
    silent)."""
    from lmtune.parallel.launch import report_outcome

    monkeypatch.delenv("LMTUNE_ERROR_DIR", raising=False)
    for local_rank, main, said in ((0, False, True), (1, False, False), (0, True, False)):
        env = SimpleNamespace(local_rank=local_rank, is_main=main)
        report_outcome(12, stopped=False, env=env)  # type: ignore[arg-type]
        err = capsys.readouterr().err
        assert ("this node's ranks finished at step 12; rank 0's node printed the summary" in err) is said
    report_outcome(8, stopped=True, env=SimpleNamespace(local_rank=0, is_main=False))  # type: ignore[arg-type]
    assert "stopped by a signal with a checkpoint of step 8; run the same command again on every node" in (
        capsys.readouterr().err
    )


def test_workers_stopped_before_training_say_where_the_signal_may_have_come_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank stops on one rank's signal before training: a node of several that was not
    signalled said the workers were stopped by SIGTERM, as if this node had been."""
    stopped = SimpleNamespace(failures={0: _failure(128 + int(signal.SIGTERM), 100)})
    assert failed(stopped, tmp_path, hung=False) == 143
    assert (
        capsys.readouterr().err.strip().endswith("stopped by SIGTERM before training began; nothing to save")
    )
    assert failed(stopped, tmp_path, hung=False, single_node=False) == 143
    said = "stopped by SIGTERM (on this node or on another of the job) before training began"
    assert said in capsys.readouterr().err


def test_a_worker_whose_launcher_died_before_it_looked_ends_at_once() -> None:
    """A worker took the process that adopted it (init, a subreaper) for its launcher where the
    launcher died before the worker read its parent, and trained on alone (a SIGKILL at start)."""
    import os
    import subprocess
    import sys

    probe = "from lmtune.parallel.launched import die_with_launcher; die_with_launcher(); print('on')"
    # Its parent; a live process that is not (a name inherited from elsewhere); a dead one.
    for launcher, code, said in ((os.getpid(), 0, "on"), (1, 0, "on"), (2**22 + 1, 1, "")):
        env = {**os.environ, "LMTUNE_LAUNCHER_PID": str(launcher)}
        ran = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
        assert (ran.returncode, ran.stdout.strip()) == (code, said), ran.stderr


def test_the_launcher_loads_torch_only_after_it_quiets_torchs_cpp_logs() -> None:
    """The launcher sets TORCH_CPP_LOG_LEVEL before torch loads (torch reads it then): a module-level
    import of torch in its modules printed c10d's C++ stack traces into a node's output."""
    import subprocess
    import sys

    modules = "lmtune.cli, lmtune.parallel.launch, lmtune.parallel.failure_report"  # not rendezvous: torch's
    probe = f"import sys, {modules}; print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "False", loaded.stdout + loaded.stderr
