"""What the launcher says when a worker of its job failed: the messages the workers reported (each
once), else the rank that ended first and how; a worker killed by the kernel's out-of-memory killer
is named as such, with what to lower."""

from __future__ import annotations

import json
import logging
import re
import signal
import sys
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from lmtune.errors import USER_ERROR_EXIT_CODE
from lmtune.parallel.health import HANG_EXIT_CODE


def reported_errors(error_dir: Path) -> list[tuple[str, int]]:
    """(message, exit code) of every worker that reported one, by rank (not those that only lost
    their connection to another: :func:`lost_connections`)."""
    return [(r["message"], int(r["exit_code"])) for r in _reports(error_dir).values() if not r.get("lost")]


def lost_connections(error_dir: Path) -> dict[int, str]:
    """rank -> message, of the workers whose collective failed because another rank had gone."""
    return {rank: r["message"] for rank, r in _reports(error_dir).items() if r.get("lost")}


def _reports(error_dir: Path) -> dict[int, dict[str, Any]]:
    found = sorted(error_dir.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    reports = {}
    for p in found:
        try:
            reports[int(p.stem.split("-")[1])] = json.loads(p.read_text(encoding="utf-8"))
        except ValueError:  # being written right now
            continue
    return reports


# What a job that ended this way has (a checkpoint may not have been saved yet: it said "are kept").
RESUMES = (
    "any checkpoint in --output-dir is kept, and the same command (on every node) resumes from the "
    "newest, or starts again where none was saved"
)

# A restart this node began, which another node's launcher ended by leaving the job.
CLOSED_ELSEWHERE = (
    "another node ended the job while this node was starting it again (that node's --max-restarts were "
    f"used up, or it stopped), and its output says why; {RESUMES}"
)

# What gloo and NCCL say when the other end of a collective has gone (its process ended or was
# killed, its node went down).
_LOST = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|ncclRemoteError|remote process exited", re.IGNORECASE
)


def lost_connection(e: BaseException, rank: int) -> str | None:
    """The line for ``e`` where it is a collective that failed because another rank had gone, else
    None: the cause is that rank's (its own output says why), not this one's."""
    found = _LOST.search(str(e))
    if found is None:
        return None
    return (
        f"rank {rank} lost its connection to another rank of the job ({found.group(0)}): a rank or a "
        f"node of the job ended first, and its output says why; {RESUMES}"
    )


# What gloo and NCCL say when a collective waited past its timeout (--collective-timeout, from
# the first step on): another rank stopped answering without ending (stopped, stuck, far slower).
_TIMED_OUT = re.compile(
    r"Timed out waiting (\d+)ms for \w+ operation|collective operation timeout", re.IGNORECASE
)


def collective_timed_out(e: BaseException, rank: int) -> str | None:
    """The line for ``e`` where it is a collective that waited past its timeout, else None."""
    found = _TIMED_OUT.search(str(e))
    if found is None:
        return None
    waited = f" {int(found.group(1)) / 1000:g} s" if found.group(1) else ""
    return (
        f"rank {rank} waited{waited} for the other ranks in a collective and gave up (--collective-timeout): "
        f"a rank of the job stopped answering without ending (stopped, stuck, or far slower); {RESUMES}"
    )


def failed(e: Any, error_dir: Path, hung: bool, memory_advice: str = "", single_node: bool = True) -> int:
    """The exit code of a job whose worker failed, with what the workers reported, said once
    (``memory_advice``: the kernel's out-of-memory killer killed a process meanwhile, and this is
    what the run can lower)."""
    if hung:
        print(
            f"lmtune: ended the job after a hang (exit code {HANG_EXIT_CODE})",
            file=sys.stderr,
            flush=True,
        )
        return HANG_EXIT_CODE
    reported = reported_errors(error_dir)
    messages = list(dict.fromkeys(message for message, _ in reported))
    for message in messages:
        print(f"error: {message}", file=sys.stderr, flush=True)
    # By what the workers reported, not by which exit the agent saw first: a worker stopped
    # while it tears down after the error can die of a signal instead.
    codes = {code for _, code in reported} | {f.exitcode for f in e.failures.values()}
    if USER_ERROR_EXIT_CODE in codes:
        return USER_ERROR_EXIT_CODE
    if messages and HANG_EXIT_CODE in codes:  # a collective that timed out (collective_timed_out)
        return HANG_EXIT_CODE
    # Workers that a signal reached before training (and not through this launcher) stop together,
    # each exiting 128 + its number: the job ends as they did, not as a failure.
    ended = {code for code in codes if code > 0}
    if ended and all(code - 128 in (signal.SIGTERM, signal.SIGINT) for code in ended):
        name = signal.Signals(max(ended) - 128).name
        # Every rank stops on one rank's signal: on several nodes, this one may not have had it.
        where = "" if single_node else " (on this node or on another of the job)"
        print(
            f"lmtune: the workers were stopped by {name}{where} before training began; nothing to save",
            file=sys.stderr,
        )
        return max(ended)
    if not messages:
        # The first to end is the cause; the launcher then stops the others with SIGTERM (within
        # the second a failure's time is kept to, a SIGTERM is the later one).
        order = sorted(e.failures.items(), key=lambda f: (f[1].timestamp, f[1].exitcode == -signal.SIGTERM))
        first, *rest = order
        stopped = [rank for rank, failure in rest if failure.exitcode == -signal.SIGTERM]
        causes = [first, *((r, f) for r, f in rest if r not in stopped)]
        lost = lost_connections(error_dir)
        if lost and all(rank in lost for rank, _ in causes):  # the cause is on another node
            for message in dict.fromkeys(lost.values()):
                print(f"error: {message}", file=sys.stderr, flush=True)
            return 1
        causes = [(r, f) for r, f in causes if r not in lost]  # this node's own cause
        for rank, failure in causes:
            print(f"lmtune: rank {rank} {_ended(failure.exitcode)}", file=sys.stderr)
        if stopped:
            print(
                f"lmtune: the launcher then stopped rank(s) {', '.join(map(str, stopped))}", file=sys.stderr
            )
        if memory_advice and any(f.exitcode == -signal.SIGKILL for _, f in causes):
            print(
                "error: the kernel's out-of-memory killer killed a process while the job ran: the job needs "
                f"more memory than the machine (or its memory limit) has{memory_advice}",
                file=sys.stderr,
            )
            return USER_ERROR_EXIT_CODE  # as memory that runs out inside a rank
        print(f"lmtune: {RESUMES}", file=sys.stderr)
    return 1


