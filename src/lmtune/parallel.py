"""Wrap the model for the chosen strategy, and the no-sync context for gradient accumulation."""

from __future__ import annotations

import inspect
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lmtune.distributed import DistEnv
from lmtune.errors import UserError


def resolve_strategy(strategy: str, env: DistEnv) -> str:
    """Turn ``auto`` into a concrete strategy and reject ones that cannot run here."""
    if strategy == "auto":
        return "ddp" if env.distributed else "single"
    if strategy == "ddp" and not env.distributed:
        return "single"  # DDP over one process is the single-process run, without the wrapper cost
    if strategy in ("single", "dp") and env.distributed:
        raise UserError(
            f"--strategy {strategy} runs in one process, but {env.world_size} were launched; "
            "use --strategy ddp (or auto)"
        )
    if strategy == "dp":
        if env.device.type != "cuda":
            raise UserError(
                "--strategy dp (nn.DataParallel) needs CUDA GPUs and none is in use here; "
                "use --strategy single on CPU"
            )
        if torch.cuda.device_count() < 2:
            raise UserError(
                "--strategy dp needs at least 2 visible GPUs "
                f"(CUDA_VISIBLE_DEVICES shows {torch.cuda.device_count()})"
            )
    return strategy


def wrap_model(module: nn.Module, strategy: str, env: DistEnv) -> nn.Module:
    """Place the module on this rank's device and wrap it for ``strategy``."""
    module = module.to(env.device)
    if strategy == "dp":
        # Logical ids: with CUDA_VISIBLE_DEVICES=1,2 these are physical GPUs 1 and 2.
        return nn.DataParallel(module, device_ids=list(range(torch.cuda.device_count())))
    if strategy == "ddp":
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        # Rotary-embedding buffers are not state to synchronise; broadcasting them every forward
        # would cost a collective per micro-step (newer PyTorch names the switch differently).
        no_buffer_sync: dict[str, Any] = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else {"broadcast_buffers": False}
        )
        return DistributedDataParallel(module, device_ids=device_ids, **no_buffer_sync)
    return module


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DP/DDP wrapper (or the module itself)."""
    if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
        inner: nn.Module = model.module
        return inner
    return model


def no_sync(model: nn.Module, sync: bool) -> AbstractContextManager[object]:
    """Skip the gradient all-reduce on a micro-step that is not the last of its optimizer step."""
    if not sync and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return nullcontext()
