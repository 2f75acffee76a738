"""Other packages' warnings that say nothing about the user's run stay out of lmtune's output,
hidden only around lmtune's own calls into them; -v shows them."""

from __future__ import annotations

import logging
import warnings

import pytest

from lmtune.config.environment import VERBOSE as VERBOSE_ENV
from lmtune.config.verbosity import quiet_calls


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


def test_a_runs_quieting_is_put_back_when_the_call_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes' notices were quieted for the whole process (its levels and a warnings filter
    left set after lmtune.train returned), and peft's adapter layers imported bitsandbytes outside
    the quieted import, so its missing-kernel notice (naming a trust_remote_code that is not
    lmtune's) came on every LoRA run."""
    from lmtune.config.verbosity import RUN_QUIETED_LOGGERS, run_quiet_restored
    from lmtune.model.lora import _quiet_peft
    from lmtune.model.quantization import quiet_bitsandbytes

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    ops = logging.getLogger("bitsandbytes.backends.cpu.ops")
    was = ops.level
    ops.setLevel(logging.NOTSET)  # as a fresh process has it, whatever an earlier test's call left
    try:
        levels = {name: logging.getLogger(name).level for name in RUN_QUIETED_LOGGERS}
        filters = list(warnings.filters)
        with run_quiet_restored():
            warnings.resetwarnings()  # inside: put back with the rest
            quiet_bitsandbytes()
            assert all(logging.getLogger(name).level == logging.ERROR for name in RUN_QUIETED_LOGGERS)
            assert any(f[1] is not None and f[1].pattern.startswith("MatMul8bitLt") for f in warnings.filters)
        assert {name: logging.getLogger(name).level for name in RUN_QUIETED_LOGGERS} == levels
        assert warnings.filters == filters
        with _quiet_peft():
            assert not ops.isEnabledFor(logging.WARNING)
        assert ops.isEnabledFor(logging.WARNING)
    finally:
        ops.setLevel(was)
