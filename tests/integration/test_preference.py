"""`lmtune train --objective dpo | ipo | simpo | orpo` through the CLI, in process: TRL's metric names
in metrics.jsonl, run.json and TensorBoard; the best checkpoint by reward accuracy; samples; the
report's reward plots; conversational pairs with LoRA; and the user errors, each naming what to fix."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from lmtune.cli import main
from tests.conftest import train_rows, write_jsonl
from tests.support.pairs import write_pairs

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")


def _dpo_args(root: Path) -> list[str]:
    """The DPO run of ``dpo_run``, its files in ``root``."""
    args = ["train", "--objective", "dpo", "--data", str(root / "pairs.jsonl"), "--eval-split", "8"]
    args += ["--max-steps", "4", "--global-batch-size", "8", "--micro-batch-size", "4", "--max-length", "96"]
    args += ["--lr", "3e-3", "--eval-every", "2", "--metric-for-best", "eval_rewards/accuracies"]
    args += ["--load-best-at-end", "--sample-prompts", str(root / "prompts.jsonl")]
    args += ["--sample-max-new-tokens", "4", "--report-to", "tensorboard", "--cache-dir", str(root / "cache")]
    return [*args, "--output-dir", str(root / "out"), "--no-progress"]


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dpo")
    write_pairs(root / "pairs.jsonl", 48, seed=11)
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "12 + 30 = ?"}) + "\n")
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert main(_dpo_args(root)) == 0
    (root / "said.txt").write_text(said.getvalue())
    return root / "out"


def test_a_finished_run_run_again_computes_no_reference(
    dpo_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing to do is known before the reference pass: with its cache gone, none is computed."""
    root = dpo_run.parent
    cached = root / "cache" / "reference-logps"
    assert any(cached.iterdir())
    shutil.rmtree(cached)
    capsys.readouterr()
    assert main(_dpo_args(root)) == 0
    said = "".join(capsys.readouterr())
    assert "nothing to do" in said and "reference log-probs" not in said, said
    assert not cached.exists()


def test_metrics_rows_and_run_json_carry_the_preference_metrics(dpo_run: Path) -> None:
    train = train_rows(dpo_run)
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(all(k in r for k in METRICS) for r in train)
    evals = train_rows(dpo_run, "eval")
    assert [r["step"] for r in evals] == [2, 4]
    assert all(f"eval_{k}" in r for r in evals for k in METRICS) and all(
        r["eval_examples"] == 8 for r in evals
    )
    run = json.loads((dpo_run / "run.json").read_text())
    result = run["result"]["eval"]
    assert result["loss"] == evals[-1]["eval_loss"] and result["examples"] == 8
    said = (dpo_run.parent / "said.txt").read_text()  # the log counts pairs, as the data line does
    assert "eval data: 8 pairs of --data held out" in said and said.count(" (8 pairs, ") == 2, said
    assert "; objective dpo (beta 0.1), log-probs by " in said  # the start line named a loss it had not
    assert result["rewards/accuracies"] == evals[-1]["eval_rewards/accuracies"]
    assert result["rewards/margins"] == evals[-1]["eval_rewards/margins"]
    assert run["resolved"]["objective"] == "dpo"
    assert run["resolved"]["reference"] == "the starting model, log-probs precomputed"
    assert run["data"]["reference"]["files"][0]["pairs"] == 48  # training and held-out pairs at once
    best = run["result"]["best"]
    assert best["metric"] == "eval_rewards/accuracies"
    assert best["value"] == max(r["eval_rewards/accuracies"] for r in evals)  # higher is better
    samples = [
        r
        for r in map(json.loads, (dpo_run / "metrics.jsonl").read_text().splitlines())
        if r["kind"] == "sample"
    ]
    assert samples and samples[0]["prompt"] == "12 + 30 = ?" and samples[0]["tokens"] > 0


