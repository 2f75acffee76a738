"""Run health: per-rank heartbeats, the launcher's hang watchdog, and straggler detection.

Each rank records its step and phase with a timestamp at every phase boundary into a small
memory-mapped file (a store of a few bytes, no system call, no collective). The launcher that
started the ranks reads those files; when the rank that stopped advancing first (the one furthest
behind) has not moved for ``--hang-timeout`` (at least; 10 x the slowest step so far), it writes a
diagnosis (which rank, which phase of which step, for how long, what the others do, the stuck
ranks' Python stacks where they can be had) to the log and OUTPUT/hang-report.txt and ends the
workers, so the job exits with code 3 or, under --max-restarts, restarts from its last checkpoint.
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import statistics
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from lmtune.config import environment
from lmtune.parallel.launched import proc_stat

HEALTH_DIR_ENV = environment.HEALTH_DIR
HANG_EXIT_CODE = 3
HANG_REPORT = "hang-report.txt"
# The report's first line: a file of that name without it is the user's, never written over.
HANG_REPORT_HEAD = "lmtune hang report\n"
PHASES = (
    "start",
    "load",
    "data-prep",
    "data",
    "forward",
    "backward",
    "optimizer",
    "eval",
    "save",
    "sample",
    "done",
    "upload",
)
# Not watched: how long loading a model, tokenizing or uploading to the hub takes is not a hang
# (each has its own bound: huggingface_hub times out and retries on its own).
UNWATCHED = {"start", "load", "data-prep", "done", "upload"}
# The order a step runs its watched phases in (lmtune.training.loop): the samples (rank 0 alone,
# one beat) before the evaluation (every rank, a beat per batch) before the save. PHASES is the
# heartbeat file's encoding, not this order.
_STEP_ORDER = {
    phase: i for i, phase in enumerate(("data", "forward", "backward", "optimizer", "sample", "eval", "save"))
}
# Watched with a longer bound: the first step (compilation, warm-up) and saving (a large checkpoint
# is one long write); generating samples is bounded by its own budget (lmtune.training.samples).
# Evaluation beats at every batch, so it is watched like a step.
LONG = {"save"}
LONG_GRACE_S = 600.0
SAMPLE_GRACE_S = 180.0
_RECORD = struct.Struct("<qiid")  # step, phase, pid, wall time


class Heartbeat:
    """This rank's step and phase for the launcher's watchdog; a no-op without a health folder."""

    def __init__(self, folder: Path | None, rank: int):
        self.step = 0  # the optimizer step in progress, from 1; 0 before training
        self._map: mmap.mmap | None = None
        self._stacks: IO[str] | None = None
        if folder is None:
            return
        path = folder / f"rank-{rank}.hb"
        path.write_bytes(bytes(_RECORD.size))
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), _RECORD.size)
        # SIGUSR1 from the watchdog: every thread's Python stack, written even while this process
        # waits inside a collective (faulthandler writes from its C signal handler).
        self._stacks = (folder / f"rank-{rank}.stacks").open("w", encoding="utf-8")
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        self.beat("start")

    @classmethod
    def from_env(cls, rank: int) -> Heartbeat:
        return cls(environment.folder(HEALTH_DIR_ENV, must_exist=True), rank)

    def beat(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        if self._map is not None:
            _RECORD.pack_into(self._map, 0, self.step, PHASES.index(phase), os.getpid(), time.time())

    def close(self) -> None:
        if self._map is not None:
            self.beat("done")
            faulthandler.unregister(signal.SIGUSR1)
            self._map.close()
            self._map = None
        if self._stacks is not None:
            self._stacks.close()
            self._stacks = None


@dataclass(frozen=True)
class Beat:
    rank: int
    step: int
    phase: str
    pid: int
    time: float


def read_beats(folder: Path) -> dict[int, Beat]:
    beats = {}
    for path in folder.glob("rank-*.hb"):
        try:
            rank = int(path.stem.split("-")[1])
            step, phase, pid, t = _RECORD.unpack(path.read_bytes()[: _RECORD.size])
        except (OSError, ValueError, struct.error):
            continue
        if pid > 0 and 0 <= phase < len(PHASES) and abs(time.time() - t) < 86400:  # not half-written
            beats[rank] = Beat(rank=rank, step=step, phase=PHASES[phase], pid=pid, time=t)
    return beats


def ended_ranks() -> list[int]:
    """This node's ranks whose processes have ended (their heartbeats' pids gone, or zombies): the
    launcher stops the rest of the job when one does."""
    folder = os.environ.get(HEALTH_DIR_ENV)
    if not folder:
        return []
    return sorted(b.rank for b in read_beats(Path(folder)).values() if _process_state(b.pid) in ("?", "Z"))


def _process_state(pid: int) -> str:
    """R, S, D, T (stopped), Z, ... from /proc; "?" where it cannot be read."""
    try:
        return proc_stat(pid)[0]
    except (OSError, IndexError):
        return "?"


@dataclass
class Watchdog:
    """Watches the heartbeats of this node's ranks from the launcher (a thread of its own)."""

    folder: Path
    output_dir: Path
    floor_s: float  # --hang-timeout
    on_hang: Callable[[], None]  # after the report: end the workers
    slowest_step_s: float = 0.0
    hangs: int = 0
    _last: dict[int, tuple[int, int, float]] = field(default_factory=dict)  # rank -> (pid, step, since)
    started: float = field(default_factory=time.time)  # a report written since is this job's

    def limit(self, beat: Beat) -> float:
        base = max(self.floor_s, 10 * self.slowest_step_s)
        if beat.phase in LONG or beat.step <= 1:
            return max(base, LONG_GRACE_S)
        return max(base, SAMPLE_GRACE_S) if beat.phase == "sample" else base

    def observe(self, beats: dict[int, Beat]) -> None:
        """Learn step durations from the steps the ranks reach."""
        for rank, b in beats.items():
            pid, step, since = self._last.get(rank, (0, -1, b.time))
            if pid != b.pid:  # a new attempt of this rank
                self._last[rank] = (b.pid, b.step, b.time)
                continue
            if b.step > step:
                if step >= 2:  # the first step (warm-up) is no measure
                    self.slowest_step_s = max(self.slowest_step_s, (b.time - since) / (b.step - step))
                self._last[rank] = (pid, b.step, b.time)

    def check(self, now: float) -> str | None:
        """The diagnosis when the job is stuck, else None."""
        beats = {r: b for r, b in read_beats(self.folder).items() if _process_state(b.pid) not in ("?", "Z")}
        self.observe(beats)
        watched = [b for b in beats.values() if b.phase not in UNWATCHED]
        if not watched or any(b.phase in UNWATCHED and b.phase != "done" for b in beats.values()):
            return None
        # The rank that stopped advancing first: the one furthest behind (the others wait for it in a
        # collective), by its last beat's time only between equals. By time alone, on a crowded
        # machine a rank that beat "backward" before the stuck one was scheduled to beat "forward"
        # was named instead.
        first = min(watched, key=lambda b: (b.step, _STEP_ORDER.get(b.phase, len(_STEP_ORDER)), b.time))
        if now - first.time <= self.limit(first):
            return None
        return diagnose(first, beats, now, self.limit(first))

    def run(self, ended: threading.Event) -> None:
        while not ended.wait(0.5):
            diagnosis = self.check(time.time())
            if diagnosis is None:
                continue
            self.hangs += 1
            traces = self.output_dir / "comm-traces"
            if traces.is_dir() and any(traces.iterdir()):  # NCCL's flight recorder dumped
                diagnosis += f"\nNCCL flight recorder dumps: {traces} (analyse: torchfrtrace {traces} -j)"
            report = diagnosis + "\n" + _stacks(self.folder, read_beats(self.folder))
            path = self.output_dir / HANG_REPORT
            try:
                if users_hang_report(path):  # put there since the run started
                    raise OSError(f"{path} is not lmtune's report; it is kept")
                if path.is_file() and path.stat().st_mtime >= self.started:  # another node's, this job's
                    with path.open("a", encoding="utf-8") as f:  # each node watches its own ranks
                        f.write("\n" + report)
                else:
                    path.write_text(HANG_REPORT_HEAD + report, encoding="utf-8")
                where = f"{path}"
            except OSError as e:
                where = f"(could not write {path}: {e})"
            print(f"lmtune: {diagnosis}\nlmtune: the full report with stacks: {where}", flush=True)
            self.on_hang()
            self._last.clear()
            ended.wait(5.0)  # the workers end (or restart) before the next look


