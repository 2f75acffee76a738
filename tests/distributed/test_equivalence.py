"""N ranks train the same model as one process: the real CLI under the real launcher, gloo on CPU.

The launches are expensive (~7 s of imports per rank), so each runs once per module and every
check below reads their outputs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import assert_same_training, run_lmtune, uneven_texts, write_jsonl

pytestmark = pytest.mark.distributed

STEPS = 6
GLOBAL_BATCH = 8


def _read_metrics(out: Path, kind: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("equivalence")
    train = write_jsonl(root / "train.jsonl", uneven_texts(STEPS * GLOBAL_BATCH + 3, seed=11))
    evald = write_jsonl(root / "eval.jsonl", uneven_texts(7, seed=12))  # odd: 4 + 3 on 2 ranks
    base = [
        "--model",
        "tiny",
        "--data",
        str(train),
        "--eval-data",
        str(evald),
        "--seed",
        "7",
        "--global-batch-size",
        str(GLOBAL_BATCH),
        "--micro-batch-size",
        "2",
        "--epochs",
        "1",
        "--eval-every",
        "3",
        "--lr",
        "1e-3",
        "--warmup-ratio",
        "0.2",
        "--max-length",
        "64",
        "--threads-per-process",
        "1",
        "--no-progress",
    ]
    # Padded micro-batches in sampler order: the case where a mean of means goes wrong.
    common = [*base, "--packing", "off", "--no-group-by-length"]
    # NEFTune and LoRA's dropout on packed rows: each example's noise and masks must not depend on
    # its rank or row.
    neftune = [*base, "--packing", "on", "--neftune-alpha", "5", "--lora", "--lora-dropout", "0.2"]
    names = ("single", "nproc", "torchrun", "checkpointed", "neftune_single", "neftune_nproc")
    outs = {name: root / name for name in names}
    procs = {
        "single": run_lmtune(["train", *common, "--output-dir", str(outs["single"])]),
        "nproc": run_lmtune(["train", *common, "--nproc-per-node", "2", "--output-dir", str(outs["nproc"])]),
        "torchrun": run_lmtune(
            ["train", *common, "--output-dir", str(outs["torchrun"])],
            launcher=[
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "localhost:0",
                "-m",
            ],
        ),
        "checkpointed": run_lmtune(
            [
                "train",
                *common,
                "--nproc-per-node",
                "2",
                "--activation-checkpointing",
                "--output-dir",
                str(outs["checkpointed"]),
            ]
        ),
        "neftune_single": run_lmtune(["train", *neftune, "--output-dir", str(outs["neftune_single"])]),
        "neftune_nproc": run_lmtune(
            ["train", *neftune, "--nproc-per-node", "2", "--output-dir", str(outs["neftune_nproc"])]
        ),
    }
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return outs


def test_run_setup_differs_only_in_world_size_and_accumulation(runs: dict[str, Path]) -> None:
    single = json.loads((runs["single"] / "run.json").read_text())
    nproc = json.loads((runs["nproc"] / "run.json").read_text())
    assert single["environment"]["world_size"] == 1 and single["resolved"]["accumulation"] == 4
    assert nproc["environment"]["world_size"] == 2 and nproc["resolved"]["accumulation"] == 2
    assert nproc["resolved"]["strategy"] == "ddp" and nproc["environment"]["backend"] == "gloo"
    assert single["resolved"]["total_steps"] == nproc["resolved"]["total_steps"] == STEPS


def test_per_step_losses_match(runs: dict[str, Path]) -> None:
    single, nproc, torchrun = (_read_metrics(runs[k], "train") for k in ("single", "nproc", "torchrun"))
    assert [r["step"] for r in single] == list(range(1, STEPS + 1))
    for a, b, c in zip(single, nproc, torchrun, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a, b)
        assert abs(b["loss"] - c["loss"]) <= 1e-6
        assert a["target_tokens"] == b["target_tokens"] and a["tokens"] == b["tokens"]
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    assert single[-1]["loss"] < single[0]["loss"]


def test_final_weights_match_to_fp32_rounding(runs: dict[str, Path]) -> None:
    single = load_file(runs["single"] / "final" / "model.safetensors")
    for other in ("nproc", "torchrun"):
        assert_same_training(load_file(runs[other] / "final" / "model.safetensors"), single, other)
    start = load_file(runs["single"] / "final" / "model.safetensors")
    assert any(not torch.equal(start[k], torch.zeros_like(start[k])) for k in start)


def test_eval_counts_every_example_once_across_ranks(runs: dict[str, Path]) -> None:
    single, nproc = (_read_metrics(runs[k], "eval") for k in ("single", "nproc"))
    assert [r["step"] for r in single] == [3, 6] == [r["step"] for r in nproc]
    for a, b in zip(single, nproc, strict=True):
        assert a["eval_examples"] == b["eval_examples"] == 7
        assert a["eval_tokens"] == b["eval_tokens"]
        assert b["eval_perplexity"] == pytest.approx(a["eval_perplexity"], rel=1e-6)


def test_final_model_loads_with_transformers(runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(runs["nproc"] / "final")
    tok = AutoTokenizer.from_pretrained(runs["nproc"] / "final")
    assert model.config.vocab_size == len(tok)


def test_a_user_error_on_every_rank_is_reported_once_without_hanging(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = run_lmtune(
        ["train", "--nproc-per-node", "2", "--model", "./no-such-model", "--output-dir", str(tmp_path / "o")],
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("--model ./no-such-model: no such folder") == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert time.monotonic() - started < 60


def test_activation_checkpointing_under_ddp_trains_the_same(runs: dict[str, Path]) -> None:
    """Recomputed activations give the same gradients: no "marked ready twice", same weights."""
    plain, checkpointed = (_read_metrics(runs[k], "train") for k in ("nproc", "checkpointed"))
    assert [r["loss"] for r in checkpointed] == pytest.approx([r["loss"] for r in plain], abs=1e-6)
    a = load_file(runs["nproc"] / "final" / "model.safetensors")
    b = load_file(runs["checkpointed"] / "final" / "model.safetensors")
    assert_same_training(a, b)


def test_neftune_noise_and_dropout_are_the_same_on_two_ranks_as_in_one_process(runs: dict[str, Path]) -> None:
    single, nproc = (_read_metrics(runs[k], "train") for k in ("neftune_single", "neftune_nproc"))
    plain = _read_metrics(runs["single"], "train")
    assert len(single) == len(nproc) == STEPS
    assert [r["loss"] for r in nproc] == pytest.approx([r["loss"] for r in single], abs=1e-6)
    assert single[0]["loss"] != pytest.approx(plain[0]["loss"], abs=1e-4)  # the noise was there
    for name in ("neftune_single", "neftune_nproc"):
        run = json.loads((runs[name] / "run.json").read_text())
        assert run["config"]["neftune_alpha"] == 5.0 and run["resolved"]["batching"] == "pack"
        assert run["config"]["lora_dropout"] == 0.2
    assert_same_training(
        load_file(runs["neftune_nproc"] / "final" / "adapter_model.safetensors"),
        load_file(runs["neftune_single"] / "final" / "adapter_model.safetensors"),
        "NEFTune and LoRA dropout, 2 ranks vs 1 process",
    )
