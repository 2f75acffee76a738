"""Preference tuning across ranks: 1 process x GA 4 == 2 ranks x GA 2 for DPO (precomputed and
live reference, LoRA with the adapter-disabled reference, FSDP2), IPO packed, SimPO and ORPO
(full logits): per-step losses and metrics to 1e-6, the final evaluation, and the weights; under
DDP both ranks end with the same weights (the chunked head's gradients are all-reduced); the
precomputed reference trains as the live one. One launch runs every 2-rank setting.

Then through the CLI: 2 ranks resumed mid-epoch on 1 process end as the uninterrupted run, and a
resume on the same world size is bit-identical."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO, assert_same_training, run_lmtune, train_rows
from tests.support.pairs import write_pairs

pytestmark = pytest.mark.distributed

NAMES = [
    "dpo",
    "dpo-live",
    "dpo-lora-live",
    "dpo-fsdp",
    "dpo-fsdp-live",
    "ipo-packed",
    "simpo",
    "orpo-full-logits",
]
ONE_PROCESS = [n for n in NAMES if "fsdp" not in n]  # fsdp in one process is the single run
TWO_RANKS_ONLY = ["dpo-fsdp-bf16"]  # its numerics are bf16's: checked on its own


def _worker(out: Path, data: Path, names: list[str], ranks: int) -> None:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    cmd = [*(launcher if ranks > 1 else [sys.executable, "-m"]), "tests.support.preference_worker"]
    proc = subprocess.run(
        [*cmd, str(out), str(data), *names], capture_output=True, text=True, timeout=900, cwd=REPO, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("preference")
    data = write_pairs(root / "pairs.jsonl", 64, seed=3)
    with ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(_worker, root / "one", data, ONE_PROCESS, 1),
            pool.submit(_worker, root / "two", data, [*NAMES, *TWO_RANKS_ONLY], 2),
        ]
        for job in jobs:
            job.result()
    return root


def _result(root: Path, name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((root / name / "result.json").read_text())
    return loaded


@pytest.mark.parametrize("name", NAMES)
def test_two_ranks_train_as_one_process(runs: Path, name: str) -> None:
    single = name.replace("-fsdp", "")  # FSDP2 over 2 ranks against the single process
    one, two = _result(runs / "one", single), _result(runs / "two", name)
    assert len(one["steps"]) == len(two["steps"]) == 6
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert a["count"] == b["count"] == 8  # pairs per step
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        for metric, value in a["metrics"].items():
            # Rewards are beta x a difference of log-probs summed over an answer's tokens in fp32,
            # whose order of additions differs with the batch layout: a few ulps of a sum of tens
            # (1.1e-6 relative on an AVX-512 CPU for IPO's rewards/rejected).
            assert b["metrics"][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), metric
    assert two["eval_examples"] == one["eval_examples"] == 16
    for metric, value in one["eval"].items():
        assert two["eval"][metric] == pytest.approx(value, rel=1e-6, abs=1e-6), metric
    weights = {r: load_file(str(runs / "two" / name / f"weights-rank{r}.safetensors")) for r in (0, 1)}
    if "fsdp" not in name:  # DDP: both replicas took the same updates
        assert all(bool((weights[0][k] == weights[1][k]).all()) for k in weights[0]), name
    assert_same_training(
        load_file(str(runs / "one" / single / "weights-rank0.safetensors")), weights[0], name
    )


def test_the_first_dpo_step_is_ln2_and_the_references_agree(runs: Path) -> None:
    """Policy == reference at the start: the first loss is ln 2 (exactly with the live reference,
    computed in the same forward); the precomputed reference trains as the live one."""
    import math

    live, lora, precomputed = (_result(runs / "one", n) for n in ("dpo-live", "dpo-lora-live", "dpo"))
    assert live["steps"][0]["loss"] == math.log(2)
    assert lora["steps"][0]["loss"] == math.log(2)
    assert live["steps"][0]["metrics"]["rewards/margins"] == 0.0
    for a, b in zip(live["steps"], precomputed["steps"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert precomputed["eval"]["eval_loss"] == pytest.approx(live["eval"]["eval_loss"], abs=1e-6)


def test_fsdp_in_bf16_starts_at_ln2_from_its_precomputed_reference(runs: Path) -> None:
    """FSDP2 gathers bf16 weights under --precision bf16; the residual stream was bf16 too, so a
    pair's log-probs moved with the batch it came in: the precomputed reference disagreed with the
    policy at the start (first loss 0.677, accuracies 0.75 on the untrained model). It is fp32 now,
    as autocast keeps it in one process."""
    import math

    first = _result(runs / "two", "dpo-fsdp-bf16")["steps"][0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert abs(first["metrics"]["rewards/margins"]) < 1e-4


def _cli(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--objective",
        "dpo",
        "--data",
        str(data),
        "--output-dir",
        str(out),
        "--max-steps",
        "6",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "2",
        "--max-length",
        "64",
        "--save-every",
        "3",
        "--keep-last",
        "0",
        "--lr",
        "1e-3",
        "--threads-per-process",
        "1",
        "--no-progress",
        *extra,
    ]


def _resume_copy(src: Path, dst: Path, step: int) -> None:
    (dst / "checkpoints").mkdir(parents=True)
    name = f"step-{step:06d}"
    shutil.copytree(src / "checkpoints" / name, dst / "checkpoints" / name)


def test_resume_mid_epoch_across_and_on_the_same_world_size(runs: Path) -> None:
    data = runs / "pairs.jsonl"
    two, one = runs / "cli-two", runs / "cli-one"
    with ThreadPoolExecutor(2) as pool:
        procs = [
            pool.submit(run_lmtune, _cli(data, two, "--nproc-per-node", "2"), 600),
            pool.submit(run_lmtune, _cli(data, one), 600),
        ]
        for proc in procs:
            assert proc.result().returncode == 0, proc.result().stderr[-3000:]
    assert "reference log-probs of 64 pairs" in procs[1].result().stdout  # one of them computed, or read
    two_to_one, one_to_one = runs / "resumed-2-to-1", runs / "resumed-1-to-1"
    _resume_copy(two, two_to_one, 3)
    _resume_copy(one, one_to_one, 3)
    for out in (two_to_one, one_to_one):
        proc = run_lmtune(_cli(data, out), 600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "resuming from" in proc.stdout and "(from the cache)" in proc.stdout
    final = "final/model.safetensors"
    same = load_file(str(one / final)), load_file(str(one_to_one / final))
    assert all(bool((same[0][k] == same[1][k]).all()) for k in same[0])
    assert_same_training(load_file(str(two / final)), load_file(str(two_to_one / final)), "2 -> 1")
    losses = {r["step"]: r["loss"] for r in train_rows(one)}
    assert [r["step"] for r in train_rows(one_to_one)] == [4, 5, 6]
    assert all(r["loss"] == losses[r["step"]] for r in train_rows(one_to_one))
    run = json.loads((one / "run.json").read_text())
    assert run["result"]["eval"] is None and run["data"]["reference"]["kind"] == "logprobs"
