"""The best checkpoint by an eval metric is kept and can become final/; early stopping stops at the
evaluation the rule names. In this process (world size 1), on a run whose eval loss rises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lmtune.cli import main
from tests.conftest import train_rows, uneven_texts, write_jsonl


def _first_stop(losses: list[float], patience: int) -> int:
    """The index of the evaluation at which the patience rule stops (lower is better)."""
    best, without = float("inf"), 0
    for i, value in enumerate(losses):
        if value < best:
            best, without = value, 0
        else:
            without += 1
            if without >= patience:
                return i
    return len(losses) - 1


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("best")
    data = write_jsonl(root / "d.jsonl", uneven_texts(200, seed=4))
    out = root / "out"
    argv = ["train", "--data", str(data), "--eval-split", "40", "--output-dir", str(out), "--no-progress"]
    argv += ["--metric-for-best", "eval_loss", "--eval-every", "2", "--early-stopping-patience", "2"]
    argv += ["--load-best-at-end", "--keep-last", "1", "--save-every", "4", "--global-batch-size", "8"]
    # A learning rate far too high: the eval loss soon rises, so the patience rule must fire.
    assert main([*argv, "--lr", "3e-2", "--max-steps", "60", "--seed", "2"]) == 0
    return out


def test_early_stopping_stops_at_the_evaluation_the_rule_names(run: Path) -> None:
    evals = train_rows(run, kind="eval")
    losses = [r["eval_loss"] for r in evals]
    stop = _first_stop(losses, patience=2)
    assert train_rows(run)[-1]["step"] < 60  # it stopped before the end
    assert evals[-1]["step"] == evals[stop]["step"] == train_rows(run)[-1]["step"]
    result = json.loads((run / "run.json").read_text())["result"]
    assert result["stopped_by"] == "early_stopping"
    best_step = evals[losses.index(min(losses[: stop + 1]))]["step"]
    assert result["best"]["step"] == best_step and result["best"]["metric"] == "eval_loss"
    assert result["best"]["value"] == min(losses)


def test_the_best_checkpoint_is_kept_and_becomes_final(run: Path) -> None:
    best = json.loads((run / "run.json").read_text())["result"]["best"]
    folder = Path(best["checkpoint"])
    assert folder.is_dir(), "pruned by --keep-last 1"
    last = sorted(p.name for p in (run / "checkpoints").iterdir())[-1]
    assert last != folder.name  # --keep-last kept the newest too
    final = load_file(run / "final" / "model.safetensors")
    saved = load_file(folder / "model.safetensors")
    shared = final.keys() & saved.keys()  # a tied head is stored once, under either name
    assert len(shared) >= len(final) - 1 and all((final[k] == saved[k]).all() for k in shared)
