"""Opening a data file's bytes: decompressed where its name says so, a damaged archive named as
such, and text in an encoding other than UTF-8 said with how to convert it."""

from __future__ import annotations

import bz2
import codecs
import gzip
import lzma
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from lmtune.errors import UserError

OPENERS: dict[str, Callable[..., Any]] = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


class Undecompressable(UserError):
    """A compressed data file that does not decompress: damaged or cut short."""


DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


@contextmanager
def opened(path: str) -> Iterator[BinaryIO]:
    """``path`` open for reading its bytes, decompressed where its name says so (``.gz``): a
    damaged or truncated archive is named, not a traceback."""
    opener = OPENERS.get(Path(path).suffix.lower())
    if opener is None:
        with open(path, "rb") as f:
            yield f
        return
    try:
        with opener(path, "rb") as f:
            yield f
    except DECOMPRESSION_ERRORS as e:
        raise Undecompressable(f"{path}: cannot be decompressed ({e or type(e).__name__})") from None


def damage(path: str) -> str | None:
    """What is wrong with the archive at ``path``, found by reading it all, or None."""
    try:
        with OPENERS[Path(path).suffix.lower()](path, "rb") as f:
            while f.read(1 << 20):
                pass
    except DECOMPRESSION_ERRORS as e:
        return str(e) or type(e).__name__
    return None


def spoilt(path: str, damaged: str, bad_line: str) -> Undecompressable:
    line, _, problem = bad_line.removeprefix(f"{path}:").partition(": ")
    return Undecompressable(
        f"{path}: {damaged}: the archive is damaged, which is why line {line} read as {problem}"
    )


def compressed_hint(head: bytes) -> str:
    """What to say of a file under a plain name that starts as gzip, xz or bzip2 files do."""
    packed = head.startswith((b"\x1f\x8b", b"\xfd7zXZ", b"BZh"))
    return ": it is compressed; name it by its compression (.gz, .xz, .bz2)" if packed else ""


# Byte-order marks of the encodings Windows tools save "Unicode" text in (UTF-32's first: its
# little-endian mark begins with UTF-16's).
_OTHER_ENCODINGS = [(mark, "UTF-32") for mark in (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)] + [
    (mark, "UTF-16") for mark in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
]


def check_utf8(path: str) -> None:
    """A text file saved in UTF-16 or UTF-32 (Excel's and PowerShell's "Unicode", Python's
    ``encoding="utf-16-le"``) is said as such with how to convert it: its lines read as bad UTF-8
    and broken JSON, its CSV header as the names of no field."""
    with opened(path) as f:
        head = f.read(4)
    encoding = next((name for mark, name in _OTHER_ENCODINGS if head.startswith(mark)), None)
    said = f"it starts with {encoding}'s byte-order mark"
    if encoding is None and (encoding := _unmarked_encoding(head)) is not None:
        said = "its first characters are ASCII with zero bytes between them"
    if encoding is not None:
        tool = _read_as_text(path)
        raise UserError(
            f"{path}: {encoding} text ({said}); lmtune reads UTF-8: convert it, such as "
            f"{tool}iconv -f {encoding} -t UTF-8 {'' if tool else 'FILE '}> NEW"
        )


def _unmarked_encoding(head: bytes) -> str | None:
    """UTF-16 or UTF-32 without a byte-order mark, by where the zero bytes of its first ASCII
    characters (a JSON record's ``{"``, a CSV header, text) fall; UTF-8 text holds no zero byte."""
    if len(head) < 4 or head.count(0) not in (2, 3):
        return None
    zero = [b == 0 for b in head]
    return {
        (False, True, False, True): "UTF-16LE",
        (True, False, True, False): "UTF-16BE",
        (False, True, True, True): "UTF-32LE",
        (True, True, True, False): "UTF-32BE",
    }.get((zero[0], zero[1], zero[2], zero[3]))


def _read_as_text(path: str) -> str:
    """The command that writes a compressed file's text out, piped to the next (or "")."""
    tool = {".gz": "gunzip -c", ".bz2": "bzip2 -dc", ".xz": "xz -dc"}.get(Path(path).suffix.lower())
    return f"{tool} FILE | " if tool else ""
