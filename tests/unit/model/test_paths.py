"""A CPU bf16 run's paths (lmtune.model.paths): decided by override, checkpoint, rule or a cached
timing with a margin, never by a timing that flips between identical runs; a resumed run takes its
checkpoint's paths whatever a timing would say now.

The CPU's units are stood in for (every branch runs on any machine); the real units are reported
as found, and ``ONEDNN_MAX_CPU_ISA`` caps them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from lmtune.errors import UserError
from lmtune.model import paths
from lmtune.model.attention import CPU_ATTENTION_ENV
from lmtune.model.paths import BF16, FP32, CpuUnits, Decision, Paths, Question, Workload, decide_paths
from lmtune.model.products import PRODUCTS_ENV
from lmtune.parallel.distributed import read_dist_env
from tests.conftest import uneven_texts, write_jsonl

ENV = read_dist_env("cpu")
AMX = CpuUnits(amx=True, avx512_bf16=True, avx2=True)
AVX512_BF16 = CpuUnits(amx=False, avx512_bf16=True, avx2=True)
AVX512 = CpuUnits(amx=False, avx512_bf16=False, avx2=True)  # oneDNN emulates bf16 with AVX-512
AVX2 = CpuUnits(amx=False, avx512_bf16=False, avx2=True)


def _workload(head_dim: int = 16) -> Workload:
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=1, head_dim=head_dim
    )
    return Workload(config, [[20, 7], [33, 12]])


class _Timings:
    """Stands in for the two timings: says what they decided, and counts the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, products: str, attention: str):
        self.calls: list[str] = []
        self.products, self.attention = products, attention
        monkeypatch.setattr(paths, "time_products", lambda _: self._said("products"))
        monkeypatch.setattr(paths, "time_attention", lambda _: self._said("attention"))

    def _said(self, name: str) -> Decision:
        self.calls.append(name)
        return Decision(getattr(self, name), f"timed (standing in): {getattr(self, name)}")


def _machine(monkeypatch: pytest.MonkeyPatch, units: CpuUnits, onednn_bf16: bool) -> None:
    monkeypatch.setattr(paths, "cpu_units", lambda: units)
    monkeypatch.setattr(paths, "onednn_bf16", lambda: onednn_bf16)
    monkeypatch.delenv(PRODUCTS_ENV, raising=False)
    monkeypatch.delenv(CPU_ATTENTION_ENV, raising=False)


def _decide(question: Question | None = None, head_dim: int = 16) -> Paths:
    return decide_paths(question or Question(cpu_bf16=True, attention=True), _workload(head_dim), ENV)


def _choices(found: Paths) -> tuple[str | None, str | None]:
    return (
        found.products.choice if found.products else None,
        found.attention.choice if found.attention else None,
    )


@pytest.mark.parametrize(
    ("units", "onednn_bf16", "head_dim", "expected", "timed"),
    [
        (AMX, True, 64, (BF16, FP32), []),
        (AMX, True, 128, (BF16, "timed"), ["attention"]),
        (AVX512_BF16, True, 128, ("timed", FP32), ["products"]),
        (AVX512, True, 128, ("timed", FP32), ["products"]),
        (AVX2, False, 128, (FP32, FP32), []),
    ],
    ids=["AMX-heads-64", "AMX-heads-128", "AVX-512-BF16", "AVX-512", "AVX2"],
)
def test_rules_decide_where_the_units_do_and_only_the_rest_is_timed(
    monkeypatch: pytest.MonkeyPatch,
    units: CpuUnits,
    onednn_bf16: bool,
    head_dim: int,
    expected: tuple[str, str],
    timed: list[str],
) -> None:
    _machine(monkeypatch, units, onednn_bf16)
    timings = _Timings(monkeypatch, products="X", attention="Y")
    found = _decide(head_dim=head_dim)
    assert timings.calls == timed
    said = {"products": "X", "attention": "Y"}
    assert _choices(found) == tuple(
        said[n] if e == "timed" else e for n, e in zip(said, expected, strict=True)
    )
    for decision in (found.products, found.attention):
        assert decision is not None and decision.how.startswith(("rule:", "timed"))
    assert found.to_json()["cpu_matrix_units"] == units.describe()
    assert units.describe() in found.line()


