"""The output folder: one run at a time (a lock), nothing of an earlier run replaced silently.

The lock is a file created with ``O_EXCL`` holding who holds it (host, pid, the pid's start time,
the job's run id). It is taken by the job before anything is written: by lmtune's launcher (which
hands its token to the workers it starts), or by rank 0 when a single process or ``torchrun``
runs the job. A lock whose process is gone on this host is stale and taken over with a warning; a
lock of a restarted attempt of the same job is taken over silently. The file lives in the output
folder itself, so nodes that share that folder see the same lock.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from lmtune.errors import UserError
from lmtune.parallel.distributed import DistEnv, broadcast_object
from lmtune.parallel.launch import LOCK_TOKEN_ENV

LOCK_FILE = ".lmtune.lock"
# What an earlier run leaves; none of it is written through a symbolic link.
RUN_FILES = (
    *("final", "checkpoints", "metrics.jsonl", "run.json", "samples"),
    *("tensorboard", "wandb", "mlruns", "reporting.json", "hang-report.txt", "comm-traces"),
)
# torchrun's run id when none is given: shared by unrelated jobs, so it proves nothing.
_ANONYMOUS_RUN_IDS = ("", "none")


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    pid_started: str | None  # the process's start time (Linux), so a reused pid is not taken for it
    started: float
    run_id: str
    token: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, since {when}"


def _pid_started(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
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
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        return LockHolder(**{k: raw[k] for k in LockHolder.__dataclass_fields__})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"{path}: an unreadable lock file; if no run is using this folder, delete it"
        ) from None


class RunLock:
    """The held lock of one output folder; ``release`` removes it if it is still ours."""

    def __init__(self, path: Path, holder: LockHolder, owned: bool):
        self.path = path
        self.holder = holder
        self.owned = owned  # False: held by the launcher that started this worker

    def release(self) -> None:
        if not self.owned:
            return
        try:
            current = _read(self.path)
        except UserError:
            return
        if current is not None and current.token == self.holder.token:
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def acquire(output_dir: Path, run_id: str, warn: Callable[[str], None]) -> RunLock:
    """Take the lock of ``output_dir`` for this process, or accept the launcher's.

    Raises:
        UserError: when another live run holds it, or the folder cannot be written.
    """
    _check_folder(output_dir)
    path = output_dir / LOCK_FILE
    inherited = os.environ.get(LOCK_TOKEN_ENV)
    pid = os.getpid()
    me = LockHolder(
        host=socket.gethostname(),
        pid=pid,
        pid_started=_pid_started(pid),
        started=time.time(),
        run_id=run_id,
        token=uuid.uuid4().hex,
    )
    for _ in range(3):  # a holder may release between our look and our create
        current = _read(path)
        if current is not None:
            if inherited and current.token == inherited:
                return RunLock(path, current, owned=False)
            same_job = current.run_id == run_id and run_id not in _ANONYMOUS_RUN_IDS
            if not same_job and (current.host != me.host or _alive(current)):
                raise UserError(
                    f"--output-dir {output_dir}: another run is using it ({current.describe()}); "
                    f"wait for it, choose another --output-dir, or, if that run is gone, delete {path}"
                )
            if not same_job:
                warn(f"taking over the lock of a run that is gone ({current.describe()})")
            path.unlink(missing_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        except OSError as e:
            raise UserError(f"--output-dir {output_dir}: cannot write there ({e.strerror})") from None
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(asdict(me), f)
        return RunLock(path, me, owned=True)
    raise UserError(f"--output-dir {output_dir}: its lock keeps changing hands; is another run starting?")


def _check_folder(output_dir: Path) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output-dir {output_dir}: exists and is not a folder")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--output-dir {output_dir}: cannot create it ({e.strerror})") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {output_dir}: not writable")
    for name in RUN_FILES:
        if (output_dir / name).is_symlink():
            raise UserError(
                f"--output-dir {output_dir}: {name} is a symbolic link; lmtune does not write through "
                "links (remove it, or choose another --output-dir)"
            )


def check_earlier_run(output_dir: Path, continued: bool, overwrite: bool, config: dict[str, Any]) -> None:
    """Refuse to replace an earlier run's results that no checkpoint continues; ``--overwrite``
    deletes them (and the checkpoints) instead. Call with the lock held.

    The same run stopped before its first checkpoint (its run.json has this very ``config``, and it
    has no ``final/``) starts over: what it leaves is its own and is written again.
    """
    present = [n for n in RUN_FILES if (output_dir / n).exists()]
    if overwrite:
        for name in present:
            target = output_dir / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        return
    if continued or not ({"final", "metrics.jsonl"} & set(present)) or _finished_record(output_dir):
        return  # a finished run's record: the checkpoint manager judges it once the run is built
    if "final" not in present and _recorded_config(output_dir) == config:
        return
    results = [n for n in present if n in ("final", "metrics.jsonl")]
    raise UserError(
        f"--output-dir {output_dir} holds an earlier run ({', '.join(results)}) with no checkpoint to "
        "continue from; choose another --output-dir, or --overwrite to replace it"
    )


def _recorded_config(output_dir: Path) -> Any:
    try:
        return json.loads((output_dir / "run.json").read_text(encoding="utf-8")).get("config")
    except (OSError, ValueError, AttributeError):
        return None


def remove_leftovers(output_dir: Path) -> list[Path]:
    """Temporary folders of saves that a killed run never finished (with the lock held, nobody
    else is writing them)."""
    leftovers = [*output_dir.glob("checkpoints/.step-*.tmp"), *output_dir.glob("final.tmp")]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def prepare_output(
    output_dir: Path,
    *,
    resume: str,
    overwrite: bool,
    config: dict[str, Any],
    env: DistEnv,
    warn: Callable[[str], None],
) -> None:
    """Rank 0, holding the lock: clear unfinished saves, refuse to replace an earlier run's results
    (``--overwrite`` deletes them). Every rank raises the same error, so none is left waiting."""
    from lmtune.checkpoint.layout import list_checkpoints

    problem = ""
    if env.is_main:
        try:
            for path in remove_leftovers(output_dir):
                warn(f"removed {path}, left by a save that did not finish")
            # A checkpoint here (--resume never then refuses it by itself), or one named by --resume.
            continued = resume not in ("auto", "never") or bool(list_checkpoints(output_dir))
            check_earlier_run(output_dir, continued, overwrite, config)
        except UserError as e:
            problem = str(e)
    problem = broadcast_object(problem, env)
    if problem:
        raise UserError(problem)


@dataclass(frozen=True)
class Finished:
    """run.json's record of a run that completed (its final/ saved, or stopped early)."""

    step: int  # the last step it took
    total_steps: int  # the steps it was asked for (more than ``step`` when it stopped early)
    same_run: bool  # the run now starting has the same fingerprint (what defines a run)


