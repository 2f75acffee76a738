"""--precision: the dtypes it means, where it can run, its autocast context and fp16's scaler.

Weights and optimizer state stay fp32 with every choice; bf16 and fp16 are compute dtypes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from lmtune.errors import UserError

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def low_precision_dtype(precision: str) -> torch.dtype | None:
    """The autocast (and FSDP compute) dtype of ``--precision``; None for fp32."""
    return None if precision == "fp32" else DTYPES[precision]


def check_device(precision: str, device: torch.device) -> None:
    if precision == "fp16" and device.type != "cuda":
        raise UserError(
            "--precision fp16 needs a CUDA GPU (its gradient scaler is for GPUs); use bf16 on CPU"
        )


def autocast_context(precision: str, device: torch.device) -> AbstractContextManager[object]:
    dtype = low_precision_dtype(precision)
    return nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def grad_scaler(precision: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (its range is too narrow for small gradients); None otherwise."""
    return torch.amp.GradScaler("cuda") if precision == "fp16" else None