@pytest.mark.parametrize("units", [AMX, AVX2], ids=["AMX", "AVX2"])
@pytest.mark.parametrize("forced", [BF16, FP32])
def test_each_path_can_be_forced(monkeypatch: pytest.MonkeyPatch, units: CpuUnits, forced: str) -> None:
    _machine(monkeypatch, units, onednn_bf16=units.bf16)
    timings = _Timings(monkeypatch, products="X", attention="Y")
    monkeypatch.setenv(PRODUCTS_ENV, forced)
    monkeypatch.setenv(CPU_ATTENTION_ENV, forced)
    found = _decide()
    assert _choices(found) == (forced, forced) and not timings.calls
    assert found.products is not None and found.products.how == f"set by {PRODUCTS_ENV}"
    assert found.attention is not None and found.attention.how == f"set by {CPU_ATTENTION_ENV}"
    products = paths.products_of(found, "bf16")
    assert products.fp32 == (forced == FP32) and products.bucketed == (forced == BF16 or units.bf16)


@pytest.mark.parametrize("variable", [PRODUCTS_ENV, CPU_ATTENTION_ENV])
def test_a_bad_override_is_a_user_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    _machine(monkeypatch, AMX, onednn_bf16=True)
    _Timings(monkeypatch, products=BF16, attention=FP32)
    monkeypatch.setenv(variable, "fp64")
    with pytest.raises(UserError, match=f"{variable}='fp64': expected auto, fp32 or bf16"):
        _decide()


def test_nothing_is_decided_outside_a_cpu_bf16_run(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, AMX, onednn_bf16=True)
    timings = _Timings(monkeypatch, products=BF16, attention=BF16)
    found = _decide(Question(cpu_bf16=False, attention=True))
    assert _choices(found) == (None, None) and not timings.calls
    assert paths.products_of(found, "fp32").description == "fp32"
    found = _decide(Question(cpu_bf16=True, attention=False))  # masked attention: nothing to choose
    assert found.attention is None and not timings.calls


def test_the_default_is_kept_unless_the_other_is_faster_by_the_margin() -> None:
    for default_s, other_s, chosen in [(1.0, 0.95, "a"), (1.0, 0.85, "b"), (1.0, 1.5, "a")]:
        ways = ("a", lambda s=default_s: s), ("b", lambda s=other_s: s)
        decided = paths._timed(*ways, what="each")
        assert decided.choice == chosen, (default_s, other_s)
        assert "median of" in decided.how and "a unless b is 10% faster" in decided.how


def test_both_timings_run_on_the_runs_shapes() -> None:
    """The real timings (not stood in for) run and decide, on a small model's shapes."""
    for decided in (paths.time_products(_workload()), paths.time_attention(_workload())):
        assert decided.choice in (BF16, FP32) and decided.how.startswith("timed:")


def test_a_timed_choice_is_cached_and_taken_by_later_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _machine(monkeypatch, AVX512_BF16, onednn_bf16=True)
    monkeypatch.setattr(paths, "_attention_rule", lambda units, head_dim: None)  # a CPU that times both
    timings = _Timings(monkeypatch, products=FP32, attention=BF16)
    question = Question(cpu_bf16=True, attention=True, cache=tmp_path / "paths.json", threads=2)
    first = _decide(question)
    timings.products, timings.attention = BF16, FP32  # what a timing would say now: flipped
    again = _decide(question)
    assert timings.calls == ["products", "attention"]  # the second run did not time
    assert _choices(first) == _choices(again) == (FP32, BF16)
    assert again.products is not None and again.products.how.startswith("cached")
    other = _decide(Question(cpu_bf16=True, attention=True, cache=tmp_path / "paths.json", threads=1))
    assert _choices(other) == (BF16, FP32)  # another thread count is another machine for a timing


