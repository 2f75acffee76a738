"""The objective seam: a second objective (a per-sequence mean loss, normalised by the global number
of examples) trains through lmtune's build and fit, and 2 ranks x 2 accumulation steps equal
1 process x 4, per-step losses, metrics and weights, as for supervised fine-tuning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO, assert_same_training, uneven_texts, write_jsonl

pytestmark = pytest.mark.distributed


def _run(out: Path, data: Path, micro: int, ranks: int) -> list[dict[str, Any]]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m"]
    # The worker imports the test objective from this repository's tests package.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [
            *(launcher if ranks > 1 else [sys.executable, "-m"]),
            "tests.support.seam_worker",
            str(out),
            str(data),
            str(micro),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows: list[dict[str, Any]] = json.loads((out / "steps.json").read_text())
    return rows


def test_a_second_objective_is_exact_across_ranks(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "train.jsonl", uneven_texts(60, seed=5))
    one = _run(tmp_path / "one", data, micro=2, ranks=1)  # 4 accumulation steps
    two = _run(tmp_path / "two", data, micro=2, ranks=2)  # 2 ranks x 2
    assert len(one) == len(two) == 6
    for a, b in zip(one, two, strict=True):
        assert (a["count"], a["examples"]) == (b["count"], b["examples"]) == (8, 8)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["metrics"]["target_tokens"] == pytest.approx(a["metrics"]["target_tokens"], abs=1e-9)
    assert_same_training(
        load_file(str(tmp_path / "one" / "weights.safetensors")),
        load_file(str(tmp_path / "two" / "weights.safetensors")),
        "sequence-mean objective, 1 x GA 4 vs 2 ranks x GA 2",
    )
