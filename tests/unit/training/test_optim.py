from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from lmtune.checkpoint.state import optimizer_state_bytes
from lmtune.config.settings import TrainConfig
from lmtune.model.modeling import FINETUNE_LR, LoadedModel
from lmtune.training.optim import build_optimizer, build_schedule, default_lr, param_groups, warmup_cosine


def test_schedule_warms_up_then_decays_to_the_floor_as_transformers_does() -> None:
    """The warmup reached the learning rate a step before transformers' (from (step+1)/warmup): an
    HF Trainer run of the same settings differed by 9e-3 in its weights after 20 steps."""
    from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

    lrs = [warmup_cosine(s, total_steps=20, warmup_steps=4, min_ratio=0.1) for s in range(20)]
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))
    assert warmup_cosine(20, 20, 4, 0.1) == pytest.approx(0.1)
    for warmup, floor in ((4, 0.1), (0, 0.0), (3, 0.0)):
        opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
        hf = get_cosine_with_min_lr_schedule_with_warmup(opt, warmup, 20, min_lr_rate=floor)
        theirs = []
        for _ in range(20):
            theirs.append(hf.get_last_lr()[0])
            opt.step()
            hf.step()
        assert [warmup_cosine(s, 20, warmup, floor) for s in range(20)] == pytest.approx(theirs, abs=1e-12)


def test_a_warmup_ratio_is_rounded_up_as_transformers_does() -> None:
    """Python's round took 10 steps x 0.05 to no warmup at all (transformers: 1), 25 x 0.1 to 2 (3)."""
    from transformers import TrainingArguments

    from lmtune.config.groups import ScheduleSettings
    from lmtune.config.settings import warmup_steps

    for total, ratio in ((10, 0.05), (25, 0.1), (24, 0.1), (200, 0.05), (7, 0.0)):
        theirs = TrainingArguments(output_dir="unused", warmup_steps=ratio).get_warmup_steps(total)
        assert warmup_steps(ScheduleSettings(warmup_ratio=ratio), total) == theirs


def test_scheduler_follows_the_function() -> None:
    model = torch.nn.Linear(3, 3)
    opt = build_optimizer("adamw", model, lr=1.0, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8)
    sched = build_schedule(
        opt, name="cosine", total_steps=10, warmup_steps=2, min_ratio=0.0, decay_ratio=0.1, lr=1.0
    )
    seen = []
    for _ in range(10):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert seen == pytest.approx([warmup_cosine(s, 10, 2, 0.0) for s in range(10)])


def test_no_weight_decay_on_biases_and_norms() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay, no_decay = param_groups(model, 0.1)
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]  # type: ignore[union-attr]
    assert len(no_decay["params"]) == 3 and no_decay["weight_decay"] == 0.0  # type: ignore[arg-type]


def _train(name: str, steps: int) -> tuple[list[float], torch.optim.Optimizer]:
    """A few steps of the tiny preset on one fixed batch: the loss must fall."""
    from lmtune.model.modeling import load_model
    from lmtune.objectives.sft import SummedLoss

    model = SummedLoss(load_model("tiny", 0).model)
    opt = build_optimizer(name, model, lr=3e-3, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8)
    ids = torch.randint(3, 250, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(ids, torch.ones_like(ids), ids).sum() / ids.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, opt


def test_8bit_adamw_trains_with_a_quarter_of_the_state() -> None:
    pytest.importorskip("bitsandbytes")
    losses, opt8 = _train("adamw8bit", 15)
    assert losses[-1] < 0.8 * losses[0]
    _, opt32 = _train("adamw", 1)
    ratio = optimizer_state_bytes(opt8) / optimizer_state_bytes(opt32)
    assert ratio <= 0.3, ratio
    # bitsandbytes keeps fp32 state for tensors under 4096 elements (norm gains); the rest is 8-bit.
    moments = [v for s in opt8.state.values() for k, v in s.items() if k in ("state1", "state2")]
    large = [m for m in moments if m.numel() >= 4096]
    assert large and all(m.dtype == torch.uint8 for m in large)
    # Master weights stay fp32.
    assert all(p.dtype == torch.float32 for g in opt8.param_groups for p in g["params"])


def test_paged_8bit_and_sgd_train() -> None:
    pytest.importorskip("bitsandbytes")
    import warnings

    for name in ("paged_adamw8bit", "sgd"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # bitsandbytes' "paged optimizers are not supported on CPU"
            losses, opt = _train(name, 10)
        assert losses[-1] < losses[0], name
        assert "Paged" not in type(opt).__name__  # on the CPU there is nothing to page


def test_8bit_state_survives_a_weights_only_round_trip(tmp_path: Path) -> None:
    pytest.importorskip("bitsandbytes")
    _, opt = _train("adamw8bit", 2)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    _, fresh = _train("adamw8bit", 1)
    fresh.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))
    assert optimizer_state_bytes(fresh) == optimizer_state_bytes(opt)


