"""The output folder: one run at a time (its lock, :mod:`lmtune.checkpoint.lock`, taken once the
folder is one lmtune may write in), nothing of an earlier run replaced silently: an earlier run is
continued, refused, or replaced under --overwrite, removing only what lmtune wrote.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from lmtune.checkpoint.finished import check_continued_into, earlier_record, recorded_finish
from lmtune.checkpoint.layout import (
    LOCK_FILE,
    checkpoint_of,
    enclosing_run,
    in_the_way,
    lmtunes_folder,
    refuse_users_steps,
    remove_checkpoint,
    temporary_of,
)
from lmtune.checkpoint.lock import RunLock, take
from lmtune.checkpoint.owned import listed as names_listed
from lmtune.checkpoint.owned import users_files_said
from lmtune.config import environment
from lmtune.config.environment import LOCK_TOKEN
from lmtune.config.files import unwritable
from lmtune.config.mixture import named_items
from lmtune.config.replay import is_run_record
from lmtune.config.run_groups import names_checkpoint
from lmtune.errors import UserError
from lmtune.parallel.distributed import DistEnv, all_gather_object, decided_by_main, stop_if_signalled
from lmtune.parallel.health import HANG_REPORT, HEALTH_DIR_ENV, users_hang_report
from lmtune.parallel.launched import launch_started, run_id

# What an earlier run leaves; none of it is written through a symbolic link.
RUN_FOLDERS = ("final", "checkpoints", "samples", "tensorboard", "wandb", "mlruns", "comm-traces")
RUN_RECORDS = ("metrics.jsonl", "run.json", "reporting.json", HANG_REPORT)
RUN_FILES = (*RUN_FOLDERS, *RUN_RECORDS)
# Inside these folders lmtune removes only what it, or the reporter it ran, names so (a user's own
# files there are kept): TensorBoard's event files, W&B's run folders and logs, MLflow's file store
# (experiments by number), NCCL's flight-recorder dumps.
_OWN_ENTRIES = {
    "checkpoints": re.compile(r"\.?step-\d+(\.tmp|\.replaced-\d+)?"),
    "samples": re.compile(r"rank-\d+\.jsonl"),
    "tensorboard": re.compile(r"events\.out\.tfevents\.\d{10}\..+\.\d+\.\d+"),
    "wandb": re.compile(r"(offline-)?run-\d{8}_\d{6}-[a-z0-9]+|latest-run|debug(-internal|-cli\..+)?\.log"),
    "mlruns": re.compile(r"\d+|\.trash|models"),
    "comm-traces": re.compile(r"rank_\d+"),
}


def acquire(
    output_dir: Path, run_id: str, warn: Callable[[str], None], inherited: str | None = None
) -> RunLock:
    """Take the lock of ``output_dir`` for this process, or accept the launcher's
    (:func:`lmtune.checkpoint.lock.take`), once the folder is one lmtune may write in.

    Raises:
        UserError: when another live run holds it, or the folder cannot be written.
    """
    # The folders this run makes (--output-dir new/run: new/ too), removed again if it writes nothing.
    created = sum(1 for _ in itertools.takewhile(lambda p: not p.exists(), (output_dir, *output_dir.parents)))
    _check_folder(output_dir)
    return take(output_dir, run_id, warn, created, inherited)


def job_lock(
    output_dir: Path, run_id: str, env: DistEnv, warn: Callable[[str], None]
) -> RunLock | nullcontext[None]:
    """The output folder's lock for the job (collective, in its process group): rank 0 takes it, or
    accepts the one lmtune's launcher holds for the job, whose token every rank hands in (rank 0 may
    run on a node whose launcher holds none); a refusal is raised on every rank."""
    tokens = all_gather_object(environment.token(LOCK_TOKEN), env)
    inherited = next((token for token in tokens if token), None)
    held: list[RunLock] = []
    decided_by_main(lambda: held.append(acquire(output_dir, run_id, warn, inherited)), None, env)
    return held[0] if held else nullcontext()


def _check_folder(output_dir: Path) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"--output-dir {output_dir}: exists and is not a folder")
    if output_dir.is_symlink() and not output_dir.exists():
        raise UserError(
            f"--output-dir {output_dir}: a link to {os.readlink(output_dir)}, which is not there; make that "
            "folder, or give another --output-dir"
        )
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--output-dir {output_dir}: cannot create it ({e.strerror})") from None
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise UserError(f"--output-dir {output_dir}: not writable ({unwritable(output_dir)})")
    for name in (*RUN_FILES, LOCK_FILE):
        problem = _entry_problem(output_dir / name, folder=name in RUN_FOLDERS)
        if problem and (output_dir / name).is_symlink():  # a link to keep it on another disk, often
            raise UserError(
                f"--output-dir {output_dir}: {name} is {problem}: remove the link, and give an --output-dir "
                f"on the other disk to keep the run's {name} there (or choose another --output-dir)"
            )
        if problem:
            raise UserError(
                f"--output-dir {output_dir}: {name} is {problem}; lmtune writes only its own files "
                "(remove it, or choose another --output-dir)"
            )
    # Known now, not after the steps before the save that needs the name (final.tmp's: once the run
    # is known to write final/, final_problem; a finished run run again writes nothing).
    for temporary in output_dir.glob("checkpoints/.step-*.tmp"):
        if problem := in_the_way(temporary):
            raise UserError(problem)


def _entry_problem(path: Path, folder: bool) -> str:
    """Why lmtune may not write ``path`` ("" when it may): a link, or not what lmtune writes there."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return ""
    if stat.S_ISLNK(mode):
        return "a symbolic link; lmtune does not write through links"
    if folder and not stat.S_ISDIR(mode):
        return "not a folder"
    if not folder and not stat.S_ISREG(mode):
        return "not a regular file"
    return ""


