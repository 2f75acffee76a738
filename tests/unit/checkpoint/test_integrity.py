"""Files from disk are data: crafted checkpoints run nothing, manifests stay inside their folder,
one run per output folder, checkpoints sort by number, a full disk loses nothing."""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lmtune.checkpoint import sharded, store
from lmtune.checkpoint.layout import (
    LOCK_FILE,
    MANIFEST,
    TEMPORARY_MARK,
    list_checkpoints,
    step_folder,
    verify,
)
from lmtune.checkpoint.resume import resumable_when_full
from lmtune.checkpoint.rundir import (
    acquire,
    check_earlier_run,
    job_lock,
    remove_leftovers,
    replace_earlier_run,
)
from lmtune.checkpoint.state import ModelParts, TrainerState
from lmtune.checkpoint.store import save_checkpoint
from lmtune.config.groups import ExampleSettings
from lmtune.errors import NoSpace, UserError
from lmtune.parallel.distributed import DistEnv, read_dist_env
from lmtune.parallel.launch import LOCK_TOKEN_ENV
from tests.conftest import mounted_tmpfs


class Payload:
    """Unpickling this creates ``marker``: proof that code from a file ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.marker), "w"))


def _dcp_folder(folder: Path, extra: dict[str, Any] | None = None) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"lr": 0.5, **(extra or {})}}
    save(state, checkpoint_id=str(folder), no_dist=True)


def test_a_crafted_index_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    folder, marker = tmp_path / "sharded", tmp_path / "ran"
    _dcp_folder(folder)
    assert sharded.read_index(folder).state_dict_metadata  # our own index reads fine
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UserError, match=r"\.metadata: refused"):
        sharded.read_index(folder)
    with pytest.raises(UserError, match=r"\.metadata: refused"):
        sharded.load({"model": {"w": torch.zeros(2, 3)}}, folder, no_dist=True)
    assert not marker.exists()


def test_an_index_pointing_outside_its_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    _dcp_folder(folder)
    index = sharded.read_index(folder)
    for info in index.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    with pytest.raises(UserError, match="not a shard file of this folder"):
        sharded.read_index(folder)


def test_a_crafted_stored_value_is_read_as_data(tmp_path: Path) -> None:
    """DCP keeps non-tensor values pickled in its shard files; they are loaded weights-only."""
    folder, marker = tmp_path / "sharded", tmp_path / "ran"
    _dcp_folder(folder, {"evil": Payload(marker)})
    marker.unlink(missing_ok=True)
    state: dict[str, Any] = {"model": {"w": torch.zeros(2, 3)}, "optimizer": {"lr": 0.0, "evil": None}}
    with pytest.raises(UserError, match=r"refused, the stored value optimizer\.evil is not plain data"):
        sharded.load(state, folder, no_dist=True)
    assert not marker.exists()
    honest: dict[str, Any] = {"model": {"w": torch.zeros(2, 3)}, "optimizer": {"lr": 0.0}}
    sharded.load(honest, tmp_path / "sharded", no_dist=True)
    assert honest["optimizer"]["lr"] == 0.5 and torch.equal(
        honest["model"]["w"], torch.arange(6.0).view(2, 3)
    )


def _checkpoint(folder: Path, files: dict[str, bytes]) -> None:
    import hashlib

    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    manifest = {
        name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()
    }
    (folder / MANIFEST).write_text(json.dumps(manifest))


GOOD = {"trainer.json": b"{}", "model.safetensors": b"m", "optimizer.pt": b"o"}


def test_manifest_entries_must_be_plain_files_inside_the_folder(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ok", GOOD)
    assert verify(tmp_path / "ok") is None
    outside = tmp_path / "secret"
    outside.write_bytes(b"s")
    _checkpoint(tmp_path / "dots", GOOD)
    manifest = json.loads((tmp_path / "dots" / MANIFEST).read_text())
    manifest["../secret"] = {"bytes": 1, "sha256": "x"}
    (tmp_path / "dots" / MANIFEST).write_text(json.dumps(manifest))
    assert "not a plain path inside the checkpoint" in str(verify(tmp_path / "dots"))
    _checkpoint(tmp_path / "link", GOOD)
    (tmp_path / "link" / "optimizer.pt").unlink()
    (tmp_path / "link" / "optimizer.pt").symlink_to(outside)
    assert verify(tmp_path / "link") == "optimizer.pt is a symbolic link"
    _checkpoint(tmp_path / "extra", GOOD)
    (tmp_path / "extra" / "sharded").mkdir()
    (tmp_path / "extra" / "sharded" / ".metadata").write_bytes(b"planted")
    assert verify(tmp_path / "extra") == "sharded/.metadata is not in the manifest"
    _checkpoint(tmp_path / "absolute", {**GOOD})
    manifest = json.loads((tmp_path / "absolute" / MANIFEST).read_text())
    manifest[str(outside)] = {"bytes": 1, "sha256": "x"}
    (tmp_path / "absolute" / MANIFEST).write_text(json.dumps(manifest))
    assert "not a plain path" in str(verify(tmp_path / "absolute"))


def test_checkpoints_sort_by_step_number(tmp_path: Path) -> None:
    for step in (999_998, 999_999, 1_000_000, 7):
        step_folder(tmp_path, step).mkdir(parents=True)
    (tmp_path / "checkpoints" / ".step-1000001.tmp").mkdir()
    (tmp_path / "checkpoints" / "step-000007.replaced-1").mkdir()
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step-000007", "step-999998", "step-999999", "step-1000000"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_one_run_per_output_folder(tmp_path: Path) -> None:
    warnings: list[str] = []
    with acquire(tmp_path / "out", "", warnings.append) as held:
        assert (tmp_path / "out" / LOCK_FILE).is_file() and held.owned
        with pytest.raises(UserError, match=rf"another run is using it \(pid {os.getpid()} on"):
            acquire(tmp_path / "out", "", warnings.append)
    assert not (tmp_path / "out" / LOCK_FILE).exists()  # released
    assert warnings == []


def test_a_stale_lock_is_taken_over_with_a_warning(tmp_path: Path) -> None:
    lock = tmp_path / LOCK_FILE
    holder = {"host": socket.gethostname(), "pid": _dead_pid(), "pid_started": None, "started": 0.0}
    lock.write_text(json.dumps({**holder, "run_id": "", "token": "old"}))
    warnings: list[str] = []
    with acquire(tmp_path, "", warnings.append) as held:
        assert held.owned and json.loads(lock.read_text())["pid"] == os.getpid()
    assert len(warnings) == 1 and "a run that is gone" in warnings[0]
    # Another host's live-looking lock cannot be checked from here: refused, naming the holder.
    lock.write_text(json.dumps({**holder, "host": "elsewhere", "run_id": "", "token": "t"}))
    with pytest.raises(UserError, match="on elsewhere"):
        acquire(tmp_path, "", warnings.append)
    # ... unless it is this job's own (a restarted attempt of the same run id).
    lock.write_text(json.dumps({**holder, "host": "elsewhere", "run_id": "job-7", "token": "t"}))
    with acquire(tmp_path, "job-7", warnings.append) as held:
        assert held.owned
    assert len(warnings) == 1
    # lmtune's default --rdzv-id is every job's, and a live holder here of the same id is another
    # job (two torchrun jobs of one id on two ports): a second job took a running job's folder over.
    for run_id, host, pid in (("lmtune", "elsewhere", 1), ("job-7", socket.gethostname(), os.getpid())):
        lock.write_text(json.dumps({**holder, "host": host, "pid": pid, "run_id": run_id, "token": "t"}))
        with pytest.raises(UserError, match="another run is using it"):
            acquire(tmp_path, run_id, warnings.append)
    # The job's own launcher's lock, its token handed in by the ranks of its node (rank 0 may run
    # on another node), is accepted: not taken, not refused.
    lock.write_text(json.dumps({**holder, "pid": os.getpid(), "run_id": "lmtune", "token": "a" * 32}))
    with acquire(tmp_path, "lmtune", warnings.append, inherited="a" * 32) as held:
        assert not held.owned
    assert lock.is_file()


def test_a_worker_accepts_its_launchers_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with acquire(tmp_path, "run", print) as launcher:
        monkeypatch.setenv(LOCK_TOKEN_ENV, launcher.holder.token)
        with job_lock(tmp_path, "run", read_dist_env("cpu"), print) as worker:
            assert worker is not None and not worker.owned
        assert (tmp_path / LOCK_FILE).is_file()  # the worker leaves the launcher's lock alone


def test_an_earlier_run_is_not_replaced_without_overwrite(tmp_path: Path) -> None:
    (tmp_path / "final").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "run.json").write_text(json.dumps({"config": {"lr": 1.0}, "environment": {}}))
    with pytest.raises(UserError, match=r"holds an earlier run \(final, metrics.jsonl\)"):
        check_earlier_run(tmp_path, continued=False, overwrite=False, config={"lr": 1.0})
    check_earlier_run(tmp_path, continued=True, overwrite=False, config={})  # its checkpoints continue it
    (tmp_path / "final").rmdir()
    # The same run, stopped before its first step, starts over: it lost nothing, so nothing is said.
    said: list[str] = []
    check_earlier_run(tmp_path, continued=False, overwrite=False, config={"lr": 1.0}, warn=said.append)
    assert said == []
    # One with other settings that ended before its first step (out of memory, with a smaller
    # --micro-batch-size now) is replaced too, saying so: it trained nothing.
    check_earlier_run(tmp_path, continued=False, overwrite=False, config={"lr": 2.0}, warn=said.append)
    replaced = f"{tmp_path} holds a run that ended before its first step: starting this one in its place"
    assert said == [replaced]
    said.clear()
    # Stopped after some steps, before its first checkpoint, it starts over, saying so; another is refused.
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    check_earlier_run(tmp_path, continued=False, overwrite=False, config={"lr": 1.0}, warn=said.append)
    assert len(said) == 1 and "stopped before its first checkpoint: starting it again from step 0" in said[0]
    assert "--save-every N keeps a stopped run's progress" in said[0]
    with pytest.raises(UserError, match=r"holds an earlier run \(metrics.jsonl\)"):
        check_earlier_run(tmp_path, continued=False, overwrite=False, config={"lr": 2.0})
    check_earlier_run(tmp_path, continued=False, overwrite=True, config={})
    assert (tmp_path / "run.json").exists()  # deleted once the new run is built
    replace_earlier_run(tmp_path, read_dist_env("cpu"), 0)
    assert not (tmp_path / "run.json").exists() and not (tmp_path / "metrics.jsonl").exists()
    (tmp_path / "checkpoints" / ".step-000004.tmp").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".step-000004.tmp" / TEMPORARY_MARK).touch()
    (tmp_path / "checkpoints" / ".step-000005.tmp").mkdir()  # a user's, of that name: kept
    assert [p.name for p in remove_leftovers(tmp_path)] == [".step-000004.tmp"]
    assert (tmp_path / "checkpoints" / ".step-000005.tmp").is_dir()


def test_a_run_killed_before_its_run_json_leaves_a_folder_the_next_run_takes(tmp_path: Path) -> None:
    """Killed in the half second after metrics.jsonl is opened and before run.json is written (a
    `| head` closing the pipe did it), a run left an empty metrics.jsonl, and the folder was refused
    as holding files not lmtune's, --overwrite too. A row in it is still at stake."""
    (tmp_path / "metrics.jsonl").touch()
    said: list[str] = []
    check_earlier_run(tmp_path, continued=False, overwrite=False, config={"lr": 1.0}, warn=said.append)
    check_earlier_run(tmp_path, continued=False, overwrite=True, config={"lr": 1.0}, warn=said.append)
    assert said == []
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    for overwrite in (False, True):
        with pytest.raises(UserError, match=r"holds metrics\.jsonl but no lmtune run"):
            check_earlier_run(tmp_path, continued=False, overwrite=overwrite, config={"lr": 1.0})