def test_a_recorded_choice_wins_unless_this_cpu_cannot_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = {
        "products": {"choice": BF16, "decided": "rule: AMX"},
        "attention": {"choice": BF16, "decided": "timed: ..."},
    }
    _machine(monkeypatch, AMX, onednn_bf16=True)
    timings = _Timings(monkeypatch, products=FP32, attention=FP32)
    found = _decide(Question(cpu_bf16=True, attention=True, recorded=recorded))
    assert _choices(found) == (BF16, BF16) and not timings.calls
    assert found.attention is not None and found.attention.how == "from the checkpoint (timed: ...)"
    again = {"attention": {"choice": BF16, "decided": found.attention.how}}  # resumed once more
    twice = _decide(Question(cpu_bf16=True, attention=True, recorded=again)).attention
    assert twice is not None and twice.how == "from the checkpoint (timed: ...)"
    monkeypatch.setenv(CPU_ATTENTION_ENV, FP32)  # an override still wins
    assert _choices(_decide(Question(cpu_bf16=True, attention=True, recorded=recorded))) == (BF16, FP32)
    # A rule that only prefers fp32 (AVX-512 BF16 without AMX) keeps the recorded bf16 attention.
    _machine(monkeypatch, AVX512_BF16, onednn_bf16=True)
    kept = _decide(Question(cpu_bf16=True, attention=True, recorded=recorded))
    assert kept.attention is not None and kept.attention.choice == BF16
    _machine(monkeypatch, AVX2, onednn_bf16=False)  # resumed on a CPU without bf16 kernels
    found = _decide(Question(cpu_bf16=True, attention=True, recorded=recorded))
    assert _choices(found) == (FP32, FP32)
    assert found.products is not None and "the checkpoint's bf16 set aside" in found.products.how


def test_oneDNN_s_isa_cap_hides_the_units_it_keeps_oneDNN_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    found = paths.cpu_units()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    assert paths.cpu_units() == CpuUnits(amx=False, avx512_bf16=found.avx512_bf16, avx2=found.avx2)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    capped = paths.cpu_units()
    assert not capped.amx and not capped.avx512_bf16 and capped.avx2 == found.avx2


# ---- a resumed run takes its checkpoint's paths ---------------------------------------------


def _train(out: Path, data: Path) -> dict[str, Any]:
    from lmtune.config.settings import TrainConfig
    from lmtune.train import train

    cfg = TrainConfig(
        model="tiny",
        data=str(data),
        output_dir=str(out),
        precision="bf16",
        max_steps=6,
        save_every=3,
        keep_last=0,
        global_batch_size=4,
        micro_batch_size=2,
        max_length=64,
        threads_per_process=1,
        progress=False,
    )
    train(cfg)
    return dict(json.loads((out / "run.json").read_text())["resolved"]["paths"])


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def test_a_resumed_run_takes_the_recorded_paths_when_the_timing_flips(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first run's timings choose fp32 products and bf16 attention; at the resume they would
    choose the other way (and the cache is gone), yet the resumed run takes the checkpoint's paths
    and ends bit-identical to the uninterrupted run. A fresh run with the flipped attention timing
    ends elsewhere: the paths do change the numbers."""
    monkeypatch.setenv("LMTUNE_CACHE_DIR", str(tmp_path / "cache"))
    data = write_jsonl(tmp_path / "data.jsonl", uneven_texts(24, seed=4))
    _machine(monkeypatch, AVX512_BF16, onednn_bf16=True)  # both paths timed, on any CPU
    monkeypatch.setattr(paths, "_attention_rule", lambda units, head_dim: None)
    timings = _Timings(monkeypatch, products=FP32, attention=BF16)
    full = _train(tmp_path / "full", data)
    assert (full["products"]["choice"], full["attention"]["choice"]) == (FP32, BF16)
    recorded = json.loads((tmp_path / "full" / "checkpoints" / "step-000003" / "paths.json").read_text())
    assert recorded == full

    shutil.rmtree(tmp_path / "cache")
    timings.products, timings.attention = BF16, FP32
    resumed_out = tmp_path / "resumed"
    (resumed_out / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "full" / "checkpoints" / "step-000003", resumed_out / "checkpoints" / "step-000003"
    )
    timings.calls.clear()
    resumed = _train(resumed_out, data)
    assert not timings.calls
    assert (resumed["products"]["choice"], resumed["attention"]["choice"]) == (FP32, BF16)
    assert resumed["attention"]["decided"].startswith("from the checkpoint (timed")
    full_weights, resumed_weights = _weights(tmp_path / "full"), _weights(resumed_out)
    assert all(torch.equal(full_weights[k], resumed_weights[k]) for k in full_weights)

    timings.products = FP32  # keep products as they were: only the attention flips
    flipped = _train(tmp_path / "flipped", data)
    assert flipped["attention"]["choice"] == FP32
    flipped_weights = _weights(tmp_path / "flipped")
    assert any(not torch.equal(full_weights[k], flipped_weights[k]) for k in full_weights)
