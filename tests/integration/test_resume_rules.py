"""What a rerun into the same output folder does: continue, refuse with the reason, or say it is done.

Runs in this process (world size 1, the same code path as a rank): each is a few steps of the tiny
preset.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

from lmtune.checkpoint import resume
from lmtune.cli import main
from lmtune.errors import UserError
from lmtune.training.optim import warmup_cosine
from tests.conftest import train_rows, uneven_texts, write_jsonl
from tests.unit.checkpoint.test_integrity import Payload

STEPS, SAVE = 6, 3


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        *("--data", str(data), "--output-dir", str(out), "--max-steps", str(STEPS)),
        *("--save-every", str(SAVE), "--global-batch-size", "8", "--lr", "1e-3", "--seed", "3"),
        *("--max-length", "64", "--keep-last", "0", "--no-progress", "--warmup-ratio", "0"),
        *extra,
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rules")
    data = write_jsonl(root / "a.jsonl", uneven_texts(40, seed=1))
    other = write_jsonl(root / "b.jsonl", uneven_texts(40, seed=2))  # the same count, other texts
    out = root / "run"
    assert main(_args(data, out)) == 0
    return {"root": root, "data": data, "other": other, "out": out}


def _copy(base: dict[str, Path], name: str, step: int = SAVE) -> Path:
    out = base["root"] / name
    ckpt = f"checkpoints/step-{step:06d}"
    shutil.copytree(base["out"] / ckpt, out / ckpt)
    return out


def _rewrite_manifest(folder: Path) -> None:
    """What an attacker does after planting a file: the manifest matches again."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {
        p.relative_to(folder).as_posix(): {
            "bytes": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in files
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    for needle in needles:
        assert needle in err, err
    assert "Traceback" not in err
    return err


def test_a_finished_run_says_so_and_changes_nothing(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p: p.read_bytes() for p in base["out"].rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_args(base["data"], base["out"])) == 0
    said = capsys.readouterr().out
    assert "holds this run, finished at step 6" in said and "not applied" not in said
    assert {p: p.read_bytes() for p in base["out"].rglob("*") if p.is_file()} == before
    # A setting changed for a run that will not train again: said to have no effect there.
    # Where and how it runs is no setting of the run (a node's new rendezvous port was listed).
    where = ["--threads-per-process", "1", "--num-workers", "1", "--device", "cpu", "--strategy", "single"]
    assert main([*_args(base["data"], base["out"]), "--lr", "0.5", "--weight-decay", "0.25", *where]) == 0
    said = capsys.readouterr().out
    assert "not applied (--lr 0.5, was " in said and "--weight-decay 0.25, was " in said
    assert not any(option in said for option in where[::2])
    assert {p: p.read_bytes() for p in base["out"].rglob("*") if p.is_file()} == before
    # Through the Python API, the result is the one run.json recorded (not nan).
    from lmtune.cli.commands import train_config
    from lmtune.cli.parser import build_parser
    from lmtune.train import train

    again = train(train_config(build_parser().parse_args(_args(base["data"], base["out"]))))
    recorded = json.loads((base["out"] / "run.json").read_text())["result"]
    assert (again.steps, again.last_loss) == (STEPS, recorded["last_loss"])
    assert again.not_applied == ()
    # ... and says what of this call it did not apply (a loop over learning rates into one folder
    # returned the first run's result each time, the log line alone saying so).
    changed = train(
        train_config(build_parser().parse_args([*_args(base["data"], base["out"]), "--lr", "0.5"]))
    )
    assert changed.steps == STEPS and len(changed.not_applied) == 1
    assert changed.not_applied[0].startswith("lr 0.5, was ")  # as a call names it (it said --lr)


def _finished_copy(base: dict[str, Path], name: str, checkpoints: tuple[int, ...]) -> Path:
    """The finished run's records and final/, with only these of its checkpoints."""
    out = base["root"] / name
    shutil.copytree(base["out"] / "final", out / "final")
    for record in ("run.json", "metrics.jsonl"):
        shutil.copy(base["out"] / record, out / record)
    for step in checkpoints:
        ckpt = f"checkpoints/step-{step:06d}"
        shutil.copytree(base["out"] / ckpt, out / ckpt)
    return out


def test_a_finished_runs_damaged_last_checkpoint_is_named_not_called_missing(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """A truncated optimizer.pt in the last step's checkpoint was "No checkpoint holds step 6", which
    sent the user to --overwrite, deleting everything."""
    out = _finished_copy(base, "finished-truncated", (STEPS,))
    optimizer = out / f"checkpoints/step-{STEPS:06d}/optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    capsys.readouterr()
    assert main(_args(base["data"], out)) == 0
    said = capsys.readouterr().out
    assert f"Its checkpoint {out / 'checkpoints' / f'step-{STEPS:06d}'} is damaged (" in said
    assert "No checkpoint holds" not in said
    # None earlier to name: said (it pointed to "an earlier one" that was not there); with one, named.
    assert (
        "to train on, no earlier whole checkpoint is left to continue from; --overwrite starts afresh" in said
    )
    (out / "checkpoints").rename(out / "checkpoints.kept")
    shutil.copytree(base["out"] / f"checkpoints/step-{SAVE:06d}", out / f"checkpoints/step-{SAVE:06d}")
    (out / "checkpoints.kept" / f"step-{STEPS:06d}").rename(out / f"checkpoints/step-{STEPS:06d}")
    assert main(_args(base["data"], out)) == 0
    older = out / "checkpoints" / f"step-{SAVE:06d}"
    assert f"to train on, --resume {older} continues from the one before it" in capsys.readouterr().out
    (older / "optimizer.pt").unlink()  # the one before damaged too: not named
    assert main(_args(base["data"], out)) == 0
    assert "no earlier whole checkpoint is left to continue from" in capsys.readouterr().out


@pytest.mark.parametrize("checkpoints", [(), (SAVE,)], ids=["no checkpoint", "an older one"])
def test_a_finished_run_is_finished_whatever_checkpoints_it_holds(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str], checkpoints: tuple[int, ...]
) -> None:
    """Without a checkpoint (a multi-process run without --save-every was once refused), or with an
    older one (a run stopped once by Ctrl+C resumed from it and trained again): both finished."""
    out = _finished_copy(base, f"finished-{len(checkpoints)}", checkpoints)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_args(base["data"], out, "--save-every", "0")) == 0
    said = capsys.readouterr().out
    assert "holds this run, finished at step 6" in said
    # Not "Raise --max-steps": that is refused below, for want of a checkpoint of step 6.
    assert "No checkpoint holds step 6 to train on from (--save-every); --overwrite starts afresh" in said
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.rglob("*") if p.is_file()} == before
    # More steps continue from the final state only: here there is none, and the message says so.
    _fails(_args(base["data"], out, "--max-steps", "9"), capsys, "finished at step 6", "--overwrite")
    # Another run into the folder is refused, naming the way out (by the checkpoint's fingerprint
    # when there is one to compare, else as an earlier run).
    needles = ("differs in what defines it",) if checkpoints else ("holds an earlier run",)
    _fails(_args(base["other"], out, "--save-every", "0"), capsys, *needles, "--overwrite")