FINISHED_KEY = "finished"  # under run.json's "result"


def fingerprint_hash(fixed: dict[str, Any]) -> str:
    import hashlib

    return hashlib.blake2b(
        json.dumps(fixed, sort_keys=True, default=str).encode(), digest_size=12
    ).hexdigest()


def finished_record(step: int, total_steps: int, fixed: dict[str, Any]) -> dict[str, Any]:
    """What run.json records once a run is finished, under ``result.finished``."""
    return {"step": step, "total_steps": total_steps, "fingerprint": fingerprint_hash(fixed)}


def _finished_record(output_dir: Path) -> dict[str, Any] | None:
    try:
        path = output_dir / "run.json"
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 64 << 20:
            return None
        record = json.loads(path.read_text(encoding="utf-8"))["result"][FINISHED_KEY]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    if not isinstance(record, dict):
        return None
    numbers = all(type(record.get(k)) is int and record[k] >= 0 for k in ("step", "total_steps"))
    return (
        record
        if isinstance(record, dict) and numbers and isinstance(record.get("fingerprint"), str)
        else None
    )


def read_finished(output_dir: Path, fixed: dict[str, Any], env: DistEnv) -> Finished | None:
    """The finished run recorded in ``output_dir``, judged against this run's fingerprint (rank 0
    reads it for all ranks), or None.

    Raises:
        UserError: when the folder holds another run, finished, and no checkpoint of it.
    """
    from lmtune.checkpoint.layout import list_checkpoints

    found: Finished | None = None
    problem = ""
    if env.is_main:
        record = _finished_record(output_dir)
        if record is not None:
            same = record["fingerprint"] == fingerprint_hash(fixed)
            found = Finished(step=record["step"], total_steps=record["total_steps"], same_run=same)
            if not same and not list_checkpoints(output_dir):
                problem = (
                    f"--output-dir {output_dir} holds an earlier run (final, finished at step "
                    f"{found.step}) that differs from this one; choose another --output-dir, or "
                    "--overwrite to replace it"
                )
    found, problem = broadcast_object((found, problem), env)
    if problem:
        raise UserError(problem)
    return found