def _tiny_parts() -> tuple[ModelParts, Any, torch.optim.Optimizer]:
    from lmtune.model.modeling import load_model

    loaded = load_model("tiny", 0)
    optimizer = torch.optim.AdamW(loaded.model.parameters(), lr=1e-3)
    return ModelParts(loaded.model, loaded.model, sharded=False, lora=False), loaded.tokenizer, optimizer


ONE = DistEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend=None
)


def _state(step: int) -> TrainerState:
    return TrainerState(
        step=step, epoch=0, step_in_epoch=step, global_batch_size=8, world_size=1, seed=0, examples=100
    )


def test_a_refused_checkpoint_stops_every_rank_with_rank_0s_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 judges the checkpoint to continue; its refusal goes through the broadcast the other
    ranks wait in, so they stop with the same message rather than see rank 0 leave (which gloo
    reports as a traceback on their side)."""
    from lmtune.checkpoint import resume
    from lmtune.parallel import distributed

    parts, tokenizer, optimizer = _tiny_parts()
    save_checkpoint(tmp_path, _state(1), parts, tokenizer, optimizer, ONE, keep_last=0, records={})
    (step_folder(tmp_path, 1) / "optimizer.pt").unlink()
    sent: list[object] = []

    def broadcast(obj: object, env: DistEnv) -> object:
        if env.is_main:
            sent.append(obj)
        return sent[-1]

    monkeypatch.setattr(distributed, "broadcast_object", broadcast)
    said = []
    for rank in (0, 1):
        with pytest.raises(UserError) as refused:
            resume.resume_point("auto", tmp_path, replace(ONE, rank=rank, world_size=2, backend="gloo"))
        said.append(str(refused.value))
    assert said[0] == said[1] and "is damaged: optimizer.pt is missing" in said[0]


def test_a_full_disk_is_a_user_error_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parts, tokenizer, optimizer = _tiny_parts()
    save_checkpoint(tmp_path, _state(1), parts, tokenizer, optimizer, ONE, keep_last=0, records={})
    assert verify(step_folder(tmp_path, 1)) is None

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(
        UserError, match=r"saving step 2 to .*step-000002: the disk filled while it was written, about"
    ):
        save_checkpoint(tmp_path, _state(2), parts, tokenizer, optimizer, ONE, keep_last=0, records={})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]
    assert verify(step_folder(tmp_path, 1)) is None
    # Checked before writing: too little room is refused at once, naming both sizes.
    monkeypatch.setattr(store, "free_bytes", lambda folder: 2**20)
    with pytest.raises(
        UserError, match=r"MB needed, 1.0 MB free; step-000001, the newest checkpoint, is intact"
    ):
        save_checkpoint(tmp_path, _state(3), parts, tokenizer, optimizer, ONE, keep_last=0, records={})
    # The first save of a run has no earlier checkpoint to speak of.
    with pytest.raises(
        UserError, match=r"MB free; no earlier checkpoint was saved, so the run starts afresh"
    ):
        save_checkpoint(
            tmp_path / "new", _state(1), parts, tokenizer, optimizer, ONE, keep_last=0, records={}
        )


def test_a_disk_that_fills_while_a_checkpoint_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real 5 MB disk: the first checkpoint (~3.5 MB) fits; the second, let past the free-space
    check (as when another job fills the disk meanwhile), fails inside torch's or safetensors'
    writer, which name no cause (torch: "unexpected pos ..."): still one sentence, and the
    half-written folder is gone, its space with it."""
    with mounted_tmpfs(tmp_path / "disk", "size=5m") as disk:
        parts, tokenizer, optimizer = _tiny_parts()
        save_checkpoint(disk, _state(1), parts, tokenizer, optimizer, ONE, keep_last=0, records={})
        monkeypatch.setattr(store, "free_bytes", lambda folder: 1 << 40)
        with pytest.raises(UserError, match=r"step-000002: about [\d.]+ MB needed, [\d.]+ MB free") as e:
            save_checkpoint(disk, _state(2), parts, tokenizer, optimizer, ONE, keep_last=0, records={})
        assert "step-000001, the newest checkpoint, is intact" in str(e.value)
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["step-000001"]
        assert verify(step_folder(disk, 1)) is None
        assert shutil.disk_usage(disk).free > 1 << 20


