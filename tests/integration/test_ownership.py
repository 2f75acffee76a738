"""lmtune writes, replaces and deletes only what it wrote: `lmtune export` never replaces a user's
folder or a run's files, `--overwrite` removes only lmtune's own entries, and an output folder that
would destroy or read back the run's inputs is refused before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmtune.checkpoint import rundir
from lmtune.checkpoint.export_folder import EXPORT_MARKER
from lmtune.checkpoint.layout import LOCK_FILE, TEMPORARY_MARK, verify
from lmtune.checkpoint.owned import WRITTEN_RECORD, file_stats, users_files
from lmtune.checkpoint.rundir import check_earlier_run, check_output_dir, replace_earlier_run
from lmtune.cli import main
from lmtune.errors import UserError
from lmtune.parallel.distributed import read_dist_env
from lmtune.parallel.health import HANG_REPORT, HANG_REPORT_HEAD, HEALTH_DIR_ENV
from tests.conftest import one_line_error as _error
from tests.conftest import tiny_run_with_checkpoint, write_jsonl


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run_with_checkpoint(tmp_path_factory.mktemp("own"))


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_never_replaces_what_it_did_not_write(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = run / "checkpoints" / "step-000002"
    before = _files(run)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "ideas.txt").write_text("mine")
    assert "not empty and not an earlier export" in _error(["export", str(ckpt), str(notes)], capsys)
    said = _error(["export", str(ckpt), str(notes / "ideas.txt" / "model")], capsys)
    assert f"cannot write the export there ({notes / 'ideas.txt'} is a file, not a folder)" in said
    assert "not empty and not an earlier export" in _error(
        ["export", str(ckpt), str(notes), "--overwrite"], capsys
    )
    assert (notes / "ideas.txt").read_text() == "mine"
    for inside in (run, run / "checkpoints", run / "final", run / "final" / "sub", run / "new"):
        assert "lies inside the run folder" in _error(
            ["export", str(ckpt), str(inside), "--overwrite"], capsys
        )
    assert _files(run) == before and verify(ckpt) is None  # the run's files are untouched
    # A copy of the checkpoint outside any run: neither its folder nor one inside it is a destination.
    holder = tmp_path / "holder"
    holder.mkdir()
    copy = holder / "ckpt"
    copy.mkdir()
    for f in ckpt.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    for dest in (holder, copy, copy / "x"):
        assert "the checkpoint" in _error(["export", str(copy), str(dest)], capsys)
    # The run's final/ is a model folder already: said so, not called a broken checkpoint.
    said = _error(["export", str(run / "final"), str(tmp_path / "again")], capsys)
    assert "a model folder (a run's final/ or an export)" in said and "RUN/checkpoints/step-N" in said
    assert not (tmp_path / "again").exists()
    # The run's own folder: said so, with its newest checkpoint.
    said = _error(["export", str(run), str(tmp_path / "again")], capsys)
    assert "a run's folder, not a checkpoint" in said and "step-000002 is its newest" in said
    # The same words for --resume, before any data is read; none of them is called damaged.
    for given, words in (
        (run, "a run's folder, not a checkpoint (" + str(run / "checkpoints" / "step-000002")),
        (run / "checkpoints", "the folder of a run's checkpoints, not a checkpoint"),
        (run / "final", "a model folder (a run's final/ or an export)"),
    ):
        argv = ["train", "--resume", str(given), "--output-dir", str(tmp_path / "r"), "--max-steps", "4"]
        said = _error(argv, capsys)
        assert f"--resume {given}: {words}" in said and "damaged" not in said
    # A run's folder given as --model points at its model.
    said = _error(["train", "--model", str(run), "--output-dir", str(tmp_path / "r")], capsys)
    assert f"not a model folder; a run's folder? Its model is --model {run / 'final'}" in said


def test_export_writes_beside_and_replaces_only_an_earlier_export(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = run / "checkpoints" / "step-000002"
    dest = tmp_path / "exported"
    dest.mkdir()  # an empty folder is a destination
    assert main(["export", str(ckpt), str(dest)]) == 0
    assert (dest / "model.safetensors").is_file() and (dest / EXPORT_MARKER).is_file()
    assert json.loads((dest / EXPORT_MARKER).read_text())["checkpoint"] == str(ckpt.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # no temporary sibling left
    capsys.readouterr()
    assert "holds an earlier export; --overwrite replaces it" in _error(
        ["export", str(ckpt), str(dest)], capsys
    )
    # A file the earlier export wrote (its marker records it) goes; a file added since is the
    # user's, and so is one of the export's files changed since (an edited model card).
    (dest / "stale.txt").write_text("from the earlier export")
    marker = json.loads((dest / EXPORT_MARKER).read_text())
    marker["stats"]["stale.txt"] = file_stats(dest)["stale.txt"]
    (dest / EXPORT_MARKER).write_text(json.dumps(marker))
    (dest / "deploy.sh").write_text("mine")
    card = (dest / "README.md").read_text()
    (dest / "README.md").write_text(card + "\nMy notes on this model.\n")
    said = _error(["export", str(ckpt), str(dest), "--overwrite"], capsys)
    assert "did not write, or changed since it wrote them (README.md, deploy.sh)" in said
    assert (dest / "deploy.sh").read_text() == "mine" and (dest / "stale.txt").is_file()
    assert (dest / "README.md").read_text().endswith("My notes on this model.\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]
    (dest / "deploy.sh").unlink()
    (dest / "README.md").unlink()
    assert main(["export", str(ckpt), str(dest), "--overwrite"]) == 0
    assert not (dest / "stale.txt").exists() and (dest / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]


def test_export_keeps_a_lora_base_and_the_working_folder_and_merges_a_relative_base(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export over a LoRA checkpoint's own base (an earlier export, so --overwrite would replace
    it) lost the base that the adapter, the run's resume and --merge-lora load; an export into
    the working folder was a traceback (`.`) or left the shell in a deleted folder; --merge-lora
    refused a run whose --model was typed relative to where it trained."""
    from safetensors.torch import load_file

    monkeypatch.chdir(tmp_path)
    assert main(["export", str(run / "checkpoints" / "step-000002"), "models/base"]) == 0
    data = write_jsonl(tmp_path / "d.jsonl", [f"text {i}" for i in range(16)])
    argv = ["train", "--model", "models/base", "--lora", "--data", str(data), "--output-dir", "lora"]
    argv += [
        "--max-steps",
        "2",
        "--save-every",
        "2",
        "--global-batch-size",
        "8",
        "--merge-lora",
        "--no-progress",
    ]
    assert main(argv) == 0
    ckpt = tmp_path / "lora" / "checkpoints" / "step-000002"
    base = tmp_path / "models" / "base"
    before = _files(base)
    for dest, how in (
        ("models/base", "is"),
        ("models", "holds"),
        (f"{base}/", "is"),
        ("models/base/sub", "lies in"),
    ):
        said = _error(["export", str(ckpt), dest, "--overwrite"], capsys)
        assert f"{how} {base}, the base model of the checkpoint's LoRA adapter" in said
    assert _files(base) == before
    # A full run's --model, and a preference run's --reference-model, which its resume reads again.
    argv = [
        "train",
        "--model",
        "models/base",
        "--data",
        str(data),
        "--output-dir",
        "full",
        "--max-steps",
        "1",
    ]
    assert main([*argv, "--save-every", "1", "--global-batch-size", "8", "--no-progress"]) == 0
    said = _error(
        ["export", str(tmp_path / "full" / "checkpoints" / "step-000001"), "models/base", "--overwrite"],
        capsys,
    )
    assert f"is {base}, the run's --model" in said
    here = tmp_path / "away" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    for dest, words in ((".", "the working folder;"), (str(here), "the working folder;"), ("..", "it holds")):
        assert words in _error(["export", str(ckpt), dest], capsys)
    assert "DIR is empty" in _error(["export", str(ckpt), ""], capsys)
    assert "CHECKPOINT is empty" in _error(["export", "", "m"], capsys)
    assert main(["export", str(ckpt), "merged", "--merge-lora"]) == 0  # from another working folder
    exported, trained = (
        load_file(here / "merged" / "model.safetensors"),
        load_file(tmp_path / "lora" / "final" / "merged" / "model.safetensors"),
    )
    assert exported.keys() == trained.keys() and all(exported[k].equal(trained[k]) for k in trained)
    base.rename(base.with_name("moved"))  # the adapter's base gone: said as the adapter's, not as --model
    said = _error(["export", str(ckpt), "merged-again", "--merge-lora"], capsys)
    assert f"{ckpt}: its adapter's base model {base}: no such folder" in said


