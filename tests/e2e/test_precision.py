"""bf16 autocast trains on CPU; --compile either compiles or falls back and still trains; a long CPU
bf16 run on varied lengths keeps its memory flat on whichever paths the CPU takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtune.config.settings import TrainConfig
from lmtune.model.attention import CPU_ATTENTION_ENV
from lmtune.model.paths import BF16, FP32, cpu_units
from lmtune.model.products import PRODUCTS_ENV, onednn_bf16
from lmtune.train import train
from tests.conftest import run_lmtune, train_rows
from tests.support.pairs import write_pairs


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
    record = json.loads((out / "run.json").read_text())
    resolved, paths = record["resolved"], record["resolved"]["paths"]
    if cfg.compile:  # all 4 of the tiny preset's blocks
        assert record["result"]["compile"]["compiled"] == "4 of 4 decoder blocks"
    assert (record["result"]["compile"] is None) is not cfg.compile
    assert paths["cpu_matrix_units"] == cpu_units().describe()
    if cfg.precision != "bf16" or cfg.compile:
        assert paths["products"] is None and paths["attention"] is None
        return
    # Which paths a CPU takes is tested by forcing each (tests/unit/model/test_paths.py); here: the run
    # says what it took and how, and the rules held where they decide.
    products = paths["products"]
    assert products["choice"] in (BF16, FP32) and products["decided"]
    assert resolved["products"].startswith("fp32 products" if products["choice"] == FP32 else "bf16")
    if not onednn_bf16():
        assert products == {
            "choice": FP32,
            "decided": "rule: PyTorch has no bf16 matrix kernels for this CPU (reference loops)",
        }
    elif cpu_units().amx:
        assert products == {"choice": BF16, "decided": "rule: AMX"}


def test_compile_under_activation_checkpointing_compiles_and_trains_as_eager(tmp_path: Path) -> None:
    """transformers checkpoints inside a block's forward, and a checkpoint traced by torch.compile
    takes no graph break (attention is left out of the graphs): every block ran eagerly, unsaid
    (0 graphs). The checkpoint now goes around the compiled forward."""
    losses = {}
    for name, extra in (("eager", ()), ("compiled", ("--compile",))):
        out = tmp_path / name
        argv = ["train", "--activation-checkpointing", "--max-steps", "3", "--output-dir", str(out), *extra]
        proc = run_lmtune(argv)
        assert proc.returncode == 0, proc.stderr
        losses[name] = [r["loss"] for r in train_rows(out)]
        if extra:
            assert "; activation checkpointing; compiled per block" in proc.stdout
            assert json.loads((out / "run.json").read_text())["result"]["compile"]["graphs"] > 0
            assert "torch.compile made no graph" not in proc.stdout
    assert losses["compiled"] == pytest.approx(losses["eager"], abs=1e-5)


def _varied_run(tmp_path: Path, env: dict[str, str]) -> tuple[dict[str, object], dict[int, int]]:
    """200 steps of examples of every length from 8 to 200 tokens, one example per micro-batch
    pair: a new token count at almost every step."""
    import random

    rng = random.Random(0)
    data = tmp_path / "varied.jsonl"
    texts = ["".join(rng.choices("abcdefgh ", k=rng.randint(8, 200))) for _ in range(400)]
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    args = ["train", "--data", str(data), "--precision", "bf16", "--max-steps", "200"]
    args += ["--global-batch-size", "2", "--packing", "off", "--no-progress", "--output-dir", str(out)]
    args += ["--threads-per-process", "2"]
    proc = run_lmtune(args, timeout=600, env_extra=env)
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads((out / "run.json").read_text())["resolved"]
    return resolved, {r["step"]: r["peak_memory_bytes"] for r in train_rows(out)}


def test_cpu_bf16_memory_stays_flat_over_a_long_run(tmp_path: Path) -> None:
    """On whichever paths this CPU takes: the peak after step 200 within 5% of the peak after step
    100 (a new shape per step grew a run on AMX ~5 MB a step: 1,094 MiB at 100, 1,367 at 200)."""
    resolved, peak = _varied_run(tmp_path, {PRODUCTS_ENV: "auto", CPU_ATTENTION_ENV: "auto"})
    assert peak[200] <= 1.05 * peak[100], (resolved["paths"], peak[50], peak[100], peak[200])


@pytest.mark.skipif(not cpu_units().bf16, reason="no bf16 matrix units: bf16 kernels run in reference loops")
def test_cpu_bf16_kernels_memory_stays_flat_over_a_long_run(tmp_path: Path) -> None:
    """bf16 products and bf16 (bucketed) attention forced, on a CPU with bf16 units: the kernels
    that keep one per shape, on bounded shapes."""
    resolved, peak = _varied_run(tmp_path, {PRODUCTS_ENV: BF16, CPU_ATTENTION_ENV: BF16})
    assert resolved["products"] == "bf16, token counts bucketed"
    assert "bf16 in lengths rounded to 64" in str(resolved["attention"])
    assert peak[200] <= 1.05 * peak[100], (peak[50], peak[100], peak[200])


def test_compile_keeps_per_example_attention(tmp_path: Path) -> None:
    """--compile compiles each decoder block with attention left out of its graphs: packed rows keep
    per-example attention and the chunked loss, the losses are the eager run's, and the graphs do
    not multiply with the batches' example lengths (traced, the per-example loop specialised the
    graph on every batch's lengths and recompiled). A DPO run's live reference (a copy of the
    compiled model) computes with its own frozen weights, not the policy's: the same losses too."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    pairs = write_pairs(tmp_path / "pairs.jsonl", 32, seed=3)

    def run(name: str, **settings: object) -> tuple[dict[str, object], list[float]]:
        out = tmp_path / name
        cfg = TrainConfig(output_dir=str(out), progress=False, **settings)  # type: ignore[arg-type]
        train(cfg)
        return json.loads((out / "run.json").read_text())["resolved"], [r["loss"] for r in train_rows(out)]

    torch._dynamo.reset()
    counters.clear()
    eager, eager_losses = run("eager", max_steps=12, packing="on")
    compiled, compiled_losses = run("compiled", max_steps=12, packing="on", compile=True)
    assert compiled["attention"] == eager["attention"] == "per example"
    assert compiled["loss"] == eager["loss"] and str(compiled["loss"]).startswith("chunked")
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4)
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 6, f"{graphs} graphs for 12 steps of packed rows"

    dpo = {"objective": "dpo", "reference": "live", "data": str(pairs), "max_steps": 4}
    dpo["global_batch_size"] = 8
    _, eager_dpo = run("dpo-eager", **dpo)
    _, compiled_dpo = run("dpo-compiled", **dpo, compile=True)
    assert eager_dpo[-1] < eager_dpo[0] - 0.01  # the policy moved away from its reference
    assert compiled_dpo == pytest.approx(eager_dpo, rel=1e-4)
