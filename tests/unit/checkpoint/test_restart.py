"""A worker that --max-restarts started again goes on from its own launch's newest checkpoint."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lmtune.checkpoint import resume
from lmtune.checkpoint.resume import launch_started, restart_settings
from lmtune.config.settings import TrainConfig
from lmtune.parallel.distributed import read_dist_env

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


def test_the_launch_started_before_this_process() -> None:
    started = launch_started()
    if not Path(f"/proc/{os.getppid()}/stat").exists():
        assert started is None
        return
    assert started is not None
    own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
    boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
    assert started <= float(boot.split()[1]) + int(own) / os.sysconf("SC_CLK_TCK") <= time.time() + 1
