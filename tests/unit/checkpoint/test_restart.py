"""A worker that --max-restarts started again goes on from its own launch's newest checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmtune.checkpoint import resume
from lmtune.checkpoint.resume import restart_settings
from lmtune.config.settings import TrainConfig
from lmtune.parallel.distributed import read_dist_env
from lmtune.parallel.launched import launch_started

STARTED = 1_000_000.0  # when the launch began, as launch_started gives it


def _checkpoint(out: Path, step: int, job: str | None, saved_at: object = STARTED + 60) -> None:
    folder = out / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    state = {"step": step} | ({"job": job, "saved_at": saved_at} if job is not None else {})
    (folder / "trainer.json").write_text(json.dumps(state))


def test_a_restart_goes_on_from_its_own_launchs_checkpoint_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restart applied --overwrite again (the job's checkpoints deleted, step 1); switching it to
    resume, one killed before its first start replaced an earlier run resumed that run's."""
    settings = TrainConfig(output_dir=str(tmp_path), overwrite=True, resume="never").checkpoint
    env = read_dist_env("cpu")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setattr(resume, "launch_started", lambda: STARTED)
    assert restart_settings(settings, env) is settings  # no checkpoint yet: as the first start
    _checkpoint(tmp_path, 50, None)  # an earlier run's, of an lmtune before the launch was recorded
    _checkpoint(tmp_path, 60, "job-b")  # another launch's
    assert restart_settings(settings, env) is settings
    # An earlier job of the same run id (torchrun's "none", lmtune's default --rdzv-id, a fixed id
    # used again): saved before this launch began, or by an lmtune that did not record when.
    _checkpoint(tmp_path, 70, "job-a", saved_at=STARTED - 1)
    assert restart_settings(settings, env) is settings
    _checkpoint(tmp_path, 71, "job-a", saved_at="yesterday")
    assert restart_settings(settings, env) is settings
    _checkpoint(tmp_path, 72, "job-a", saved_at=time.time() + 600)  # copied from a clock ahead
    assert restart_settings(settings, env) is settings
    _checkpoint(tmp_path, 80, "job-a")
    again = restart_settings(settings, env)
    assert (again.overwrite, again.resume) == (False, "auto")
    assert "a restart goes on from the newest checkpoint" in capsys.readouterr().err
    # Whatever torchrun's restart count says: each node's agent counts its own restarts.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restart_settings(settings, env) == again
    # A --resume PATH stays: the run's record says it began there, so it goes on from its newest.
    given = TrainConfig(output_dir=str(tmp_path), overwrite=True, resume=str(tmp_path / "a")).checkpoint
    kept = restart_settings(given, env)
    assert (kept.overwrite, kept.resume) == (False, given.resume)
    # Where the launch's start is not known, nothing is taken for its own.
    monkeypatch.setattr(resume, "launch_started", lambda: None)
    assert restart_settings(settings, env) is settings
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # not launched by torchrun
    monkeypatch.setattr(resume, "launch_started", lambda: STARTED)
    assert restart_settings(settings, env) is settings


def test_the_launch_is_the_nearest_ancestor_it_did_not_start(tmp_path: Path) -> None:
    """A worker's parent was taken for the launch: a wrapper script between torchrun and lmtune,
    which torchrun starts again with each restart, made every restart's checkpoints look older than
    the launch (--overwrite then deleted them). And /proc/stat's boot time, in whole seconds, put
    the launch up to a second early (an earlier job's checkpoint of that second counted as its own)."""
    if not Path("/proc/self/stat").exists():
        assert launch_started() is None
        return
    ours = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
    booted = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    started_here = booted + int(ours) / os.sysconf("SC_CLK_TCK")
    time.sleep(0.3)  # the wrapper and the worker start visibly later than this process
    probe = "from lmtune.parallel.launched import launch_started; print(launch_started())"
    worker = f"{sys.executable} -c '{probe}'"
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "none"}  # as torchrun gives its workers
    for command in (
        [sys.executable, "-c", probe],
        ["sh", "-c", f"{worker}; true"],
        ["sh", "-c", f'sh -c "{worker}; true"'],
    ):
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        assert float(out) == pytest.approx(started_here, abs=0.05), command
