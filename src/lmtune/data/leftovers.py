"""The data cache's leftovers: what builders killed mid-way left (temporary folders, error markers,
damaged entries set aside), removed once no waiting rank trusts them; nothing else in the folder."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from lmtune.config import environment
from lmtune.data.dataset import IDS_FILE, MASK_FILE, META_FILE, OFFSETS_FILE, PARTS_FILE

CACHE_WAIT_TIMEOUT_ENV = environment.CACHE_WAIT_TIMEOUT
CACHE_WAIT_TIMEOUT_S = 600.0
ENTRY_FILES = frozenset({IDS_FILE, MASK_FILE, META_FILE, OFFSETS_FILE, PARTS_FILE})  # what a builder writes

# What a builder names its temporary folder, error marker and damaged entry set aside: an entry's
# key, then a run's nonce (cache_key's 24 hex digits, uuid's 8). A user's file in a folder given as
# --cache-dir (report.tmp-2024, x.bad-1) is no leftover of lmtune's.
_LEFTOVER = re.compile(r"[0-9a-f]{24}\.(tmp-[0-9a-f]{8}-\d+|error-[0-9a-f]{8}(\.part-\d+)?|bad-[0-9a-f]{8})")


def remove_stale(cache_dir: Path) -> list[Path]:
    """Temporary folders and error markers that builders left when they were killed: those written
    to longer ago than the wait timeout, after which no waiting rank trusts them either."""
    limit = environment.seconds(CACHE_WAIT_TIMEOUT_ENV, CACHE_WAIT_TIMEOUT_S)
    removed = []
    try:
        named = [p for p in cache_dir.iterdir() if _LEFTOVER.fullmatch(p.name)]
    except OSError:  # no cache folder yet
        return []
    for path in named:
        try:
            inside = list(path.iterdir()) if path.is_dir() and not path.is_symlink() else []
            newest = max(p.lstat().st_mtime for p in [path, *inside])
        except OSError:
            continue
        # A folder holding anything a builder does not write is not lmtune's, whatever its name.
        theirs = any(p.name not in ENTRY_FILES or p.is_symlink() or not p.is_file() for p in inside)
        if time.time() - newest > limit and not theirs:
            remove_entry(path)
            removed.append(path)
    return removed


def remove_entry(path: Path) -> None:
    """A cache entry's folder, or a marker file, gone (never through a link)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
