"""Where `lmtune export` writes: a destination that is new, empty or an earlier export (never a
user's folder, a run's, or a model folder the checkpoint's run reads again), written beside it
and swapped into place."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from lmtune.checkpoint.finished import earlier_record
from lmtune.checkpoint.layout import open_to_umask
from lmtune.checkpoint.owned import file_stats, listed, not_ours, recorded_stats
from lmtune.config.files import read_json_object
from lmtune.config.verbosity import no_progress_bars
from lmtune.errors import UserError, out_of_space
from lmtune.model.lora import ADAPTER_CONFIG

EXPORT_MARKER = ".lmtune-export.json"  # what marks a folder as an earlier export, which --overwrite replaces


def check_destination(checkpoint: Path, out: Path, overwrite: bool) -> None:
    """Refuse an export destination whose files are not the export's to replace: a run folder or
    anything inside one (its checkpoints, final/, records), a folder holding the checkpoint, a
    non-empty folder that is not an earlier export, and an earlier export without ``overwrite``."""
    from lmtune.checkpoint.layout import enclosing_run

    where = f"lmtune export: {out}"
    if out.is_symlink():
        raise UserError(f"{where}: a symbolic link; lmtune does not write through links")
    source, dest = checkpoint.resolve(), out.expanduser().resolve()
    run = enclosing_run(dest)
    if run is not None:
        raise UserError(
            f"{where}: lies inside the run folder {run}, whose files are that run's; "
            "choose a folder outside it"
        )
    if dest == source or dest in source.parents or source in dest.parents:
        raise UserError(f"{where}: holds or lies inside the checkpoint {checkpoint}; choose another folder")
    for folder, what in _inputs_of(checkpoint):
        if dest == folder or dest in folder.parents or folder in dest.parents:
            raise UserError(
                f"{where}: {'is' if dest == folder else 'holds' if dest in folder.parents else 'lies in'} "
                f"{folder}, {what}; choose another folder"
            )
    if not dest.exists():
        return
    if not dest.is_dir():
        raise UserError(f"{where}: exists and is not a folder")
    # Written beside and renamed into place: a mount point cannot be renamed, and the working
    # folder would be left behind, deleted, under the shell that ran the export.
    here = Path.cwd().resolve()
    what = "the working folder" if dest == here else f"it holds the working folder {here}"
    if os.path.ismount(dest) or dest == here or dest in here.parents:
        what = "a mount point" if os.path.ismount(dest) else what
        raise UserError(
            f"{where}: {what}; an export is written beside its folder and renamed into place, so "
            f"give a folder inside it ({dest / 'model'})"
        )
    if not os.access(dest, os.W_OK):  # swapped in, it would hold files you could not remove
        raise UserError(
            f"{where}: not writable by you (its permissions, or a read-only file system); choose "
            "another folder"
        )
    if not any(dest.iterdir()):
        return
    if not (dest / EXPORT_MARKER).is_file():
        raise UserError(f"{where}: not empty and not an earlier export; choose a new or empty folder")
    if not overwrite:
        raise UserError(f"{where}: holds an earlier export; --overwrite replaces it")


def _inputs_of(checkpoint: Path) -> list[tuple[Path, str]]:
    """The model folders the checkpoint's run reads again, as far as its files name them: the
    LoRA adapter's base, and its run.json's --model and --reference-model."""
    config_file = checkpoint / ADAPTER_CONFIG
    try:
        adapter = read_json_object(config_file) if config_file.is_file() else {}
    except UserError:  # said where the export reads it
        adapter = {}
    run = earlier_record(checkpoint.parent.parent)
    config, resolved = run.get("config"), run.get("resolved")
    named = [
        (
            adapter.get("base_model_name_or_path"),
            "the base model of the checkpoint's LoRA adapter, which the adapter, its run's resume and "
            "--merge-lora load",
        ),
        (resolved.get("model_source") if isinstance(resolved, dict) else None, "the run's --model"),
        (
            config.get("reference_model") if isinstance(config, dict) else None,
            "the run's --reference-model, which its resume reads again",
        ),
    ]
    found = [(Path(p).expanduser(), what) for p, what in named if isinstance(p, str) and p]
    return [(p.resolve(), what) for p, what in found if p.is_dir()]


def write_export(out: Path, write: Callable[[Path], None], checkpoint: Path) -> None:
    """Write into a temporary sibling, then swap it in; what was at ``out`` (empty, or an earlier
    export) is removed only once the new folder is complete."""
    out = out.expanduser()
    nonce = uuid.uuid4().hex[:8]
    tmp, aside = out.with_name(f".{out.name}.tmp-{nonce}"), out.with_name(f".{out.name}.old-{nonce}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:  # named as given: the temporary sibling is no name the user knows
        blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        why = f"{blocking} is a file, not a folder" if blocking is not None else e.strerror
        raise UserError(f"{out}: cannot write the export there ({why})") from None
    try:
        with no_progress_bars():
            write(tmp)
        open_to_umask(tmp)
        files = _files_in(tmp)
        marker = {
            "checkpoint": str(checkpoint.resolve()),
            "written": time.time(),
            "files": sorted(files),
            "stats": file_stats(tmp),  # as written: an edit since makes the file the user's
        }
        (tmp / EXPORT_MARKER).write_text(json.dumps(marker), encoding="utf-8")
        if out.exists():
            _check_only_exported(out, files)
            # The user's folder (empty, or an earlier export) keeps its permissions: one made 0700 is
            # not opened to everyone by the swap, nor one of another user's taken by root.
            kept = out.stat()
            tmp.chmod(stat.S_IMODE(kept.st_mode))
            if os.geteuid() == 0 and (kept.st_uid, kept.st_gid) != (0, 0):
                os.chown(tmp, kept.st_uid, kept.st_gid)
            out.rename(aside)
        tmp.rename(out)
    except Exception as e:
        full = out_of_space(e, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not out.exists():
            aside.rename(out)
        if full:
            said = f"no space left on device while writing {out}; nothing there changed"
            if (out / EXPORT_MARKER).is_file():
                said += " (a new export is written beside the one it replaces: both must fit)"
            raise UserError(said) from None
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _files_in(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir()}


def _check_only_exported(out: Path, files: set[str]) -> None:
    """Refuse to replace an earlier export that holds files no export wrote (a user's script or
    notes added since) or that changed since it wrote them (an edited model card): what its marker
    records, as it recorded it, is lmtune's. A marker of an older lmtune records names only: those,
    and what this export writes too, are lmtune's; anything else is not."""
    try:
        marker = json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        marker = None
    marker = marker if isinstance(marker, dict) else {}
    if isinstance(marker.get("stats"), dict):
        theirs = not_ours(out, recorded_stats(marker["stats"]), frozenset({EXPORT_MARKER}))
    else:
        names = marker.get("files")
        names = names if isinstance(names, list) else []
        ours = {*files, *(f for f in names if isinstance(f, str)), EXPORT_MARKER}
        theirs = sorted(_files_in(out) - ours)
    if theirs:
        raise UserError(
            f"lmtune export: {out}: holds files an export did not write, or changed since it wrote them "
            f"({listed(theirs)}); lmtune replaces only what it wrote: move them, or export to another folder"
        )
