"""Bad input, from a careless user or an attacker: exit 2, one line naming the file:line, option or
variable, no traceback, and bounded time and memory."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmtune.cli import main
from lmtune.config.groups import ExampleSettings
from lmtune.data.prepare import encode_in_memory
from lmtune.data.readers import iter_records
from lmtune.data.sources import BadLines, Record, Source
from lmtune.data.tokenize import CHARS_PER_TOKEN
from lmtune.model.modeling import byte_tokenizer
from tests.conftest import mounted_tmpfs, run_lmtune, tiny_run_with_checkpoint, write_jsonl
from tests.conftest import one_line_error as _error


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("model: ~\n", "run.yaml:1: model: needs a value (got null)"),
        ("data: null\n", "run.yaml:1: data: needs a value"),
        ("output_dir: null\n", "run.yaml:1: output_dir: needs a value"),
        (
            "max_steps: 3\nmax-steps: 4\n",
            "run.yaml:2: max_steps is set twice (as max_steps on line 1 and max-steps); give it once",
        ),
        ("lr: .inf\n", "run.yaml:1: lr: must be a finite number"),
        ("epochs: [1, 2]\n", "run.yaml:1: epochs: expected int"),
        (
            "num_epochs: 2.5\n",
            "run.yaml:1: num_epochs: expected int, got 2.5 (lmtune trains whole epochs: max_steps",
        ),
        # Named as the file has it (an alias, a nested group), with its line.
        ("seed: 1\nlearning_rate: abc\n", "run.yaml:2: learning_rate: expected float, got 'abc'"),
        ("lora:\n  enabled: true\n  rank: x\n", "run.yaml:3: lora.rank: expected int, got 'x'"),
        ("seed: 1\nepochs: -1\n", "run.yaml:2: epochs: must be >= 1 (got -1)"),  # a range, checked later
        # Checked as the run starts (the template read, the data split, the model's layers): still
        # named by the file's line.
        ("seed: 1\nchat_template: tokenizer_default\n", "run.yaml:2: chat_template: the tokenizer's own"),
        ("seed: 1\nval_set_size: 20000\n", "run.yaml:2: val_set_size: holds out 20000 of"),
        ("lora: true\nlora_target_modules: [qproj]\n", "run.yaml:2: lora_target_modules: qproj matched no"),
        ("seed: 1\ndata: nothing-*.jsonl\n", "run.yaml:2: data: nothing-*.jsonl: no file matches"),
        # A batch that does not divide: named by the micro batch's line, the global batch as the file has it.
        (
            "global_batch_size: 32\nmicro_batch_size: 5\n",
            "run.yaml:2: micro_batch_size: global_batch_size 32 does not divide into 5 x 1 process",
        ),
        # Another setting the reason names is named as the file would name it.
        (
            "warmup_steps: 5\nwarmup_ratio: 0.1\n",
            "run.yaml:2: warmup_ratio: is instead of warmup_steps: give",
        ),
    ],
)
def test_bad_yaml_settings(
    yaml_text: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml_text if "output_dir" in yaml_text else f"{yaml_text}output_dir: {tmp_path / 'o'}\n"
    )
    assert needle in _error(["train", "--config", str(config)], capsys)


def test_a_bad_value_given_by_a_flag_is_named_by_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(f"epochs: 2\noutput_dir: {tmp_path / 'o'}\n")
    said = _error(["train", "--config", str(config), "--epochs", "0"], capsys)
    assert said == "error: --epochs: must be >= 1 (got 0)\n"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--lr", "inf"], "--lr: must be a finite number"),
        (["--adam-eps", "nan"], "--adam-eps: must be a finite number"),
        (["--seed", str(2**64)], "--seed: must be in [0, 2**32)"),
        (["--max-st", "2"], "unknown option --max-st; did you mean --max-steps?"),  # no abbreviations
    ],
)
def test_bad_numbers_and_abbreviations(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    full = ["train", "--output-dir", str(tmp_path / "o"), *argv]
    assert needle in _error(full, capsys)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"RANK": "1"}, "RANK set but not WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE set but not RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"),
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer"),
        (
            {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "1"},
            "RANK=2 must be in [0, WORLD_SIZE=2)",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "x", "MASTER_PORT": "99999"},
            "MASTER_PORT=99999 is not a port",
        ),
    ],
)
def test_a_half_set_launch_environment_fails_at_once(
    env: dict[str, str],
    needle: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert needle in _error(["train", "--output-dir", str(tmp_path / "o"), "--max-steps", "1"], capsys)


def test_output_folder_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert "exists and is not a folder" in _error(["train", "--output-dir", str(a_file)], capsys)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "final").symlink_to(tmp_path)
    said = _error(["train", "--output-dir", str(linked)], capsys)
    assert "final is a symbolic link" in said
    assert "remove the link, and give an --output-dir on the other disk to keep the run's final there" in said
    (tmp_path / "dangling").symlink_to(tmp_path / "gone" / "x")
    said = _error(["train", "--output-dir", str(tmp_path / "dangling")], capsys)
    assert f"a link to {tmp_path / 'gone' / 'x'}, which is not there; make that folder" in said


def _records(path: Path, skip: bool = False) -> tuple[list[Record], BadLines]:
    bad = BadLines(skip=skip)
    return list(iter_records(Source("jsonl", str(path)), "text", bad)), bad


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "first"}\n{"text": "second"}\n')
    records, _ = _records(path)
    assert [r.fields["text"] for r in records] == ["first", "second"]


def test_unpaired_surrogates_and_deep_nesting_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    huge = '{"text": "big", "n": 1' + "0" * 100_000 + "}\n"  # more digits than Python converts
    path.write_text('{"text": "ok \\ud83d\\ude00"}\n{"text": "a\\ud800b"}\n' + "[" * 100_000 + "\n" + huge)
    with pytest.raises(Exception, match=r"bad.jsonl:2: holds an unpaired UTF-16 surrogate \('\\ud800'\)"):
        _records(path)
    records, bad = _records(path, skip=True)
    assert [r.fields["text"] for r in records] == ["ok \U0001f600"]
    assert bad.count == 3 and "bad.jsonl:3: not valid JSON (nested too deeply)" in bad.messages[1]
    assert "bad.jsonl:4: not valid JSON here (Exceeds the limit (4300 digits)" in bad.messages[2]


def test_audit_reports_a_surrogate_as_a_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["fine"] * 40)
    with path.open("a") as f:
        f.write('{"text": "\\udfff"}\n')
    assert main(["data", "audit", str(path)]) == 2
    out = capsys.readouterr().out
    assert "d.jsonl:41: holds an unpaired UTF-16 surrogate" in out


@pytest.mark.parametrize("truncation", ["right", "left", "drop"])
def test_a_huge_text_is_cut_to_what_max_length_keeps(
    truncation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cut changes nothing: the kept tokens are those of the whole text."""
    tok = byte_tokenizer()
    text = "".join(f"word{i} " for i in range(4000))  # ~36k characters, far beyond 16 x (32 + 64)
    records = [
        Record("mem", 1, {"prompt": "question: ", "completion": text}),
        Record("mem", 2, {"text": text}),
    ]
    settings = ExampleSettings(max_length=32, truncation=truncation)
    cut, cut_stats = encode_in_memory(records, tok, settings)
    monkeypatch.setattr("lmtune.data.tokenize.CHARS_PER_TOKEN", 10**9)
    whole, whole_stats = encode_in_memory(records, tok, settings)
    assert cut_stats == whole_stats and len(cut) == len(whole) == (0 if truncation == "drop" else 2)
    for i in range(len(cut)):
        assert (cut[i].input_ids == whole[i].input_ids).all() and (cut[i].labels == whole[i].labels).all()
    assert len(text) > CHARS_PER_TOKEN * (32 + 64)


