"""The runs `lmtune report` reads: a run folder's rows and run.json, read as hostile data (a line
cut off mid-write is left out; a file that is not lmtune's is said to be no run)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lmtune.config.files import RUN_RECORD_BYTES, decode_json, read_bytes, read_json
from lmtune.errors import UserError, brief
from lmtune.outputs.reporters import is_number
from lmtune.outputs.runlog import row_problem
from lmtune.parallel.launch import warn


@dataclass
class RecordedRun:
    name: str
    folder: Path
    rows: list[dict[str, Any]]
    info: dict[str, Any] = field(default_factory=dict)  # run.json; {} when not written yet

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("kind") == kind]

    def series(self, key: str, kind: str = "train") -> tuple[list[float], list[float]]:
        """(steps, values) where ``key`` has a number."""
        points = [(r["step"], r[key]) for r in self.kind(kind) if is_number(r.get(key))]
        return [float(s) for s, _ in points], [float(v) for _, v in points]


METRICS_BYTES = 1 << 30


def load_run(folder: Path) -> RecordedRun:
    """A run folder's rows and run.json, read as hostile data: only regular files, with size caps;
    a row that is not what lmtune writes is skipped with a warning, never a traceback."""
    metrics = folder / "metrics.jsonl"
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder" if not folder.exists() else f"{folder}: not a folder")
    if not metrics.is_file():
        # RUN/final or RUN/checkpoints/step-N given for RUN.
        run = next((f for f in list(folder.parents)[:2] if (f / "metrics.jsonl").is_file()), None)
        inside = f"; it is inside the run {run}: give that folder" if run is not None else ""
        raise UserError(
            f"{folder}: no metrics.jsonl, so not an lmtune output folder (or not started){inside}"
        )
    try:
        text = read_bytes(metrics, limit=METRICS_BYTES, follow_links=False).decode("utf-8", "replace")
    except FileNotFoundError:
        raise UserError(f"{metrics}: disappeared while being read") from None
    rows, skipped = [], []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        try:
            row = decode_json(line, f"{metrics}:{number}")
        except UserError as e:
            if number < len(lines):  # the last line may be the one being written as the file was read
                skipped.append(str(e))
            continue
        problem = row_problem(row)
        if problem:
            skipped.append(f"{metrics}:{number}: {problem}")
        else:
            rows.append(row)
    if not rows and not (folder / "run.json").is_file() and text.strip():
        # One line, the last, was taken for a row being written: "hello" was reported as a run.
        first = brief(skipped[0], 200) if skipped else f"{metrics}:{len(lines)}: {brief(lines[-1], 80)}"
        raise UserError(
            f"{folder}: its metrics.jsonl holds no row lmtune writes (first: {first}), so not an lmtune "
            "output folder"
        )
    if skipped:
        warn(f"skipped {len(skipped)} rows that are not what lmtune writes (first: {brief(skipped[0], 200)})")
    return RecordedRun(name=folder.resolve().name, folder=folder, rows=rows, info=_run_info(folder))


def _run_info(folder: Path) -> dict[str, Any]:
    """run.json's sections as the report reads them ({} when absent or unreadable, with a warning)."""
    path = folder / "run.json"
    try:
        loaded: Any = read_json(path, limit=RUN_RECORD_BYTES)
    except FileNotFoundError:
        return {}
    except UserError as e:
        warn(f"{e}; reporting without it")
        return {}
    info = {k: v for k, v in loaded.items() if isinstance(v, dict)} if isinstance(loaded, dict) else {}
    info["data"] = {k: v for k, v in info.get("data", {}).items() if isinstance(v, dict)}
    return info


def settings_of(run: RecordedRun) -> dict[str, Any]:
    """The run's settings, an unset one (None: lmtune chose) by the value the run resolved (its lr
    read "null" where the run trained at 0.001)."""
    config, resolved = run.info.get("config") or {}, run.info.get("resolved") or {}
    return {k: resolved.get(k) if v is None and k in resolved else v for k, v in config.items()}


def named_apart(runs: list[RecordedRun]) -> list[RecordedRun]:
    """Runs whose folders share a name (runs/mix, other/mix) named by as much of their path as
    tells them apart: the legends and tables showed two runs of one name."""
    paths = [run.folder.resolve().parts for run in runs]

    def name(i: int) -> str:
        for depth in range(1, len(paths[i]) + 1):
            if sum(p[-depth:] == paths[i][-depth:] for p in paths) == 1:
                return "/".join(paths[i][-depth:])
        return runs[i].name

    return [replace(run, name=name(i)) for i, run in enumerate(runs)]


def load_runs(folders: list[Path]) -> list[RecordedRun]:
    """Each folder's run, named apart; a run given twice (by any spelling) is refused: it was
    overlaid on itself."""
    seen: dict[Path, Path] = {}
    for f in folders:
        if (earlier := seen.setdefault(f.resolve(), f)) is not f:
            said = f"{f} and {earlier} are one run" if str(f) != str(earlier) else f"{f} is named twice"
            raise UserError(f"{said}; give each run once")
    return named_apart([load_run(f) for f in folders])