def _ran_here(folder: Path) -> bool:
    """Whether an lmtune run wrote ``folder``'s entries: its run.json, or a checkpoint whose
    manifest checks out. Not the lock (this run holds it by now), nor entries that only bear
    lmtune's names (``final/``, ``metrics.jsonl``, ``checkpoints/step-1/``): a user's may."""
    from lmtune.checkpoint.layout import list_checkpoints, verify

    record = earlier_record(folder)
    if is_run_record(record):
        return True
    return any(verify(p) is None for p in list_checkpoints(folder))


def _empty_record(path: Path) -> bool:
    """An empty metrics.jsonl: what a run killed before its run.json leaves (the log is opened
    first). It holds nothing to lose, whoever made it, so it neither stands for a run nor is at
    stake: that folder was refused, --overwrite too, as one holding files not lmtune's."""
    plain = path.name == "metrics.jsonl" and not path.is_symlink() and path.is_file()
    return plain and not path.stat().st_size


def check_earlier_run(
    output_dir: Path,
    continued: bool,
    overwrite: bool,
    config: dict[str, Any],
    warn: Callable[[str], None] = lambda message: None,
) -> None:
    """Refuse to replace an earlier run's results that no checkpoint continues. Under
    ``--overwrite``, check that they may be deleted (lmtune's own entries only), which
    :func:`replace_earlier_run` does once the new run is built. Call with the lock held.

    The same run stopped before its first checkpoint (its run.json has this very ``config``, no
    ``final/``), or any that ended before its first step, starts over, saying so."""
    # Only a run under lmtune's launcher with its watchdog writes one.
    if os.environ.get(HEALTH_DIR_ENV) and users_hang_report(output_dir / HANG_REPORT):
        raise UserError(
            f"--output-dir {output_dir} holds {HANG_REPORT}, which lmtune did not write, where a run "
            "that hangs writes its report; move it, or choose another --output-dir"
        )
    # A finished run's: judged once the run is built (run again, it writes nothing there).
    if (overwrite or not recorded_finish(output_dir)) and (problem := final_problem(output_dir)):
        raise UserError(problem)
    present = [n for n in RUN_FILES if (output_dir / n).exists() and not _empty_record(output_dir / n)]
    if overwrite:
        if present and not _ran_here(output_dir):
            raise UserError(
                f"--overwrite: {output_dir} holds {', '.join(present)} but no lmtune run (no run.json "
                "of one, nor a complete checkpoint), so they are not lmtune's to delete; move them or "
                "choose another --output-dir"
            )
        refuse_users_steps(output_dir, "--overwrite")  # before anything is deleted
        return
    # Entries a run writes whole by these names: a user's own would be replaced (--overwrite refuses
    # them too, so it is not suggested). Not hang-report.txt: a run that hung before its run.json
    # leaves one, and its rerun must start.
    written = ("final", "metrics.jsonl", "run.json", "reporting.json")
    at_stake = [n for n in present if n in written] + _samples_files(output_dir)
    if at_stake and not _ran_here(output_dir):
        raise UserError(
            f"--output-dir {output_dir} holds {names_listed(at_stake)} but no lmtune run (no run.json of "
            "one, nor a complete checkpoint), and this run writes entries of those names; choose another "
            "--output-dir, or move them"
        )
    if continued or not ({"final", "metrics.jsonl"} & set(present)) or recorded_finish(output_dir):
        return  # a finished run's record: the checkpoint manager judges it once the run is built
    if "final" not in present:
        from lmtune.outputs.runlog import read_metrics

        trained = read_metrics(output_dir)
        if earlier_record(output_dir).get("config") == config:
            # Stopped before its first step, it lost nothing that --save-every would have kept.
            if trained:
                warn(
                    f"{output_dir} holds this run, stopped before its first checkpoint: starting it again "
                    "from step 0 (--save-every N keeps a stopped run's progress)"
                )
            return
        if not trained:  # ended before its first step (out of memory, say): nothing to lose
            warn(f"{output_dir} holds a run that ended before its first step: starting this one in its place")
            return
    results = [n for n in present if n in ("final", "metrics.jsonl")]
    raise UserError(
        f"--output-dir {output_dir} holds an earlier run ({', '.join(results)}) with no checkpoint to "
        "continue from; choose another --output-dir, or --overwrite to replace it"
    )


