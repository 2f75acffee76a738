"""The attempts of a run before the one that resumed it: how each ended and where the next one took
up, read from the folder's run.json and metrics.jsonl before the resumed run replaces them
(run.json's ``resolved.attempts``; ``lmtune report`` and the model card say it, where a finished
run read as if it had run through at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmtune.checkpoint.layout import checkpoint_of
from lmtune.config.files import is_int, read_json_object
from lmtune.errors import UserError
from lmtune.outputs.runlog import read_metrics

# How an attempt ended, by its run.json: ``result.stopped_by`` where it has a result.
ENDINGS = {
    "signal": "stopped by a signal",
    "early_stopping": "stopped early",
    None: "finished",
}
NO_RESULT = "ended without a result (killed, failed, or its machine stopped)"
OTHER_END = "stopped"  # a result whose stopped_by is none of ENDINGS'
MOST_KEPT = 100  # a run resumed more often keeps its newest attempts (run.json stays small)


def earlier_attempts(output_dir: Path, resumed_from: Path | None, step: int) -> list[dict[str, Any]]:
    """The attempts before this one, oldest first, each ``{"ended", "last_step", "resumed_from"}``
    (``last_step``: its last step in metrics.jsonl, None where it logged none). Empty for a run
    that starts fresh, or continues another folder's checkpoint (another run's attempts)."""
    if resumed_from is None or not checkpoint_of(resumed_from, output_dir):
        return []
    try:
        info = read_json_object(output_dir / "run.json")
    except (UserError, OSError):  # killed before its first record: its attempt is still one
        info = {}
    resolved, result = info.get("resolved"), info.get("result")
    earlier = read_attempts(resolved.get("attempts")) if isinstance(resolved, dict) else []
    ended = ENDINGS.get(result.get("stopped_by"), OTHER_END) if isinstance(result, dict) else NO_RESULT
    if isinstance(result, dict) and ended == ENDINGS[None] and "final_step" not in result:  # killed in final/
        ended = NO_RESULT
    try:
        steps = [row["step"] for row in read_metrics(output_dir) if is_int(row.get("step"))]
    except (UserError, OSError):  # none (a checkpoint copied in), or unreadable: no step to name
        steps = []
    this = {"ended": ended, "last_step": max(steps, default=None), "resumed_from": step}
    return [*earlier, this][-MOST_KEPT:]


def read_attempts(entries: Any) -> list[dict[str, Any]]:
    """The attempts a run.json records (read as hostile data: what is not of their shape is left out)."""
    if not isinstance(entries, list):
        return []
    return [
        {"ended": e["ended"], "last_step": e.get("last_step"), "resumed_from": e["resumed_from"]}
        for e in entries[-MOST_KEPT:]
        if isinstance(e, dict)
        and e.get("ended") in [*ENDINGS.values(), NO_RESULT, OTHER_END]
        and (e.get("last_step") is None or is_int(e.get("last_step")))
        and is_int(e.get("resumed_from"))
    ]


def attempts_line(entries: Any) -> str:
    """``last logged step 37, ended without a result (...), resumed from step 30; ...``, from a
    run.json's ``resolved.attempts``; "" where the run ran through at once."""
    return "; ".join(
        (f"last logged step {a['last_step']}, " if a["last_step"] is not None else "")
        + f"{a['ended']}, resumed from step {a['resumed_from']}"
        for a in read_attempts(entries)
    )


def finished_status(entries: Any) -> str:
    """A finished run's status: ``finished``, or ``finished after 2 resumes``."""
    resumes = len(read_attempts(entries))
    return f"finished after {resumes} resume{'s' if resumes > 1 else ''}" if resumes else "finished"
