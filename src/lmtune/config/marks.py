"""The marks of the files lmtune writes at a path the user names or a default one (`report.html`,
a plot, a JSON table): a later command replaces a file of its own kind that carries the mark, and
refuses, before any work, a file of that name it did not write. The mark is in the content (an
HTML generator tag, a PNG text chunk, a JSON field), so a copied or renamed file keeps it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

from lmtune.config.files import MIB, decode_json, read_text
from lmtune.errors import UserError

Kind = Literal["html", "png", "json"]
GENERATOR = "lmtune"
HTML_MARK = f'<meta name="generator" content="{GENERATOR}">'
PNG_METADATA = {"Software": GENERATOR}  # matplotlib's savefig(metadata=...): a PNG tEXt chunk
JSON_FIELD = "written_by"
# What is read to find the mark: text chunks come before a PNG's image data, the tag in an HTML
# head; a JSON table is read whole.
_HEAD_BYTES = 64 * 1024
_JSON_BYTES = 64 * MIB


def json_marked(value: dict[str, Any], command: str) -> dict[str, Any]:
    """``value`` with the field that marks it as written by ``lmtune command``."""
    return {JSON_FIELD: f"{GENERATOR} {command}", **value}


def written_by_lmtune(path: Path, kind: Kind) -> bool:
    """Whether the file at ``path`` carries lmtune's mark for ``kind``; False for a link, a folder,
    or anything unreadable, which is never replaced."""
    try:
        if kind != "json":
            head = _head(path)
            if kind == "html":
                return HTML_MARK.encode() in head
            chunk = b"tEXtSoftware\x00" + GENERATOR.encode()
            return head.startswith(b"\x89PNG\r\n\x1a\n") and chunk in head
        value = decode_json(read_text(path, limit=_JSON_BYTES, follow_links=False), str(path))
    except (OSError, UserError):
        return False
    rows = value if isinstance(value, list) and value else [value]
    return all(isinstance(r, dict) and str(r.get(JSON_FIELD, "")).startswith(GENERATOR) for r in rows)


def _head(path: Path) -> bytes:
    """The first bytes of a regular file, not through a link; nothing for anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        return os.read(fd, _HEAD_BYTES) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)


def check_replaceable(path: Path, option: str, kind: Kind) -> None:
    """Refuse (exit 2) to write ``option``'s file at ``path`` over a file lmtune did not write."""
    if (path.exists() or path.is_symlink()) and not written_by_lmtune(path, kind):
        raise UserError(
            f"{option} {path}: this file exists and lmtune did not write it; "
            "name another file, or move it away first"
        )
