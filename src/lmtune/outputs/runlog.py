"""Rank-zero output: the progress bar, messages, and the metrics.jsonl / run.json files.

Every rank builds a :class:`RunLog`; on ranks other than 0 each method does nothing, so callers
never branch on the rank themselves.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from tqdm import tqdm

from lmtune.config.files import read_bytes
from lmtune.data.mixture import SourceIndex
from lmtune.outputs.reporters import Reporter
from lmtune.parallel.distributed import DistEnv

METRICS_BYTES = 1 << 30  # a million steps of rows


class InfoLog(Protocol):
    """What a component needs of the run's log: a line for the user (rank 0 prints it)."""

    def info(self, message: str) -> None: ...


def open_jsonl(path: Path, keep_through_step: int) -> Any:
    """Open a per-step JSONL file for appending, dropping rows after ``keep_through_step``.

    Rows after the checkpoint a run resumes from were written by the attempt that died; the
    resumed run writes them again.
    """
    kept: list[str] = []
    if keep_through_step > 0 and path.is_file():
        for row, line in _rows(path):
            if row is None:
                break  # a line cut off by the crash ends what can be kept
            step = row.get("step", 0)
            if isinstance(step, int) and step <= keep_through_step:
                kept.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("w", encoding="utf-8")
    f.writelines(line + "\n" for line in kept)
    f.flush()
    return f


class ExampleOrderLog:
    """samples/rank-R.jsonl: the example ids each optimizer step consumed on this rank, and with a
    mixture (``sources``) the source each came from."""

    def __init__(self, output_dir: Path, rank: int, resume_step: int, sources: SourceIndex | None = None):
        self._file = open_jsonl(output_dir / "samples" / f"rank-{rank}.jsonl", resume_step)
        self._sources = sources

    def __call__(self, step: int, example_ids: list[int]) -> None:
        row: dict[str, Any] = {"step": step, "ids": example_ids}
        if self._sources is not None:
            row["sources"] = [self._sources.name(i) for i in example_ids]
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class RunLog:
    def __init__(self, env: DistEnv, output_dir: Path, progress: bool):
        self.active = env.is_main
        self.output_dir = output_dir
        self.progress = progress and self.active
        self._bar: tqdm[Any] | None = None
        self._metrics: Any = None
        self._reporters: list[Reporter] = []
        if self.active:
            output_dir.mkdir(parents=True, exist_ok=True)

    def open_metrics(self, resume_step: int) -> None:
        """Start metrics.jsonl; a resumed run keeps the rows up to its checkpoint and appends."""
        if self.active:
            self._metrics = open_jsonl(self.output_dir / "metrics.jsonl", resume_step)

    def __enter__(self) -> RunLog:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def add_reporters(self, reporters: list[Reporter]) -> None:
        """Outputs that get every row metrics.jsonl gets (--report-to), from now on."""
        self._reporters += reporters

    def close(self) -> None:
        self.end_progress()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        for reporter in self._reporters:
            reporter.close()
        self._reporters = []

    def info(self, message: str) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def start_progress(self, total: int, initial: int = 0, desc: str = "train", unit: str = "step") -> None:
        if self.progress:
            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True)

    def end_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def record(self, row: dict[str, Any]) -> None:
        """Append one JSON object to metrics.jsonl."""
        if self._metrics is not None:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()
        for reporter in list(self._reporters):
            try:
                reporter.write(row)
            except Exception as e:  # a dashboard that fails must not end the training it reports on
                self._reporters.remove(reporter)
                self.info(f"warning: {type(reporter).__name__} stopped: {type(e).__name__}: {e}")

    def advance(self, postfix: dict[str, str] | None = None) -> None:
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        if self.active:
            path = self.output_dir / name
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
            tmp.replace(path)


def read_metrics(output_dir: Path, kind: str | None = "train") -> list[dict[str, Any]]:
    """The rows of one kind ("train", "eval", "sample"; None: all) of a run's metrics.jsonl."""
    rows = [row for row, _ in _rows(output_dir / "metrics.jsonl") if row is not None]
    return [r for r in rows if isinstance(r.get("kind"), str) and (kind is None or r["kind"] == kind)]


def _rows(path: Path) -> Iterator[tuple[dict[str, Any] | None, str]]:
    """(row, line) of a JSONL file lmtune wrote (a regular file, not a link); row None where a line
    is not a JSON object (cut off by a crash, or edited)."""
    text = read_bytes(path, limit=METRICS_BYTES, follow_links=False).decode("utf-8", "replace")
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            row = None
        yield (row if isinstance(row, dict) else None), line


def tokens_per_second(train_rows: list[dict[str, Any]], warmup: int = 0) -> float:
    """Tokens per second of wall time over the steps after the first ``warmup`` ones."""
    timed = train_rows[warmup:]
    start = train_rows[warmup - 1]["elapsed_s"] if warmup else 0.0
    return float(sum(r["tokens"] for r in timed) / (timed[-1]["elapsed_s"] - start))
