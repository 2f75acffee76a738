"""Progress where it can be seen: a bar redrawn on a terminal, lines now and then in a job's log
(each redraw of a bar would stay there, one long line of them)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from lmtune.outputs.runlog import ProgressLines, RunLog, _draws_in_place
from lmtune.parallel.distributed import read_dist_env


def test_a_bar_only_where_it_is_redrawn_in_place(tmp_path: Path) -> None:
    with (tmp_path / "log").open("w") as file:
        assert not _draws_in_place(file)
    assert _draws_in_place(io.StringIO())  # no file behind it: a notebook's stream


def test_lines_at_the_first_step_then_every_interval_and_the_last(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("lmtune.outputs.runlog.time.monotonic", lambda: now[0])
    lines = ProgressLines(total=10, done=4, desc="train", unit="step", every_s=30)  # resumed at step 4
    said = []
    for step in range(5, 11):
        now[0] += 10
        said.append(lines.advance({"loss": f"{1 / step:.2f}"} if step % 2 else None))  # the logged steps'
    assert said[0] == "train: step 5/10 (50%), loss 0.20; 0:00:10 elapsed, 0:00:50 left"
    assert said[1:3] == [None, None]  # 10 and 20 s after the first line: within the interval
    assert said[3] == "train: step 8/10 (80%), loss 0.14; 0:00:40 elapsed, 0:00:20 left"
    assert said[4] is None and said[5] == "train: step 10/10 (100%), loss 0.11; 0:01:00 elapsed, 0:00:00 left"


def test_the_log_counts_every_step_whatever_log_every(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bar (or the lines) reach the last step when the figures are logged every N steps."""
    from lmtune.training.callbacks import StepLogger

    monkeypatch.setattr("lmtune.outputs.runlog._draws_in_place", lambda stream: False)
    log = RunLog(read_dist_env("cpu"), tmp_path, progress=True)
    assert not log.progress and log.wants_progress
    log.start_progress(6)
    assert log._lines is not None
    logger = StepLogger(log, every=3, mfu=lambda *a: None, device=read_dist_env("cpu").device)
    monkeypatch.setattr("lmtune.training.callbacks.step_row", lambda *a: {})
    from types import SimpleNamespace

    for step in range(1, 7):
        end = SimpleNamespace(
            state=SimpleNamespace(step=step),
            finished=step == 6,
            result=SimpleNamespace(loss=1.0, tokens=10, examples=1, target_tokens=4, nonfinite=False),
            seconds=1.0,
            lr=1e-3,
        )
        logger.on_step_end(end, None)  # type: ignore[arg-type]
    assert log._lines.done == 6
    assert "train: step 6/6 (100%), loss 1.0000" in capsys.readouterr().out


def test_a_row_of_several_steps_holds_their_mean_loss_as_the_hf_trainers_logging_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--log-every N (HF's logging_steps) wrote its last step's loss under the name the HF Trainer
    gives the mean of the N steps' losses (TensorBoard's train/loss too); a step that was not
    finite (skipped under --on-nan skip) is left out of the mean."""
    from types import SimpleNamespace

    from lmtune.training.callbacks import StepLogger

    log = RunLog(read_dist_env("cpu"), tmp_path, progress=False)
    rows: list[dict[str, object]] = []
    monkeypatch.setattr(log, "record", rows.append)
    monkeypatch.setattr(
        "lmtune.training.callbacks.step_row", lambda step, *a: {"step": step.state.step, "loss": 0}
    )
    for every in (3, 1):
        rows.clear()
        logger = StepLogger(log, every=every, mfu=lambda *a: None, device=read_dist_env("cpu").device)
        for step, loss in enumerate([1.0, 2.0, 3.0, 4.0, float("nan"), 6.0, 7.0], start=1):
            result = SimpleNamespace(loss=loss, tokens=10, examples=1, target_tokens=4, nonfinite=step == 5)
            end = SimpleNamespace(
                state=SimpleNamespace(step=step), finished=step == 7, result=result, seconds=1.0, lr=1e-3
            )
            logger.on_step_end(end, None)  # type: ignore[arg-type]
        if every == 3:
            assert rows == [
                {"step": 3, "loss": 2.0, "loss_steps": 3, "step_loss": 3.0},
                {"step": 6, "loss": 5.0, "loss_steps": 2, "step_loss": 6.0},
                {"step": 7, "loss": 7.0, "loss_steps": 1, "step_loss": 7.0},
            ]
        else:  # each step's own row, as before
            assert [r["loss"] for r in rows] == [0] * 7


def test_a_steps_own_loss_is_read_back_from_a_row_of_several() -> None:
    """A run stopped after its last checkpoint and run again recorded the window's mean as its last
    loss (run.json's result, the card) where the step's own is recorded otherwise."""
    from lmtune.outputs.runlog import loss_at

    rows = [
        {"kind": "train", "step": 4, "loss": 2.5, "loss_steps": 4, "step_loss": 2.0},
        {"kind": "train", "step": 5, "loss": 1.5},  # --log-every 1: the step's own
    ]
    assert (loss_at(rows, 4), loss_at(rows, 5)) == (2.0, 1.5)
    assert loss_at(rows, 6) != loss_at(rows, 6)  # none: nan
