"""bf16 autocast trains on CPU; --compile either compiles or falls back and still trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtune.config import TrainConfig
from lmtune.train import train
from tests.conftest import train_rows


@pytest.mark.parametrize("extra", [{"precision": "bf16"}, {"compile": True}], ids=["bf16", "compile"])
def test_training_options_still_learn(tmp_path: Path, extra: dict[str, object]) -> None:
    out = tmp_path / "out"
    cfg = TrainConfig(output_dir=str(out), max_steps=30, progress=False, **extra)  # type: ignore[arg-type]
    result = train(cfg)
    rows = train_rows(out)
    assert result.steps == 30 and len(rows) == 30
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    assert all(0 < r["mfu"] < 1.5 for r in rows[1:])
