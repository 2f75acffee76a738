"""The files lmtune writes at a path the user names or a default one (`report.html`, a plot, a JSON
table): each carries a mark in its content (an HTML report's opening, a PNG text chunk, a JSON
field naming the command), so a copied or renamed one keeps it. A later command replaces a file of
its own kind that carries the mark, and refuses, before any work, anything else at that path: a
user's file of that name, another kind of lmtune's files, a folder or a link. Files are written
whole into place (a temporary sibling renamed over the old one), never half-written.
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from typing import Any, Literal

from lmtune.config.files import MIB, decode_json, read_text, unwritable
from lmtune.errors import UserError

Kind = Literal["report", "png", "bench", "plan", "eval"]
GENERATOR = "lmtune"
# A report begins with these bytes exactly: a page that merely quotes the tag is not one.
HTML_HEAD = (
    f'<!doctype html><html><head><meta charset=\'utf-8\'><meta name="generator" content="{GENERATOR}">'
)
PNG_METADATA = {"Software": GENERATOR}  # matplotlib's savefig(metadata=...): a PNG tEXt chunk
JSON_FIELD = "written_by"
_WHAT = {
    "report": "an HTML report",
    "png": "a PNG plot",
    "bench": "a bench table",
    "plan": "a plan",
    "eval": "an evaluation",
}
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHUNK = b"tEXtSoftware\x00" + GENERATOR.encode()
# Text chunks come before a PNG's image data; a JSON table is read whole.
_HEAD_BYTES = 64 * 1024
_JSON_BYTES = 64 * MIB


def json_marked(value: dict[str, Any], command: str) -> dict[str, Any]:
    """``value`` with the field that marks it as written by ``lmtune command``."""
    return {JSON_FIELD: f"{GENERATOR} {command}", **value}


def written_by_lmtune(path: Path, kind: Kind) -> bool:
    """Whether the regular file at ``path`` is lmtune's file of ``kind`` (a bench table, a plan:
    written by that command); False for a link, a folder, or anything unreadable."""
    try:
        if kind == "report":
            return _head(path).startswith(HTML_HEAD.encode())
        if kind == "png":
            head = _head(path)
            # The whole chunk, its length first: the words in some other chunk are not the mark.
            return (
                head.startswith(_PNG_SIGNATURE)
                and struct.pack(">I", len(_PNG_CHUNK) - 4) + _PNG_CHUNK in head
            )
        value = decode_json(read_text(path, limit=_JSON_BYTES, follow_links=False), str(path))
    except (OSError, UserError):
        return False
    rows = value if isinstance(value, list) and value else [value]
    return all(isinstance(r, dict) and r.get(JSON_FIELD) == f"{GENERATOR} {kind}" for r in rows)


def _head(path: Path) -> bytes:
    """The first bytes of a regular file, not through a link; nothing for anything else."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        return os.read(fd, _HEAD_BYTES) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)


def check_replaceable(path: Path, option: str, kind: Kind) -> None:
    """Refuse (exit 2) to write ``option``'s file of ``kind`` at ``path`` over anything but an
    earlier one, or into a folder it cannot write."""
    where = f"{option} {path}"
    if path.is_symlink():
        raise UserError(f"{where}: a symbolic link; lmtune does not write through links")
    if path.is_dir():
        raise UserError(f"{where}: a folder; name a file")
    if path.exists() and not written_by_lmtune(path, kind):
        raise UserError(
            f"{where}: not {_WHAT[kind]} lmtune wrote, and lmtune replaces only its own; name another "
            "file, or move this one away first"
        )
    folder = next(f for f in (path.absolute().parent, *path.absolute().parents) if f.exists())  # made later
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{where}: cannot write in {folder} ({unwritable(folder)})")


def write_output(path: Path, data: bytes | str, option: str) -> None:
    """Write ``data`` whole at ``path`` (checked by :func:`check_replaceable`), in a folder made
    for it where there is none."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{option} {path}: cannot write it ({e.strerror})") from None
