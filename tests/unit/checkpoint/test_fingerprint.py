"""A resume's comparison with its checkpoint says each difference as saved -> now."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtune.checkpoint.resume import Fingerprint, compare
from lmtune.errors import UserError


def test_an_unset_setting_is_said_none_not_python_none() -> None:
    saved = Fingerprint({"--reference-model": None, "--seed": 1}, {"--beta": 0.1})
    changed = Fingerprint({"--reference-model": "/models/ref", "--seed": 1}, {"--beta": 0.1})
    with pytest.raises(UserError, match="--reference-model none -> /models/ref"):
        compare(saved, changed, Path("c"))
    now = Fingerprint({"--reference-model": None, "--seed": 1}, {"--beta": 0.2})
    assert compare(saved, now, Path("c")) == ["--beta 0.1 -> 0.2"]