def test_an_export_into_a_users_empty_folder_keeps_its_permissions(run: Path, tmp_path: Path) -> None:
    """A folder made 0700 for the weights became 0755 (the export is written beside it and renamed
    into its place)."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o700)
    assert main(["export", str(run / "checkpoints" / "step-000002"), str(private)]) == 0
    assert (private / "model.safetensors").is_file() and private.stat().st_mode & 0o777 == 0o700
    if os.geteuid() == 0:  # root exporting into another user's empty folder leaves it theirs
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
        assert main(["export", str(run / "checkpoints" / "step-000002"), str(theirs)]) == 0
        assert (theirs.stat().st_uid, theirs.stat().st_gid) == (65534, 65534)


def test_an_export_into_a_folder_you_cannot_write_is_refused(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty 0555 folder was replaced by the export (written beside it, renamed into place) and
    kept its mode: files its owner could not remove. As root, the refusal is checked in a process
    without the capability that writes anywhere, as a user's."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    argv = ["export", str(run / "checkpoints" / "step-000002"), str(locked)]
    if os.geteuid() != 0:
        code = main(argv)
        said = capsys.readouterr().err
    else:
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to drop the capability that writes anywhere")
        drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
        done = subprocess.run([*drop, sys.executable, "-m", "lmtune", *argv], capture_output=True, text=True)
        code, said = done.returncode, done.stderr
    assert code == 2 and not any(locked.iterdir())
    assert f"{locked}: not writable by you (its permissions, or a read-only file system)" in said


def test_saved_weights_are_as_readable_as_the_files_beside_them(run: Path, tmp_path: Path) -> None:
    """safetensors writes 0600; lmtune's folders follow the umask (022 here: 0644), so a serving
    account can read the weights as it can read their config."""
    umask = os.umask(0o022)
    os.umask(umask)
    expected = 0o666 & ~umask
    assert main(["export", str(run / "checkpoints" / "step-000002"), str(tmp_path / "exp")]) == 0
    for folder in (run / "final", run / "checkpoints" / "step-000002", tmp_path / "exp"):
        weights = [p for p in folder.rglob("*.safetensors")]
        assert weights and all(p.stat().st_mode & 0o777 == expected for p in weights), folder
        assert (folder / "config.json").stat().st_mode & 0o777 == expected


def _earlier_run(folder: Path) -> None:
    (folder / "checkpoints" / "step-000002").mkdir(parents=True)
    (folder / "checkpoints" / "step-000002" / "manifest.json").write_text("{}")  # lmtune's, if damaged
    (folder / "checkpoints" / ".step-000004.tmp").mkdir()  # a save cut short (marked as lmtune's)
    (folder / "checkpoints" / ".step-000004.tmp" / TEMPORARY_MARK).touch()
    # A checkpoint lmtune saved, and a user's notes put into it since (its manifest lists no notes).
    (folder / "checkpoints" / "step-000003" / "sharded").mkdir(parents=True)
    (folder / "checkpoints" / "step-000003" / "sharded" / "0.distcp").write_text("weights")
    (folder / "checkpoints" / "step-000003" / "NOTES.txt").write_text("mine")
    listed = {"sharded/0.distcp": {"bytes": 7, "sha256": "x"}}
    (folder / "checkpoints" / "step-000003" / "manifest.json").write_text(json.dumps(listed))
    (folder / "checkpoints" / "step-7").mkdir()  # a user's folder named as lmtune names its own
    (folder / "checkpoints" / "step-7" / "notes.txt").write_text("mine")
    (folder / "checkpoints" / "my-notes.txt").write_text("mine")
    (folder / "samples").mkdir()
    (folder / "samples" / "rank-0.jsonl").write_text("{}\n")
    (folder / "samples" / "list.txt").write_text("mine")
    (folder / "final").mkdir()
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / "run.json").write_text('{"config": {}, "environment": {}}')
    (folder / "notes.txt").write_text("mine")
    # The reporters' folders: what TensorBoard and W&B wrote, and a user's files beside it.
    (folder / "tensorboard").mkdir()
    (folder / "tensorboard" / "events.out.tfevents.1764686400.host.example.4242.0").write_bytes(b"\0")
    (folder / "tensorboard" / "events.out.tfevents.123.mine").write_text("mine")
    (folder / "tensorboard" / "my_notes.txt").write_text("mine")
    (folder / "wandb" / "run-20261202_141500-ab12cd34" / "files").mkdir(parents=True)
    (folder / "wandb" / "debug.log").write_text("")
    (folder / "wandb" / "keep.txt").write_text("mine")


def test_overwrite_removes_only_lmtunes_own_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _earlier_run(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    # A user's step-N is in the way of this run's checkpoints: refused before anything is deleted.
    with pytest.raises(
        UserError, match=r"--overwrite: .*step-7 holds no checkpoint of lmtune.s .* move it out"
    ):
        check_earlier_run(tmp_path, continued=False, overwrite=True, config={})
    assert sorted(tmp_path.rglob("*")) == before
    (tmp_path / "checkpoints" / "step-7").rename(tmp_path / "step-7")
    # A user's file inside one of lmtune's checkpoints would outlive it as a step-N folder of
    # theirs, which the new run would refuse after the old one was gone: refused first too.
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(UserError, match=r"--overwrite: .*step-000003 holds NOTES\.txt, which lmtune did not"):
        check_earlier_run(tmp_path, continued=False, overwrite=True, config={})
    assert sorted(tmp_path.rglob("*")) == before
    (tmp_path / "checkpoints" / "step-000003" / "NOTES.txt").rename(tmp_path / "NOTES.txt")
    before = sorted(tmp_path.rglob("*"))
    check_earlier_run(tmp_path, continued=False, overwrite=True, config={})
    assert sorted(tmp_path.rglob("*")) == before  # checked only: deleted once the new run is built
    said: list[str] = []
    replace_earlier_run(tmp_path, read_dist_env("cpu"), 0, said.append)
    # What it deleted is said (it deleted without a word), with what it kept.
    assert len(said) == 1
    assert said[0].startswith(
        "--overwrite: removed the earlier run's final, lmtune's files in checkpoints/, "
    )
    assert "kept what lmtune did not write there: " in said[0] and "my-notes.txt" in said[0]
    # A restart (--max-restarts) before the job's first checkpoint: the files its first start wrote
    # (since the launch began) are its own, which it called "the earlier run's".
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    for began, whose in (
        (time.time() - 60, "this job's first start's"),
        (time.time() + 60, "the earlier run's"),
    ):
        (tmp_path / "run.json").write_text("{}")
        monkeypatch.setattr(rundir, "launch_started", lambda began=began: began)
        replace_earlier_run(tmp_path, read_dist_env("cpu"), 0, said.append)
        assert said[-1].startswith(f"--overwrite: removed {whose} run.json from {tmp_path}")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == [
        *("NOTES.txt", "checkpoints", "checkpoints/my-notes.txt"),
        *("notes.txt", "samples", "samples/list.txt", "step-7", "step-7/notes.txt"),
        *("tensorboard", "tensorboard/events.out.tfevents.123.mine", "tensorboard/my_notes.txt"),
        *("wandb", "wandb/keep.txt"),
    ]
    # Folders named as lmtune names its entries, in a folder that holds no lmtune run, are not its.
    # Nor are they with this run's lock in it (check_earlier_run runs with the lock held), or a
    # metrics.jsonl, a checkpoint-named folder without a manifest, or a run.json of another tool.
    other = tmp_path / "other"
    (other / "wandb").mkdir(parents=True)
    (other / "final").mkdir()
    (other / "checkpoints" / "step-000001").mkdir(parents=True)
    (other / "checkpoints" / "step-000001" / "keep.txt").write_text("mine")
    (other / "metrics.jsonl").write_text('{"loss": 1}\n')
    (other / "run.json").write_text('{"config": {"lr": 1}}')
    (other / LOCK_FILE).write_text("held by this run")
    with pytest.raises(UserError, match="not lmtune's to delete"):
        check_earlier_run(other, continued=False, overwrite=True, config={})
    # Without --overwrite, the refusal does not suggest it: it would refuse them too.
    with pytest.raises(
        UserError, match=r"holds final, metrics\.jsonl, run\.json but no lmtune run"
    ) as refused:
        check_earlier_run(other, continued=False, overwrite=False, config={})
    assert "--overwrite" not in str(refused.value)
    assert sorted(p.name for p in other.iterdir()) == sorted(
        ["wandb", "final", "checkpoints", "metrics.jsonl", "run.json", LOCK_FILE]
    )
    assert (other / "checkpoints" / "step-000001" / "keep.txt").is_file()
    # A file a run writes whole, of a user's, alone in the folder: refused too, whatever else is
    # asked (a continued checkpoint from elsewhere would write over it as well).
    for name in ("run.json", "samples/rank-0.jsonl", "reporting.json"):
        alone = tmp_path / "alone" / name.replace("/", "-")
        (alone / name).parent.mkdir(parents=True, exist_ok=True)
        (alone / name).write_text("my own notes")
        for continued in (False, True):
            with pytest.raises(UserError, match=f"holds {name} but no lmtune run"):
                check_earlier_run(alone, continued=continued, overwrite=False, config={})
        assert (alone / name).read_text() == "my own notes"
    hung = tmp_path / "hung"  # a run that hung before its run.json: its rerun starts
    hung.mkdir()
    (hung / HANG_REPORT).write_text(HANG_REPORT_HEAD + "rank 1 waited in all_reduce")
    check_earlier_run(hung, continued=False, overwrite=False, config={})
    # A user's file of that name was written over by the next hang: refused first, with --overwrite too,
    # where a watchdog runs (a single process has none).
    (hung / HANG_REPORT).write_text("my own notes on the hang")
    check_earlier_run(hung, continued=False, overwrite=False, config={})
    monkeypatch.setenv(HEALTH_DIR_ENV, str(tmp_path))
    for overwrite in (False, True):
        with pytest.raises(UserError, match=f"holds {HANG_REPORT}, which lmtune did not write"):
            check_earlier_run(hung, continued=False, overwrite=overwrite, config={})


def test_a_users_folders_and_files_named_like_lmtunes_temporary_ones_are_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder with no run in it, holding a user's final.tmp/, checkpoints/.step-2.tmp/ and
    run.tmp: a run there removed all three ("left by a save that did not finish"), run.tmp
    replaced by run.json. They are kept; a save that would need one of the names is refused."""
    data = write_jsonl(tmp_path / "d.jsonl", ["some text"] * 16)
    out = tmp_path / "home"
    for folder in (out / "final.tmp", tmp_path / "home2" / "checkpoints" / ".step-000002.tmp"):
        folder.mkdir(parents=True)
        (folder / "thesis.tex").write_text("mine")
    (out / "run.tmp").write_text("mine too")
    before = _files(out)
    argv = ["train", "--data", str(data), "--output-dir", str(out), "--global-batch-size", "8"]
    assert main([*argv, "--max-steps", "1", "--save-every", "0", "--no-progress"]) == 2
    said = capsys.readouterr()
    assert "removed" not in said.out + said.err
    assert (
        f"{out / 'final.tmp'}: lmtune writes its temporary folder there, and this is not one it made"
        in said.err
    )
    assert {k: v for k, v in _files(out).items() if k in before} == before
    assert (out / "run.tmp").read_text() == "mine too" and not list(out.glob(".run.json.tmp-*"))
    # The checkpoint of step 2 would be written through checkpoints/.step-000002.tmp: refused too.
    argv[argv.index(str(out))] = str(tmp_path / "home2")
    said = _error([*argv, "--max-steps", "2", "--save-every", "2", "--no-progress"], capsys)
    assert ".step-000002.tmp: lmtune writes its temporary folder there" in said
    assert not (tmp_path / "home2" / "metrics.jsonl").exists()  # refused before training, not at the save
    assert (tmp_path / "home2" / "checkpoints" / ".step-000002.tmp" / "thesis.tex").read_text() == "mine"


