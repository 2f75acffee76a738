"""The run's records on a disk that is full: one sentence naming the file (the run's caller adds
what it resumes from), and nothing that fails a second time as the run unwinds. /dev/full stands
in for the disk: every write to it fails as a full disk's does (ENOSPC)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from lmtune.errors import NoSpace, out_of_space
from lmtune.outputs.runlog import ExampleOrderLog, RunLog
from lmtune.parallel.distributed import read_dist_env

FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full here")


def test_a_row_that_does_not_fit_ends_the_run_in_one_sentence(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").symlink_to(FULL)
    with pytest.raises(NoSpace) as raised, RunLog(read_dist_env("cpu"), tmp_path, progress=False) as log:
        log.open_metrics(0)
        log.record({"kind": "train", "step": 1, "loss": 2.0})
    assert str(raised.value) == f"no space left on device while writing {tmp_path / 'metrics.jsonl'}"
    assert raised.value.path == tmp_path / "metrics.jsonl"
    # Closing the log on the way out did not fail again (its unwritten row is dropped): NoSpace is
    # what came out, and it shows no OSError chained to it.
    assert raised.value.__suppress_context__


def test_run_json_that_does_not_fit_leaves_the_earlier_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = RunLog(read_dist_env("cpu"), tmp_path, progress=False)
    log.write_json("run.json", {"config": 1})
    opened = os.open

    def full_for_the_new_one(path: Any, flags: int, mode: int = 0o777) -> int:
        # Where the new one is written before it replaces the old: a disk that is full.
        return opened(FULL, os.O_WRONLY) if ".run.json.tmp-" in str(path) else opened(path, flags, mode)

    monkeypatch.setattr(os, "open", full_for_the_new_one)
    with pytest.raises(NoSpace, match=r"^no space left on device while writing .*run\.json$"):
        log.write_json("run.json", {"config": 1, "result": 2})
    monkeypatch.undo()
    assert json.loads((tmp_path / "run.json").read_text()) == {"config": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]


def test_run_json_is_written_beside_a_users_run_tmp_not_through_it(tmp_path: Path) -> None:
    """`run.tmp` was its temporary name: a user's file of that name was replaced."""
    log = RunLog(read_dist_env("cpu"), tmp_path, progress=False)
    (tmp_path / "run.tmp").write_text("mine")
    log.write_json("run.json", {"config": 1})
    assert (tmp_path / "run.tmp").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json", "run.tmp"]


def test_each_ranks_example_order_that_does_not_fit(tmp_path: Path) -> None:
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "rank-1.jsonl").symlink_to(FULL)
    order = ExampleOrderLog(tmp_path, rank=1, resume_step=0)
    with pytest.raises(NoSpace, match=r"writing .*samples/rank-1\.jsonl$"):
        order(1, [3, 1, 2])
    order.close()


def test_what_counts_as_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert out_of_space(OSError(errno.ENOSPC, "No space left on device"))
    assert out_of_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    safetensors_says = "Error while serializing: I/O error: No space left on device (os error 28)"
    assert out_of_space(RuntimeError(safetensors_says))
    torch_says = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not out_of_space(torch_says)
    assert not out_of_space(torch_says, tmp_path / "gone" / "step-1")  # a disk with room
    assert not out_of_space(OSError(errno.EACCES, "Permission denied"), tmp_path)
    seen = []

    def usage(path: Path) -> shutil._ntuple_diskusage:
        seen.append(path)
        return shutil._ntuple_diskusage(100 << 20, 100 << 20, 4096)

    monkeypatch.setattr("lmtune.errors.shutil.disk_usage", usage)
    assert out_of_space(torch_says, tmp_path / "gone" / "step-1")  # the disk holding it is full
    assert seen == [tmp_path]  # asked of the nearest folder that exists
