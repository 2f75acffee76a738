from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmtune.cli import main
from lmtune.data.audit import rank_imbalance


def test_audit_reports_everything_and_fails_on_bad_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "mixed.jsonl"
    rows = [
        {"text": "hello world"},
        {"prompt": "Q: 1+1?\nA: ", "completion": "2"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]},
        {"messages": [{"role": "user", "content": "no reply"}]},
        {"text": "x" * 100},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    png = tmp_path / "h.png"
    code = main(
        [
            "data",
            "audit",
            str(f),
            "--max-length",
            "64",
            "--nproc-per-node",
            "2",
            "--global-batch-size",
            "2",
            "--plot",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "messages 2, prompt_completion 1, text 2" in out
    assert f"{f}:6: not valid JSON" in out
    assert "1 truncated, 0 dropped" in out
    assert "no trainable tokens 1" in out
    assert "EOS keeps its label yes" in out
    assert "rank imbalance      2 ranks" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_clean_data_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "ok.jsonl"
    f.write_text('{"text": "a"}\n{"text": "bb"}\n')
    assert main(["data", "audit", str(f)]) == 0
    assert "result              clean" in capsys.readouterr().out


def test_rank_imbalance_of_equal_lengths_is_one() -> None:
    even = rank_imbalance(np.full(64, 10), world_size=4, global_batch_size=16, micro_batch_size=2, seed=0)
    assert even is not None and even.mean == pytest.approx(1.0) and even.padding == pytest.approx(1.0)
    # The sampler deals tokens evenly (a steady ramp of lengths stays within a few percent); one
    # example far longer than the rest is what no dealing can even out.
    ramp = rank_imbalance(np.arange(1, 65), 4, 16, 2, seed=0)
    assert ramp is not None and ramp.worst < 1.1 and ramp.padding > 1.0
    outlier = np.full(64, 10)
    outlier[5] = 400
    skewed = rank_imbalance(outlier, 4, 16, 2, seed=0)
    assert skewed is not None and skewed.worst > 2.0
