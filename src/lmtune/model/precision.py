"""--precision: the dtypes it means, where it can run, its autocast context and fp16's scaler.

Weights and optimizer state stay fp32 with every choice; bf16 and fp16 are compute dtypes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch

from lmtune.errors import SettingError
from lmtune.model.products import Fp32Products

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def low_precision_dtype(precision: str) -> torch.dtype | None:
    """The autocast (and FSDP compute) dtype of ``--precision``; None for fp32."""
    return None if precision == "fp32" else DTYPES[precision]


def check_device(precision: str, device: torch.device, training: bool = True) -> None:
    """fp16 is a GPU's precision: training's gradient scaler is for GPUs, and lmtune evaluates as
    it trains."""
    if precision == "fp16" and device.type != "cuda":
        why = " (its gradient scaler is for GPUs)" if training else ""
        # A SettingError: a --config file's value is named by its line.
        raise SettingError("precision", "--precision", f"fp16 needs a CUDA GPU{why}; use bf16 on CPU")


def autocast_context(
    precision: str, device: torch.device, fp32_products: bool = False
) -> AbstractContextManager[object]:
    """Autocast of ``precision`` (none under fp32); with ``fp32_products`` (a CPU bf16 run, see
    lmtune.model.products) its matrix products in fp32 of bf16 operands."""
    dtype = low_precision_dtype(precision)
    if dtype is None:
        return nullcontext()
    if fp32_products:
        return _WithFp32Products(device, dtype)
    return torch.autocast(device_type=device.type, dtype=dtype)


class _WithFp32Products:
    """Autocast and Fp32Products together; reusable, like torch.autocast (evaluation enters one
    context for every batch)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.stack = ExitStack()

    def __enter__(self) -> None:
        self.stack.enter_context(torch.autocast(device_type=self.device.type, dtype=self.dtype))
        self.stack.enter_context(Fp32Products())

    def __exit__(self, *exc: Any) -> bool | None:
        return self.stack.__exit__(*exc)


def grad_scaler(precision: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (its range is too narrow for small gradients); None otherwise."""
    return torch.amp.GradScaler("cuda") if precision == "fp16" else None