def test_a_checkpoint_linked_in_from_another_run_is_never_deleted_through_the_link(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """checkpoints/step-N as a link to another run's checkpoint: --overwrite deleted the files of
    the link's target (the manifest's list, read through it) and then failed on the link, and
    pruning did the same mid-run. Pruning passes it by; resuming from it and --overwrite are refused,
    naming the link; the target stays whole, and --resume through a link of the user's own (not
    in a checkpoints/ folder) reads its target."""
    data = write_jsonl(tmp_path / "d.jsonl", [f"text {i}" for i in range(16)])
    target = run / "checkpoints" / "step-000002"
    before = _files(target)
    out = tmp_path / "b"
    argv = ["train", "--data", str(data), "--output-dir", str(out), "--global-batch-size", "8"]
    argv += ["--no-progress"]
    assert main([*argv, "--max-steps", "1", "--save-every", "1"]) == 0
    (out / "checkpoints" / "step-000000").symlink_to(target)  # older than the run's own: pruning's case
    assert main([*argv, "--max-steps", "3", "--save-every", "1", "--keep-last", "1"]) == 0  # pruned around it
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000000", "step-000003"]
    (out / "checkpoints" / "step-000009").symlink_to(target)  # the newest: resume's case
    resume = _error([*argv, "--max-steps", "12", "--save-every", "1"], capsys)
    overwrite = _error([*argv, "--max-steps", "1", "--overwrite"], capsys)
    link = out / "checkpoints" / "step-000009"
    said = "is a link (to {}), not a checkpoint this run saved: lmtune never prunes, replaces or resumes"
    assert f"error: the newest checkpoint in --output-dir: {link} {said.format(target)}" in resume
    assert f"error: --overwrite: {link.with_name('step-000000')} {said.format(target)}" in overwrite
    assert "--resume TARGET to continue a checkpoint of another folder here" in overwrite
    assert _files(target) == before and verify(target) is None
    assert (out / "checkpoints" / "step-000000").is_symlink() and link.is_symlink()
    # A link of the user's own naming a checkpoint: --resume reads where it points.
    (tmp_path / "latest").symlink_to(target)
    for name in ("step-000000", "step-000009"):
        (out / "checkpoints" / name).unlink()
    other = ["--output-dir", str(tmp_path / "c"), "--resume", str(tmp_path / "latest")]
    assert main([*argv[:3], *other, *argv[5:], "--max-steps", "3"]) == 0
    run_json = json.loads((tmp_path / "c" / "run.json").read_text())
    assert run_json["resolved"]["resumed_from"] == str(target)
    assert main(["export", str(tmp_path / "latest"), str(tmp_path / "exported")]) == 0  # export too
    # A damaged newest checkpoint points at the one before it that lmtune saved, never at a link
    # (that advice led to a link to another run); --resume never names the link (not --overwrite).
    (out / "checkpoints" / "step-000001").symlink_to(target)
    (out / "checkpoints" / "step-000003" / "optimizer.pt").unlink()
    damaged = _error([*argv, "--max-steps", "5"], capsys)
    assert "step-000003, is damaged" in damaged and "--resume" not in damaged
    never = _error([*argv, "--max-steps", "5", "--resume", "never"], capsys)
    assert f"--resume never: {out / 'checkpoints' / 'step-000001'} is a link" in never
    assert _files(target) == before


def test_output_folders_that_would_lose_or_reread_inputs_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "d.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match="the root folder"):
        check_output_dir(Path("/"), {}, overwrite=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    check_output_dir(tmp_path / "home", {}, overwrite=False)
    for home in (tmp_path / "home", tmp_path):
        with pytest.raises(UserError, match="home folder or above it"):
            check_output_dir(home, {}, overwrite=True)
    refused = {
        (data, str(data), False): "lies inside --data",  # --data DIR --output-dir DIR
        (data / "run", str(data), False): "lies inside --data",
        (data / "run", f"{data}/*.jsonl", False): "lies inside --data",
        (tmp_path / "out", str(tmp_path / "out" / "final" / "d.jsonl"), False): "where this run writes",
        (
            tmp_path / "out",
            str(tmp_path / "out" / "final" / "d.jsonl"),
            True,
        ): "which --overwrite would delete",
    }
    (tmp_path / "out" / "final").mkdir(parents=True)
    (tmp_path / "out" / "final" / "d.jsonl").write_text("{}")
    for (out, spec, overwrite), needle in refused.items():
        with pytest.raises(UserError, match=needle):
            check_output_dir(out, {"--data": spec}, overwrite)
    check_output_dir(tmp_path / "elsewhere", {"--data": str(data)}, overwrite=True)
    # Beside the run's entries: --overwrite deletes those alone, so the data stays (it was refused).
    check_output_dir(data, {"--data": str(data / "d.jsonl")}, overwrite=True)
    check_output_dir(data, {"--data": "some/hub-dataset"}, overwrite=True)  # not a local path
    run = tmp_path / "earlier"  # another run's checkpoint or final/ is never a new run's folder
    (run / "checkpoints" / "step-000002").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    for inside in (run / "checkpoints" / "step-000002", run / "final", run / "final" / "merged"):
        with pytest.raises(UserError, match=f"lies inside {run / inside.relative_to(run).parts[0]}, which"):
            check_output_dir(inside, {}, overwrite=False)
    check_output_dir(run, {}, overwrite=False)  # the run's own folder: judged by the run's rules
    # A folder beside the run's entries is not the run's: a run in the working folder (--output-dir
    # .) left the runs below it continuable (they were refused).
    check_output_dir(run / "another-run", {}, overwrite=False)


def test_train_refuses_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "d.jsonl", ["a text"] * 8)
    assert "lies inside --data" in _error(["train", "--data", str(data), "--output-dir", str(data)], capsys)
    cached = [
        "train",
        "--data",
        str(data),
        "--output-dir",
        str(tmp_path / "o"),
        "--cache-dir",
        str(data / "c"),
    ]
    assert "--cache-dir" in _error(cached, capsys)  # the next run would read the cache as data
    assert sorted(p.name for p in data.iterdir()) == ["d.jsonl"]  # not even a lock
    assert "the root folder" in _error(["train", "--output-dir", "/", "--overwrite"], capsys)
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "metrics.jsonl")
    assert "metrics.jsonl is not a regular file" in _error(
        ["train", "--data", str(data), "--output-dir", str(out), "--max-steps", "1"], capsys
    )
    assert not (out / LOCK_FILE).exists()
    # A run that stops before writing anything removes the folders it made for --output-dir (the
    # parents too: new/q/ stayed), and none that was there.
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    assert "holds no records" in _error(
        ["train", "--data", str(empty), "--output-dir", str(out / "new" / "q" / "r")], capsys
    )
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]


