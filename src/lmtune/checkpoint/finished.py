"""run.json's record of a finished run: a run run again with no more steps asked for has nothing
to do (and the settings it changed apply to nothing), and another run finished in the same folder
is refused rather than mixed with it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtune.checkpoint.layout import list_checkpoints
from lmtune.config.files import RUN_RECORD_BYTES, read_json_object
from lmtune.config.mixture import same_weights
from lmtune.config.run_groups import names_checkpoint
from lmtune.config.settings import option_name
from lmtune.errors import UserError
from lmtune.parallel.distributed import DistEnv, decided_by_main


@dataclass(frozen=True)
class Finished:
    """run.json's record of a run that completed (its final/ saved, or stopped early)."""

    step: int  # the last step it took
    total_steps: int  # the steps it was asked for (more than ``step`` when it stopped early)
    same_run: bool  # the run now starting has the same fingerprint (what defines a run)


FINISHED_KEY = "finished"  # under run.json's "result"


# Known only once the --reference-model is loaded, after a finished run is recognised: a finished
# run's record leaves it out; a checkpoint's fingerprint holds it, and a resume checks it.
REFERENCE_WEIGHTS = "reference weights (--reference-model)"


def fingerprint_hash(fixed: dict[str, Any]) -> str:
    kept = {k: v for k, v in fixed.items() if k != REFERENCE_WEIGHTS}
    return hashlib.blake2b(json.dumps(kept, sort_keys=True, default=str).encode(), digest_size=12).hexdigest()


def finished_record(step: int, total_steps: int, fixed: dict[str, Any]) -> dict[str, Any]:
    """What run.json records once a run is finished, under ``result.finished``."""
    return {"step": step, "total_steps": total_steps, "fingerprint": fingerprint_hash(fixed)}


def recorded_finish(output_dir: Path) -> dict[str, Any] | None:
    """run.json's ``result.finished`` in ``output_dir`` when it is well-formed, else None."""
    result = earlier_record(output_dir).get("result")
    record = result.get(FINISHED_KEY) if isinstance(result, dict) else None
    if not isinstance(record, dict):  # no run.json, or not one lmtune wrote: no finished run is recorded
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


def earlier_record(output_dir: Path) -> dict[str, Any]:
    """The folder's run.json, or {} where there is none lmtune can read."""
    try:
        return read_json_object(output_dir / "run.json", limit=RUN_RECORD_BYTES)
    except (OSError, UserError):
        return {}


def recorded_resume(output_dir: Path) -> str | None:
    """The checkpoint the folder's run last began from by an explicit --resume, as an absolute
    path (run.json's ``resolved.resume_path``; an older run.json's as typed), or None."""
    record = earlier_record(output_dir)
    resolved, config = record.get("resolved"), record.get("config")
    path = resolved.get("resume_path") if isinstance(resolved, dict) else None
    if isinstance(path, str):
        return path
    given = config.get("resume") if isinstance(config, dict) else None
    if not names_checkpoint(given) or not given.strip():
        return None
    return str(Path(given).resolve())


def began_from(output_dir: Path, resume: str | Path) -> bool:
    """Whether ``output_dir``'s run began from the checkpoint ``resume`` names (its command's
    --resume, :func:`recorded_resume`): that command run again."""
    return recorded_resume(output_dir) == str(Path(resume).resolve())


# Settings that say where and how a command runs, not what it trains (a node's rendezvous address,
# threads, restarts: a finished run run again from another port listed it as "not applied"). N
# processes train as one, so a finished run's strategy and process count changed apply to nothing
# (--strategy fsdp was said to apply to further steps, which a full checkpoint of DDP's refuses).
_NOT_THE_RUN = frozenset({"output_dir", "resume", "overwrite", "progress", "doctor", "cache_dir"}) | {
    "cache_per_node", "num_workers", "threads_per_process", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id",
    "max_restarts", "strategy", "nproc_per_node", "device",
}  # fmt: skip


def check_continued_into(output_dir: Path, resume: Path, config: dict[str, Any]) -> None:
    """``--resume`` of another folder's checkpoint into ``output_dir``: refused where the folder holds
    another run (its newest checkpoint, its finished record, or else its run.json, of other
    settings), whose records and final model the continued run would mix with its own.

    Raises:
        UserError: naming what the folder holds.
    """
    from lmtune.checkpoint.fingerprint import read_fingerprint

    found = list_checkpoints(output_dir)
    held = [n for n in ("final", "metrics.jsonl", "run.json") if (output_dir / n).exists()]
    if (not held and not found) or began_from(output_dir, resume):
        return  # a new folder, or the same command again (its run began from that checkpoint)
    theirs, finish = read_fingerprint(resume), recorded_finish(output_dir)
    mine = read_fingerprint(found[-1]) if found else None
    if theirs is not None and mine is not None:
        same = mine.fixed == theirs.fixed
    elif theirs is not None and finish is not None:
        same = finish["fingerprint"] == fingerprint_hash(theirs.fixed)
    else:  # what a run that recorded no --resume path recorded
        recorded = earlier_record(output_dir).get("config")
        keys = (config.keys() | (recorded or {}).keys()) - _NOT_THE_RUN
        same = isinstance(recorded, dict) and all(recorded.get(k) == config.get(k) for k in keys)
    if not same:
        held += ["checkpoints"] if found else []
        raise UserError(
            f"--output-dir {output_dir} holds another run ({', '.join(held)}), and --resume {resume} "
            "continues a checkpoint of another folder into it: the two runs' records and models would be "
            "mixed; choose a new --output-dir, or --overwrite to replace that run"
        )


def changed_settings(output_dir: Path, config: dict[str, Any]) -> list[str]:
    """This command's settings that differ from those run.json recorded (``--lr 2e-4, was
    0.0001``), for a finished run that will not train again: changing them does nothing there."""
    record = earlier_record(output_dir)
    recorded, resolved = record.get("config"), record.get("resolved")
    if not isinstance(recorded, dict):
        return []
    resolved = resolved if isinstance(resolved, dict) else {}  # what an unset setting took (--lr)

    def shown(name: str, value: Any, was: bool) -> str:
        if value is not None:
            return str(value)
        return f"unset (it took {resolved[name]})" if was and name in resolved else "unset"

    def same(name: str, value: Any) -> bool:  # the value given now is what an unset one took
        if name == "data_weights" and same_weights(recorded[name], value):  # 10,6,4 is 0.5,0.3,0.2
            return True
        return recorded[name] == value or (recorded[name] is None and resolved.get(name, None) == value)

    return [
        f"{option_name(name)} {shown(name, value, False)}, was {shown(name, recorded.get(name), True)}"
        for name, value in config.items()
        if name not in _NOT_THE_RUN and name in recorded and not same(name, value)
    ]
