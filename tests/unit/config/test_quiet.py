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