def test_tensorboard_and_report_show_the_rewards(dpo_run: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(dpo_run / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/rewards/margins", "eval/rewards/accuracies", "eval/loss"} <= tags
    page = tmp_path / "report.html"
    assert main(["report", str(dpo_run), "--out", str(page)]) == 0
    text = page.read_text()
    for name in ("reward_margins", "reward_accuracies"):
        assert f"<figure id='plot-{name}'><img" in text
    # The data counts pairs, with the held-out split and the reference log-probs' file.
    assert "<td>pairs 48, held out 8, left to train on 40, tokens " in text
    assert "<td>the starting model: 48 pairs in " in text and "<td>last eval reward accuracy</td>" in text


@pytest.mark.parametrize(
    ("objective", "extra"),
    [("ipo", ["--lora"]), ("simpo", ["--chat-template", "chatml"]), ("orpo", ["--lora"])],
)
def test_conversational_pairs_train(
    objective: str, extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_pairs(tmp_path / "chat.jsonl", 16, seed=2, chat=True)
    out = tmp_path / "out"
    args = ["train", "--objective", objective, "--data", str(data), *extra, "--max-steps", "2"]
    args += ["--global-batch-size", "8", "--no-progress", "--output-dir", str(out)]
    assert main(args) == 0
    knobs = {
        "ipo": "beta 0.1",
        "simpo": "beta 0.1, gamma 0.5, label smoothing 0.0",
        "orpo": "lambda 0.1",
    }  # ORPO has no beta
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("objective "))
    assert line.split(";")[0] == f"objective {objective}: {knobs[objective]}"
    saved = "adapter_model.safetensors" if "--lora" in extra else "model.safetensors"
    assert (out / "final" / saved).is_file()
    if "--lora" in extra:  # the adapter trained without dropout, and its config says so (0.05 before)
        for folder in (out / "final", out / "checkpoints" / "step-000002"):
            assert json.loads((folder / "adapter_config.json").read_text())["lora_dropout"] == 0.0
    config = json.loads((out / "final" / "generation_config.json").read_text())
    assert config["eos_token_id"]  # chat data: the saved model stops at the end of turn
    rows = train_rows(out)
    assert len(rows) == 2 and all("rewards/accuracies" in r for r in rows)
    if objective == "orpo":
        assert all("nll_loss" in r and "log_odds_ratio" in r for r in rows)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--objective", "sft"],
            "holds preference pairs (prompt, chosen, rejected); tune on them with --objective",
        ),
        (["--objective", "sft"], "records that hold 'messages' too, as UltraFeedback's, train on those with"),
        (["--objective", "dpo", "--data", "TEXT"], "--objective dpo tunes on preference pairs"),
        (["--objective", "dpo", "--data", "BAD"], "bad.jsonl:2: preference record has no 'rejected' field"),
        (["--objective", "dpo", "--data", "SAME"], "same.jsonl: every pair has the same chosen and rejected"),
        (["--objective", "dpo", "--strategy", "dp"], "--strategy: --objective dpo keeps both answers"),
        (["--objective", "sft", "--metric-for-best", "eval_rewards/accuracies"], "reward metrics need"),
        (
            ["--objective", "simpo", "--reference-model", "tiny"],
            "--reference-model: applies to --objective dpo",
        ),
        (["--objective", "ipo", "--label-smoothing", "0.1"], "--label-smoothing: applies to --objective dpo"),
        (["--objective", "dpo", "--beta", "0"], "--beta: must be > 0"),
        (["--objective", "cpo"], "TRL's cpo is not here: it adds an NLL term"),  # was "the closest is ipo"
        (  # each record was "has no 'messages' field"
            ["--objective", "dpo", "--data-format", "messages"],
            "--data-format: reads single examples, and --objective dpo trains on pairs",
        ),
        (
            ["--objective", "dpo", "--reference-model", "nope", "--global-batch-size", "8"],
            "--reference-model nope: could not load it",
        ),
    ],
)
def test_user_errors_name_what_to_fix(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = write_pairs(tmp_path / "pairs.jsonl", 8)
    text = write_jsonl(tmp_path / "text.jsonl", ["plain text"] * 8)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
        + "\n"
        + json.dumps({"prompt": "a", "chosen": "b"})
        + "\n"
    )
    same = tmp_path / "same.jsonl"
    same.write_text(
        "".join(json.dumps({"prompt": f"{i}+2=", "chosen": "4", "rejected": "4"}) + "\n" for i in range(8))
    )
    files = {"TEXT": str(text), "BAD": str(bad), "SAME": str(same)}
    args = [files.get(a, a) for a in args]
    data = [] if "--data" in args else ["--data", str(pairs)]
    code = main(
        ["train", *data, *args, "--max-steps", "1", "--output-dir", str(tmp_path / "o"), "--no-progress"]
    )
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_reference_model_precomputed_or_live_gives_the_same_losses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Also: a --reference-model folder retrained in place between a stop and the resume (the
    user's SFT run continued into it) is refused, where the rest of the run trained against it."""
    from lmtune.model.modeling import build_preset

    def save_reference(seed: int) -> None:
        other = build_preset("tiny", seed=seed)
        other.model.save_pretrained(folder)
        other.tokenizer.save_pretrained(folder)

    folder = tmp_path / "reference"
    save_reference(99)  # not the policy: the first loss is not ln 2
    data = write_pairs(tmp_path / "pairs.jsonl", 16, seed=5)
    losses, commands = {}, {}
    for mode in ("logprobs", "live"):
        out = tmp_path / mode
        args = ["train", "--objective", "dpo", "--data", str(data), "--reference-model", str(folder)]
        args += ["--reference", mode, "--global-batch-size", "8", "--no-progress", "--output-dir", str(out)]
        assert main([*args, "--max-steps", "2"]) == 0
        losses[mode], commands[mode] = [r["loss"] for r in train_rows(out)], args
        run = json.loads((out / "run.json").read_text())
        assert str(folder) in run["resolved"]["reference"]
    assert abs(losses["logprobs"][0] - 0.6931471805599453) > 1e-3
    assert losses["live"] == pytest.approx(losses["logprobs"], abs=1e-6)
    save_reference(98)
    for mode, args in commands.items():
        assert main([*args, "--max-steps", "2"]) == 0  # finished: nothing trains against it
        capsys.readouterr()
        assert main([*args, "--max-steps", "3"]) == 2, mode
        said = capsys.readouterr().err
        assert "reference weights (--reference-model)" in said, said
        assert f"the weights of --reference-model {folder} changed since the checkpoint" in said
    save_reference(99)
    for mode, args in commands.items():
        assert main([*args, "--max-steps", "3"]) == 0, mode
        assert [r["step"] for r in train_rows(tmp_path / mode)] == [1, 2, 3]
    # The same reference moved to another folder: its weights, by their hash, resume (refused before).
    moved = folder.rename(tmp_path / "moved-reference")
    for mode, args in commands.items():
        args = [str(moved) if a == str(folder) else a for a in args]
        assert main([*args, "--max-steps", "4"]) == 0, mode
        assert [r["step"] for r in train_rows(tmp_path / mode)] == [1, 2, 3, 4]


def test_a_reference_cache_that_cannot_be_written_costs_a_warning(
    dpo_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full or read-only cache disk: this run trains; a later one computes the log-probs again."""
    root = dpo_run.parent
    cached = root / "cache" / "reference-logps"
    shutil.rmtree(cached, ignore_errors=True)
    cached.write_text("in the way")  # not a folder: nothing can be written under it
    capsys.readouterr()
    try:
        assert main([*_dpo_args(root), "--output-dir", str(root / "uncached"), "--max-steps", "2"]) == 0
    finally:
        cached.unlink()
    said = capsys.readouterr().out
    assert f"warning: could not cache the reference log-probs at {cached}{os.sep}" in said, said
    assert "a later run computes them again" in said


def test_a_poisoned_reference_cache_is_computed_again(
    dpo_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cached log-probs set to 1e30 trained with rewards of -1e29, said nowhere: log-probs are never
    positive, so such a cache is not lmtune's, and is replaced with a warning."""
    import numpy as np

    root = dpo_run.parent
    cached = sorted((root / "cache" / "reference-logps").rglob("*.npy"))
    if not cached:  # another test removed the cache: one step caches the log-probs again
        assert main([*_dpo_args(root), "--output-dir", str(root / "refill"), "--max-steps", "1"]) == 0
        cached = sorted((root / "cache" / "reference-logps").rglob("*.npy"))
    assert cached
    for path in cached:
        np.save(path, np.full_like(np.load(path), 1e30))
    capsys.readouterr()
    assert main([*_dpo_args(root), "--output-dir", str(root / "poisoned"), "--max-steps", "2"]) == 0
    said = capsys.readouterr().out
    assert f"warning: {cached[0]}: not the reference log-probs of this data (values that are not" in said
    assert train_rows(root / "poisoned")[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-4)
    assert all((np.load(path) <= 0).all() for path in cached)  # cached again, as computed


def test_a_resume_that_cannot_match_is_refused_before_the_reference_pass(
    dpo_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The checkpoint's fingerprint is read before hours of reference log-probs, not after."""
    root = dpo_run.parent
    shutil.rmtree(root / "cache" / "reference-logps", ignore_errors=True)
    capsys.readouterr()
    assert main([*_dpo_args(root), "--seed", "3", "--max-steps", "6"]) == 2
    said = "".join(capsys.readouterr())
    assert "cannot resume from" in said and "--seed 42 -> 3" in said, said
    assert "reference log-probs" not in said and not (root / "cache" / "reference-logps").exists()


def test_a_signal_during_the_reference_pass_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before training there is nothing to save: the pass stops at its next batch, exit 128 + 2."""
    import os
    import signal

    from lmtune.objectives.preference import PreferenceLoss

    write_pairs(tmp_path / "pairs.jsonl", 48, seed=11)
    forwards: list[bool] = []
    original = PreferenceLoss.forward

    def forward(self: PreferenceLoss, *args: object, **kwargs: object) -> object:
        forwards.append(self.logps_only)
        if len(forwards) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl+C during the first of 12 batches
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PreferenceLoss, "forward", forward)
    args = ["train", "--objective", "dpo", "--data", str(tmp_path / "pairs.jsonl"), "--max-steps", "2"]
    args += ["--global-batch-size", "8", "--micro-batch-size", "4", "--max-length", "96", "--no-progress"]
    assert main([*args, "--cache-dir", str(tmp_path / "cache"), "--output-dir", str(tmp_path / "out")]) == 130
    assert forwards == [True]  # one reference batch, no training step
    assert "stopped by SIGINT before training began" in capsys.readouterr().err
    assert not (tmp_path / "out" / "checkpoints").exists() or not any(
        (tmp_path / "out" / "checkpoints").iterdir()
    )


def test_the_model_card_names_the_objectives_weights_reference_and_evaluation(dpo_run: Path) -> None:
    card = (dpo_run / "final" / "README.md").read_text()
    objective = next(line for line in card.splitlines() if line.startswith("| objective"))
    assert "`dpo`" in objective and "beta 0.1" in objective
    assert "reference: the starting model, log-probs precomputed" in objective
    evaluated = json.loads((dpo_run / "run.json").read_text())["result"]["eval"]
    row = next(line for line in card.splitlines() if "evaluation" in line and "reward accuracy" in line)
    assert (
        f"loss {evaluated['loss']:.4f}" in row
        and f"reward accuracy {evaluated['rewards/accuracies']:.4f}" in row
    )