def test_a_run_replaces_its_final_folder_only_as_it_wrote_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """final/ records the files lmtune wrote there; a continued or overwritten run that would
    replace it refuses, before training, while a file there is not lmtune's or was changed."""
    out = tiny_run_with_checkpoint(tmp_path)
    final = out / "final"
    assert (final / WRITTEN_RECORD).is_file()
    data = str(tmp_path / "d.jsonl")
    argv = ["train", "--data", data, "--output-dir", str(out), "--global-batch-size", "8", "--no-progress"]
    (final / "serve.py").write_text("mine")
    before = _files(out)
    for extra in ([], ["--overwrite"]):
        said = _error([*argv, "--max-steps", "3", *extra], capsys)
        assert f"{final} holds files lmtune did not write, or changed since it wrote them (serve.py)" in said
        assert _files(out) == before  # nothing trained, nothing removed
    (final / "serve.py").unlink()
    card = (final / "README.md").read_text()
    (final / "README.md").write_text(card.replace("lmtune", "my tool"))
    assert "(README.md)" in _error([*argv, "--max-steps", "3"], capsys)
    (final / "README.md").write_text(card)  # back as lmtune wrote it: its own again
    assert users_files(final) == []
    (final / "README.md").unlink()  # what lmtune wrote may go
    assert main([*argv, "--max-steps", "3"]) == 0  # continues to step 3 and writes final/ again
    assert (final / "README.md").is_file() and users_files(final) == []
    assert json.loads((out / "run.json").read_text())["result"]["steps"] == 3