def users_hang_report(path: Path) -> bool:
    """Whether ``path`` is something other than lmtune's hang report (a user's file of that name,
    a folder, a link): never written over."""
    if not path.exists() and not path.is_symlink():
        return False
    if path.is_symlink() or not path.is_file():
        return True
    try:
        with path.open("rb") as f:
            return f.read(len(HANG_REPORT_HEAD)) != HANG_REPORT_HEAD.encode()
    except OSError:
        return True


def diagnose(first: Beat, beats: dict[int, Beat], now: float, limit: float) -> str:
    states = {b.rank: _process_state(b.pid) for b in beats.values()}
    # A stopped process is the cause wherever it is; else the rank that stopped advancing first.
    stopped = sorted(r for r, state in states.items() if state == "T")
    stuck = stopped or [first.rank]
    ago, where = f"{now - first.time:.0f} s", f"step {first.step}, phase {first.phase}"
    verb = "is" if len(stopped) == 1 else "are"
    cause = (
        f"{', '.join(f'rank {r}' for r in stopped)} {verb} stopped by a signal, and nothing has advanced "
        f"for {ago}, since {where}"
        if stopped
        else f"rank {first.rank} stopped advancing first, {ago} ago in {where}"
    )
    lines = [f"the job is stuck: {cause} (limit {limit:.0f} s; --hang-timeout sets its floor)"]
    for b in sorted(beats.values(), key=lambda b: b.rank):
        what = {
            "T": "stopped by a signal (SIGSTOP, a debugger): it cannot dump its stack",
            "D": "in an uninterruptible wait (I/O)",
        }.get(states[b.rank], "running")
        waiting = "" if b.rank in stuck else " (waiting for the stuck rank, probably in a collective)"
        lines.append(
            f"  rank {b.rank} (pid {b.pid}): step {b.step}, {b.phase}, "
            f"last heartbeat {now - b.time:.0f} s ago; {what}{waiting}"
        )
    return "\n".join(lines)


