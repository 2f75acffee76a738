"""Other packages' warnings that say nothing about the user's run stay out of lmtune's output,
hidden only around lmtune's own calls into them; -v shows them."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import pytest

from lmtune.config.verbosity import VERBOSE_ENV, quiet_calls
from tests.conftest import run_lmtune, write_jsonl

OURS = ("lmtune", "error")


def _foreign(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(OURS)]


def test_quiet_calls_hide_only_inside_and_restore(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    logger = logging.getLogger("some.package")
    before = logger.level
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_calls("some"):
            warnings.warn("renamed", FutureWarning, stacklevel=1)
            assert logging.getLogger("some").level == logging.ERROR
        warnings.warn("outside", FutureWarning, stacklevel=1)
        monkeypatch.setenv(VERBOSE_ENV, "1")
        with quiet_calls("some"):
            warnings.warn("verbose", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["outside", "verbose"]
    assert logger.level == before and logging.getLogger("some").level == logging.NOTSET


def test_commands_print_no_foreign_lines_and_verbose_shows_them(tmp_path: Path) -> None:
    """LoRA (peft, and through it bitsandbytes), the 8-bit optimizer and transformers' schedules: the
    imports and calls that printed bitsandbytes' kernel notice and transformers' FutureWarning."""
    data = str(write_jsonl(tmp_path / "d.jsonl", [f"{i} plus {i}" for i in range(8)]))
    args = ["train", "--lora", "--optimizer", "adamw8bit", "--lr-schedule", "linear", "--max-steps", "1"]
    args += ["--data", data, "--global-batch-size", "8", "--no-progress"]
    quiet = run_lmtune([*args, "--output-dir", str(tmp_path / "quiet")], timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert _foreign(quiet.stderr) == []
    loud = run_lmtune([*args, "--output-dir", str(tmp_path / "loud"), "-v"], timeout=300)
    assert loud.returncode == 0, loud.stderr
    assert _foreign(loud.stderr)  # there was something to hide
    for command in (["--help"], ["plan", "--help"], ["data", "audit", data]):
        proc = run_lmtune(command, timeout=120)
        assert proc.returncode == 0 and _foreign(proc.stderr) == [], (command, proc.stderr)
