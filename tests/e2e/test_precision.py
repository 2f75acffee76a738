"""bf16 autocast trains on CPU; --compile either compiles or falls back and still trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmtune.config.settings import TrainConfig
from lmtune.model.products import choose_products
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
    measured = [r["mfu"] for r in rows[1:] if r["mfu"] is not None]  # None: over 100% (peak read low)
    assert len(measured) >= 20 and all(0 < m <= 1 for m in measured)
    products = json.loads((out / "run.json").read_text())["resolved"]["products"]
    assert products == choose_products(cfg.precision, torch.device("cpu"), cfg.compile).description


def test_cpu_bf16_attention_memory_stays_flat_over_a_long_run(tmp_path: Path) -> None:
    """Bucketed bf16 attention on the CPU (forced: this machine may measure fp32 faster): 200 steps
    of examples of every length from 8 to 200 tokens, and the process's peak memory after step 50
    is within 5% of its peak after step 200 (unbounded shapes grew it ~20 MB a step)."""
    import json
    import random

    from lmtune.model.attention import CPU_ATTENTION_ENV
    from tests.conftest import run_lmtune

    rng = random.Random(0)
    data = tmp_path / "varied.jsonl"
    texts = ["".join(rng.choices("abcdefgh ", k=rng.randint(8, 200))) for _ in range(400)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    args = [
        "train",
        "--data",
        str(data),
        "--precision",
        "bf16",
        "--max-steps",
        "200",
        "--global-batch-size",
        "2",
    ]
    args += ["--packing", "off", "--no-progress", "--output-dir", str(out), "--threads-per-process", "2"]
    proc = run_lmtune(args, timeout=600, env_extra={CPU_ATTENTION_ENV: "bf16"})
    assert proc.returncode == 0, proc.stderr
    assert (
        "bf16 in lengths rounded to 64" in json.loads((out / "run.json").read_text())["resolved"]["attention"]
    )
    peak = {r["step"]: r["peak_memory_bytes"] for r in train_rows(out)}
    assert peak[200] <= 1.05 * peak[50], (peak[50], peak[200])