def test_named_output_files_replace_only_what_lmtune_wrote(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`report --out/--png`, `data audit --plot`, `plan --json` and `bench --json` (whose default,
    bench.json, lands in the working folder) replace a file of that name only when lmtune wrote
    it; a user's file is refused before any work, and left as it was."""
    from lmtune.tools.report import PLOTS

    page, pngs, plot = tmp_path / "report.html", tmp_path / "png", tmp_path / "lengths.png"
    report = ["report", str(run), "--out", str(page), "--png", str(pngs)]
    data = write_jsonl(tmp_path / "d.jsonl", ["one two", "three"])
    audit = ["data", "audit", str(data), "--global-batch-size", "2", "--plot", str(plot)]
    mine = b"\x89PNG\r\n\x1a\n my own figure"
    # A page that quotes the tag is no report of lmtune's: only its opening marks one.
    quoting = b'<html><!-- <meta name="generator" content="lmtune"> --></html>'
    for path, argv, content, what in [
        (page, report, quoting, "not an HTML report lmtune wrote"),
        (plot, audit, mine, "not a PNG plot lmtune wrote"),
    ]:
        path.write_bytes(content)
        assert what in _error(argv, capsys)
        assert path.read_bytes() == content and (path == plot or not pngs.exists())
        path.unlink()
        assert main(argv) == 0
        assert main(argv) == 0 and path.read_bytes() != b""  # its own file: replaced
    (pngs / f"{next(iter(PLOTS))}.png").write_bytes(mine)  # a user's figure among lmtune's
    assert "--png" in _error(report, capsys)
    (pngs / f"{next(iter(PLOTS))}.png").unlink()
    # A plot these runs hold no data for is not written: a user's file of its name stays as it is, and
    # lmtune's own from an earlier report (a preference run's) goes, so the folder shows this report.
    assert main(report) == 0
    (pngs / "reward_margins.png").write_bytes(mine)
    (pngs / "reward_accuracies.png").write_bytes((pngs / "loss.png").read_bytes())
    capsys.readouterr()
    assert main(report) == 0
    assert "(removed reward_accuracies.png: no data now)" in capsys.readouterr().out
    assert (pngs / "reward_margins.png").read_bytes() == mine and not (
        pngs / "reward_accuracies.png"
    ).exists()
    # A link is never written through, even to a file lmtune wrote.
    link = tmp_path / "link.html"
    link.symlink_to(page)
    assert "a symbolic link" in _error([*report[:3], str(link)], capsys)
    # A run's own entries are not for other files: a checkpoint would fail its manifest.
    inside = run / "checkpoints" / "step-000002" / "r.html"
    said = _error([*report[:3], str(inside)], capsys)
    assert f"lies inside {run.resolve() / 'checkpoints'}, which the run in {run.resolve()} wrote" in said
    said = _error([*report[:5], str(run / "final" / "png")], capsys)
    assert f"lies inside {run.resolve() / 'final'}, which the run" in said
    assert not inside.exists() and not (run / "final" / "png").exists()
    # A folder of one's own beside the run's entries is not the run's (RUN/report.html was taken
    # and RUN/plots/report.html refused), as for --output-dir.
    assert main([*report[:3], str(run / "plots" / "r.html")]) == 0
    shutil.rmtree(run / "plots")
    assert "name a .html or .htm file" in _error([*report[:3], str(tmp_path / "r.png")], capsys)
    table = tmp_path / "table.json"
    for command, content in [
        (["plan", "--json"], '{"mine": 1}'),
        (["bench", "--steps", "1", "--json"], '{"mine": 1}'),
        (["plan", "--json"], '[{"written_by": "lmtune bench"}]'),  # another command's file
        (["bench", "--steps", "1", "--json"], '[{"written_by": "lmtune-bench"}]'),
    ]:
        table.write_text(content)
        assert "--json" in _error([*command, str(table)], capsys)
        assert table.read_text() == content
    # The default lands in the working folder; its refusal says it is the default the user did not type.
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        (tmp_path / "bench.json").write_text('{"mine": 1}')
        assert "the default --json bench.json: not a bench table" in _error(["bench", "--steps", "1"], capsys)
        assert (tmp_path / "bench.json").read_text() == '{"mine": 1}'


def test_what_marks_a_file_as_lmtunes(tmp_path: Path) -> None:
    from lmtune.config.marks import JSON_FIELD, json_marked, written_by_lmtune

    f = tmp_path / "t.json"
    for value, kind, ours in [
        (json_marked({"a": 1}, "plan"), "plan", True),
        (json_marked({"a": 1}, "plan"), "bench", False),
        ([json_marked({"a": 1}, "bench"), json_marked({"a": 2}, "bench")], "bench", True),
        ([json_marked({"a": 1}, "bench"), {"a": 2}], "bench", False),  # a row added by hand
        ([], "bench", False),
        ({JSON_FIELD: "someone else"}, "plan", False),
        ("lmtune plan", "plan", False),
    ]:
        f.write_text(json.dumps(value))
        assert written_by_lmtune(f, kind) is ours, value  # type: ignore[arg-type]
    f.write_bytes(b"\xff\xfe not text")
    assert not written_by_lmtune(f, "plan")
    assert not written_by_lmtune(tmp_path, "report") and not written_by_lmtune(tmp_path / "none.png", "png")


def test_overwrite_deletes_the_earlier_run_only_once_the_new_one_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A typo in an --overwrite command (model, data, batch) is refused with the earlier run intact."""
    out = tmp_path / "out"
    data = write_jsonl(tmp_path / "d.jsonl", [f"text {i}" for i in range(16)])
    (tmp_path / "bad.jsonl").write_text('{"text": "a text"}\n{not json\n')
    argv = ["train", "--output-dir", str(out), "--max-steps", "1", "--no-progress", "--overwrite"]
    assert main([*argv, "--data", str(data), "--global-batch-size", "8"]) == 0
    before = _files(out)
    for wrong, said in (
        (["--model", "tiny-typo", "--data", str(data)], "--model tiny-typo"),
        (["--data", str(tmp_path / "bad.jsonl")], "bad.jsonl:2"),
        (["--data", str(data), "--global-batch-size", "64"], "64"),
        # Inputs inside the folder --overwrite would empty (it deleted them, then said they were damaged).
        (["--data", str(data), "--resume", str(out / "checkpoints" / "step-000001")], "would delete"),
        (
            ["--data", str(data), "--objective", "dpo", "--reference-model", str(out / "final")],
            "would delete",
        ),
    ):
        assert said in _error([*argv, *wrong], capsys)
        assert _files(out) == before
    assert main([*argv, "--data", str(data), "--global-batch-size", "4", "--seed", "3"]) == 0
    assert json.loads((out / "run.json").read_text())["config"]["seed"] == 3  # replaced now


def test_a_run_stopped_under_overwrite_says_to_resume_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """ "The same command again" would start it over: --overwrite deletes the checkpoint just saved."""
    import signal

    import torch

    original = torch.optim.AdamW.step
    steps: list[int] = []

    def step(self: torch.optim.AdamW, *args: object, **kwargs: object) -> object:
        steps.append(1)
        if len(steps) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl+C early in a run of 4 steps
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    out = tmp_path / "out"
    argv = ["train", "--max-steps", "4", "--no-progress", "--output-dir", str(out), "--overwrite"]
    main(argv)
    printed = capsys.readouterr()
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 1 and len(steps) < 4  # stopped early, with a checkpoint
    assert "; run the same command without --overwrite to resume (with it, the run starts over)" in (
        printed.out + printed.err
    )
    monkeypatch.setattr(torch.optim.AdamW, "step", original)
    assert main(argv[:-1]) == 0  # as it said: without --overwrite, it resumes
    assert f"resuming from {out / 'checkpoints' / saved[0]}" in capsys.readouterr().out
    # --resume never: the same command again refused the checkpoint the stop had just saved.
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    steps.clear()
    never = ["train", "--max-steps", "4", "--no-progress", "--output-dir", str(tmp_path / "never")]
    main([*never, "--resume", "never"])
    printed = capsys.readouterr()
    assert "; run the same command without --resume never to resume (with it, the run refuses its " in (
        printed.out + printed.err
    )
    monkeypatch.setattr(torch.optim.AdamW, "step", original)
    assert main(never) == 0 and "resuming from" in capsys.readouterr().out


def test_an_export_is_never_written_over_a_folder_the_checkpoints_run_reads_again(tmp_path: Path) -> None:
    """A DPO run's --reference-model (an earlier export, so --overwrite would take it) replaced by
    the export: the run's resume was refused for good, as another reference."""
    from lmtune.checkpoint.export_folder import check_destination

    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    ckpt.mkdir(parents=True)
    reference = tmp_path / "models" / "ref"
    reference.mkdir(parents=True)
    (reference / EXPORT_MARKER).write_text("{}")
    run = {
        "config": {"model": "tiny", "reference_model": str(reference)},
        "resolved": {"model_source": "preset tiny"},
    }
    (tmp_path / "run" / "run.json").write_text(json.dumps(run))
    with pytest.raises(
        UserError, match=r"is .*models/ref, the run's --reference-model, which its resume reads"
    ):
        check_destination(ckpt, reference, overwrite=True)
    check_destination(ckpt, tmp_path / "models" / "other", overwrite=True)  # anywhere else
