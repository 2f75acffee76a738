"""Which files of a folder lmtune wrote, and whether they are still as it wrote them, so that
replacing the folder (a run's final/, an earlier export) never takes a user's file or edit with it.

A folder's record lists each file lmtune wrote with its size and, up to ``HASHED_UP_TO`` bytes,
its content's hash: a file that is not listed, or whose size or content differ (a model card
rewritten, a config edited), is the user's, and the replacement is refused, naming it. Weights
files are judged by their size (hashing gigabytes at every save and start would cost more than
the rare same-size replacement it would catch). No time is kept: a copy (``cp -r``) is as its
original.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

WRITTEN_RECORD = ".lmtune-written.json"  # in a run's final/: the files lmtune wrote there
HASHED_UP_TO = 64 << 20  # configs, tokenizers, cards: hashed; larger files (weights): size only


def file_stats(folder: Path) -> dict[str, list[Any]]:
    """Every file under ``folder`` (relative path: size, and the blake2b of its content up to
    ``HASHED_UP_TO`` bytes, else ""); a link is listed as itself (its target), never followed."""
    stats: dict[str, list[Any]] = {}
    for path in sorted(folder.rglob("*")):
        name = path.relative_to(folder).as_posix()
        if path.is_symlink():
            target = str(path.readlink())
            stats[name] = [len(target), hashlib.blake2b(target.encode(), digest_size=16).hexdigest()]
        elif path.is_file():
            size = path.stat().st_size
            stats[name] = [size, _digest(path) if size <= HASHED_UP_TO else ""]
    return stats


def _digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def record_written(folder: Path) -> None:
    """Record every file now under ``folder`` as lmtune's (call once it has written them all)."""
    stats = {name: stat for name, stat in file_stats(folder).items() if name != WRITTEN_RECORD}
    (folder / WRITTEN_RECORD).write_text(json.dumps({"files": stats}), encoding="utf-8")


def recorded_stats(files: Any) -> dict[str, list[Any]]:
    """A parsed record's map of files; what is malformed in it counts as unrecorded."""
    if not isinstance(files, dict):
        return {}
    return {
        name: stat
        for name, stat in files.items()
        if isinstance(stat, list) and len(stat) == 2 and isinstance(stat[0], int) and isinstance(stat[1], str)
    }


def not_ours(folder: Path, recorded: dict[str, list[Any]], own: frozenset[str] = frozenset()) -> list[str]:
    """Files under ``folder`` that are not as lmtune wrote them: not recorded, or recorded with
    another size or content. ``own`` are files that count as lmtune's without a record (the record
    itself)."""
    return [
        name for name, stat in file_stats(folder).items() if name not in own and recorded.get(name) != stat
    ]


def users_files(folder: Path) -> list[str]:
    """What replacing ``folder``, a run's final/, would take from its user: see :func:`not_ours`.
    A final/ without a record (written by an lmtune before records, or a save that did not get
    to record) is judged as before: all of it lmtune's."""
    try:
        record = json.loads((folder / WRITTEN_RECORD).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        record = None
    files = record.get("files") if isinstance(record, dict) else None
    return not_ours(folder, recorded_stats(files), frozenset({WRITTEN_RECORD}))


def users_files_said(folder: Path) -> str:
    """``FOLDER holds files lmtune did not write, or changed since ... (a, b)``, or "" when
    :func:`users_files` finds none."""
    theirs = users_files(folder)
    return (
        f"{folder} holds files lmtune did not write, or changed since it wrote them ({listed(theirs)})"
        if theirs
        else ""
    )


def listed(names: list[str], limit: int = 5) -> str:
    """``a, b, c and 4 more``."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