def test_missing_bitsandbytes_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from lmtune.errors import UserError

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.optim", None)
    with pytest.raises(UserError, match="--optimizer adamw8bit needs bitsandbytes"):
        build_optimizer("adamw8bit", torch.nn.Linear(2, 2), 1e-3, 0.0, (0.9, 0.999), 1e-8)


def _lrs(name: str, total: int, start: int = 0, steps: int | None = None) -> list[float]:
    model = torch.nn.Linear(3, 3)
    opt = build_optimizer("adamw", model, lr=1.0, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8)
    sched = build_schedule(
        opt,
        name=name,
        total_steps=total,
        warmup_steps=4,
        min_ratio=0.1,
        decay_ratio=0.3,
        lr=2.0,
        start_step=start,
    )
    seen = []
    for _ in range(total - start if steps is None else steps):
        seen.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return seen


@pytest.mark.parametrize("name", ["cosine", "linear", "constant", "wsd"])
def test_each_schedule_follows_its_formula_and_resumes_exactly(name: str) -> None:
    import math

    total = 20

    def expected(s: int) -> float:
        if s < 4 and name == "wsd":  # transformers' wsd warms up from lr x min_lr_ratio
            return 2.0 * (0.1 + 0.9 * s / 4)
        if s < 4:
            return 2.0 * s / 4  # every schedule's warmup as transformers': its first step at 0
        if name == "cosine":
            return 2.0 * warmup_cosine(s, total, 4, 0.1)
        if name == "linear":
            return 2.0 * (total - s) / (total - 4)
        if name == "constant" or s < total - 6:
            return 2.0
        progress = (s - (total - 6)) / 6  # wsd: the last 30% decay (cosine) to lr x 0.1
        return 2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    assert _lrs(name, total) == pytest.approx([expected(s) for s in range(total)])
    assert _lrs(name, total, start=9) == _lrs(name, total)[9:]  # rebuilt at a resume step: the same


@pytest.mark.parametrize(
    ("source", "settings", "unit", "expected"),
    [
        ("preset tiny", {}, "pairs", (1e-3, "the preset's default")),  # from scratch, whatever the objective
        ("preset tiny", {"lora": True}, "tokens", (1e-3, "the preset's default")),
        ("Qwen/Qwen2.5-0.5B", {}, "tokens", (2e-5, "the default for a pretrained model")),
        ("Qwen/Qwen2.5-0.5B", {"lora": True}, "tokens", (2e-4, "the default for LoRA")),
        # A TRL user's DPO without a learning rate: TRL's DPOConfig default, not supervised tuning's.
        ("Qwen/Qwen2.5-0.5B", {"objective": "dpo"}, "pairs", (1e-6, "TRL's default for preference tuning")),
        ("runs/sft/final", {"objective": "orpo", "lora": True}, "pairs", (1e-5, "ten times TRL's")),
    ],
)
def test_the_default_learning_rate_follows_the_model_and_the_objective(
    source: str, settings: dict[str, object], unit: str, expected: tuple[float, str]
) -> None:
    default = 1e-3 if source.startswith("preset ") else FINETUNE_LR
    loaded = LoadedModel(model=torch.nn.Linear(1, 1), tokenizer=None, default_lr=default, source=source)
    lr, note = default_lr(TrainConfig(**settings), loaded, unit)
    assert lr == pytest.approx(expected[0]) and note.startswith(expected[1])


def test_a_warmup_as_long_as_the_run_is_said() -> None:
    """The learning rate would never reach --lr; the HF Trainer accepts it in silence."""
    from lmtune.training.record import _warmup_note

    said = _warmup_note(TrainConfig(warmup_steps=100), 2, 1e-3)
    assert said == (
        "warning: the warmup (100 steps) is as long as the run (2) or longer: the learning rate is still "
        "rising at the last step and never reaches 0.001"
    )
    assert _warmup_note(TrainConfig(warmup_steps=10), 10, 1e-3) is not None
    assert _warmup_note(TrainConfig(warmup_steps=9), 10, 1e-3) is None
    assert _warmup_note(TrainConfig(), 10, 1e-3) is None  # the default ratio: a share of the run
    # One step with the default ratio's one step of warmup (from 0): it trains nothing.
    assert "runs at learning rate 0 and trains nothing" in str(_warmup_note(TrainConfig(), 1, 1e-3))
    # wsd's warmup starts at lr x min_lr_ratio (transformers' get_wsd_schedule): it said 0.
    wsd = TrainConfig(lr_schedule="wsd")
    assert "runs at learning rate 0.0001 (wsd's warmup starts at" in str(_warmup_note(wsd, 1, 1e-3))
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    made = build_schedule(
        opt, name="wsd", total_steps=1, warmup_steps=1, min_ratio=0.1, decay_ratio=0.1, lr=1e-3
    )
    assert made.get_last_lr() == [pytest.approx(1e-4)]  # what the warning says
    assert "learning rate 0 and" in str(_warmup_note(wsd.replace(min_lr_ratio=0.0), 1, 1e-3))