def test_a_full_disk_while_the_run_writes_its_records_names_what_it_resumes_from(tmp_path: Path) -> None:
    parts, tokenizer, optimizer = _tiny_parts()
    full = NoSpace("no space left on device while writing the metrics", tmp_path / "metrics.jsonl")
    said = r"^no space .* metrics; no earlier checkpoint was saved, so the run"
    with pytest.raises(NoSpace, match=said), resumable_when_full(tmp_path):
        raise full
    save_checkpoint(tmp_path, _state(1), parts, tokenizer, optimizer, ONE, keep_last=0, records={})
    said = r"metrics; step-000001, the newest checkpoint, is intact \(free some"
    with pytest.raises(NoSpace, match=said), resumable_when_full(tmp_path):
        raise full
    elsewhere = NoSpace("no space left on device while caching", tmp_path.parent / "cache")
    said = r"^no space left on device while caching$"  # not the run's folder: nothing to add
    with pytest.raises(NoSpace, match=said), resumable_when_full(tmp_path):
        raise elsewhere


def test_an_existing_checkpoint_of_the_same_step_is_kept_aside(tmp_path: Path) -> None:
    parts, tokenizer, optimizer = _tiny_parts()
    step_folder(tmp_path, 2).mkdir(parents=True)
    (step_folder(tmp_path, 2) / "broken").write_text("")
    save_checkpoint(tmp_path, _state(2), parts, tokenizer, optimizer, ONE, keep_last=1, records={})
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names[0] == "step-000002" and names[1].startswith("step-000002.replaced-")
    assert (tmp_path / "checkpoints" / names[1] / "broken").is_file()


