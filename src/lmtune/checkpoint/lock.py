"""The output folder's lock: one run at a time. A file created with ``O_EXCL`` holding who holds it
(host, pid, the pid's start time, the job's run id, the out-of-memory killer's counts when it was
taken). It is taken by the job before anything is written: by lmtune's launcher (which hands its
token to the workers it starts), or by rank 0 when a single process or ``torchrun`` runs the job. A
lock whose process is gone on this host is stale and taken over with a warning (saying when the
out-of-memory killer has been at work since: a lone process it kills leaves only the shell's
"Killed"); a lock of a restarted attempt of the same job is taken over silently. The file lives in
the output folder itself, so nodes that share that folder see the same lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from lmtune.checkpoint.layout import LOCK_FILE
from lmtune.config.files import KIB, is_int, read_json_object
from lmtune.config.run_groups import LaunchSettings
from lmtune.errors import UserError
from lmtune.parallel.failure_report import oom_kills, out_of_memory_kills
from lmtune.parallel.launched import proc_stat

# torchrun's run id when none is given, and lmtune's default --rdzv-id: shared by unrelated jobs
# (a second job of the README's command took a running job's folder over), so they prove nothing.
_ANONYMOUS_RUN_IDS = ("", "none", LaunchSettings().rdzv_id)


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    pid_started: str | None  # the process's start time (Linux), so a reused pid is not taken for it
    started: float
    run_id: str
    token: str
    # The out-of-memory killer's counts when the lock was taken (None: a lock of an earlier lmtune).
    oom_kills: tuple[int, ...] | None = None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, since {when}"


def _pid_started(pid: int) -> str | None:
    try:
        return proc_stat(pid)[19]
    except (OSError, IndexError):
        return None


def _alive(holder: LockHolder) -> bool:
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: alive
    started = _pid_started(holder.pid)
    return started is None or holder.pid_started is None or started == holder.pid_started


def _read(path: Path) -> LockHolder | None:
    """The lock's holder (None: no lock). Read without following a link, a regular file of at most
    64 KiB: a lock that is a link to /dev/zero or a FIFO is refused, not read until memory runs out."""
    try:
        raw = read_json_object(path, limit=64 * KIB)
        fields = {k: raw[k] for k in LockHolder.__dataclass_fields__ if k != "oom_kills"}
        kills = raw.get("oom_kills")
        holder = LockHolder(**fields, oom_kills=tuple(kills) if isinstance(kills, list) else kills)
        why = "" if _plausible(holder) else "values of the wrong kind"
    except FileNotFoundError:
        return None
    except UserError as e:
        why = str(e).removeprefix(f"{path}: ")
    except (KeyError, TypeError):
        why = "not a lock file lmtune wrote"
    if why:
        raise UserError(f"{path}: an unreadable lock file ({why}); if no run is using this folder, delete it")
    return holder


def lock_status(output_dir: Path) -> str | None:
    """Whether a run holds ``output_dir`` now, from its lock: ``running`` (its process lives),
    ``gone`` (its process on this host is not there: killed, or the machine restarted),
    ``elsewhere`` (held from another host, which cannot be checked from here), None (no lock)."""
    try:
        holder = _read(output_dir / LOCK_FILE)
    except UserError:
        return None  # an unreadable lock says nothing of a run
    if holder is None:
        return None
    if holder.host != socket.gethostname():
        return "elsewhere"
    return "running" if _alive(holder) else "gone"


def _plausible(h: LockHolder) -> bool:
    strings = all(isinstance(v, str) for v in (h.host, h.run_id, h.token))
    number = isinstance(h.started, (int, float)) and not isinstance(h.started, bool) and 0 <= h.started < 1e11
    kills = h.oom_kills is None or (
        isinstance(h.oom_kills, tuple) and all(is_int(k, 0, 2**62) for k in h.oom_kills)
    )
    started = isinstance(h.pid_started, (str, type(None)))
    return strings and number and kills and started and is_int(h.pid, 1, 2**22)


@contextmanager
def _arbiter(folder: Path) -> Iterator[None]:
    """Lock changes in ``folder`` one process at a time: an exclusive ``flock`` on the folder itself.
    Two processes that both find a stale lock would otherwise each remove "the stale one" (the
    other's new lock, for the later one) and both hold the folder. Where the file system has no
    ``flock`` (some network ones), ``O_EXCL`` alone decides, as across hosts."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        with suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


class RunLock:
    """The held lock of one output folder; ``release`` removes it if it is still ours."""

    def __init__(self, path: Path, holder: LockHolder, owned: bool, created: int = 0):
        self.path = path
        self.holder = holder
        self.owned = owned  # False: held by the launcher that started this worker
        self.created = created  # the folders this run created: the output folder and N-1 above it

    def release(self) -> None:
        if not self.owned:
            return
        with _arbiter(self.path.parent):
            try:
                current = _read(self.path)
            except UserError:
                return
            if current is not None and current.token == self.holder.token:
                self.path.unlink(missing_ok=True)
        # A run that stopped before writing anything (bad data, a batch larger than the data)
        # leaves no empty folder of its own behind.
        remove_made(self.path.parent, self.created)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def remove_made(folder: Path, made: int) -> None:
    """Remove ``folder`` and the ``made - 1`` above it that a run created, as long as each is empty
    (rmdir removes only an empty folder)."""
    for each in [folder, *folder.parents][:made]:
        try:
            each.rmdir()
        except OSError:
            return


def take(
    output_dir: Path, run_id: str, warn: Callable[[str], None], created: int, inherited: str | None = None
) -> RunLock:
    """Take the lock of ``output_dir`` (an existing folder; ``created``: the folders this run made,
    it and those above it) for this process, or accept the launcher's (``inherited``: its token,
    which :func:`lmtune.checkpoint.rundir.job_lock` gathers from the job's ranks).

    Raises:
        UserError: when another live run holds it, or the folder cannot be written.
    """
    path = output_dir / LOCK_FILE
    pid = os.getpid()
    me = LockHolder(
        host=socket.gethostname(),
        pid=pid,
        pid_started=_pid_started(pid),
        started=time.time(),
        run_id=run_id,
        token=uuid.uuid4().hex,
        oom_kills=oom_kills(),
    )
    with _arbiter(output_dir):
        for _ in range(3):  # another host's holder may release between our look and our create
            current = _read(path)
            if current is not None:
                if inherited and current.token == inherited:
                    return RunLock(path, current, owned=False)
                _take_over(current, me, output_dir, warn)
                path.unlink(missing_ok=True)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                continue
            except OSError as e:
                raise UserError(f"--output-dir {output_dir}: cannot write there ({e.strerror})") from None
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(asdict(me), f)
            except OSError as e:  # a full disk: an empty lock left here would block the next run
                path.unlink(missing_ok=True)
                remove_made(output_dir, created)  # empty again: they were this run's
                raise UserError(f"--output-dir {output_dir}: cannot write there ({e.strerror})") from None
            return RunLock(path, me, owned=True, created=created)
    raise UserError(f"--output-dir {output_dir}: its lock keeps changing hands; is another run starting?")


def _take_over(current: LockHolder, me: LockHolder, output_dir: Path, warn: Callable[[str], None]) -> None:
    """Refuse a lock held by a live run (or one on another host, which cannot be checked from
    here); a restarted attempt of the same job (its own --rdzv-id, a SLURM job id) takes its own
    lock over silently where its holder is not a live process here (two torchrun jobs of one id
    on two ports shared a folder)."""
    same_job = current.run_id == me.run_id and me.run_id not in _ANONYMOUS_RUN_IDS
    if same_job and not (current.host == me.host and _alive(current)):
        return
    if current.host != me.host or _alive(current):
        raise UserError(
            f"--output-dir {output_dir}: another run is using it ({current.describe()}); wait for it, "
            f"choose another --output-dir, or, if that run is gone, delete {output_dir / LOCK_FILE}"
        )
    killed = current.oom_kills is not None and out_of_memory_kills(current.oom_kills)
    warn(
        f"taking over the lock of a run that is gone ({current.describe()})"
        + (
            "; the kernel's out-of-memory killer has ended a process since it started, most likely that "
            'run (a process it kills says nothing more than the shell\'s "Killed"): a smaller '
            "--micro-batch-size, --activation-checkpointing or a shorter --max-length needs less memory, "
            "and `lmtune plan` sizes a run for this machine"
            if killed
            else ""
        )
    )