def test_a_finished_run_whose_final_folder_is_gone_names_where_its_model_is(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = _finished_copy(base, "final-gone", (STEPS,))
    shutil.rmtree(out / "final")  # moved elsewhere by its user
    capsys.readouterr()
    assert main(_args(base["data"], out)) == 0
    said = capsys.readouterr().out
    assert f"final is gone; the model of step 6 is in its checkpoint {out}/checkpoints/step-000006" in said
    assert f"lmtune export {out}/checkpoints/step-000006 DIR" in said and "the model is in" not in said
    shutil.rmtree(out / "checkpoints")
    assert main(_args(base["data"], out)) == 0
    assert "final is gone, and no checkpoint holds step 6: --overwrite" in capsys.readouterr().out


def test_a_finished_run_run_again_with_the_users_files_in_final_does_nothing(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Its model card edited, notes put beside it: the same command was refused ("this run replaces
    final/"), though it replaces nothing; a run that trains on would, and is refused before it trains."""
    out = _finished_copy(base, "final-edited", (SAVE, STEPS))
    (out / "final" / "README.md").write_text("my card")
    (out / "final" / "NOTES.md").write_text("mine")
    (out / "final.tmp").mkdir()  # a folder of the user's by lmtune's temporary name: it is not written
    (out / "final.tmp" / "draft.md").write_text("mine")
    capsys.readouterr()
    assert main(_args(base["data"], out)) == 0
    said = capsys.readouterr().out
    assert (
        "holds this run, finished at step 6" in said and "Raise --max-steps or --epochs to train on" in said
    )
    assert (out / "final" / "README.md").read_text() == "my card"
    shutil.rmtree(out / "final.tmp")
    err = _fails(_args(base["data"], out, "--max-steps", "9"), capsys, "this run replaces final/")
    assert "NOTES.md" in err and "README.md" in err
    assert [r["step"] for r in train_rows(out)] == list(range(1, STEPS + 1))  # nothing trained


def test_a_run_stopped_before_its_final_folder_keeps_its_last_loss(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped after its last checkpoint, before final/ and run.json's result: the same command
    trains nothing and writes final/, with the loss its last step logged (it was None)."""
    out = _copy(base, "before-final", STEPS)
    shutil.copy(base["out"] / "metrics.jsonl", out / "metrics.jsonl")
    from lmtune.cli.commands import train_config
    from lmtune.cli.parser import build_parser
    from lmtune.train import train

    result = train(train_config(build_parser().parse_args(_args(base["data"], out))))
    assert "no steps left to train" in capsys.readouterr().out
    logged = train_rows(base["out"])[-1]
    assert logged["step"] == STEPS and result.last_loss == logged["loss"]
    assert json.loads((out / "run.json").read_text())["result"]["last_loss"] == logged["loss"]
    assert f"| train loss at step {STEPS} | {logged['loss']:.4f} |" in (out / "final/README.md").read_text()


def test_more_steps_continue_a_finished_run_from_its_final_state(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = _finished_copy(base, "continued", (SAVE, STEPS))
    capsys.readouterr()
    assert main(_args(base["data"], out, "--max-steps", "9")) == 0
    assert "resuming from" in capsys.readouterr().out
    assert [r["step"] for r in train_rows(out)] == list(range(1, 10))
    finished = json.loads((out / "run.json").read_text())["result"]["finished"]
    assert (finished["step"], finished["total_steps"]) == (9, 9)
    assert main(_args(base["data"], out, "--max-steps", "9")) == 0  # and now that run is finished
    assert "finished at step 9" in capsys.readouterr().out


def test_a_finished_run_whose_last_checkpoint_is_damaged_continues_from_the_one_named(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal names the checkpoint before the damaged one; the command it suggests, in the
    same folder, continues from there (an explicit --resume of this folder's checkpoint is the
    user's choice of step), and the damaged one is kept aside."""
    out = _finished_copy(base, "finished-damaged", (SAVE, STEPS))
    (out / "checkpoints" / "step-000006" / "optimizer.pt").unlink()
    older = out / "checkpoints" / "step-000003"
    said = _fails(_args(base["data"], out, "--max-steps", "9"), capsys, "is damaged", f"--resume {older}")
    assert "another --output-dir" in said
    assert main(_args(base["data"], out, "--max-steps", "9", "--resume", str(older))) == 0
    assert "resuming from" in capsys.readouterr().out
    assert [r["step"] for r in train_rows(out)] == list(range(1, 10))
    finished = json.loads((out / "run.json").read_text())["result"]["finished"]
    assert (finished["step"], finished["total_steps"]) == (9, 9)
    assert any(p.name.startswith("step-000006.replaced-") for p in (out / "checkpoints").iterdir())
    # Another folder's checkpoint into a finished run's folder is still refused, saying why.
    other = _finished_copy(base, "finished-other", (SAVE, STEPS))
    for steps in ("9", "6"):
        said = _fails(_args(base["data"], other, "--max-steps", steps, "--resume", str(older)), capsys)
        assert "a checkpoint of another folder" in said and "leave --resume out" in said
    # This folder's earlier step with no more steps asked for: said, not ignored (it was "nothing to do").
    said = _fails(
        _args(base["data"], other, "--max-steps", "6", "--resume", str(other / older.relative_to(out))),
        capsys,
    )
    assert "no more steps are asked for, so nothing would train from that checkpoint" in said


def test_an_early_stopped_run_is_finished(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "a.jsonl", uneven_texts(60, seed=4))
    argv = _args(data, tmp_path / "early", "--eval-split", "12", "--eval-every", "1")
    # No later evaluation beats the first by 10 nats: the patience of 1 stops the run at step 2.
    argv += [
        "--metric-for-best",
        "eval_loss",
        "--early-stopping-patience",
        "1",
        "--early-stopping-threshold",
        "10",
    ]
    assert main(argv) == 0
    assert "stopping early at step 2" in capsys.readouterr().out
    before = {p: p.read_bytes() for p in (tmp_path / "early").rglob("*") if p.is_file()}
    assert main(argv) == 0
    assert "finished at step 2" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in (tmp_path / "early").rglob("*") if p.is_file()} == before


def test_what_defines_the_run_must_match(base: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(base, "differs")
    _fails(_args(base["other"], out), capsys, "training data (content, tokenizer and data settings)")
    _fails(_args(base["data"], out, "--max-length", "32"), capsys, "--max-length 64 -> 32")
    _fails(_args(base["data"], out, "--optimizer", "sgd"), capsys, "--optimizer adamw -> sgd")
    _fails(_args(base["data"], out, "--model", "small"), capsys, "model config")
    _fails(_args(base["data"], out, "--seed", "4"), capsys, "--seed 3 -> 4")
    # Found by the run itself (no --resume given): named as found, not as "--resume FOLDER".
    ckpt = out / "checkpoints" / f"step-{SAVE:06d}"
    found = f"{ckpt}, the newest checkpoint in {out} (continued by default): it was saved by full"
    _fails(_args(base["data"], out, "--lora"), capsys, found)
    _fails(
        _args(base["data"], out, "--lora", "--resume", str(ckpt)), capsys, f"--resume {ckpt}: it was saved"
    )
    assert not (out / "final").exists()


def test_a_run_cut_to_its_checkpoint_says_nothing_is_left_to_apply_its_changes_to(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped at step 3 of 6 and resumed with --max-steps 2: it said "applied from step 4"."""
    out = _copy(base, "cut")
    assert main(_args(base["data"], out, "--max-steps", "2")) == 0
    said = "changed since the checkpoint, applied at step 3, where the run ends (no step left): total steps"
    assert f"{said} 6 -> 2" in capsys.readouterr().out


def test_a_changed_lr_and_length_apply_from_the_resume_step(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(base, "longer", step=STEPS)
    shutil.copy(base["out"] / "metrics.jsonl", out / "metrics.jsonl")
    changed = ("--max-steps", "9", "--lr", "5e-4", "--micro-batch-size", "2", "--neftune-alpha", "5")
    assert main(_args(base["data"], out, *changed)) == 0
    log = capsys.readouterr().out
    assert (
        "changed since the checkpoint, applied from step 7: --lr 0.001 -> 0.0005; total steps 6 -> 9; "
        "--micro-batch-size auto -> 2; --neftune-alpha none -> 5.0" in log
    )
    lrs = {r["step"]: r["lr"] for r in train_rows(out)}
    assert [lrs[s] for s in (7, 8, 9)] == pytest.approx(
        [5e-4 * warmup_cosine(s, 9, 0, 0.1) for s in (6, 7, 8)]
    )
    assert lrs[6] == pytest.approx(1e-3 * warmup_cosine(5, 6, 0, 0.1))  # the first run's rows are kept
    assert json.loads((out / "run.json").read_text())["resolved"]["lr"] == 5e-4
    # The record of what each resume changed: run.json, the checkpoints, the cards.
    first = {
        "step": 6,
        "changes": ["--lr 0.001 -> 0.0005", "total steps 6 -> 9", "--micro-batch-size auto -> 2"],
    }
    first["changes"].append("--neftune-alpha none -> 5.0")
    again = ("--max-steps", "11", "--lr", "5e-4", "--micro-batch-size", "2", "--packing", "on")
    assert main(_args(base["data"], out, *again)) == 0
    # How a step is computed is said too (--packing, checkpointing, compile, the loss's chunks).
    second = {
        "step": 9,
        "changes": ["total steps 9 -> 11", "--packing auto -> on", "--neftune-alpha 5.0 -> none"],
    }
    assert json.loads((out / "run.json").read_text())["resolved"]["changed_on_resume"] == [first, second]
    card = (out / "final" / "README.md").read_text()
    assert (
        "| changed on resume | after step 6: --lr 0.001 -> 0.0005, total steps 6 -> 9, --micro-batch-size "
        "auto -> 2, --neftune-alpha none -> 5.0; after step 9: total steps 9 -> 11, --packing auto -> on, "
        "--neftune-alpha 5.0 -> none (the rows above hold the last resume's settings) |"
    ) in card
    assert main(["export", str(out / "checkpoints" / "step-000009"), str(base["root"] / "step9")]) == 0
    exported = (base["root"] / "step9" / "README.md").read_text()
    # The resume after step 9 changed nothing that checkpoint trained with; its card holds the
    # settings it was saved under (NEFTune on, 9 steps planned), not the last resume's.
    assert "after step 6: --lr" in exported and "after step 9, later than this checkpoint: total" in exported
    assert "(the rows above hold this checkpoint's settings)" in exported and "| steps | 9 of 9 (" in exported
    assert "NEFTune noise on the input embeddings (alpha 5.0)" in exported and "NEFTune" not in card


def test_a_damaged_newest_checkpoint_stops_the_run_and_is_kept(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = base["root"] / "damaged"
    shutil.copytree(base["out"] / "checkpoints", out / "checkpoints")
    with (out / "checkpoints" / "step-000006" / "optimizer.pt").open("ab") as f:
        f.write(b"x")
    _fails(_args(base["data"], out), capsys, "step-000006, is damaged: optimizer.pt has", "--resume")
    # Given by --resume, or to export, it is called damaged too (not a model folder, as its files
    # would suggest), and --resume names the checkpoint saved before it.
    damaged = out / "checkpoints" / "step-000006"
    earlier = f"--resume {out / 'checkpoints' / 'step-000003'} continues from the one before it"
    _fails(
        _args(base["data"], base["root"] / "other-out", "--resume", str(damaged)),
        capsys,
        "is damaged",
        earlier,
    )
    mine = base["root"] / "my-data"  # a user's folder, neither damaged nor lmtune's to remove
    mine.mkdir()
    (mine / "d.jsonl").write_text("{}")
    said = _fails(
        _args(base["data"], base["root"] / "other-out", "--resume", str(mine)),
        capsys,
        ": not a checkpoint (no manifest",
    )
    assert "remove" not in said and "damaged" not in said
    part = out / "checkpoints" / "step-000003" / "sharded"  # where torch's DCP tools read an FSDP one
    part.mkdir()
    resumed = _args(base["data"], base["root"] / "other-out", "--resume", str(part))
    for command in (["export", str(part), str(base["root"] / "exported")], resumed):
        _fails(
            command, capsys, f"a part of the checkpoint {part.parent}, not a checkpoint: give {part.parent}"
        )
    part.rmdir()
    newest = out / "checkpoints" / "step-000099"  # the same, as a run folder's newest checkpoint
    shutil.copytree(mine, newest)
    _fails(_args(base["data"], out), capsys, "step-000099, is not one lmtune saved", "move it out of")
    assert (newest / "d.jsonl").is_file()
    shutil.rmtree(newest)
    _fails(
        ["export", str(damaged), str(base["root"] / "exported")],
        capsys,
        "not a valid checkpoint: optimizer.pt",
    )
    assert main(_args(base["data"], out, "--resume", str(out / "checkpoints" / "step-000003"))) == 0
    kept = [p.name for p in (out / "checkpoints").iterdir() if ".replaced-" in p.name]
    assert len(kept) == 1 and kept[0].startswith("step-000006.replaced-")
    final = {k: v for k, v in torch.load(out / "checkpoints" / "step-000006" / "optimizer.pt").items()}
    assert final["state"]  # a new, valid checkpoint of step 6 stands beside the kept one
    # A file of the user's put into a whole checkpoint is named as such, not called damage.
    noted = base["root"] / "noted"
    shutil.copytree(base["out"] / "checkpoints", noted / "checkpoints")
    (noted / "checkpoints" / "step-000006" / "NOTES.txt").write_text("mine")
    said = _fails(_args(base["data"], noted), capsys, "holds NOTES.txt, which lmtune did not write")
    assert "move NOTES.txt out of the checkpoint" in said and "damaged" not in said


def test_an_earlier_run_without_checkpoints_is_not_replaced(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = base["root"] / "earlier"
    shutil.copytree(base["out"] / "final", out / "final")
    shutil.copy(base["out"] / "metrics.jsonl", out / "metrics.jsonl")
    # What says an lmtune run wrote them; without its finish record, as a run that died at its end.
    record = json.loads((base["out"] / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({k: v for k, v in record.items() if k != "result"}))
    _fails(_args(base["data"], out), capsys, "holds an earlier run (final, metrics.jsonl)", "--overwrite")
    assert main(_args(base["data"], out, "--overwrite", "--max-steps", "3", "--save-every", "0")) == 0
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3]


@pytest.mark.parametrize("where", ["sharded index", "optimizer state"])
def test_a_planted_payload_runs_nothing(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str], where: str
) -> None:
    out = _copy(base, f"planted-{where.replace(' ', '-')}")
    ckpt = out / "checkpoints" / "step-000003"
    marker = base["root"] / f"ran-{where.replace(' ', '-')}"
    if where == "sharded index":
        (ckpt / "sharded").mkdir()
        (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    else:
        torch.save({"state": Payload(marker)}, ckpt / "optimizer.pt")
    _rewrite_manifest(ckpt)
    _fails(_args(base["data"], out), capsys, "refused")
    if where == "sharded index":  # export reads the index where the checkpoint has no other model
        (ckpt / "model.safetensors").unlink()
        _rewrite_manifest(ckpt)
        _fails(["export", str(ckpt), str(base["root"] / "exported")], capsys, "refused")
    assert not marker.exists()


def test_a_checkpoint_from_before_fingerprints_resumes_with_a_note(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = _copy(base, "legacy")
    ckpt = out / "checkpoints" / "step-000003"
    (ckpt / "fingerprint.json").unlink()
    _rewrite_manifest(ckpt)
    assert main(_args(base["data"], out)) == 0
    assert "predates run fingerprints" in capsys.readouterr().out


def test_a_resume_past_max_steps_trains_nothing_and_records_no_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """run.json stays strict JSON (it held a bare NaN) and the card shows no loss row."""
    from tests.conftest import tiny_run_with_checkpoint

    first = tiny_run_with_checkpoint(tmp_path)
    argv = ["train", "--data", str(tmp_path / "d.jsonl"), "--global-batch-size", "8", "--no-progress"]
    argv += ["--resume", str(first / "checkpoints" / "step-000002"), "--max-steps", "1"]
    assert main([*argv, "--output-dir", str(tmp_path / "again")]) == 0
    assert "no steps left to train" in capsys.readouterr().out
    text = (tmp_path / "again" / "run.json").read_text()
    run = json.loads(text, parse_constant=lambda name: pytest.fail(f"run.json holds {name}"))
    assert run["result"]["last_loss"] is None and run["result"]["steps"] == 2
    card = (tmp_path / "again" / "final" / "README.md").read_text()
    assert "train loss" not in card and "2 of 1" not in card
    assert "2 (its checkpoint was past the 1 this run planned: nothing more was trained)" in card
    from lmtune.tools.recorded import load_run
    from lmtune.tools.report import _summary

    assert _summary(load_run(tmp_path / "again"))["steps"].startswith("2 (its checkpoint was past the 1 ")
    # It saved its state in its own folder: a longer run continues there (it found no checkpoint).
    assert (tmp_path / "again" / "checkpoints" / "step-000002").is_dir()
    assert main([*argv[:-4], "--max-steps", "3", "--output-dir", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "run.json").read_text())["result"]["steps"] == 3


def test_a_signal_while_the_run_is_built_stops_it_before_any_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A preemption (or Ctrl+C) after the data is read and before the first step: no step is
    trained and nothing saved, it exits as the signal would, and the same command then starts."""
    import os
    import signal

    import lmtune.training.build as build

    chosen = build.choose_paths

    def signalled(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signal.SIGTERM)  # while the model is being set up
        return chosen(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(build, "choose_paths", signalled)
    argv = ["train", "--max-steps", "2", "--output-dir", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 128 + signal.SIGTERM
    said = capsys.readouterr().err
    assert "stopping before training begins, with nothing to save" in said
    assert "stopped by SIGTERM before training began" in said
    assert train_rows(tmp_path / "out") == [] and not (tmp_path / "out" / "checkpoints").exists()
    monkeypatch.setattr(build, "choose_paths", chosen)
    assert main(argv) == 0
    assert [r["step"] for r in train_rows(tmp_path / "out")] == [1, 2]


def test_a_runs_record_given_as_config_trains_that_run_again(
    base: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--config RUN/run.json` was "unknown setting config / resolved / ..."; its config alone
    refused the recorded defaults of a feature that is off (lora_rank 16 without lora). From another
    folder, its relative paths are read from the folder the run started in."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(base["data"], tmp_path / "my data.jsonl")
    argv = _args(Path("my data.jsonl"), Path("a"), "--lora", "--lora-rank", "4", "--eval-split", "0.1")
    assert main([*argv, "--overwrite"]) == 0
    first = tmp_path / "a"
    # Without a new --output-dir: the recorded folder, finished; its --overwrite is not taken again
    # (it deleted the run being read and trained it over).
    recorded_first = (first / "run.json").read_bytes()
    assert main(["train", "--config", "a/run.json"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--config", str(first / "run.json")]) == 0  # the same run: finished
    assert (first / "run.json").read_bytes() == recorded_first and not (elsewhere / "a").exists()
    again = tmp_path / "b"
    assert main(["train", "--config", str(first / "run.json"), "--output-dir", str(again)]) == 0
    trained = [[(r["step"], r["loss"], r["grad_norm"]) for r in train_rows(out)] for out in (first, again)]
    assert trained[0] == trained[1] and len(trained[0]) == STEPS  # the same losses, step by step
    recorded = json.loads((again / "run.json").read_text())["config"]
    assert recorded == json.loads((first / "run.json").read_text())["config"] | {
        "data": str(tmp_path / "my data.jsonl"),
        "output_dir": str(again),
        "overwrite": False,
    }


def test_ctrl_c_stops_a_python_loop_of_runs_after_saving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """From Python, Ctrl+C stopped the run (saved) and lmtune.train returned: a notebook's loop
    trained the next run whole, and one before the first step raised an Exception, which `except
    Exception` swallowed. Now KeyboardInterrupt after the save, and the same call resumes; the
    caller's torch thread count is left as it was."""
    import os
    import signal

    import lmtune
    import lmtune.training.build as build

    original = torch.optim.AdamW.step
    steps: list[int] = []

    def step(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        steps.append(1)
        if len(steps) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    cfg = lmtune.TrainConfig(model="tiny", max_steps=4, output_dir=str(tmp_path / "out"), progress=False)
    torch.set_num_threads(1)
    with pytest.raises(KeyboardInterrupt, match=r"stopped by Ctrl\+C with its last step saved .*; the same"):
        lmtune.train(cfg)  # the step under way when the signal came is finished (its flag is read once)
    assert torch.get_num_threads() == 1 and len(steps) == 3
    said = "".join(capsys.readouterr())  # the stop line names the call, not a command
    assert "call lmtune.train with the same settings again to resume" in said and "same command" not in said
    assert (tmp_path / "out" / "checkpoints" / "step-000003").is_dir()
    monkeypatch.setattr(torch.optim.AdamW, "step", original)
    assert lmtune.train(cfg).steps == 4  # the same call resumes
    assert [r["step"] for r in train_rows(tmp_path / "out")] == [1, 2, 3, 4]
    chosen = build.choose_paths

    def signalled(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signal.SIGINT)  # before the first step
        return chosen(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(build, "choose_paths", signalled)
    with pytest.raises(KeyboardInterrupt, match="stopped by SIGINT before training began"):
        lmtune.train(lmtune.TrainConfig(model="tiny", max_steps=1, output_dir=str(tmp_path / "b")))
    assert torch.get_num_threads() == 1
    # Ctrl+C during the last step: the run finishes (final/ saved), and the message said a call resumes it.
    monkeypatch.setattr(build, "choose_paths", chosen)
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    steps.clear()
    done = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt, match=r"after the run's last step: it finished .*nothing is left"):
        lmtune.train(lmtune.TrainConfig(model="tiny", max_steps=2, output_dir=str(done), progress=False))
    assert (done / "final" / "model.safetensors").is_file() and len(steps) == 2
    assert json.loads((done / "run.json").read_text())["result"]["finished"]["step"] == 2
    # A refusal from Python names the settings as the call gives them (it said --global-batch-size,
    # --overwrite); one naming a command to run keeps its flags.
    monkeypatch.setattr(torch.optim.AdamW, "step", original)
    more = lmtune.TrainConfig(model="tiny", max_steps=4, global_batch_size=16, output_dir=str(done))
    said = r"global_batch_size 32 -> 16\. .* another output_dir \(or overwrite=True\)$"
    with pytest.raises(UserError, match=said):
        lmtune.train(more.replace(progress=False))
    capsys.readouterr()


def test_a_signal_while_the_run_is_built_keeps_the_earlier_run_it_would_resume_or_replace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Neither --overwrite's deletion nor a resumed run's new run.json happens for a run that stops
    before its first step: the folder is as the earlier run left it."""
    import os
    import signal

    import lmtune.training.build as build

    out = tmp_path / "out"
    argv = ["train", "--max-steps", "2", "--save-every", "1", "--output-dir", str(out), "--no-progress"]
    assert main(argv) == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock"}
    chosen = build.choose_paths

    def signalled(*args: object, **kwargs: object) -> object:
        os.kill(os.getpid(), signal.SIGTERM)
        return chosen(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(build, "choose_paths", signalled)
    for more in (["--max-steps", "3"], ["--overwrite"]):  # a resume of step 2; a replacement
        assert main([*argv, *more]) == 128 + signal.SIGTERM
        after = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock"}
        assert after.keys() == before.keys(), more
        assert [p for p in before if before[p] != after[p]] == [], more


def test_another_folders_checkpoint_into_another_runs_folder_is_refused(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume of run A's checkpoint into the folder of run B (other data): B's final model and
    records were replaced and mixed with A's (steps 1-3 of B, 4-6 of A in one metrics.jsonl)."""
    b = base["root"] / "run-b"
    assert main(_args(base["other"], b, "--max-steps", "3")) == 0
    before = {p: p.read_bytes() for p in b.rglob("*") if p.is_file()}
    ckpt = base["out"] / "checkpoints" / "step-000003"
    said = _fails(
        _args(base["data"], b, "--resume", str(ckpt)), capsys, f"--output-dir {b} holds another run"
    )
    assert "final, metrics.jsonl, run.json, checkpoints" in said and "--overwrite" in said
    assert {p: p.read_bytes() for p in b.rglob("*") if p.is_file()} == before
    # Into a new folder, and again with the same command (now that folder's run): continued.
    fresh = base["root"] / "run-c"
    for _ in range(2):
        assert main(_args(base["data"], fresh, "--resume", str(ckpt))) == 0
    assert [r["step"] for r in train_rows(fresh)] == [4, 5, 6]


def test_a_lora_base_retrained_in_place_is_refused_on_resume(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """The frozen base is read from --model again on resume: the user's own SFT run continued into
    the same final/ (or a hub model updated) made the resumed LoRA run another one, silently."""
    sft = base["root"] / "sft"
    short = ["--global-batch-size", "8", "--max-length", "64", "--no-progress", "--data", str(base["data"])]
    assert main(["train", "--output-dir", str(sft), "--max-steps", "2", *short]) == 0
    lora = ["--lora", "--model", str(sft / "final")]
    out = base["root"] / "lora"
    assert main(_args(base["data"], out, *lora, "--max-steps", str(SAVE))) == 0
    shutil.copytree(out, base["root"] / "lora-same")
    # The same base, its folder spelled another way (refused as "--model S1/final -> S1/final/"): resumed.
    same = ["--lora", "--model", f"{sft / 'final'}/"]
    assert main(_args(base["data"], base["root"] / "lora-same", *same)) == 0
    # The same weights in another folder (moved to another disk): the same base, resumed.
    shutil.copytree(out, base["root"] / "lora-moved")
    shutil.copytree(sft / "final", base["root"] / "moved-base")
    moved = ["--lora", "--model", str(base["root"] / "moved-base")]
    assert main(_args(base["data"], base["root"] / "lora-moved", *moved)) == 0
    assert [r["step"] for r in train_rows(base["root"] / "lora-moved")] == list(range(1, STEPS + 1))
    assert main(["train", "--output-dir", str(sft), "--max-steps", "3", *short]) == 0  # final/ replaced
    said = _fails(_args(base["data"], out, *lora), capsys, "starting weights (--model)")
    assert f"the weights of --model {sft / 'final'} changed since the checkpoint" in said


def test_the_same_command_with_its_resume_continues_where_the_run_got_to(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped run began with --resume PATH: the same command again went back to PATH (a requeued
    job lost its progress at every preemption). From another working folder, and with PATH gone,
    it is still the same command; --resume never refuses a finished run's checkpoints."""
    began = base["root"] / "elsewhere" / "step-000003"
    shutil.copytree(base["out"] / "checkpoints" / "step-000003", began)
    out = base["root"] / "requeued"
    assert (
        main(_args(base["data"], out, "--resume", str(began), "--save-every", "1", "--max-steps", "5")) == 0
    )
    shutil.rmtree(out / "final")  # as a stop leaves it: no final/, no finished record
    record = json.loads((out / "run.json").read_text())
    del record["result"]["finished"]
    (out / "run.json").write_text(json.dumps(record))
    shutil.rmtree(began)
    monkeypatch.chdir(base["root"])  # typed relative to another working folder
    capsys.readouterr()
    assert main(_args(base["data"], out, "--resume", "elsewhere/step-000003", "--save-every", "1")) == 0
    assert f"resuming from {out}/checkpoints/step-000005" in capsys.readouterr().out
    assert [r["step"] for r in train_rows(out)] == [4, 5, 6]
    more = _args(base["data"], base["out"], "--max-steps", "9", "--resume", "never")
    _fails(more, capsys, "--resume never, but")


def test_a_run_killed_while_writing_final_logs_its_final_evaluation_once(base: dict[str, Path]) -> None:
    """Killed after its last step's checkpoint, while it wrote final/ (as a run whose final/ is
    gone): the rerun evaluated again and metrics.jsonl (and TensorBoard) held the last eval twice."""
    out = base["root"] / "final-killed"
    args = _args(base["data"], out, "--eval-data", str(base["other"]), "--eval-every", str(SAVE))
    assert main(args) == 0
    shutil.rmtree(out / "final")
    record = json.loads((out / "run.json").read_text())
    del record["result"]  # written after final/
    (out / "run.json").write_text(json.dumps(record))
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [SAVE, STEPS]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, STEPS + 1))


def test_merge_lora_asked_of_a_finished_lora_run_names_export(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--merge-lora added to a finished LoRA run was only "they would apply to further steps only":
    merging needs no step, and export merges the checkpoint's adapter."""
    out = base["root"] / "lora-finished"
    args = _args(base["data"], out, "--lora", "--save-every", str(STEPS))
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--merge-lora"]) == 0
    said = capsys.readouterr().out
    assert "not applied (--merge-lora True, was False)" in said
    assert f"lmtune export {out / 'checkpoints' / 'step-000006'} DIR --merge-lora" in said


def test_a_restart_decides_as_a_resume_and_records_the_command_as_given(
    base: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker --max-restarts started again goes on from its launch's checkpoint, but run.json
    recorded what it decided with (--resume auto, no --overwrite, no resume_path): the same command
    run again later went back to the checkpoint the run began from, and trained its steps again."""
    began = base["root"] / "restart-from" / "step-000003"
    shutil.copytree(base["out"] / "checkpoints" / "step-000003", began)
    out = base["root"] / "restarted"
    started = time.time() - 1
    monkeypatch.setattr(resume, "launch_started", lambda: started)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-r")
    given = ("--resume", str(began), "--save-every", "1", "--overwrite")
    assert main(_args(base["data"], out, *given, "--max-steps", "5")) == 0  # the first start, "killed"
    shutil.rmtree(out / "final")
    record = json.loads((out / "run.json").read_text())
    del record["result"]["finished"]
    (out / "run.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(_args(base["data"], out, *given)) == 0  # its restart
    said = capsys.readouterr()
    assert "a restart goes on from the newest checkpoint" in said.err
    assert "--overwrite: removed" not in said.err
    assert f"resuming from {out}/checkpoints/step-000005" in said.out
    assert [r["step"] for r in train_rows(out)] == [4, 5, 6]
    record = json.loads((out / "run.json").read_text())
    assert (record["config"]["overwrite"], record["config"]["resume"]) == (True, str(began))
    assert record["resolved"]["resume_path"] == str(began.resolve())
    # Stopped at its last step, the same command run again (another launch, without --overwrite, as
    # a stop's advice says) continues from there, not from where the run began.
    shutil.rmtree(out / "final")
    del record["result"]["finished"]
    (out / "run.json").write_text(json.dumps(record))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-s")
    assert main(_args(base["data"], out, *given[:-1])) == 0
    assert f"resuming from {out}/checkpoints/step-000006" in capsys.readouterr().out