def final_problem(output_dir: Path) -> str:
    """Why this run may not replace ``final/`` ("" when it may): files in it lmtune did not write,
    or a folder of the user's where lmtune writes it first (final.tmp)."""
    final = output_dir / "final"
    if final.is_dir() and not final.is_symlink() and (theirs := users_files_said(final)):
        return (
            f"{theirs}; this run replaces final/: move them out of it first (or copy final/ elsewhere to "
            "keep it)"
        )
    return in_the_way(temporary_of(final))


def _samples_files(output_dir: Path) -> list[str]:
    """--record-samples' files in ``output_dir``, as ``samples/rank-0.jsonl``."""
    named = _OWN_ENTRIES["samples"].fullmatch
    return [
        f"samples/{p.name}" for p in sorted((output_dir / "samples").glob("rank-*.jsonl")) if named(p.name)
    ]


def replace_earlier_run(
    output_dir: Path, env: DistEnv, signum: int, say: Callable[[str], None] = lambda _: None
) -> None:
    """``--overwrite``: delete what an earlier run wrote, by rank 0 with the lock held, once the new
    run's model and data are loaded (a typo in the command must not cost the earlier run), and
    checked again (:func:`check_earlier_run` checked it before): a user's files are kept. Not when
    a rank got a signal (``signum``, this rank's) while the run was built: it stops, nothing lost."""
    stop_if_signalled(signum, env)

    def replace() -> None:
        refuse_users_steps(output_dir, "--overwrite")
        whose = _whose(output_dir)
        removed, kept = remove_own_entries(output_dir)
        if removed or kept:  # deleted: said, as any deletion of a run's results is
            done = [f"removed {whose} {', '.join(removed)} from {output_dir}"] if removed else []
            done += (
                [f"kept what lmtune did not write there: {names_listed([str(k) for k in kept])}"]
                if kept
                else []
            )
            say(f"--overwrite: {'; '.join(done)}")

    decided_by_main(replace, None, env)


def _whose(output_dir: Path) -> str:
    """Whose entries --overwrite removes: a restart before the job's first checkpoint removes its
    first start's (run.json written since the launch began), else an earlier run's."""
    started = launch_started() if run_id() else None
    try:
        written = (output_dir / "run.json").stat().st_mtime
    except OSError:
        return "the earlier run's"
    return "this job's first start's" if started is not None and written > started else "the earlier run's"


def remove_own_entries(output_dir: Path) -> tuple[list[str], list[Path]]:
    """Delete what an earlier run wrote into ``output_dir``; returns what it removed (an entry, or
    ``lmtune's files in NAME/`` where a user's stay) and what was kept (a user's files inside
    checkpoints/ or samples/). Links are removed, never followed."""
    removed: list[str] = []
    kept: list[Path] = []
    for name in (*RUN_FILES, "final.tmp"):
        target = output_dir / name
        if not (target.exists() or target.is_symlink()):
            continue
        if name == "final.tmp" and not lmtunes_folder(target):
            kept.append(target)  # a user's folder of that name
            continue
        pattern = _OWN_ENTRIES.get(name)
        if pattern is not None and target.is_dir() and not target.is_symlink():
            own = False
            for entry in target.iterdir():
                if not pattern.fullmatch(entry.name):
                    kept.append(entry)
                    continue
                own = True
                if name == "checkpoints":
                    kept += remove_checkpoint(entry)  # a user's step-N, or files put into one, stay
                else:
                    _remove(entry)
            if not any(target.iterdir()):
                target.rmdir()
                removed.append(name)
            elif own:
                removed.append(f"lmtune's files in {name}/")
        else:
            _remove(target)
            removed.append(name)
    return removed, kept


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def run_entry_holding(path: Path) -> Path | None:
    """The entry of a run (its final/, checkpoints/, records, lock) that holds or is ``path``
    (resolved), or None: a folder of one's own beside a run's entries is not the run's."""
    run = enclosing_run(path.parent) if path != path.parent else None
    # path lies below run (searched from its parent up), so its first part names the entry.
    if run is None or path.relative_to(run).parts[0] not in (*RUN_FILES, "final.tmp", LOCK_FILE):
        return None
    return run / path.relative_to(run).parts[0]


