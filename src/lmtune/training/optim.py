"""Optimizer and learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from lmtune.config.groups import OptimSettings
from lmtune.config.settings import TrainConfig
from lmtune.config.verbosity import BITSANDBYTES_LOGGERS, quiet_calls
from lmtune.errors import UserError
from lmtune.model.modeling import LoadedModel

# Adapters start at zero and need a larger step than full fine-tuning of pretrained weights.
LORA_MIN_DEFAULT_LR = 2e-4
# TRL's default for DPOConfig, CPOConfig (SimPO) and ORPOConfig: preference tuning moves a tuned
# model a little; ten times that for adapters (as 2e-5 and 2e-4 for supervised tuning).
PREFERENCE_DEFAULT_LR = 1e-6


def default_lr(cfg: TrainConfig, loaded: LoadedModel, unit: str) -> tuple[float, str]:
    """The learning rate when --lr is not given, and where it comes from (for the start line).
    ``unit``: the objective's ("pairs" for preference tuning)."""
    preset = loaded.source.startswith("preset ")  # built from a config: trained from scratch
    if unit == "pairs" and not preset:
        if cfg.lora.enabled:
            return 10 * PREFERENCE_DEFAULT_LR, "ten times TRL's preference-tuning default, for LoRA"
        return PREFERENCE_DEFAULT_LR, "TRL's default for preference tuning"
    lr = max(loaded.default_lr, LORA_MIN_DEFAULT_LR) if cfg.lora.enabled else loaded.default_lr
    if preset:
        return lr, "the preset's default"
    return lr, "the default for LoRA" if cfg.lora.enabled else "the default for a pretrained model"


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


def build_optimizer(
    name: str,
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    momentum: float = 0.9,
) -> torch.optim.Optimizer:
    """The optimizer ``name`` over the model's trainable parameters (fp32 master weights always).

    ``adamw`` is fused into one kernel per step where PyTorch supports it (several times faster than
    the per-tensor loop, the same update). The 8-bit variants keep both moments block-quantised to
    one byte each (bitsandbytes); tensors under 4096 elements keep fp32 state, as bitsandbytes
    decides, which costs little.
    """
    groups = param_groups(model, weight_decay)
    params = [p for g in groups for p in g["params"]]  # type: ignore[attr-defined]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum)
    if name in ("adamw8bit", "paged_adamw8bit"):
        if any(hasattr(p, "to_local") for p in params):
            raise UserError(
                f"--optimizer {name} does not work with --strategy fsdp: bitsandbytes' 8-bit update "
                "takes whole tensors, not FSDP2's sharded DTensor parameters; use --strategy ddp "
                "(with --lora or --activation-checkpointing to save memory), or --optimizer adamw"
            )
        bnb_optim = _bitsandbytes_optim(name)
        # Paging moves state between GPU and CPU memory; on the CPU there is nothing to page, and
        # bitsandbytes would warn at the first step that it falls back to the unpaged update.
        paged = name == "paged_adamw8bit" and any(p.device.type == "cuda" for p in params)
        cls = bnb_optim.PagedAdamW8bit if paged else bnb_optim.AdamW8bit
        optimizer: torch.optim.Optimizer = cls(groups, lr=lr, betas=betas, eps=eps)
        return optimizer
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None)


def _bitsandbytes_optim(name: str) -> Any:
    try:
        # On CPU it logs that optional 4-bit kernels are missing; the 8-bit optimizer never uses them.
        with quiet_calls(*BITSANDBYTES_LOGGERS):
            import bitsandbytes.optim as bnb_optim
    except ImportError as e:
        raise UserError(
            f"--optimizer {name} needs bitsandbytes, which is not installed here ({e}); "
            "pip install 'lmtune[memory]' (or bitsandbytes), or use --optimizer adamw"
        ) from None
    return bnb_optim


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup from 0 to 1, then cosine decay to ``min_ratio`` at the end, as
    transformers' ``cosine_with_min_lr`` (the warmup's first step at 0, as every schedule here)."""
    if step < warmup_steps:
        return step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_schedule(
    optimizer: torch.optim.Optimizer,
    *,
    name: str,
    total_steps: int,
    warmup_steps: int,
    min_ratio: float,
    decay_ratio: float,
    lr: float,
    start_step: int = 0,
) -> LambdaLR:
    """The LR schedule ``name`` from ``lr``, positioned at ``start_step``.

    cosine: linear warmup, cosine decay to ``lr * min_ratio``. linear (to 0), constant, and wsd
    (warmup, stable, then the last ``decay_ratio`` of the steps decaying to ``lr * min_ratio``) are
    transformers' own schedules. Every schedule is a function of the step alone, so a resumed run
    rebuilds it from its own settings (a changed ``--lr`` or run length applies from the resume
    step) and gets the same learning rate as an uninterrupted run when nothing changed.
    """
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = lr
    last = start_step - 1
    if name == "cosine":
        return LambdaLR(
            optimizer, lambda s: warmup_cosine(s, total_steps, warmup_steps, min_ratio), last_epoch=last
        )
    # transformers.optimization imports its trainer's helpers, and with them peft and bitsandbytes
    # where installed: only the schedules that need it pay for that (and are kept quiet).
    with quiet_calls(*BITSANDBYTES_LOGGERS):
        from transformers import optimization as hf
    made: Any
    if name == "linear":
        made = hf.get_linear_schedule_with_warmup(  # type: ignore[no-untyped-call]
            optimizer, warmup_steps, total_steps, last_epoch=last
        )
    elif name == "constant":
        made = hf.get_constant_schedule_with_warmup(optimizer, warmup_steps, last_epoch=last)
    else:
        decay = round(decay_ratio * total_steps)
        made = hf.get_wsd_schedule(
            optimizer,
            warmup_steps,
            decay,
            num_training_steps=total_steps,
            min_lr_ratio=min_ratio,
            last_epoch=last,
        )
    return cast(LambdaLR, made)


def optimizer_for(settings: OptimSettings, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer of ``settings`` over ``model``'s trainable parameters, at peak rate ``lr``."""
    return build_optimizer(
        settings.name,
        model,
        lr,
        weight_decay=settings.weight_decay,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
        momentum=settings.momentum,
    )


def set_hyperparameters(optimizer: torch.optim.Optimizer, settings: OptimSettings) -> None:
    """This run's settings over those a loaded optimizer state brought back with it."""
    betas = (settings.adam_beta1, settings.adam_beta2)
    for group, decay in zip(optimizer.param_groups, (settings.weight_decay, 0.0), strict=False):
        group["weight_decay"] = decay
        for key, value in (("betas", betas), ("eps", settings.adam_eps), ("momentum", settings.momentum)):
            if key in group:
                group[key] = value
