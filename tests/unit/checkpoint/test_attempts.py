"""How a resumed run records the attempts before it (lmtune.checkpoint.attempts)."""

from __future__ import annotations

import json
from pathlib import Path

from lmtune.checkpoint.attempts import attempts_line, earlier_attempts, finished_status, read_attempts


def _folder(tmp_path: Path, run: dict | None, steps: list[int]) -> Path:
    out = tmp_path / "out"
    (out / "checkpoints" / "step-4").mkdir(parents=True)
    if run is not None:
        (out / "run.json").write_text(json.dumps(run))
    rows = [{"kind": "train", "step": s, "loss": 1.0} for s in steps] + [{"kind": "eval", "step": 99}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_each_resume_adds_how_the_attempt_before_it_ended(tmp_path: Path) -> None:
    killed = _folder(tmp_path, {"resolved": {}}, [1, 2, 3, 4, 5, 6])  # no result: it never ended
    first = earlier_attempts(killed, killed / "checkpoints" / "step-4", 4)
    assert first == [{"ended": read_attempts(first)[0]["ended"], "last_step": 6, "resumed_from": 4}]
    assert first[0]["ended"].startswith("ended without a result")
    # The resumed attempt is stopped by a signal at step 8 (it saved there); the next resumes there.
    stopped = {"resolved": {"attempts": first}, "result": {"stopped_by": "signal", "steps": 8}}
    (killed / "run.json").write_text(json.dumps(stopped))
    with (killed / "metrics.jsonl").open("a") as f:
        f.write("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in (7, 8)))
    both = earlier_attempts(killed, killed / "checkpoints" / "step-4", 8)
    assert [a["ended"] for a in both] == [first[0]["ended"], "stopped by a signal"]
    assert [(a["last_step"], a["resumed_from"]) for a in both] == [(6, 4), (8, 8)]
    line = attempts_line(both)
    assert line.startswith("last logged step 6, ended without a result")
    assert line.endswith("; last logged step 8, stopped by a signal, resumed from step 8")
    assert finished_status(both) == "finished after 2 resumes"
    assert finished_status(both[:1]) == "finished after 1 resume"
    assert finished_status(None) == "finished"
    # Its steps all run, killed while it wrote final/: a result without the step final/ holds.
    (killed / "run.json").write_text(json.dumps({"result": {"stopped_by": None, "steps": 8}}))
    assert earlier_attempts(killed, killed / "checkpoints" / "step-4", 8)[-1]["ended"] == first[0]["ended"]
    (killed / "run.json").write_text(json.dumps({"result": {"stopped_by": None, "final_step": 8}}))
    assert earlier_attempts(killed, killed / "checkpoints" / "step-4", 8)[-1]["ended"] == "finished"


def test_a_fresh_run_or_another_folders_checkpoint_has_no_earlier_attempt(tmp_path: Path) -> None:
    out = _folder(tmp_path, {"result": {"stopped_by": None}}, [1, 2])
    assert earlier_attempts(out, None, 0) == []
    other = tmp_path / "other" / "checkpoints" / "step-2"
    other.mkdir(parents=True)
    assert earlier_attempts(out, other, 2) == []


def test_attempts_read_from_a_crafted_run_json_keep_only_their_shape(tmp_path: Path) -> None:
    crafted = [
        {"ended": "finished", "last_step": 3, "resumed_from": 3},
        {"ended": "<script>", "last_step": 3, "resumed_from": 3},
        {"ended": "stopped", "last_step": "3", "resumed_from": 3},
        {"ended": "stopped", "last_step": None, "resumed_from": True},
        "stopped",
    ]
    assert read_attempts(crafted) == [crafted[0]]
    assert read_attempts({"ended": "finished"}) == []
    # An unreadable run.json (killed before its first record) is still an attempt that ended.
    out = _folder(tmp_path, None, [])
    (out / "run.json").write_text("{not json")
    (out / "metrics.jsonl").unlink()
    (only,) = earlier_attempts(out, out / "checkpoints" / "step-4", 4)
    assert only["last_step"] is None and only["ended"].startswith("ended without a result")
    assert attempts_line([only]) == f"{only['ended']}, resumed from step 4"


def test_an_edited_result_record_reads_as_none_not_a_traceback() -> None:
    """run.json's result read back for a finished run called again (``TrainResult``): JSON's
    ``Infinity`` and huge numbers raised OverflowError out of ``lmtune.train``."""
    from lmtune.training.finish import recorded_outcome, recorded_result

    best = {"step": 3, "metric": "eval_loss", "value": 0.5, "checkpoint": "checkpoints/step-3"}
    assert recorded_outcome({"best": best})["best"].step == 3
    for edited in ({"step": float("inf")}, {"value": 10**400}):
        assert recorded_outcome(json.loads(json.dumps({"best": best | edited})))["best"] is None
    assert recorded_result({"last_loss": 10**400})[0] != recorded_result({"last_loss": 10**400})[0]  # nan
