"""Which files of a folder lmtune wrote, and whether they are still as it wrote them, so that
replacing the folder (a run's final/, an earlier export) never takes a user's file or edit with it.

A folder's record lists each file lmtune wrote with its size and modification time. A file that
is not listed, or whose size or time differ (a model card rewritten, a config edited), is the
user's: the replacement is refused, naming it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

WRITTEN_RECORD = ".lmtune-written.json"  # in a run's final/: the files lmtune wrote there


def file_stats(folder: Path) -> dict[str, list[int]]:
    """Every file under ``folder`` (relative path: size, modification time in ns); links are
    listed as themselves, never followed."""
    stats = {}
    for path in sorted(folder.rglob("*")):
        if path.is_symlink() or path.is_file():
            st = path.lstat()
            stats[path.relative_to(folder).as_posix()] = [st.st_size, st.st_mtime_ns]
    return stats


def record_written(folder: Path) -> None:
    """Record every file now under ``folder`` as lmtune's (call once it has written them all)."""
    stats = {name: stat for name, stat in file_stats(folder).items() if name != WRITTEN_RECORD}
    (folder / WRITTEN_RECORD).write_text(json.dumps({"files": stats}), encoding="utf-8")


def recorded_stats(files: Any) -> dict[str, list[int]]:
    """A parsed record's map of files; what is malformed in it counts as unrecorded."""
    if not isinstance(files, dict):
        return {}
    return {
        name: stat
        for name, stat in files.items()
        if isinstance(stat, list) and len(stat) == 2 and all(isinstance(v, int) for v in stat)
    }


def not_ours(folder: Path, recorded: dict[str, list[int]], own: frozenset[str] = frozenset()) -> list[str]:
    """Files under ``folder`` that are not as lmtune wrote them: not recorded, or recorded with
    another size or time. ``own`` are files that count as lmtune's without a record (the record
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


def listed(names: list[str], limit: int = 5) -> str:
    """``a, b, c and 4 more``."""
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
