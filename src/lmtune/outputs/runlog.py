"""Rank-zero output: the progress bar, messages, and the metrics.jsonl / run.json files.

Every rank builds a :class:`RunLog`; on ranks other than 0 each method does nothing, so callers
never branch on the rank themselves.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from tqdm import tqdm

from lmtune.config.files import read_bytes
from lmtune.data.mixture import SourceIndex
from lmtune.errors import NoSpace, brief, out_of_space
from lmtune.outputs.reporters import Reporter
from lmtune.parallel.distributed import DistEnv

METRICS_BYTES = 1 << 30  # a million steps of rows


class InfoLog(Protocol):
    """What a component needs of the run's log: a line for the user (rank 0 prints it)."""

    def info(self, message: str) -> None: ...


def open_jsonl(path: Path, keep_through_step: int, redone: str | None = None) -> Any:
    """Open a per-step JSONL file for appending, dropping rows after ``keep_through_step`` (and
    its rows of kind ``redone``).

    Rows after the checkpoint a run resumes from were written by the attempt that died; the
    resumed run writes them again. So are the final evaluation's, written after the last step's
    checkpoint: an attempt killed while writing final/ had logged them.
    """
    kept: list[str] = []
    if keep_through_step > 0 and path.is_file():
        for row, line in _rows(path):
            if row is None:
                break  # a line cut off by the crash ends what can be kept
            step = row.get("step", 0)
            again = redone is not None and row.get("kind") == redone and step == keep_through_step
            if isinstance(step, int) and step <= keep_through_step and not again:
                kept.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    f = path.open("w", encoding="utf-8")
    f.writelines(line + "\n" for line in kept)
    f.flush()
    return f


def append_line(f: Any, line: str) -> None:
    """Append ``line`` to a file :func:`open_jsonl` opened, now (a crash keeps what was written).

    Raises:
        NoSpace: the disk is full; ``f`` is closed (what it could not write would fail again) and
            cut back to its last whole line (a reader would meet half a row).
    """
    whole = os.fstat(f.fileno()).st_size
    try:
        f.write(line + "\n")
        f.flush()
    except OSError as e:
        if not out_of_space(e):
            raise
        with suppress(OSError):
            f.close()
        with suppress(OSError):
            os.truncate(f.name, whole)
        raise NoSpace(f"no space left on device while writing {f.name}", Path(f.name)) from None


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
        append_line(self._file, json.dumps(row))

    def close(self) -> None:
        self._file.close()


@dataclass
class ProgressLines:
    """Progress where a bar cannot be redrawn (a job's log file, a pipe): a line at the first step,
    then at most one every ``every_s`` seconds, and at the last."""

    total: int
    done: int
    desc: str
    unit: str
    every_s: float = 30.0
    shown: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=lambda: time.monotonic())
    last: float = -math.inf

    def __post_init__(self) -> None:
        self.first = self.done

    def advance(self, postfix: dict[str, str] | None) -> str | None:
        """The line to print after one more step, or None."""
        self.done += 1
        self.shown = postfix or self.shown
        now = time.monotonic()
        if now - self.last < self.every_s and self.done < self.total:
            return None
        self.last = now
        elapsed = now - self.started
        left = (self.total - self.done) * elapsed / max(self.done - self.first, 1)
        figures = "".join(f", {k} {v}" for k, v in self.shown.items())
        share = 100 * self.done / max(self.total, 1)
        return (
            f"{self.desc}: {self.unit} {self.done:,}/{self.total:,} ({share:.0f}%){figures}; "
            f"{_clock(elapsed)} elapsed, {_clock(left)} left"
        )


