"""The best checkpoint by an eval metric is kept and can become final/; early stopping stops at the
evaluation the rule names. In this process (world size 1), on a run whose eval loss rises."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from safetensors.torch import load_file

from lmtune.cli import main
from lmtune.config.files import read_json_object
from lmtune.config.settings import TrainConfig
from lmtune.errors import UserError
from lmtune.train import train
from lmtune.training.best import BEST_FILE, BestTracker
from lmtune.training.finish import TrainResult
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
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainResult]:
    root = tmp_path_factory.mktemp("best")
    data = write_jsonl(root / "d.jsonl", uneven_texts(200, seed=4))
    out = root / "out"
    cfg = TrainConfig(data=str(data), eval_split=40, output_dir=str(out), progress=False)
    cfg = cfg.replace(metric_for_best="eval_loss", eval_every=2, early_stopping_patience=2)
    cfg = cfg.replace(load_best_at_end=True, keep_last=1, save_every=4, global_batch_size=8)
    # A learning rate far too high: the eval loss soon rises, so the patience rule must fire.
    return out, train(cfg.replace(lr=3e-2, max_steps=60, seed=2))


@pytest.fixture(scope="module")
def run(trained: tuple[Path, TrainResult]) -> Path:
    return trained[0]


def test_the_result_names_the_model_final_holds(trained: tuple[Path, TrainResult], tmp_path: Path) -> None:
    """TrainResult said the last step's evaluation alone: a notebook took it for final/'s model,
    which --load-best-at-end had taken from an earlier step. Its best and final_step are run.json's,
    also for the finished run called again (run.json's config replayed, as a notebook does)."""
    out, result = trained
    recorded = json.loads((out / "run.json").read_text())
    best = recorded["result"]["best"]
    assert result.best is not None and asdict(result.best) == best and result.stopped_by == "early_stopping"
    assert result.final_step == best["step"] == recorded["result"]["final_step"] < result.steps
    assert result.eval is not None and result.eval.loss != best["value"]  # the last evaluation's
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    again = train(TrainConfig(**recorded["config"]).replace(output_dir=str(copy)))
    assert (again.best, again.final_step, again.steps) == (result.best, result.final_step, result.steps)


def test_early_stopping_stops_at_the_evaluation_the_rule_names(run: Path) -> None:
    evals = train_rows(run, kind="eval")
    losses = [r["eval_loss"] for r in evals]
    stop = _first_stop(losses, patience=2)
    assert train_rows(run)[-1]["step"] < 60  # it stopped before the end
    assert evals[-1]["step"] == evals[stop]["step"] == train_rows(run)[-1]["step"]
    record = json.loads((run / "run.json").read_text())
    result = record["result"]
    assert result["stopped_by"] == "early_stopping"
    train = record["data"]["train"]  # the data's 200 examples, 40 of them held out for evaluation
    assert (train["examples"], train["held_out"], train["training_examples"]) == (200, 40, 160)
    best_step = evals[losses.index(min(losses[: stop + 1]))]["step"]
    assert result["best"]["step"] == best_step and result["best"]["metric"] == "eval_loss"
    assert result["best"]["value"] == min(losses)


def test_the_best_checkpoint_is_kept_and_becomes_final(run: Path) -> None:
    best = json.loads((run / "run.json").read_text())["result"]["best"]
    assert best["checkpoint"] == f"checkpoints/step-{best['step']:06d}"  # relative to the output folder
    folder = run / best["checkpoint"]
    assert folder.is_dir(), "pruned by --keep-last 1"
    last = sorted(p.name for p in (run / "checkpoints").iterdir())[-1]
    assert last != folder.name  # --keep-last kept the newest too
    final = load_file(run / "final" / "model.safetensors")
    saved = load_file(folder / "model.safetensors")
    shared = final.keys() & saved.keys()  # a tied head is stored once, under either name
    assert len(shared) >= len(final) - 1 and all((final[k] == saved[k]).all() for k in shared)


def test_the_best_is_decided_by_the_metric_alone_and_the_threshold_counts_patience() -> None:
    """As Hugging Face Trainer: an improvement smaller than the threshold is still the new best
    model; it only does not reset the patience count."""
    tracker = BestTracker(metric="eval_loss", greater_is_better=False, patience=3, threshold=1.0)
    assert tracker.observe(15, 3.0059)
    assert tracker.observe(21, 2.5082)  # better by less than the threshold: the best all the same
    assert tracker.best is not None and tracker.best.step == 21 and tracker.best.value == 2.5082
    assert tracker.without_improvement == 1  # ... but it does not count as progress for patience
    assert not tracker.observe(24, float("nan")) and tracker.without_improvement == 2
    assert tracker.observe(27, 1.0) and tracker.without_improvement == 0  # better by over 1.0
    higher = BestTracker(metric="eval_accuracy", greater_is_better=True, patience=0, threshold=0.5)
    assert higher.observe(1, 0.2) and higher.observe(2, 0.3) and not higher.observe(3, 0.1)
    assert higher.best is not None and higher.best.step == 2


def test_best_json_is_read_as_data_and_its_path_follows_the_folder(tmp_path: Path) -> None:
    """The record names its checkpoint by step; a moved run finds it in its new folder, whatever
    path an older record holds, and an edited record is one line, not a traceback."""
    moved = tmp_path / "moved"
    checkpoint = moved / "checkpoints" / "step-000015"
    checkpoint.mkdir(parents=True)
    record = {"best": {"step": 15, "metric": "eval_loss", "value": 2.5, "checkpoint": "/old/name/x"}}
    (checkpoint / BEST_FILE).write_text(json.dumps({**record, "without_improvement": 1}))
    tracker = BestTracker(metric="eval_loss", greater_is_better=False, patience=2, threshold=0.0)

    def restore() -> None:  # as the checkpoint manager reads a record: bounded, a JSON object
        tracker.restore(read_json_object(checkpoint / BEST_FILE), 15)

    restore()
    assert tracker.best is not None and tracker.best.checkpoint == "checkpoints/step-000015"
    assert tracker.folder(moved) == checkpoint and tracker.without_improvement == 1
    for bad in (
        {
            "best": {"step": -1, "metric": "eval_loss", "value": 1.0, "checkpoint": ""},
            "without_improvement": 0,
        },
        {
            "best": {"step": 2, "metric": "eval_loss", "value": "NaN", "checkpoint": ""},
            "without_improvement": 0,
        },
        {"best": None, "without_improvement": 10**30},
        {  # a best step after the checkpoint's own
            "best": {"step": 999, "metric": "eval_loss", "value": 1.0, "checkpoint": ""},
            "without_improvement": 0,
        },
        [1, 2],
    ):
        (checkpoint / BEST_FILE).write_text(json.dumps(bad))
        with pytest.raises(UserError, match=r"best\.json: "):
            restore()
    (checkpoint / BEST_FILE).write_text("[" * 100_000)
    with pytest.raises(UserError, match="nested too deeply"):
        restore()


def test_a_run_continuing_another_folders_checkpoint_takes_the_best_from_there(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume of another folder's checkpoint (its last: nothing more to train): the best that run
    found is in its folder, not in this one; final/ takes it from there, or says it is gone and
    keeps the last model."""
    best = json.loads((run / "run.json").read_text())["result"]["best"]
    newest = sorted((run / "checkpoints").iterdir())[-1]
    steps = int(newest.name.removeprefix("step-"))
    copy = tmp_path / "copy" / "checkpoints" / newest.name  # the same run without its best checkpoint
    shutil.copytree(newest, copy)
    argv = ["train", "--data", str(run.parent / "d.jsonl"), "--eval-split", "40", "--no-progress"]
    argv += ["--metric-for-best", "eval_loss", "--eval-every", "2", "--load-best-at-end", "--seed", "2"]
    argv += ["--save-every", "4", "--global-batch-size", "8", "--lr", "3e-2", "--max-steps", str(steps)]
    for source, holds_best in ((newest, True), (copy, False)):
        out = tmp_path / f"from-{source.parent.parent.name}"
        assert main([*argv, "--resume", str(source), "--output-dir", str(out)]) == 0
        result = json.loads((out / "run.json").read_text())["result"]
        assert result["best"]["step"] == best["step"]
        kept = load_file(out / "final" / "model.safetensors")
        want = load_file(
            (run if holds_best else out)
            / f"checkpoints/step-{result['final_step']:06d}"
            / "model.safetensors"
        )
        assert all((kept[k] == want[k]).all() for k in kept.keys() & want.keys())
        card = (out / "final" / "README.md").read_text()
        said = "".join(capsys.readouterr())
        if holds_best:
            assert result["final_step"] == best["step"] and "(this is that model)" in card
            assert result["best"]["checkpoint"] == str(run / best["checkpoint"])  # where it was found
            assert f"the best model: step {best['step']}" in said and str(run) in said
        else:
            assert result["final_step"] == steps and "(this is that model)" not in card
            assert "is in no checkpoint here or in the run this one continued" in said


def test_a_continued_run_resumed_again_still_finds_the_best_in_the_run_it_continued(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Continued from another folder's checkpoint, then stopped and resumed from its own: the best
    is still found in the other folder (its checkpoints record the runs they continued)."""
    best = json.loads((run / "run.json").read_text())["result"]["best"]
    newest = sorted((run / "checkpoints").iterdir())[-1]
    steps = int(newest.name.removeprefix("step-"))
    out = tmp_path / "continued"
    argv = ["train", "--data", str(run.parent / "d.jsonl"), "--eval-split", "40", "--no-progress"]
    argv += ["--metric-for-best", "eval_loss", "--eval-every", "2", "--load-best-at-end", "--seed", "2"]
    # A rate far higher than the first run's: the eval loss only rises, so the best stays there.
    argv += ["--save-every", "2", "--global-batch-size", "8", "--lr", "1.0", "--output-dir", str(out)]
    assert main([*argv, "--resume", str(newest), "--max-steps", str(steps + 2)]) == 0
    assert (out / f"checkpoints/step-{steps + 2:06d}").is_dir()
    capsys.readouterr()
    assert main([*argv, "--max-steps", str(steps + 4)]) == 0  # resumed from this folder's own
    result = json.loads((out / "run.json").read_text())["result"]
    said = "".join(capsys.readouterr())
    assert f"resuming from {out / 'checkpoints' / f'step-{steps + 2:06d}'}" in said
    assert result["best"]["step"] == best["step"]
    assert result["final_step"] == best["step"]
    assert result["best"]["checkpoint"] == str(run / best["checkpoint"])
    kept = load_file(out / "final" / "model.safetensors")
    want = load_file(run / best["checkpoint"] / "model.safetensors")
    assert all((kept[k] == want[k]).all() for k in kept.keys() & want.keys())


def test_eval_on_start_logs_the_starting_model_as_step_0_and_changes_no_step(tmp_path: Path) -> None:
    """--eval-on-start (HF's eval_on_start, litgpt's initial_validation): the starting model's eval
    figures as step 0. The same run without it trains the same steps; a learning rate too small to
    move a weight ends where the baseline began; a resumed run does not log a second step 0."""
    data = write_jsonl(tmp_path / "d.jsonl", uneven_texts(48, seed=5))
    base = ["train", "--data", str(data), "--eval-split", "16", "--global-batch-size", "8", "--no-progress"]
    base += ["--save-every", "1"]

    def run(name: str, *more: str) -> Path:
        assert main([*base, "--output-dir", str(tmp_path / name), *more]) == 0
        return tmp_path / name

    with_start = run("start", "--eval-on-start", "--max-steps", "2")
    without = run("plain", "--max-steps", "2")
    evals = train_rows(with_start, kind="eval")
    assert [r["step"] for r in evals] == [0, 2]
    assert evals[1]["eval_loss"] != evals[0]["eval_loss"]

    def steps(out: Path) -> list[tuple[float, ...]]:
        return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in train_rows(out)]

    assert steps(with_start) == steps(without)
    assert train_rows(without, kind="eval")[-1]["eval_loss"] == evals[1]["eval_loss"]
    still = train_rows(run("still", "--eval-on-start", "--max-steps", "1", "--lr", "1e-12"), kind="eval")
    assert still[0]["eval_loss"] == evals[0]["eval_loss"]
    assert still[1]["eval_loss"] == pytest.approx(still[0]["eval_loss"], abs=1e-6)
    run("start", "--eval-on-start", "--max-steps", "3")  # resumes from step 2
    assert [r["step"] for r in train_rows(with_start, kind="eval")] == [0, 2, 3]
