"""The exceptions that end a run with a message rather than a traceback, and their exit codes."""

from __future__ import annotations

import errno
import math
import shutil
from pathlib import Path
from typing import TypeGuard


class UserError(Exception):
    """A mistake in the user's options, data or paths.

    The CLI turns it into a one-line message on stderr and exit code 2, without a traceback, because
    the fix is on the user's side and a stack trace would only hide the message.
    """


class SettingError(UserError):
    """A setting whose value cannot work, named by its flag (``--epochs: must be >= 1 (got -1)``);
    the CLI names the line of a --config file instead when the value came from there."""

    def __init__(self, setting: str, flag: str, reason: str):
        super().__init__(f"{flag}: {reason}")
        self.setting = setting  # the setting's name (``epochs``)
        self.reason = reason  # what is wrong with its value


class UnknownSetting(UserError, TypeError):
    """A name ``TrainConfig`` does not take: a :class:`UserError` (as the CLI's exit 2), and a
    ``TypeError``, as Python's own for an unexpected keyword."""


class WrongType(SettingError, TypeError):
    """A value of the wrong type given to ``TrainConfig`` (``beta="x"``): a :class:`SettingError`,
    and a ``TypeError``, as Python's own for a wrong argument."""


class WrongValue(SettingError, ValueError):
    """A value of the right type that the setting does not take, given to ``TrainConfig``
    (``objective="dpoo"``, ``lr=float("nan")``): a :class:`SettingError`, and a ``ValueError``."""


class NoSpace(UserError):
    """The disk (or the user's quota) was full while lmtune wrote ``path``, a file of its own."""

    def __init__(self, message: str, path: Path):
        super().__init__(message)
        self.path = path


USER_ERROR_EXIT_CODE = 2


class StoppedBySignal(Exception):
    """SIGTERM or SIGINT arrived before training began: there is nothing to save, so the run ends
    at once (exit code 128 + the signal's number, as a process killed by it would)."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name} before training began; nothing to save")
        self.signum = signum


class TrainingStopped(Exception):
    """Training cannot go on (a non-finite loss under --on-nan stop); the message says why.
    Exit code 1; the message names the newest checkpoint, if there is one."""


def out_of_space(e: BaseException, written: Path | None = None) -> bool:
    """Whether ``e`` came of a full disk or an exhausted quota, as the OS, safetensors (Rust) or
    torch report it. torch's writer names no cause ("unexpected pos 576 vs 534"), so a failure
    while the disk holding ``written`` has under 1 MiB left counts too (ask before removing what
    was half written: that frees the space again)."""
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(words in str(e) for words in ("No space left", "Disk quota exceeded", "StorageFull")):
        return True
    if written is None:
        return False
    folder = written
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def room(needed: int) -> int:
    """The free bytes lmtune asks before writing ``needed`` bytes: 5% and 1 MiB to spare."""
    return int(needed * 1.05) + (1 << 20)


def sizes(needed: int, free: int) -> str:
    """``about 11.6 MB needed, 10.2 MB free``: ``needed`` with its margin (:func:`room`), to a tenth
    of a MB below 100 MB, so that the two figures of a refusal never read the same."""

    return f"about {megabytes(room(needed))} needed, {megabytes(free)} free"


def megabytes(n: int) -> str:
    """``11.6 MB``: to a tenth of a MB below 100 MB."""
    return f"{n / 2**20:,.1f} MB" if n < 100 << 20 else f"{n / 2**20:,.0f} MB"


def brief(value: object, limit: int = 60) -> str:
    """``value`` as an error message may show it: a bounded repr (a YAML alias bomb or a 100 MB
    string is never expanded), on one line, at most ``limit`` characters."""
    import reprlib

    shortened = reprlib.Repr()
    shortened.maxstring = shortened.maxother = limit
    shortened.maxlevel, shortened.maxdict, shortened.maxlist = 3, 4, 4
    if too_long_to_show(value):
        return f"an integer of {int(value.bit_length() * math.log10(2)) + 1:,} digits"
    text = " ".join(shortened.repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def too_long_to_show(value: object) -> TypeGuard[int]:
    """An integer past ~3,000 digits: Python prints none past 4,300 (nor str() it), and no check's
    message can show it; a count of that size is no setting's."""
    return isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 10_000


def why_it_failed(e: BaseException, limit: int = 160) -> str:
    """A library's exception as a message part: its first two lines on one (torch's and
    safetensors' first often says only where, the second what), else its kind."""
    lines = [line for line in str(e).strip().splitlines()[:2] if line.strip()]
    return one_line(" ".join(lines), limit) or type(e).__name__


def one_line(text: str, limit: int = 200) -> str:
    """``text`` (a message part) on one line, at most ``limit`` characters."""
    flat = " ".join(text[: limit * 4].split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


# C0 controls and DEL but the newline and the tab: a terminal shows nothing for them, or acts on them.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), 127) if chr(c) not in "\n\t"}


def visible(text: str) -> str:
    """Generated ``text`` as it is printed: its control characters written as escapes (``\\x00``).
    A model that generated NUL bytes printed them raw to the terminal."""
    return text.translate(_CONTROLS)
