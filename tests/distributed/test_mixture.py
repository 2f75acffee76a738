"""A data mixture on 2 ranks and across a resume: one bundled comparison (three launches).

1 process uninterrupted is the reference; 2 ranks must train on the same global batches step by
step (weights within fp32 rounding), and a run stopped after its step-6 checkpoint on 2 ranks and
resumed on 1 process must read exactly the reference's remaining steps.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_lmtune, uneven_texts, write_jsonl

pytestmark = pytest.mark.distributed

STEPS, SAVE = 12, 6  # an epoch of 40 examples is 5 steps: step 6 is inside the second epoch


def train(data: str, out: Path, *extra: str) -> None:
    settings = {
        "--data": data,
        "--data-weights": "3,1",
        "--output-dir": out,
        "--max-steps": STEPS,
        "--save-every": SAVE,
        "--keep-last": 0,
        "--global-batch-size": 8,
        "--micro-batch-size": 2,
        "--lr": "1e-3",
        "--threads-per-process": 1,
        "--seed": 5,
    }
    args = ["train", *(str(x) for kv in settings.items() for x in kv), "--record-samples", "--no-progress"]
    proc = run_lmtune([*args, *extra])
    assert proc.returncode == 0, proc.stderr[-3000:]


def samples(out: Path) -> dict[int, list[tuple[int, str]]]:
    """Every step's (example id, source) pairs over all ranks, sorted: the step's global batch."""
    by_step: dict[int, list[tuple[int, str]]] = {}
    for path in sorted((out / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], []).extend(zip(row["ids"], row["sources"], strict=True))
    return {s: sorted(v) for s, v in by_step.items()}


def max_diff(a: Path, b: Path) -> float:
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def test_two_ranks_and_a_resume_onto_one_process_train_on_the_same_mixture(tmp_path: Path) -> None:
    small = write_jsonl(tmp_path / "small.jsonl", uneven_texts(10, seed=1))
    large = write_jsonl(tmp_path / "large.jsonl", uneven_texts(30, seed=2))
    data = f"{small},big={large}"
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "resumed"
    train(data, one)
    train(data, two, "--nproc-per-node", "2")
    (resumed / "checkpoints").mkdir(parents=True)  # as if the 2-rank run was killed after step 6
    shutil.copytree(two / "checkpoints" / "step-000006", resumed / "checkpoints" / "step-000006")
    train(data, resumed)

    reference = samples(one)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert samples(two) == reference
    assert samples(resumed) == {s: v for s, v in reference.items() if s > SAVE}
    # The mixture itself: 3:1 of an epoch of 40 -> small 30 (each of its 10 examples 3 times), big 10.
    first_epoch = [pair for s in range(1, 6) for pair in reference[s]]
    assert sum(src == "small" for _, src in first_epoch) == 30
    assert all(first_epoch.count((i, "small")) == 3 for i in range(10))
    big = [i for i, src in first_epoch if src == "big"]
    assert len(big) == len(set(big)) == 10 and all(10 <= i < 40 for i in big)
    assert max_diff(one, two) <= 1e-5
    assert max_diff(one, resumed) <= 1e-5
    assert torch.isfinite(torch.tensor(max_diff(two, resumed)))
