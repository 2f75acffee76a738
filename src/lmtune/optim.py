"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    """Weight decay on matrices only: decaying biases and norm gains pulls them to zero for nothing."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float
) -> torch.optim.AdamW:
    """AdamW, fused into one kernel per step where PyTorch supports it (CPU and CUDA, float params).

    The fused step is several times faster than the per-tensor loop, and computes the same update.
    """
    groups = param_groups(model, weight_decay)
    params = [p for g in groups for p in g["params"]]  # type: ignore[attr-defined]
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup from ~0 to 1, then cosine decay to ``min_ratio`` at the end."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_schedule(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, min_ratio: float
) -> LambdaLR:
    warmup = round(warmup_ratio * total_steps)
    return LambdaLR(optimizer, lambda s: warmup_cosine(s, total_steps, warmup, min_ratio))
