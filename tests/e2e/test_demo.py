"""The README's demo path: `lmtune train` on the built-in default, then `lmtune generate`."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_lmtune


def test_default_demo_trains_saves_and_generates(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_lmtune(["train", "--max-steps", "40", "--output-dir", str(out), "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert "held-out answers:" in proc.stdout
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 40
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 1.0  # it visibly learns
    assert {"step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= train_rows[0].keys()
    assert rows[-1]["kind"] == "eval" and rows[-1]["eval_examples"] == 250
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["data"] == "sample" and run["result"]["steps"] == 40

    gen = run_lmtune(
        ["generate", "--model", str(out / "final"), "--prompt", "12+34=", "--max-new-tokens", "4"]
    )
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("12+34=")