def test_waits_before_training_end_on_a_signal_or_without_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from lmtune.data.prepare import _wait_for, encode_into
    from lmtune.data.sources import BadLines, Record
    from lmtune.errors import StoppedBySignal
    from lmtune.model.modeling import byte_tokenizer

    def stopped() -> None:
        raise StoppedBySignal(15)

    folder, error = tmp_path / "key", tmp_path / "key.error-1"
    with pytest.raises(StoppedBySignal, match="stopped by SIGTERM before training began"):
        _wait_for(folder, error, "key.tmp-1-*", stopped)
    monkeypatch.setenv("LMTUNE_CACHE_WAIT_TIMEOUT", "0.3")
    started = time.monotonic()
    with pytest.raises(UserError, match="wrote nothing in that time"):
        _wait_for(folder, error, "key.tmp-1-*", lambda: None)
    assert time.monotonic() - started < 5
    # Tokenizing stops between chunks, not after the whole corpus.
    calls: list[int] = []

    def stop_after_first() -> None:
        calls.append(1)
        if len(calls) > 1:
            raise StoppedBySignal(15)

    records = (Record("mem", i, {"text": "x"}) for i in range(100_000))
    sink = type("Sink", (), {"write": lambda self, examples: None})()
    with pytest.raises(StoppedBySignal):
        encode_into(
            records, byte_tokenizer(), ExampleSettings(), sink, BadLines(skip=False), 1, stop_after_first
        )
    assert len(calls) == 2


