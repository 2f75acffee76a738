"""--report-to: TensorBoard, W&B (offline) and MLflow (file store) hold what metrics.jsonl holds,
each step once across a crash and resume; `lmtune report` draws every plot and names the settings
that differ; MFU is never reported over 100%."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import pytest

from lmtune.cli import main
from tests.conftest import run_lmtune, tiny_run_with_checkpoint, train_rows


def _wandb_history(folder: Path) -> list[dict[str, Any]]:
    """The history rows of every offline W&B run file under ``folder`` (LevelDB-style log records
    of protobuf ``Record``s, as wandb writes them)."""
    from wandb.proto import wandb_internal_pb2

    rows = []
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, pending = path.read_bytes(), 7, b""  # a 7-byte file header
        while pos + 7 <= len(data):
            room = 32768 - pos % 32768
            if room < 7:
                pos += room
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0:
                pos += room
                continue
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                if record.WhichOneof("record_type") == "history":
                    items = record.history.item
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """30 steps, every dashboard; the first attempt dies writing checkpoint 30 (after logging
    steps 21-30), the second resumes from step 20."""
    out = tmp_path_factory.mktemp("reports") / "out"
    args = ["train", "--max-steps", "30", "--save-every", "10", "--eval-every", "10", "--no-progress"]
    args += ["--report-to", "tensorboard,wandb,mlflow", "--output-dir", str(out)]
    first = run_lmtune(args, env_extra={"LMTUNE_FAULT_KILL_IN_SAVE": "30", "WANDB_SILENT": "true"})
    assert first.returncode != 0
    second = run_lmtune(args, env_extra={"WANDB_SILENT": "true"})
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stdout + second.stderr
    return out


def _expected(out: Path) -> dict[str, list[tuple[int, float]]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 31))
    per_epoch = json.loads((out / "run.json").read_text())["resolved"]["steps_per_epoch"]
    assert [r["epoch"] for r in train] == [round(r["step"] / per_epoch, 6) for r in train]  # epochs done
    return {
        "train/loss": [(r["step"], r["loss"]) for r in train],
        "train/learning_rate": [(r["step"], r["lr"]) for r in train],
        "train/grad_norm": [(r["step"], r["grad_norm"]) for r in train],
        "eval/loss": [(r["step"], r["eval_loss"]) for r in evals],
    }


def test_tensorboard_holds_every_step_once_after_a_resume(resumed: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(resumed / "tensorboard"))
    events.Reload()
    for tag, expected in _expected(resumed).items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in expected], tag  # each step once, in order
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), tag
    # Read raw (as tbparse does, without TensorBoard's purge): the first attempt's file is gone,
    # the config is there once, and each step once.
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    (events_file,) = (resumed / "tensorboard").glob("events.out.tfevents.*")
    raw = [v for e in EventFileLoader(str(events_file)).Load() for v in e.summary.value]
    assert [v.tag for v in raw].count("config/text_summary") == 1
    assert (
        sorted((v.tag, v.metadata.plugin_data.plugin_name) for v in raw if v.tag == "train/loss")
        == [("train/loss", "scalars")] * 30
    )


def test_wandb_offline_and_mlflow_hold_the_scalars_once(
    resumed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _expected(resumed)
    history = _wandb_history(resumed)
    for tag, values in expected.items():
        got = [(row["_step"], row[tag]) for row in history if tag in row]
        assert got == [(s, pytest.approx(v, rel=1e-9)) for s, v in values], tag

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store on request
    state = json.loads((resumed / "reporting.json").read_text())
    client = MlflowClient(tracking_uri=(resumed / "mlruns").resolve().as_uri())
    for tag, values in expected.items():
        got = [(m.step, m.value) for m in client.get_metric_history(state["mlflow"], tag)]
        assert sorted(got) == [(s, pytest.approx(v, rel=1e-9)) for s, v in values], tag
    assert client.get_run(state["mlflow"]).data.params["max_steps"] == "30"


def test_a_missing_package_is_a_user_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a)
    )
    assert main(["train", "--report-to", "wandb", "--max-steps", "1"]) == 2
    assert "pip install 'lmtune[wandb]'" in capsys.readouterr().err
    # Both at once (the second was named only after the first was installed).
    assert main(["train", "--report-to", "wandb,mlflow", "--max-steps", "1"]) == 2
    said = capsys.readouterr().err
    assert (
        "the wandb package and the mlflow package are not installed; pip install 'lmtune[wandb,mlflow]'"
        in said
    )
    assert main(["train", "--report-to", "tensorboard,comet", "--max-steps", "1"]) == 2


def test_report_draws_every_plot_and_the_settings_that_differ(resumed: Path, tmp_path: Path) -> None:
    from lmtune.tools.report import PLOTS

    other = tmp_path / "other"
    args = ["train", "--max-steps", "12", "--lr", "3e-3", "--profile", "--eval-every", "6", "--no-progress"]
    assert main([*args, "--output-dir", str(other)]) == 0
    page = tmp_path / "report.html"
    assert main(["report", str(resumed), str(other), "--out", str(page), "--png", str(tmp_path / "png")]) == 0
    text = page.read_text()
    for name in PLOTS:  # every plot has data: the runs record everything each draws
        # Preference objectives only (tests/integration/test_preference.py); sources evaluated apart
        # only (tests/unit/training/test_eval_sources.py).
        if name.startswith("reward_") or name == "eval_per_source":
            assert f"<figure id='plot-{name}'><img" not in text, name
            continue
        assert f"<figure id='plot-{name}'><img" in text, name
        assert (tmp_path / "png" / f"{name}.png").stat().st_size > 1000
    assert "Settings that differ" in text
    # The resumed run's wall time is its last attempt's: the training time of every attempt beside it.
    walls = text.split("<td>wall time</td>")[1].split("</tr>")[0]
    assert re.search(r"\d+ s \(the last attempt; training \d+ s over every attempt\)", walls), walls
    assert walls.count("the last attempt") == 1  # the other run was not resumed
    # It finished, after an attempt that was killed: the report says so, and where it took up.
    status = text.split("<td>status</td>")[1].split("</tr>")[0]
    assert "<td>finished after 1 resume</td><td>finished</td>" in status, status
    earlier = text.split("<td>earlier attempts</td>")[1].split("</tr>")[0]
    assert (
        "<td>last logged step 30, ended without a result (killed, failed, or its machine stopped), "
        "resumed from step 20</td><td>-</td>" in earlier
    ), earlier
    card = (resumed / "final" / "README.md").read_text()
    assert "| earlier attempts | last logged step 30, ended without a result" in card
    assert "reward accuracy" not in text.split("<h2>Plots")[0]  # no row that no run has a value for
    differ = text.split("Settings that differ")[1].split("</table>")[0]
    for setting in ("max_steps", "lr", "profile", "report_to"):
        assert f"<td>{setting}</td>" in differ
    assert "<td>seed</td>" not in differ


def test_report_reads_a_run_that_is_still_writing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main(["train", "--max-steps", "5", "--no-progress", "--output-dir", str(out)]) == 0
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 6, "lo')  # cut off mid-write
    (out / "run.json").unlink()
    assert main(["report", str(out), "--out", str(tmp_path / "r.html")]) == 0
    assert "nothing recorded" in (tmp_path / "r.html").read_text()  # no run.json: no per-rank peaks
    # A run.json of the wrong shapes is read as far as it makes sense, never a traceback.
    (out / "run.json").write_text(
        json.dumps({"config": [1], "resolved": "x", "result": {"best": [2]}, "data": {"train": 3}})
    )
    assert main(["report", str(out), "--out", str(tmp_path / "r.html")]) == 0
    assert main(["report", str(tmp_path / "missing"), "--out", str(tmp_path / "x.html")]) == 2


def test_runs_of_one_folder_name_are_told_apart_and_a_foreign_metrics_file_is_no_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """runs/mix and other/mix were both "mix" in every legend and table; a folder whose
    metrics.jsonl is another program's was reported as an lmtune run that stopped."""
    from lmtune.tools.recorded import load_run, named_apart

    for parent in ("runs", "other"):
        argv = ["train", "--max-steps", "1", "--no-progress", "--output-dir", str(tmp_path / parent / "mix")]
        assert main(argv) == 0
    runs = named_apart([load_run(tmp_path / p / "mix") for p in ("runs", "other")])
    assert [r.name for r in runs] == ["runs/mix", "other/mix"]
    both = [str(tmp_path / "runs" / "mix"), str(tmp_path / "other" / "mix")]
    assert main(["report", *both, "--out", str(tmp_path / "both.html")]) == 0
    page = (tmp_path / "both.html").read_text()
    assert "runs/mix" in page
    # The settings lmtune chose are shown as chosen: the lr read "null" where the run trained at 0.001.
    lr = json.loads((tmp_path / "runs" / "mix" / "run.json").read_text())["resolved"]["lr"]
    assert f"&quot;lr&quot;: {lr}," in page and "&quot;lr&quot;: null" not in page
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text('{"a": 1}\n{"b": 2}\n')
    capsys.readouterr()
    assert main(["report", str(foreign), "--out", str(tmp_path / "f.html")]) == 2
    assert "metrics.jsonl holds no row lmtune writes" in capsys.readouterr().err
    # One line alone was taken for a row still being written, and "hello" reported as a run.
    (foreign / "metrics.jsonl").write_text("hello\n")
    assert main(["report", str(foreign), "--out", str(tmp_path / "f.html")]) == 2
    assert "holds no row lmtune writes (first: " in capsys.readouterr().err
    assert not (tmp_path / "f.html").exists()
    # One run given twice, by two spellings, was overlaid on itself.
    assert main(["report", both[0], f"{both[0]}/../mix/", "--out", str(tmp_path / "t.html")]) == 2
    assert "are one run; give each run once" in capsys.readouterr().err


