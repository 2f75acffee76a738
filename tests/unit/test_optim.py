from __future__ import annotations

import itertools

import pytest
import torch

from lmtune.optim import build_adamw, build_schedule, param_groups, warmup_cosine


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    lrs = [warmup_cosine(s, total_steps=20, warmup_steps=4, min_ratio=0.1) for s in range(20)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))
    assert warmup_cosine(20, 20, 4, 0.1) == pytest.approx(0.1)


def test_scheduler_follows_the_function() -> None:
    model = torch.nn.Linear(3, 3)
    opt = build_adamw(model, lr=1.0, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8)
    sched = build_schedule(opt, total_steps=10, warmup_ratio=0.2, min_ratio=0.0)
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
