"""Model FLOPs and the peak this device really reaches, for MFU (model FLOPs utilisation)."""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def low_precision_dtype(precision: str) -> torch.dtype | None:
    """The autocast (and FSDP compute) dtype of ``--precision``; None for fp32."""
    return None if precision == "fp32" else DTYPES[precision]


def _synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so wall time measures it (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token: 6 per weight, plus the attention scores.

    6N counts the matrix products with the weights (2 forward, 4 backward); attention adds
    ``12 * layers * hidden * seq_len`` for QK^T and the weighted sum of V, which scale with the
    sequence length (PaLM, appendix B). Embedding lookups do no products and are left out.
    """
    config: Any = getattr(model, "config", None)
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    skip = {id(p) for p in embeddings.parameters()} if isinstance(embeddings, nn.Module) else set()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    if tied and isinstance(embeddings, nn.Module):  # the tied output projection still multiplies
        weights += sum(p.numel() for p in embeddings.parameters())
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return 6.0 * weights + 12.0 * layers * hidden * seq_len


def measure_peak_flops(device: torch.device, precision: str, seconds: float = 0.5) -> float:
    """Matrix-multiply FLOP/s this device reaches at ``precision``, measured, never looked up.

    Square products large enough to be compute-bound, in the layout a linear layer uses (``x @ W.T``):
    on CPUs without native bf16 support PyTorch's plain ``a @ b`` takes a path 20x slower than the
    one linear layers take, which made MFU read 500%. The best of several timed batches.
    """
    dtype = DTYPES[precision]
    size = 4096 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(2):  # warm-up: kernels selected, caches filled
        torch.nn.functional.linear(a, b)
    _synchronize(device)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        reps = 4
        start = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(a, b)
        _synchronize(device)
        best = max(best, reps * 2 * size**3 / (time.perf_counter() - start))
    return best


class PhaseTimer:
    """Wall time per phase of a step (data, forward, backward, optimizer), for `lmtune bench`.

    The device is synchronised at every boundary, so GPU work counts in the phase that launched it;
    DDP's all-reduce overlaps the backward pass, so the part it does not hide shows in ``backward``.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


def phase(timer: PhaseTimer | None, name: str) -> AbstractContextManager[None]:
    """``timer.phase(name)``, or nothing when the run is not timed."""
    return timer.phase(name) if timer is not None else nullcontext()


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