def check_output_dir(output_dir: Path, inputs: dict[str, str], overwrite: bool) -> None:
    """Refuse an output folder that would destroy or read back what the run reads, or another run's,
    before anything is written: ``/``; a folder inside another run's entries (its checkpoints or
    final/); under ``--overwrite`` the home folder (or above it) and a folder holding an
    input; a folder inside a data folder (the run would read its own files as data, e.g.
    ``--data DIR --output-dir DIR``); an input inside an entry the run writes (``final/``, ...).

    ``inputs``: option -> value (comma lists, globs, folders, files; hub ids are skipped).
    """
    out = output_dir.expanduser().resolve()
    if out == Path(out.anchor):
        raise UserError(f"--output-dir {output_dir}: the root folder; choose a folder of its own")
    # A run's checkpoint or final/ is that run's, never a new run's folder; a folder of its own
    # beside them is not the run's (a run in the working folder left the runs below it theirs).
    if (entry := run_entry_holding(out)) is not None:
        raise UserError(
            f"--output-dir {output_dir} lies inside {entry}, which the run in {entry.parent} wrote; "
            "choose a folder outside it"
        )
    home = Path.home().resolve()
    if overwrite and (out == home or out in home.parents):
        raise UserError(f"--overwrite --output-dir {output_dir}: refused for the home folder or above it")
    check_outside_inputs(output_dir, "--output-dir", inputs)
    for option, spec in inputs.items():
        for path, _ in _input_paths(spec):
            if out not in path.parents and out != path:
                continue
            inside = path.relative_to(out).parts
            # --overwrite deletes the run's own entries alone: an input beside them stays.
            if not inside or inside[0] in (*RUN_FILES, LOCK_FILE):
                what = "which --overwrite would delete" if overwrite else "where this run writes"
                raise UserError(
                    f"--output-dir {output_dir} holds {option} {path}, {what}; lmtune does not delete "
                    "or replace its inputs (move the input, or choose another --output-dir)"
                )


def check_outside_inputs(folder: Path, what: str, inputs: dict[str, str]) -> None:
    """Refuse a folder lmtune writes (``what``: --output-dir, --cache-dir) inside a folder the run
    reads whole (``--data DIR``, ``--model DIR``, a glob's fixed part): it would read its own files
    as its input."""
    where = folder.expanduser().resolve()
    for option, spec in inputs.items():
        for path, read_whole in _input_paths(spec):
            if read_whole and (where == path or path in where.parents):
                raise UserError(
                    f"{what} {folder} lies inside {option} {path}, which the run reads: it would read its "
                    f"own files as its input; choose another {what} outside it"
                )


def _input_paths(spec: str) -> Iterator[tuple[Path, bool]]:
    """(resolved path, whether the run reads the whole folder) of each local path in ``spec``."""
    for _, item in named_items(spec):
        path = Path(item).expanduser()
        if any(ch in item for ch in "*?["):  # a glob reads what lies under its fixed part
            fixed = list(itertools.takewhile(lambda part: not any(ch in part for ch in "*?["), path.parts))
            root = Path(*fixed) if fixed else Path(".")
            yield root.resolve(), True
        elif path.exists():
            yield path.resolve(), path.is_dir()


def remove_leftovers(output_dir: Path) -> list[Path]:
    """Temporary folders of saves that a killed run never finished (with the lock held, nobody
    else is writing them); a user's folder of such a name is kept."""
    found = [*output_dir.glob("checkpoints/.step-*.tmp"), *output_dir.glob("final.tmp")]
    leftovers = [p for p in found if lmtunes_folder(p)]
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
) -> Callable[[int], None]:
    """Rank 0, holding the lock: clear unfinished saves, refuse to replace an earlier run's results.
    Every rank raises the same error, so none is left waiting. Returns what each rank calls once
    the run is built, with the signal it got (0: none): under ``--overwrite``, the earlier run's
    deletion (:func:`replace_earlier_run`)."""
    from lmtune.checkpoint.layout import list_checkpoints

    def prepare() -> None:
        for path in remove_leftovers(output_dir):
            warn(f"removed {path}, left by a save that did not finish")
        # A checkpoint here (--resume never then refuses it by itself), or one named by --resume.
        given = names_checkpoint(resume)
        if given and not overwrite and not checkpoint_of(Path(resume), output_dir):
            check_continued_into(output_dir, Path(resume), config)
        continued = given or bool(list_checkpoints(output_dir))
        check_earlier_run(output_dir, continued, overwrite, config, warn)

    decided_by_main(prepare, None, env)
    return partial(replace_earlier_run, output_dir, env, say=warn) if overwrite else lambda signum: None
