"""`lmtune bench` runs what can run here, says why the rest cannot, and writes the table as JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from lmtune.tools.bench import skip_reason
from tests.conftest import run_lmtune


def test_bench_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_lmtune(
        [
            "bench",
            "--strategies",
            "single,dp",
            "--precisions",
            "fp32,fp16",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    rows = {(r["strategy"], r["precision"]): r for r in json.loads(out.read_text())}
    ok = rows[("single", "fp32")]
    assert ok["status"] == "ok" and ok["tokens_per_s"] > 0 and (0 < ok["mfu"] <= 1 or math.isnan(ok["mfu"]))
    assert ok["peak_memory_mib"] > 0 and set(ok["phase_ms"]) == {"data", "forward", "backward", "optimizer"}
    assert rows[("dp", "fp32")]["status"].startswith("skipped: DataParallel needs 2+ CUDA GPUs")
    assert rows[("single", "fp16")]["status"].startswith("skipped: fp16 needs a CUDA GPU")
    assert rows[("single", "fp16")]["tokens_per_s"] is None  # no figures for what did not run (0.0)
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout


def test_skip_reasons() -> None:
    assert skip_reason("ddp", "fp32", nproc=1) is not None
    assert skip_reason("fsdp", "bf16", nproc=1) is not None
    assert skip_reason("fsdp", "bf16", nproc=2) is None
    assert skip_reason("single", "bf16", nproc=1) is None


def test_a_combination_the_runs_settings_refuse_is_listed_not_the_bench_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --config with adamw8bit and --strategies single,fsdp ended the whole bench (exit 2, nothing
    measured): fsdp is listed with the reason, as fp16 on a CPU is, and single is measured."""
    import subprocess

    from lmtune.config.settings import TrainConfig
    from lmtune.tools import bench

    spawned: list[list[str]] = []
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **_: spawned.append(cmd) or SimpleNamespace(returncode=1, stderr="x")
    )
    rows = bench.run_bench(TrainConfig(optimizer="adamw8bit"), ["single", "fsdp"], ["fp32"], 2, 1, 1)
    assert [r.strategy for r in rows] == ["single", "fsdp"] and len(spawned) == 1
    assert rows[1].status.startswith("skipped: --optimizer: does not work with --strategy fsdp")
