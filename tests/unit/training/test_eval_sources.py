"""Evaluation per source: each source's loss is the loss of evaluating it alone, the overall
eval_loss is their token-weighted mean (and what it was without sources), and --metric-for-best
may name one source's metric."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import pytest

from lmtune.cli import main
from lmtune.config.run_groups import EvalSettings
from lmtune.config.settings import TrainConfig
from lmtune.config.validate import check_settings
from lmtune.errors import UserError
from lmtune.outputs.reporters import scalars
from lmtune.outputs.runlog import RunLog
from lmtune.parallel.distributed import read_dist_env
from lmtune.parallel.health import Heartbeat
from lmtune.parallel.wrap import unwrap
from lmtune.training.best import best_tracker
from lmtune.training.build import Built, build, loaders
from lmtune.training.context import RunContext
from lmtune.training.evaluate import EvalResult, evaluate
from lmtune.training.signals import StopRequest
from tests.conftest import uneven_texts, write_jsonl

ENV = read_dist_env("cpu")


@contextmanager
def built(tmp_path: Path, name: str, **settings: Any) -> Iterator[tuple[RunContext, Built]]:
    values = {"global_batch_size": 4, "micro_batch_size": 3, "max_steps": 1, "max_length": 48, **settings}
    cfg = TrainConfig(model="tiny", output_dir=str(tmp_path / name), progress=False, seed=3, **values)
    with RunLog(ENV, Path(cfg.output_dir), progress=False) as log, StopRequest() as stop:
        run = RunContext(
            cfg=cfg, env=ENV, strategy="single", threads=1, log=log, stop=stop, heartbeat=Heartbeat(None, 0)
        )
        yield run, build(run)


def evaluated(run: RunContext, b: Built) -> EvalResult:
    _, loader = loaders(run, b)
    assert loader is not None and b.eval_data is not None
    return evaluate(
        unwrap(b.model), loader, ENV, nullcontext(), objective=b.objective, sources=b.eval_data.sources
    )


def test_per_source_losses_are_each_source_alone_and_combine_to_the_overall(tmp_path: Path) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", uneven_texts(12, seed=1))
    chat = write_jsonl(tmp_path / "chat.jsonl", uneven_texts(7, seed=2))  # 7, 5: batches of 3 would mix
    code = write_jsonl(tmp_path / "code.jsonl", [f"def f{i}(): return {i * i}" for i in range(5)])
    both = f"chat={chat},code={code}"
    with built(tmp_path, "both", data=str(train), eval_data=both, metric_for_best="eval_loss/code") as (
        run,
        b,
    ):
        assert b.eval_data is not None and b.eval_data.sources is not None
        result = evaluated(run, b)
    alone = {}
    for name, path in (("chat", chat), ("code", code)):
        with built(tmp_path, name, data=str(train), eval_data=str(path)) as (run, b):
            alone[name] = evaluated(run, b)
    m = result.metrics
    assert result.sources == ("chat", "code")
    for name in ("chat", "code"):
        assert m[f"eval_loss/{name}"] == pytest.approx(alone[name].loss, rel=1e-6)
        assert m[f"eval_tokens/{name}"] == alone[name].target_tokens
        assert m[f"eval_perplexity/{name}"] == pytest.approx(math.exp(alone[name].loss), rel=1e-6)
    weighted = (
        sum(m[f"eval_loss/{n}"] * m[f"eval_tokens/{n}"] for n in ("chat", "code")) / result.target_tokens
    )
    assert result.target_tokens == m["eval_tokens/chat"] + m["eval_tokens/code"]
    assert m["eval_loss"] == pytest.approx(weighted, rel=1e-9) and result.examples == 12
    # --metric-for-best eval_loss/code is what the tracker reads.
    tracker = best_tracker(EvalSettings(metric_for_best="eval_loss/code"))
    assert tracker is not None and not tracker.greater_is_better
    assert result.value(tracker.metric) == m["eval_loss/code"]
    # As run.json records it and a finished run run again (Python API) reads it back.
    back = EvalResult.from_record(json.loads(json.dumps(result.record())))
    assert (back.loss, back.target_tokens, back.examples, back.sources) == (
        result.loss,
        result.target_tokens,
        result.examples,
        result.sources,
    )
    assert back.metrics == pytest.approx(result.metrics) and back.value(tracker.metric) == m["eval_loss/code"]


def test_held_out_share_of_a_mixture_is_evaluated_per_source(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", uneven_texts(10, seed=4))
    b = write_jsonl(tmp_path / "b.jsonl", uneven_texts(20, seed=5))
    settings = {"data": f"{a},{b}", "data_weights": "1,1", "eval_split": 0.2}
    with built(tmp_path, "split", **settings) as (run, bt):
        assert bt.eval_data is not None and bt.eval_data.source_sizes() == [2, 4]
        assert bt.train_data.source_sizes() == [8, 16]
        result = evaluated(run, bt)
    assert result.sources == ("a", "b") and result.examples == 6
    assert {"eval_loss/a", "eval_loss/b", "eval_tokens/a", "eval_tokens/b"} <= set(result.metrics)


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        (
            {"eval_data": "x/e.jsonl", "metric_for_best": "eval_loss/e"},
            r"must be eval_loss \| eval_perplexity.*; a per-source metric \(METRIC/NAME\) needs several",
        ),
        ({"eval_data": "a=x.jsonl,b=y.jsonl", "metric_for_best": "eval_loss/c"}, r"METRIC/a\|b"),
        ({"eval_data": "a=x.jsonl,b=y.jsonl", "metric_for_best": "eval_lost/a"}, r"--metric-for-best"),
        # loss is eval_loss, as the HF Trainer reads it; another name is not.
        ({"eval_data": "x.jsonl", "metric_for_best": "bleu"}, r"--metric-for-best: must be"),
        # A slash of a metric's own name is not a source's (TRL logs rewards/chosen).
        (
            {"eval_data": "x.jsonl", "metric_for_best": "eval_rewards/chosen", "objective": "dpo"},
            r"eval_rewards/margins \(got 'eval_rewards/chosen'\)$",
        ),
    ],
)
def test_metric_for_best_names_a_source_evaluated_apart(settings: dict[str, Any], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        check_settings(TrainConfig(**settings), 1)
    ok = {"eval_data": "a=x.jsonl,b=y.jsonl", "metric_for_best": "eval_perplexity/b"}
    check_settings(TrainConfig(**ok), 1)
    split = {
        "data": "a.jsonl,b.jsonl",
        "data_weights": "1,2",
        "eval_split": 0.1,
        "metric_for_best": "eval_loss/b",
    }
    check_settings(TrainConfig(**split), 1)
    dpo = {
        "objective": "dpo",
        "eval_data": "a=x.jsonl,b=y.jsonl",
        "metric_for_best": "eval_rewards/accuracies/a",
    }
    check_settings(TrainConfig(**dpo), 1)
    tracker = best_tracker(EvalSettings(metric_for_best="eval_rewards/accuracies/a"))
    assert tracker is not None and tracker.greater_is_better


def test_report_plots_and_lists_the_eval_loss_per_source(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    rows = [
        {"kind": "train", "step": 1, "loss": 3.0},
        {"kind": "eval", "step": 1, "eval_loss": 2.5, "eval_loss/chat": 2.0, "eval_loss/code": 3.0},
        {"kind": "eval", "step": 2, "eval_loss": 2.25, "eval_loss/chat": 1.75, "eval_loss/code": 2.75},
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = tmp_path / "report.html"
    assert main(["report", str(out), "--out", str(page)]) == 0
    text = page.read_text()
    assert "<figure id='plot-eval_per_source'><img" in text
    assert "chat 1.7500, code 2.7500" in text
    assert scalars(rows[2]) == {
        "eval/loss": 2.25,
        "eval/loss/chat": 1.75,
        "eval/loss/code": 2.75,
    }
