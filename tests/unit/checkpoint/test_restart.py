"""A worker that --max-restarts started again goes on from its own job's newest checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtune.checkpoint.resume import restart_config
from lmtune.config.settings import TrainConfig
from lmtune.parallel.distributed import read_dist_env


def _checkpoint(out: Path, step: int, job: str | None) -> None:
    folder = out / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True)
    state = {"step": step} | ({"job": job} if job is not None else {})
    (folder / "trainer.json").write_text(json.dumps(state))


def test_a_restart_goes_on_from_its_own_jobs_checkpoint_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restart applied --overwrite again (the job's checkpoints deleted, step 1); switching it to
    resume, one killed before its first start replaced an earlier run resumed that run's."""
    cfg = TrainConfig(output_dir=str(tmp_path), overwrite=True, resume="never")
    env = read_dist_env("cpu")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_config(cfg, env) is cfg  # no checkpoint yet: as the first start
    _checkpoint(tmp_path, 50, None)  # an earlier run's, of an lmtune before the job was recorded
    _checkpoint(tmp_path, 60, "job-b")  # another launch's
    assert restart_config(cfg, env) is cfg
    _checkpoint(tmp_path, 70, "job-a")
    again = restart_config(cfg, env)
    assert (again.checkpoint.overwrite, again.checkpoint.resume) == (False, "auto")
    assert "a restart goes on from the newest checkpoint" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the first start applies what was given
    assert restart_config(cfg, env) is cfg
