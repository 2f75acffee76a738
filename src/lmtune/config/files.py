"""Small files read safely: every record, lock, setting and template file lmtune reads is treated
as hostile. A file is opened without blocking (a FIFO never hangs the reader), must be a regular file
(not ``/dev/zero``, a socket or a device), is read up to a size cap (a huge file is refused before
it is read), and, where lmtune wrote it itself, is opened without following a symbolic link. JSON
is decoded with its nesting bounded; every problem is one :class:`UserError` line naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any

from lmtune.errors import UserError

KIB, MIB = 1 << 10, 1 << 20
# Caps by kind: lmtune's own records are a few KiB; a settings file or a template is written by hand.
RECORD_BYTES = 4 * MIB
RUN_RECORD_BYTES = 64 * MIB  # a run's run.json: its settings, results and long data lists
SETTINGS_BYTES = 1 * MIB


class TooLarge(UserError):
    """A file over the size its kind may have (callers may say it in their own words)."""


def read_bytes(path: Path, *, limit: int, follow_links: bool = True) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Raises:
        FileNotFoundError: when there is no such file (callers decide whether that is an error).
        TooLarge: over ``limit``.
        UserError: a link (``follow_links`` False), not a regular file, unreadable.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_links:
            raise UserError(f"{path}: is a symbolic link; lmtune does not follow links here") from None
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UserError(f"{path}: a folder, not a file")
        if not stat.S_ISREG(info.st_mode):
            raise UserError(f"{path}: not a regular file (a FIFO, device or socket is not read)")
        if info.st_size > limit:
            raise TooLarge(f"{path}: {info.st_size:,} bytes, over the {limit:,} such a file may have")
        chunks, total = [], 0
        while chunk := os.read(fd, min(limit + 1 - total, MIB)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # grew while being read
                raise TooLarge(f"{path}: over the {limit:,} bytes such a file may have")
        return b"".join(chunks)
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror})") from None
    finally:
        os.close(fd)


def read_text(path: Path, *, limit: int, follow_links: bool = True) -> str:
    """The UTF-8 text of ``path`` (see :func:`read_bytes`)."""
    data = read_bytes(path, limit=limit, follow_links=follow_links)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 text (byte {e.start})") from None


def decode_json(text: str, where: str) -> Any:
    """JSON from ``text``; nesting beyond Python's recursion limit is an error, not a crash."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise UserError(f"{where}: not valid JSON ({str(e).splitlines()[0][:80]})") from None


def read_json(path: Path, *, limit: int = RECORD_BYTES, follow_links: bool = False) -> Any:
    """A JSON file lmtune wrote (a record, a lock): by default not through a link."""
    return decode_json(read_text(path, limit=limit, follow_links=follow_links), str(path))


def read_json_object(path: Path, *, limit: int = RECORD_BYTES, follow_links: bool = False) -> dict[str, Any]:
    """A JSON file that must hold an object."""
    value = read_json(path, limit=limit, follow_links=follow_links)
    if not isinstance(value, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def is_int(value: Any, low: int = 0, high: int = 2**53) -> bool:
    """An int (not a bool) in ``[low, high]``: a count read from a record."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def unwritable(folder: Path) -> str:
    """Why this process may not write in ``folder``, in a few words (it checked that it may not)."""
    return "a read-only file system" if os.statvfs(folder).f_flag & os.ST_RDONLY else "no permission"