class RestartNotes(logging.Filter):
    """Under --max-restarts: the agent's logs stay quiet, but a restart is said, with the process
    whose end caused it (restarts were silent: the log only began again). Reads torch's records:
    its multiprocessing's "failed (exitcode: %s) local_rank: %s ...", its agent's "... %s/%s
    attempts left; will restart worker group" and, on a node whose own processes did not fail,
    "Detected %s new nodes from group_rank=%s; will restart worker group"."""

    def __init__(self, single_node: bool, say: Callable[[str], None], error_dir: Path):
        super().__init__()
        self.single_node, self.say, self.error_dir = single_node, say, error_dir
        self.who, self.exitcode = "", 0

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("failed (exitcode:") and len(args) >= 2:
            self.who = f"rank {args[1]}" if self.single_node else f"local rank {args[1]} of this node"
            self.exitcode = args[0] if isinstance(args[0], int) else 0
        elif "will restart worker group" in str(record.msg) and len(args) >= 4:
            left, most = (n if isinstance(n, int) else 0 for n in args[2:4])
            own = reported_errors(self.error_dir)
            if any(code == USER_ERROR_EXIT_CODE for _, code in own):
                return False  # not restarted: the launcher ends the job (launch._stop_on_user_error)
            cause = self._cause(own_reports=bool(own))
            self.say(
                f"{cause}; every process starts again from the newest checkpoint (--max-restarts: "
                f"restart {most - left + 1} of {most})"
            )
            self.who, self.exitcode = "", 0
        elif "new nodes from group_rank" in str(record.msg):  # another node's agent meets again
            self.say(
                "another node's process ended (or a node joined the job); every process starts again "
                "from the newest checkpoint"
            )
        return False

    def _cause(self, own_reports: bool) -> str:
        if not self.who or not self.exitcode:
            return "a process of the job ended"
        lost = lost_connections(self.error_dir)
        for rank in lost:  # said now: the next attempt's own failure must not read as another's
            (self.error_dir / f"rank-{rank}.json").unlink(missing_ok=True)
        if lost and not own_reports and self.exitcode == 1:
            return f"{self.who} lost its connection to another rank (a rank or a node of the job ended first)"
        return f"{self.who} {_ended(self.exitcode)}"


def _ended(exitcode: int) -> str:
    if exitcode < 0:
        with suppress(ValueError):
            return f"was killed by {signal.Signals(-exitcode).name}"
    return f"failed with exit code {exitcode}"


# Where Linux counts the processes its out-of-memory killer killed: the machine (or VM) as a whole,
# and this process's memory cgroup (v2, then v1) as a container sees its own.
_OOM_COUNTERS = (
    (Path("/proc/vmstat"), "oom_kill"),
    (Path("/sys/fs/cgroup/memory.events"), "oom_kill"),
    (Path("/sys/fs/cgroup/memory/memory.oom_control"), "oom_kill"),
)


def oom_kills() -> tuple[int, ...]:
    """The out-of-memory killer's counts, where this machine shows them."""
    counts = []
    for path, key in _OOM_COUNTERS:
        with suppress(OSError, ValueError):
            for line in path.read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == key:
                    counts.append(int(value))
    return tuple(counts)


def out_of_memory_kills(before: tuple[int, ...]) -> bool:
    now = oom_kills()
    return len(now) == len(before) and any(b > a for a, b in zip(before, now, strict=True))