def test_a_path_that_cannot_be_written_is_a_user_error(
    resumed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The path and the system's reason, exit 2, no traceback (also for a folder without
    permission, which root on this machine does not meet)."""
    capsys.readouterr()
    # A folder that is not there yet is made (as --png's is); a file where a folder should be is refused.
    assert main(["report", str(resumed), "--out", str(tmp_path / "new" / "dir" / "r.html")]) == 0
    assert (tmp_path / "new" / "dir" / "r.html").stat().st_size > 1000
    (tmp_path / "reports").mkdir()  # a folder: the report is written in it as report.html
    assert main(["report", str(resumed), "--out", str(tmp_path / "reports")]) == 0
    assert (tmp_path / "reports" / "report.html").stat().st_size > 1000
    (tmp_path / "afile").write_text("mine")
    capsys.readouterr()
    assert main(["report", str(resumed), "--out", str(tmp_path / "afile" / "x" / "r.html")]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {tmp_path / 'afile' / 'x' / 'r.html'}: {tmp_path / 'afile'} is not a folder\n"
    )
    assert (tmp_path / "afile").read_text() == "mine"
    (tmp_path / "page.html").write_text("")
    assert (
        main(
            ["report", str(resumed), "--out", str(tmp_path / "r.html"), "--png", str(tmp_path / "page.html")]
        )
        == 2
    )
    assert "--png" in capsys.readouterr().err and not (tmp_path / "r.html").exists()


def test_mfu_over_100_percent_is_never_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lmtune.train
    from lmtune.training.perf import Peak

    monkeypatch.setenv("LMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    far_below_any_cpu = Peak(1e6, False)
    monkeypatch.setattr(lmtune.train, "best_peak_flops", lambda *a, **k: far_below_any_cpu)
    out = tmp_path / "out"
    assert main(["train", "--max-steps", "3", "--no-progress", "--output-dir", str(out)]) == 0
    assert all(r["mfu"] is None for r in train_rows(out))


def test_report_tells_a_killed_run_from_a_running_one(tmp_path: Path) -> None:
    """No result yet: its lock's process alive is running; gone (kill -9) is stopped."""
    import os
    import shutil
    import socket
    import subprocess

    from lmtune.checkpoint.layout import LOCK_FILE
    from lmtune.checkpoint.lock import lock_status
    from lmtune.tools.recorded import load_run
    from lmtune.tools.report import _summary

    out = tmp_path / "killed"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped here (a pid left to os.waitpid may be reaped by the next Popen)
    holders = {"gone": ended.pid, "running": os.getpid()}
    assert lock_status(out) is None  # no lock, no result: it ended (a multi-node job that failed)
    assert _summary(load_run(out))["status"].startswith("stopped (it ended without a result")
    for expected, pid in holders.items():
        lock = {"host": socket.gethostname(), "pid": pid, "pid_started": None, "started": 1.0}
        (out / LOCK_FILE).write_text(json.dumps({**lock, "run_id": "r", "token": "t"}))
        assert lock_status(out) == expected
        assert _summary(load_run(out))["status"].startswith(
            expected if expected == "running" else "stopped (its"
        )
    (out / LOCK_FILE).write_text(json.dumps({**lock, "pid": holders["gone"], "run_id": "r", "token": "t"}))

    def then() -> str:
        return _summary(load_run(out))["status"].split("; ", 1)[1]

    assert then() == "no checkpoint was saved: the same command starts over)"
    other = tiny_run_with_checkpoint(tmp_path) / "checkpoints" / "step-000002"
    shutil.copytree(other, out / "checkpoints" / "step-000001")
    shutil.copytree(other, out / "checkpoints" / "step-000002")
    assert then() == "the same command resumes from step-000002)"
    model = next(p for p in (out / "checkpoints" / "step-000002").iterdir() if p.suffix == ".safetensors")
    with model.open("r+b") as f:
        f.truncate(100)  # damaged: resume refuses it, naming the one before
    older = out / "checkpoints" / "step-000001"
    damaged = "its newest checkpoint, step-000002, is damaged"
    assert then() == f"{damaged}: --resume {older} continues from the one before it)"
    # The command a run began with (--resume of another folder's checkpoint) goes on from the run's
    # own newest checkpoint, as train does (it said "resumes from --resume ... again").
    (out / "run.json").write_text(json.dumps({"config": {"resume": str(other)}}))
    assert then() == f"{damaged}: --resume {older} continues from the one before it)"
    # A --resume of a checkpoint the run did not begin from continues that checkpoint again.
    began = {"config": {"resume": str(other)}, "resolved": {"resume_path": str(older)}}
    (out / "run.json").write_text(json.dumps(began))
    assert then() == f"the same command resumes from --resume {other} again)"
    # Stopped by a signal: it recorded a result, and saved.
    shutil.rmtree(out / "checkpoints" / "step-000002")
    shutil.copytree(other, out / "checkpoints" / "step-000002")
    (out / "run.json").write_text(json.dumps({"result": {"stopped_by": "signal", "steps": 2}}))
    status = _summary(load_run(out))["status"]
    assert status == "stopped (by a signal; the same command resumes from step-000002)"
    # Given --overwrite, the same command would start over: the report says to drop it.
    stopped = {"stopped_by": "signal", "steps": 2}
    (out / "run.json").write_text(json.dumps({"result": stopped, "config": {"overwrite": True}}))
    assert _summary(load_run(out))["status"] == (
        "stopped (by a signal; the same command starts over (--overwrite); without --overwrite, it resumes "
        "from step-000002)"
    )
    # Given --resume never, the same command refuses the checkpoints the run saved.
    (out / "run.json").write_text(json.dumps({"result": stopped, "config": {"resume": "never"}}))
    assert _summary(load_run(out))["status"] == (
        "stopped (by a signal; the same command refuses its checkpoints (--resume never); without --resume "
        "never, it resumes from step-000002)"
    )


