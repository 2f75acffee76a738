"""The objective seam in one process: train_step normalises by the objective's own unit, adds its
metric sums over micro-steps and reports them per unit; supervised fine-tuning is the default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lmtune.config.groups import ObjectiveSettings
from lmtune.data.collate import StepCollator
from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.modeling import load_model
from lmtune.model.precision import autocast_context
from lmtune.objectives import objective_for
from lmtune.objectives.base import LossSetup
from lmtune.objectives.sft import SummedLoss, SupervisedObjective
from lmtune.parallel.distributed import read_dist_env
from lmtune.training.optim import build_optimizer, build_schedule
from lmtune.training.step import StepInput, StepOptions, Trainee, train_step
from tests.conftest import tokenized, uneven_texts
from tests.support.sequence_mean import SequenceMeanObjective

ENV = read_dist_env("cpu")


def _step(micro: int, objective: object) -> tuple[float, int, dict[str, float], dict[str, torch.Tensor]]:
    loaded = load_model("tiny", seed=3)
    data = tokenized(uneven_texts(8, seed=9), loaded.tokenizer, max_length=64)
    module = objective.loss_module(loaded.model, LossSetup())  # type: ignore[attr-defined]
    optimizer = build_optimizer(
        "sgd", module, lr=0.5, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8, momentum=0.0
    )
    schedule = build_schedule(
        optimizer,
        name="constant",
        total_steps=1,
        warmup_steps=0,
        min_ratio=1.0,
        decay_ratio=0.1,
        lr=0.5,
        start_step=0,
    )
    micro_batches = StepCollator(loaded.tokenizer.pad_token_id, micro, "pad")([data[i] for i in range(8)])
    options = StepOptions(0.0, lambda: autocast_context("fp32", ENV.device), None, objective)  # type: ignore[arg-type]
    r = train_step(Trainee(module, optimizer, schedule), StepInput(micro_batches), ENV, options)
    weights = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    return r.loss, r.count, r.metrics, weights


def _by_hand() -> tuple[float, float, dict[str, torch.Tensor]]:
    """The objective computed by hand: each example's mean token loss, averaged over the examples,
    and the weights after one SGD step of rate 0.5 on that loss."""
    loaded = load_model("tiny", seed=3)
    data = tokenized(uneven_texts(8, seed=9), loaded.tokenizer, max_length=64)
    means, tokens = [], []
    for i in range(8):
        ids, labels, _ = data[i]
        logits = loaded.model(input_ids=torch.as_tensor(ids)[None]).logits[0].float()
        target = torch.as_tensor(labels)[1:]
        keep = target != IGNORE_INDEX
        means.append(F.cross_entropy(logits[:-1][keep], target[keep]))
        tokens.append(int(keep.sum()))
    loss = torch.stack(means).mean()
    loss.backward()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for p in loaded.model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
    weights = {k: v.detach().clone() for k, v in loaded.model.state_dict().items()}
    return float(loss), sum(tokens) / len(tokens), weights


def test_a_step_is_normalised_by_the_objectives_own_unit() -> None:
    expected_loss, expected_tokens, expected_weights = _by_hand()
    loss, count, metrics, weights = _step(8, SequenceMeanObjective())
    assert count == 8
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert metrics == {"target_tokens": pytest.approx(expected_tokens, rel=1e-9)}
    for k in weights:  # the gradient is the per-sequence mean's, not a per-token one
        torch.testing.assert_close(weights[k], expected_weights[k], rtol=1e-4, atol=1e-6)


def test_accumulation_is_exact_for_any_objective() -> None:
    for objective in (SequenceMeanObjective(), SupervisedObjective()):
        whole = _step(8, objective)
        accumulated = _step(2, objective)  # four micro-steps
        assert accumulated[0] == pytest.approx(whole[0], rel=1e-6)
        assert accumulated[1:3] == whole[1:3]
        for k in whole[3]:
            torch.testing.assert_close(accumulated[3][k], whole[3][k], rtol=1e-5, atol=1e-6)


def test_supervised_fine_tuning_is_the_default_objective(tmp_path: Path) -> None:
    sft = objective_for(ObjectiveSettings())
    assert isinstance(sft, SupervisedObjective) and sft.unit == "target_tokens"
    assert isinstance(sft.loss_module(load_model("tiny", 0).model, LossSetup()), SummedLoss)
    assert sft.report(2.0, {}, 10, "eval_") == {"eval_loss": 2.0, "eval_perplexity": pytest.approx(7.389056)}
