"""Checks that need CUDA; skipped without it. Run on a lent GPU by scripts/gpu-check.sh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmtune.config.settings import TrainConfig
from lmtune.train import train
from tests.conftest import uneven_texts, write_jsonl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(tmp_path: Path, name: str, **overrides: object) -> list[float]:
    import json

    data = write_jsonl(tmp_path / "train.jsonl", uneven_texts(64, seed=3))
    cfg = TrainConfig(
        model="tiny",
        data=str(data),
        output_dir=str(tmp_path / name),
        epochs=1,
        global_batch_size=16,
        micro_batch_size=4,
        progress=False,
        **overrides,
    )  # type: ignore[arg-type]
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["kind"] == "train"]


def test_single_gpu_trains(tmp_path: Path) -> None:
    losses = _run(tmp_path, "single", strategy="single", lr=3e-3)
    assert losses[-1] < losses[0]


def test_bf16_trains_on_gpu(tmp_path: Path) -> None:
    losses = _run(tmp_path, "bf16", strategy="single", precision="bf16", lr=3e-3)
    assert losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DataParallel needs 2 GPUs")
def test_data_parallel_matches_single(tmp_path: Path) -> None:
    single = _run(tmp_path, "single", strategy="single")
    dp = _run(tmp_path, "dp", strategy="dp")
    assert dp == pytest.approx(single, abs=1e-4)
    # NEFTune's per-token seeds are scattered with the rows; each replica draws on its own GPU.
    single = _run(tmp_path, "neftune-single", strategy="single", neftune_alpha=5.0)
    dp = _run(tmp_path, "neftune-dp", strategy="dp", neftune_alpha=5.0)
    assert dp == pytest.approx(single, abs=1e-4)


def test_neftune_draws_on_the_gpu(tmp_path: Path) -> None:
    """Its generator on CUDA (the CPU tests check that the draws follow the seed, step and example)."""
    plain = _run(tmp_path, "plain", strategy="single", lr=3e-3)
    noisy = _run(tmp_path, "neftune", strategy="single", lr=3e-3, neftune_alpha=5.0)
    assert noisy[-1] < noisy[0] and noisy[0] != pytest.approx(plain[0], abs=1e-3)


def test_8bit_adamw_and_lora_train_on_gpu(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    losses = _run(tmp_path, "8bit", optimizer="adamw8bit", lr=3e-3)
    assert losses[-1] < losses[0]
    losses = _run(tmp_path, "lora", lora=True, optimizer="paged_adamw8bit", precision="bf16", lr=3e-3)
    assert losses[-1] < losses[0]


def test_qlora_trains_on_gpu_like_lora(tmp_path: Path) -> None:
    """bitsandbytes' CUDA 4-bit kernels, bf16 compute: the loss tracks plain LoRA's."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed on this machine")
    lora = _run(tmp_path, "lora", lora=True, precision="bf16", lr=3e-3)
    qlora = _run(tmp_path, "qlora", lora=True, load_in_4bit=True, precision="bf16", lr=3e-3)
    assert qlora[-1] < qlora[0]
    assert qlora == pytest.approx(lora, rel=0.05)


def test_plan_predicts_the_cuda_peak_within_15_percent(tmp_path: Path) -> None:
    """On a GPU the allocator counts the tensors the plan counts and cuBLAS's workspaces (measured)."""
    import json
    import subprocess
    import sys

    data = write_jsonl(tmp_path / "long.jsonl", [" ".join(["token"] * 300)] * 64)
    common = ["--model", "small", "--data", str(data), "--max-length", "256", "--packing", "off"]
    common += ["--global-batch-size", "16", "--micro-batch-size", "8", "--cache-dir", str(tmp_path / "c")]
    setups = [[], ["--activation-checkpointing"], ["--lora"], ["--precision", "bf16"]]
    try:
        import bitsandbytes  # noqa: F401

        setups.append(["--lora", "--load-in-4bit", "--precision", "bf16"])
    except ImportError:
        pass
    results = []
    for extra in setups:
        subprocess.run(
            [sys.executable, "-m", "lmtune", "plan", *common, *extra, "--json", str(tmp_path / "p.json")],
            check=True,
        )
        predicted = json.loads((tmp_path / "p.json").read_text())["requested"]["total"]
        out = tmp_path / ("run" + "".join(extra))
        subprocess.run(
            [
                sys.executable,
                "-m",
                "lmtune",
                "train",
                *common,
                *extra,
                "--max-steps",
                "3",
                "--output-dir",
                str(out),
            ],
            check=True,
        )
        measured = max(json.loads((out / "run.json").read_text())["result"]["peak_memory_per_rank"])
        results.append((" ".join(extra) or "fp32", predicted, measured))
    # Every setup's figures first: one GPU run must report them all, not stop at the first miss.
    for name, predicted, measured in results:
        print(
            f"plan {name}: predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB, "
            f"{(predicted - measured) / measured:+.1%}"
        )
    assert all(abs(p - m) <= 0.15 * m for _, p, m in results), results


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_fused_varlen_attention_equals_the_masked_rows_on_gpu(arch: str) -> None:
    """PyTorch's varlen flash kernel (bf16, CUDA): the loss of the padded rows, with grouped-query
    attention and a sliding window shorter than the longer examples (Mistral)."""
    import copy

    from lmtune.data.collate import Collator
    from lmtune.model.attention import use_varlen
    from lmtune.objectives.sft import SummedLoss
    from tests.unit.model.test_attention import _data, _model

    model, tok = _model(arch)
    model = model.cuda()
    masked = SummedLoss(copy.deepcopy(model))
    assert use_varlen(model)
    varlen = SummedLoss(model, varlen=True)
    data = _data(tok)
    batch = Collator(tok.pad_token_id)([data[i] for i in range(len(data))]).to(torch.device("cuda"))
    losses = []
    for module in (masked, varlen):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses.append(float(module(*batch.model_inputs()).sum()))
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