def test_report_says_which_settings_a_resume_changed(tmp_path: Path) -> None:
    """The configuration shown is the last attempt's: the steps before a resume that changed --lr
    ran with the earlier value, and the summary says so (a hostile entry is left out)."""
    from lmtune.tools.recorded import load_run
    from lmtune.tools.report import _summary, build_html

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 6, "loss": 2.0}) + "\n")
    changes = [
        {"step": 4, "changes": ["--lr 0.001 -> 0.0005", "total steps 4 -> 6"]},
        {"step": "x", "changes": [1]},
    ]
    (out / "run.json").write_text(
        json.dumps({"config": {"lr": 5e-4}, "resolved": {"changed_on_resume": changes}})
    )
    run = load_run(out)
    said = "after step 4: --lr 0.001 -> 0.0005, total steps 4 -> 6"
    assert _summary(run)["changed on resume"] == said
    assert f"<td>changed on resume</td><td>{said.replace('>', '&gt;')}</td>" in build_html([run], {})
    (out / "run.json").write_text(json.dumps({"config": {"lr": 5e-4}}))
    assert "changed on resume" not in build_html([load_run(out)], {})


def test_the_reports_last_train_loss_is_the_last_steps_own(tmp_path: Path) -> None:
    """Under --log-every N a row's loss is its steps' mean; the report said that as the last train
    loss where the final line, run.json and the card say the last step's own."""
    from lmtune.tools.recorded import load_run
    from lmtune.tools.report import _summary

    out = tmp_path / "windowed"
    out.mkdir()
    row = {"kind": "train", "step": 5, "loss": 2.5291, "loss_steps": 5, "step_loss": 2.5163}
    (out / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    assert _summary(load_run(out))["last train loss"] == "2.5163"


def test_a_mistake_found_while_the_run_is_built_leaves_no_reporters_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --sample-prompts file under --report-to left reporting.json and tensorboard/ in the
    folder, which the corrected command (even with --overwrite) then refused as not a run's."""
    bad, good = tmp_path / "bad.txt", tmp_path / "good.jsonl"
    bad.write_text("27+45=\n")
    good.write_text('"27+45="\n')
    out = tmp_path / "run"
    args = [
        "train",
        "--max-steps",
        "1",
        "--report-to",
        "tensorboard",
        "--output-dir",
        str(out),
        "--no-progress",
    ]
    assert main([*args, "--sample-prompts", str(bad)]) == 2
    assert "bad.txt:1: not JSON" in capsys.readouterr().err
    assert not (out / "reporting.json").exists() and not (out / "tensorboard").exists()
    assert main([*args, "--sample-prompts", str(good)]) == 0


def test_tensorboard_given_at_a_resume_gets_the_config_too(tmp_path: Path) -> None:
    """--report-to tensorboard added when a run resumed: its history was written, its config and
    hyperparameters not (they were written only by a run's first attempt)."""
    import shutil

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    from tests.conftest import write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [f"text {i}" for i in range(16)])
    out = tmp_path / "out"
    args = ["train", "--data", str(data), "--output-dir", str(out), "--max-steps", "4", "--save-every", "2"]
    args += ["--global-batch-size", "8", "--no-progress"]
    assert main(args) == 0
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-000004")
    record = json.loads((out / "run.json").read_text())
    del record["result"]  # as a run stopped after its step-2 checkpoint
    (out / "run.json").write_text(json.dumps(record))
    assert main([*args, "--report-to", "tensorboard"]) == 0
    (events_file,) = (out / "tensorboard").glob("events.out.tfevents.*")
    tags = [v.tag for e in EventFileLoader(str(events_file)).Load() for v in e.summary.value]
    assert tags.count("config/text_summary") == 1 and tags.count("train/loss") == 4
