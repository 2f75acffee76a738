"""run.json's record of a finished run: a run run again with no more steps asked for has nothing
to do, and another run finished in the same folder is refused rather than mixed with it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtune.checkpoint.layout import list_checkpoints
from lmtune.config.files import read_json_object
from lmtune.errors import UserError
from lmtune.parallel.distributed import DistEnv, decided_by_main


@dataclass(frozen=True)
class Finished:
    """run.json's record of a run that completed (its final/ saved, or stopped early)."""

    step: int  # the last step it took
    total_steps: int  # the steps it was asked for (more than ``step`` when it stopped early)
    same_run: bool  # the run now starting has the same fingerprint (what defines a run)


FINISHED_KEY = "finished"  # under run.json's "result"
RUN_RECORD_BYTES = 64 << 20


def fingerprint_hash(fixed: dict[str, Any]) -> str:
    return hashlib.blake2b(
        json.dumps(fixed, sort_keys=True, default=str).encode(), digest_size=12
    ).hexdigest()


def finished_record(step: int, total_steps: int, fixed: dict[str, Any]) -> dict[str, Any]:
    """What run.json records once a run is finished, under ``result.finished``."""
    return {"step": step, "total_steps": total_steps, "fingerprint": fingerprint_hash(fixed)}


def recorded_finish(output_dir: Path) -> dict[str, Any] | None:
    """run.json's ``result.finished`` in ``output_dir`` when it is well-formed, else None."""
    try:
        record = read_json_object(output_dir / "run.json", limit=RUN_RECORD_BYTES)["result"][FINISHED_KEY]
    except (UserError, OSError, KeyError, TypeError):
        return None  # no run.json, or not one lmtune wrote: no finished run is recorded
    if not isinstance(record, dict):
        return None
    numbers = all(type(record.get(k)) is int and record[k] >= 0 for k in ("step", "total_steps"))
    return record if numbers and isinstance(record.get("fingerprint"), str) else None


def read_finished(output_dir: Path, fixed: dict[str, Any], env: DistEnv) -> Finished | None:
    """The finished run recorded in ``output_dir``, judged against this run's fingerprint (rank 0
    reads it for all ranks), or None.

    Raises:
        UserError: when the folder holds another run, finished, and no checkpoint of it.
    """

    def judged() -> Finished | None:
        record = recorded_finish(output_dir)
        if record is None:
            return None
        same = record["fingerprint"] == fingerprint_hash(fixed)
        found = Finished(step=record["step"], total_steps=record["total_steps"], same_run=same)
        if not same and not list_checkpoints(output_dir):
            raise UserError(
                f"--output-dir {output_dir} holds an earlier run (final, finished at step "
                f"{found.step}) that differs from this one; choose another --output-dir, or "
                "--overwrite to replace it"
            )
        return found

    return decided_by_main(judged, None, env)