def test_a_saved_folder_shows_no_progress_bar_and_leaves_the_setting_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lmtune.train from a notebook: transformers' "Writing model shards" bar is not shown for
    lmtune's saves, and the notebook's bars elsewhere stay on."""
    from transformers.utils import logging as hf_logging

    from lmtune.checkpoint.export import save_hf_folder

    parts, tokenizer, _ = _tiny_parts()
    hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
    save_hf_folder(parts.model, tokenizer, tmp_path / "final")
    assert "Writing model shards" not in capsys.readouterr().err
    assert hf_logging.is_progress_bar_enabled() and (tmp_path / "final" / "model.safetensors").is_file()


def test_a_setting_left_to_its_default_is_named_by_the_value_it_took(tmp_path: Path) -> None:
    from lmtune.checkpoint.finished import changed_settings

    record = {"config": {"lr": None, "seed": 1}, "resolved": {"lr": 0.001}, "environment": {}}
    (tmp_path / "run.json").write_text(json.dumps(record))
    assert changed_settings(tmp_path, {"lr": 5e-4, "seed": 1}) == ["--lr 0.0005, was unset (it took 0.001)"]
    # Given now as the value it took is no change (`--lr 1e-3` again).
    assert changed_settings(tmp_path, {"lr": 1e-3, "seed": 1}) == []
