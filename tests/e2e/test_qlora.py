"""QLoRA on a model folder through the real CLI: `lmtune plan` predicts the measured peak within
15%, the 4-bit base takes a fraction of the fp32 base's memory, and bf16 compute trains."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.conftest import run_lmtune, train_rows, write_jsonl

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    from lmtune.model.modeling import build_preset

    root = tmp_path_factory.mktemp("qlora-e2e")
    base = build_preset("small", 0)
    base.model.save_pretrained(root / "model")
    base.tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]
    data = write_jsonl(root / "data.jsonl", [" ".join(rng.choices(words, k=120)) for _ in range(24)])
    common = [
        *("--model", str(root / "model"), "--data", str(data), "--lora", "--load-in-4bit"),
        *("--max-length", "256", "--packing", "on", "--micro-batch-size", "4", "--global-batch-size", "4"),
        *("--cache-dir", str(root / "cache"), "--seed", "0"),
    ]
    return root, common


def test_plan_predicts_the_measured_peak_within_15_percent(setup: tuple[Path, list[str]]) -> None:
    root, common = setup
    proc = run_lmtune(["plan", *common, "--json", str(root / "plan.json")], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "single x1 fp32 adamw+lora+nf4" in proc.stdout
    predicted = json.loads((root / "plan.json").read_text())["requested"]
    proc = run_lmtune(
        ["train", *common, "--max-steps", "3", "--output-dir", str(root / "run"), "--no-progress"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((root / "run" / "run.json").read_text())
    measured = max(run["result"]["peak_memory_per_rank"])
    assert abs(predicted["total"] - measured) <= 0.15 * measured, (predicted["total"], measured)
    size = run["resolved"]["base_bytes"]
    assert predicted["weights"] == size["quantized"] + size["full_precision"] + size["adapters"]
    assert size["adapters"] > 0  # the LoRA adapters, apart from the base


def test_bf16_compute_trains(setup: tuple[Path, list[str]]) -> None:
    root, common = setup
    out = root / "bf16"
    proc = run_lmtune(
        [
            "train",
            *common,
            "--precision",
            "bf16",
            "--max-steps",
            "6",
            "--lr",
            "2e-3",
            "--output-dir",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [r["loss"] for r in train_rows(out)]
    assert losses[-1] < losses[0]
    assert (
        json.loads((out / "run.json").read_text())["resolved"]["quantization"]
        == "nf4, double quant, compute bf16"
    )
