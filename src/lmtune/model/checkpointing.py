"""Per-block activation checkpointing: memory for recomputation in backward."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from lmtune.errors import UserError
from lmtune.model.products import Fp32Products


def checkpoint_activations(model: torch.nn.Module, name: str, fp32_products: bool = False) -> None:
    """Per-block activation checkpointing, non-reentrant: the reentrant variant runs backward
    hooks twice and DDP then sees parameters "marked ready twice"."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"--activation-checkpointing: {name} does not support gradient checkpointing")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if fp32_products:
        # The recomputation in backward runs outside the step's context: the checkpoint restores
        # autocast, not the products' mode, and a block recomputed with PyTorch's bf16 kernels
        # saves other tensors than its forward did (CheckpointError).
        kwargs["context_fn"] = _recompute_with_fp32_products
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def _recompute_with_fp32_products() -> tuple[AbstractContextManager[object], AbstractContextManager[object]]:
    """torch.utils.checkpoint's context_fn: (around the forward, around the recomputation)."""
    return nullcontext(), Fp32Products()
