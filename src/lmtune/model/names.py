"""How a --model name reads before anything loads: written as a path, and a folder near a
mistyped one (a hub id and a preset are the other readings: lmtune.model.modeling)."""

from __future__ import annotations

import difflib
from pathlib import Path


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(("/", "\\")) or name.count("/") > 1


def near_folder(parent: Path, rest: str) -> str:
    """A folder inside ``parent`` whose name is close to ``rest``'s first part (run/fnial:
    run/final), or ""."""
    head, _, tail = rest.partition("/")
    try:
        names = [p.name for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(head, names, n=1, cutoff=0.6)
    if not close:
        return ""
    return str(parent / close[0] / tail) if tail else str(parent / close[0])
