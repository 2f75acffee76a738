"""How idle CPU threads wait: passive when other threads compete at start, else the default."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtune.config.threads import DECIDED_ENV, WAIT_ENV, busy_at_start, decide_thread_wait, runnable_others


def test_passive_when_other_threads_are_runnable() -> None:
    decided = decide_thread_wait({}, lambda: 6)
    assert decided[WAIT_ENV] == "PASSIVE"
    assert decided[DECIDED_ENV] == "passive (6 other runnable threads at start)"
    assert decide_thread_wait({}, lambda: 1)[DECIDED_ENV] == "passive (1 other runnable thread at start)"


def test_the_runtime_default_on_a_quiet_or_unknown_machine() -> None:
    quiet = decide_thread_wait({}, lambda: 0)
    assert WAIT_ENV not in quiet and "no other runnable thread" in quiet[DECIDED_ENV]
    unknown = decide_thread_wait({}, lambda: None)
    assert WAIT_ENV not in unknown and "unknown" in unknown[DECIDED_ENV]


def test_busy_at_start_is_lmtunes_passive_decision_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DECIDED_ENV, decide_thread_wait({}, lambda: 3)[DECIDED_ENV])
    assert busy_at_start()
    monkeypatch.setenv(DECIDED_ENV, "OMP_WAIT_POLICY=PASSIVE (set by you)")
    assert not busy_at_start()
    monkeypatch.delenv(DECIDED_ENV)
    assert not busy_at_start()


def test_the_users_setting_and_a_parents_decision_are_kept() -> None:
    def never() -> int:
        raise AssertionError("nothing to sample when the answer is given")

    assert decide_thread_wait({"GOMP_SPINCOUNT": "1000"}, never) == {
        DECIDED_ENV: "GOMP_SPINCOUNT=1000 (set by you)"
    }
    assert decide_thread_wait({DECIDED_ENV: "passive (2 other runnable threads at start)"}, never) == {}


def test_runnable_others_is_the_median_instant_count_less_this_thread(tmp_path: Path) -> None:
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("7.76 5.13 3.00 8/312 25540\n")
    assert runnable_others(loadavg) == 7
    loadavg.write_text("0.10 0.20 0.30 1/80 100\n")
    assert runnable_others(loadavg) == 0
    assert runnable_others(tmp_path / "missing") is None
    loadavg.write_text("garbage\n")
    assert runnable_others(loadavg) is None


def test_the_python_api_is_told_to_set_passive_waiting_on_a_busy_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """lmtune.train() runs after Python imported torch, too late to choose how threads wait: on a
    busy machine its steps ran 30-50x slower than the CLI's, without a word."""
    from lmtune.config import threads

    for name in (DECIDED_ENV, WAIT_ENV, "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(threads, "runnable_others", lambda: 6)
    said = threads.spinning_among_others()
    assert said is not None and said.startswith("warning: 6 other runnable threads compete for the CPUs")
    assert "set OMP_WAIT_POLICY=PASSIVE in the environment before Python imports torch" in said
    monkeypatch.setattr(threads, "runnable_others", lambda: 0)
    assert threads.spinning_among_others() is None
    monkeypatch.setattr(threads, "runnable_others", lambda: 6)
    monkeypatch.setenv(WAIT_ENV, "ACTIVE")  # the user's choice
    assert threads.spinning_among_others() is None