def _stacks(folder: Path, beats: dict[int, Beat]) -> str:
    """Every running rank's Python stacks (faulthandler on SIGUSR1); stopped ones cannot answer."""
    asked = []
    for b in beats.values():
        if _process_state(b.pid) not in ("T", "Z", "?"):
            try:
                os.kill(b.pid, signal.SIGUSR1)
                asked.append(b)
            except OSError:
                pass
    time.sleep(2.0 if asked else 0.0)
    parts = []
    for b in sorted(beats.values(), key=lambda b: b.rank):
        path = folder / f"rank-{b.rank}.stacks"
        text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
        if b not in asked:
            text = "(no stack: the process is stopped or gone)\n"
        parts.append(f"--- rank {b.rank} (pid {b.pid}) ---\n{text}")
    return "\n".join(parts)


@dataclass
class StragglerWatch:
    """Names a rank once when its step time is over 20% above the median for 20 steps in a row."""

    ratio: float = 1.2
    steps: int = 20
    _streak: dict[int, int] = field(default_factory=dict)
    _named: set[int] = field(default_factory=set)

    def observe(self, times: list[float]) -> list[int]:
        """Per-rank step times of one step -> ranks to name now."""
        if len(times) < 2:
            return []
        median = statistics.median(times)
        named = []
        for rank, t in enumerate(times):
            slow = median > 0 and t > self.ratio * median
            self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
            if self._streak[rank] >= self.steps and rank not in self._named:
                self._named.add(rank)
                named.append(rank)
        return named