def _clock(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{s:02d}"


def _draws_in_place(stream: Any) -> bool:
    """Whether a progress bar on ``stream`` is redrawn in place: a terminal, or a stream with no
    file behind it (a notebook's). In a file or a pipe (a job's log) each redraw would be kept, one
    long line of them; the step lines say the progress there."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return True
    return os.isatty(fd)


class RunLog:
    def __init__(self, env: DistEnv, output_dir: Path, progress: bool):
        self.active = env.is_main
        self.output_dir = output_dir
        self.wants_progress = progress and self.active
        self.progress = self.wants_progress and _draws_in_place(sys.stderr)  # a bar, else lines
        self._bar: tqdm[Any] | None = None
        self._lines: ProgressLines | None = None
        self._metrics: Any = None
        self._reporters: list[Reporter] = []
        if self.active:
            output_dir.mkdir(parents=True, exist_ok=True)

    def open_metrics(self, resume_step: int, last: bool = False) -> None:
        """Start metrics.jsonl; a resumed run keeps the rows up to its checkpoint and appends (less
        the final evaluation's where it resumes from the ``last`` step's: it is evaluated again)."""
        if self.active:
            redone = "eval" if last else None
            self._metrics = open_jsonl(self.output_dir / "metrics.jsonl", resume_step, redone)

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
            with suppress(OSError):  # flushed at every row: a failure here repeats one already raised
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
        elif self.wants_progress:
            self._lines = ProgressLines(total, initial, desc, unit)

    def end_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._lines = None

    def record(self, row: dict[str, Any]) -> None:
        """Append one JSON object to metrics.jsonl."""
        if self._metrics is not None:
            append_line(self._metrics, json.dumps(row))
        for reporter in list(self._reporters):
            try:
                reporter.write(row)
            except Exception as e:  # a dashboard that fails must not end the training it reports on
                self._reporters.remove(reporter)
                self.info(f"warning: {type(reporter).__name__} stopped: {type(e).__name__}: {e}")

    def advance(self, postfix: dict[str, str] | None = None) -> None:
        """One more step (or batch) done; ``postfix``: the figures to show with it, when new."""
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)
        if self._lines is not None and (line := self._lines.advance(postfix)) is not None:
            print(line, flush=True)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        if self.active:
            path = self.output_dir / name
            # A name of its own, created anew: `run.tmp` beside it may be a user's file.
            tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(json.dumps(payload, indent=2) + "\n")
            except OSError as e:
                tmp.unlink(missing_ok=True)
                if out_of_space(e):
                    raise NoSpace(f"no space left on device while writing {path}", path) from None
                raise
            tmp.replace(path)


def read_metrics(output_dir: Path, kind: str | None = "train") -> list[dict[str, Any]]:
    """The rows of one kind ("train", "eval", "sample"; None: all) of a run's metrics.jsonl."""
    rows = [row for row, _ in _rows(output_dir / "metrics.jsonl") if row is not None]
    return [r for r in rows if isinstance(r.get("kind"), str) and (kind is None or r["kind"] == kind)]


def own_loss(row: dict[str, Any]) -> Any:
    """A train row's own step's loss: ``step_loss`` in a row of several steps (--log-every N), whose
    ``loss`` is their mean."""
    return row.get("step_loss", row.get("loss"))


def loss_at(rows: list[dict[str, Any]], step: int) -> float:
    """The training loss of step ``step`` as ``rows`` (metrics.jsonl's) logged it (:func:`own_loss`);
    nan where none is."""
    logged = [own_loss(r) for r in rows if r.get("kind") == "train" and r.get("step") == step]
    losses = [float(loss) for loss in logged if isinstance(loss, (int, float))]
    return losses[-1] if losses else float("nan")


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


MAX_MAGNITUDE = 1e18  # a measurement past this is an edited row (and would overflow a plot's scale)


def row_problem(row: Any) -> str:
    """Why a metrics row cannot be drawn ("" when it can): a step count, a known kind, and numbers
    (or null) wherever lmtune writes a measurement."""
    if not isinstance(row, dict):
        return "not a JSON object"
    step = row.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= 2**53:
        return f"step {brief(step)} is not a step count"
    if row.get("kind") not in ("train", "eval", "sample"):
        return f"unknown kind {brief(row.get('kind'))}"
    for key, value in row.items():
        if key in ("kind", "step", "prompt", "completion", "stopped") or value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        too_large = number and math.isfinite(value) and abs(value) > MAX_MAGNITUDE
        if too_large or (not number and key in _MEASURED):
            return f"{key} {brief(value)} is not a measurement"
    return ""


# What the plots and tables read from rows: numbers when present.
_MEASURED = {
    *("loss", "lr", "grad_norm", "tokens", "target_tokens", "tokens_per_s", "mfu", "peak_memory_bytes"),
    *("eval_loss", "eval_perplexity", "eval_tokens", "eval_examples", "elapsed_s", "epoch"),
    *("step_time_min_s", "step_time_max_s", "data_wait_max_s"),
}