def test_a_huge_line_trains_in_bounded_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "huge.jsonl"
    with data.open("w") as f:
        f.write(json.dumps({"text": "many words " * 1_000_000}) + "\n")  # 11 MB in one line
        f.writelines(json.dumps({"text": f"short {i}"}) + "\n" for i in range(7))
    out = tmp_path / "o"
    argv = [
        "train",
        "--data",
        str(data),
        "--output-dir",
        str(out),
        "--max-steps",
        "1",
        "--global-batch-size",
        "8",
    ]
    assert main([*argv, "--no-progress", "--max-length", "128"]) == 0
    assert "1 truncated" in capsys.readouterr().out
    assert os.path.getsize(out / "final" / "model.safetensors") > 0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "disk", "size=20m") as disk:
        yield disk


def test_a_full_disk_stops_with_a_message_and_keeps_the_last_checkpoint(
    small_disk: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real 20 MB file system: the first checkpoint (~11 MB) fits, the second does not. Known at
    the start; where the disk seemed to have room then (another job's files came later), the second
    save stops the run with the first intact."""
    from lmtune.checkpoint import store

    data = write_jsonl(small_disk.parent / "d.jsonl", ["some text"] * 16)
    out = small_disk / "out"
    argv = ["train", "--data", str(data), "--output-dir", str(out), "--max-steps", "4", "--save-every", "2"]
    argv += ["--global-batch-size", "8", "--keep-last", "0", "--no-progress"]
    err = _error(argv, capsys)
    assert "too little room on its disk for 2 checkpoints of this run at once" in err
    assert "written before the oldest goes) and its final model (about" in err
    monkeypatch.setattr(store, "free_bytes", lambda folder: 1 << 40)
    err = _error(argv, capsys)
    assert "no space left on device while saving step 4 to" in err and "MB needed" in err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    from lmtune.checkpoint.layout import verify

    assert verify(out / "checkpoints" / "step-000002") is None


def test_a_disk_too_small_for_a_checkpoint_is_refused_before_the_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real 8 MB file system, a checkpoint of ~11 MB (weights and AdamW's moments): refused before
    any step (it was found at the first save), with the way that fits; the final model alone fits.
    On 16 MB, --keep-last 1 still needs two at once (a new one is written before the old goes)."""
    data = write_jsonl(tmp_path / "d.jsonl", ["some text"] * 16)
    with mounted_tmpfs(tmp_path / "disk", "size=8m") as disk:
        out = disk / "out"
        argv = ["train", "--data", str(data), "--output-dir", str(out), "--max-steps", "1", "--no-progress"]
        err = _error([*argv, "--save-every", "1", "--global-batch-size", "8"], capsys)
        said = f"--output-dir {out}: too little room on its disk for one checkpoint and the final model"
        assert said + " of this run (about" in err
        assert (
            "MB needed, 8.0 MB free); free some space or choose another --output-dir; --save-every 0" in err
        )
        assert not (out / "metrics.jsonl").exists()
        assert main([*argv, "--save-every", "0", "--global-batch-size", "8"]) == 0
        assert (out / "final" / "model.safetensors").is_file() and not (out / "checkpoints").exists()
    with mounted_tmpfs(tmp_path / "tiny-disk", "size=2m") as disk:
        argv = ["train", "--data", str(data), "--output-dir", str(disk / "out"), "--max-steps", "2"]
        err = _error([*argv, "--save-every", "0", "--global-batch-size", "8", "--no-progress"], capsys)
        assert (
            "too little room on its disk for the final model of this run" in err and "--save-every" not in err
        )
    with mounted_tmpfs(tmp_path / "disk-13", "size=13m") as disk:  # the checkpoint fits, not the final model
        argv = ["train", "--data", str(data), "--output-dir", str(disk / "out"), "--max-steps", "2"]
        err = _error([*argv, "--global-batch-size", "8", "--no-progress"], capsys)
        assert "too little room on its disk for one checkpoint and the final model of this run" in err
        assert not (disk / "out" / "checkpoints").exists()  # it was found at the end, after the save
        # doctor without --model sizes train's default model there (it said "ok" on a 12 MB disk).
        # Sized as train's own check sizes it (--keep-last's checkpoints at once, the next and
        # final/, with its margin): it said "warn" (exit 0) where train refused.
        assert main(["doctor", "--output-dir", str(disk / "out")]) == 2
        assert "of tiny (train's default model; --model sizes yours)" in (printed := capsys.readouterr().out)
        assert re.search(r"FAIL +free disk +13\.0 MB free", printed), printed
        said = "; 4 at once (--keep-last 3, and the next before the oldest goes) and final/: ~47.1 MB in all"
        assert said in printed and "a smaller --keep-last needs fewer" in printed
        assert main(["doctor", "--output-dir", str(disk / "out"), "--keep-last", "1"]) == 2
        assert "2 at once (--keep-last 1" in capsys.readouterr().out
        assert main(["doctor", "--output-dir", str(disk / "out"), "--keep-last", "-1"]) == 2
        assert "--keep-last: must be >= 0 (got -1" in capsys.readouterr().err
    with mounted_tmpfs(tmp_path / "disk-16", "size=16m") as disk:
        argv = ["train", "--data", str(data), "--output-dir", str(disk / "out"), "--max-steps", "3"]
        argv += ["--save-every", "1", "--keep-last", "1", "--global-batch-size", "8", "--no-progress"]
        err = _error(argv, capsys)
        assert "too little room on its disk for 2 checkpoints of this run at once" in err
        assert "--save-every 0 saves only the final model, which fits" in err
    with mounted_tmpfs(tmp_path / "disk-lora", "size=2m") as disk:  # the adapter fits, not the merged base
        argv = ["train", "--data", str(data), "--output-dir", str(disk / "out"), "--max-steps", "1", "--lora"]
        argv += ["--save-every", "0", "--global-batch-size", "8", "--no-progress"]
        err = _error([*argv, "--merge-lora"], capsys)
        assert "for the final model (and the merged one --merge-lora writes) of this run" in err
        assert "without --merge-lora the adapter alone fits (`lmtune export --merge-lora` merges" in err
        assert main(argv) == 0


def test_a_disk_that_fills_during_training_stops_it_in_one_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another job fills the disk while the run goes on: its next metrics row does not fit."""
    from lmtune.checkpoint import store

    data = write_jsonl(tmp_path / "d.jsonl", ["some text"] * 16)
    monkeypatch.setattr(store, "free_bytes", lambda folder: 1 << 40)  # room for a checkpoint at the start
    with mounted_tmpfs(tmp_path / "disk", "size=1m") as disk:
        # All but 24 KiB taken (by the other job, since the start): room for run.json and ~40 rows.
        (disk / "filler").write_bytes(bytes(shutil.disk_usage(disk).free - (24 << 10)))
        out = disk / "out"
        argv = ["train", "--data", str(data), "--output-dir", str(out), "--max-steps", "400", "--log-every"]
        err = _error([*argv, "1", "--global-batch-size", "8", "--no-progress"], capsys)
        assert f"no space left on device while writing {out / 'metrics.jsonl'}; no earlier checkpoint" in err
        assert json.loads((out / "run.json").read_text())["config"]["max_steps"] == 400
        rows = (out / "metrics.jsonl").read_text()  # cut back to its last whole row
        assert rows.endswith("\n") and all(json.loads(row)["kind"] for row in rows.splitlines())


def test_a_full_disk_for_the_data_cache_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [f"line {i} " * 12 for i in range(20_000)])  # ~8 MB of ids
    with mounted_tmpfs(tmp_path / "disk", "size=1m") as disk:
        argv = ["train", "--data", str(data), "--cache-dir", str(disk), "--output-dir", str(tmp_path / "out")]
        err = _error([*argv, "--max-steps", "1", "--no-progress"], capsys)
        said = f"no space left on device while caching the tokenized data in {disk} (it needs more than the "
        assert (
            said in err
            and "MB it wrote before the disk filled, now removed; 1.0 MB is free): free some" in err
        )
        assert "--cache-dir (or LMTUNE_CACHE_DIR)" in err
        assert list(disk.iterdir()) == []  # no half-built data left, no error record (no rank waits)
        assert shutil.disk_usage(disk).free > 900 << 10


def test_a_full_disk_before_anything_is_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No room even for the run's lock or the data cache's error record: still one sentence, and
    nothing left behind (an empty lock would block the next run)."""
    data = write_jsonl(tmp_path / "d.jsonl", [f"line {i}" for i in range(64)])
    with mounted_tmpfs(tmp_path / "disk", "size=1m") as disk:
        (disk / "filler").write_bytes(bytes(shutil.disk_usage(disk).free))
        argv = ["train", "--data", str(data), "--max-steps", "1", "--no-progress"]
        err = _error([*argv, "--output-dir", str(disk / "run")], capsys)
        assert f"--output-dir {disk / 'run'}: cannot write there (No space left on device)" in err
        err = _error([*argv, "--output-dir", str(tmp_path / "out"), "--cache-dir", str(disk)], capsys)
        assert f"no space left on device while caching the tokenized data in {disk}" in err
        assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_report_pngs_that_do_not_fit_leave_no_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tiny_run_with_checkpoint(tmp_path)
    with mounted_tmpfs(tmp_path / "disk", "size=64k") as disk:
        argv = ["report", str(run), "--out", str(tmp_path / "r.html"), "--png", str(disk / "png")]
        said = _error(argv, capsys)
        assert f"--png {disk / 'png'}" in said and "cannot write it (No space left on device)" in said
        assert list(disk.iterdir()) == []  # the folder it made, with the plots that fitted, is gone


def test_memory_that_runs_out_names_the_step_and_what_to_lower(tmp_path: Path) -> None:
    """A real allocation failure: the process may map 5 GB, the step needs ~9 GB (16 rows of 2,048
    tokens of the `small` preset, unchunked by micro-batches)."""
    if shutil.which("prlimit") is None:
        pytest.skip("no prlimit here")
    data = write_jsonl(tmp_path / "long.jsonl", [f"word{i} " * 400 for i in range(16)])
    args = ["train", "--model", "small", "--data", str(data), "--max-length", "2048", "--max-steps", "1"]
    args += ["--global-batch-size", "16", "--packing", "off", "--output-dir", str(tmp_path / "out")]
    limited = ["prlimit", f"--as={5 << 30}", sys.executable, "-m"]
    proc = run_lmtune([*args, "--no-progress"], launcher=limited, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    said = proc.stderr.strip().splitlines()[-1]
    assert said.startswith(
        "error: out of memory on cpu in step 1, micro-batch 1 of 1 (16 rows of 2,048 positions)"
    )
    assert re.search(r"in its (forward|backward): it asked for [\d,]+ MiB more; to fit, try a smaller", said)
    assert (
        "--micro-batch-size (the global batch stays 16: more micro-batches a step, the same training)" in said
    )
    assert "--activation-checkpointing or a shorter --max-length (now 2,048)" in said


def test_a_read_only_output_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as disk:
        assert "cannot create it (Read-only file system)" in _error(
            ["train", "--output-dir", str(disk / "out")], capsys
        )
        said = _error(["train", "--output-dir", str(disk)], capsys)
        assert "not writable (a read-only file system)" in said
        said = _error(["report", str(tmp_path / "nothing"), "--out", str(disk / "r.html")], capsys)
        assert f"--out {disk / 'r.html'}: cannot write in {disk} (a read-only file system)" in said
        said = _error(["train", "--cache-dir", str(disk), "--output-dir", str(tmp_path / "out")], capsys)
        assert f"--cache-dir {disk}: cannot write the tokenized data there (Read-only file system)" in said
        checkpoint = tiny_run_with_checkpoint(tmp_path) / "checkpoints" / "step-000002"
        said = _error(["export", str(checkpoint), str(disk)], capsys)
        assert f"{disk}: a mount point; an export is written beside its folder" in said


def test_eval_split_settings_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", ["some text"] * 40)
    base = ["train", "--data", str(data), "--output-dir", str(tmp_path / "o")]
    assert "is instead of --eval-data" in _error(
        [*base, "--eval-split", "0.1", "--eval-data", str(data)], capsys
    )
    assert "a fraction in (0, 1) or a whole number" in _error([*base, "--eval-split", "1.5"], capsys)
    said = _error([*base, "--eval-split", "100"], capsys)
    assert "--eval-split 100: holds out 100 of 40 examples, leaving none to train on; hold out fewer" in said


def test_a_run_that_skipped_steps_says_so_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--on-nan skip with 26 of 30 updates dropped ended as quietly as a run with none."""
    monkeypatch.setenv("LMTUNE_FAULT_NAN_AT_STEP", "2")
    argv = [
        "train",
        "--max-steps",
        "4",
        "--on-nan",
        "skip",
        "--no-progress",
        "--output-dir",
        str(tmp_path / "o"),
    ]
    assert main(argv) == 0
    said = capsys.readouterr()
    assert (
        "warning: 1 of the run's 4 steps were skipped (--on-nan skip: a non-finite loss"
        in said.out + said.err
    )
    assert "a lower --lr may help" in said.out + said.err  # a quarter of the run
