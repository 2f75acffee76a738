"""Runs that fail from their setup, not from lmtune's code, said in a sentence: memory that runs out
(what was being computed, what the allocator asked for, what to lower) and a disk that fills (what
the run resumes from). The allocator's traceback names a kernel's line; the user needs the flags."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from lmtune.checkpoint.resume import resumable_when_full
from lmtune.config.advice import memory_advice
from lmtune.config.settings import TrainConfig
from lmtune.data.batch import Batch
from lmtune.errors import UserError


class OutOfMemory(UserError):
    """Memory ran out in a training step; ``where`` says in which part of it and on what batch."""

    def __init__(self, where: str, asked: str, batch_examples: int):
        super().__init__(f"out of memory {where}{asked}")
        self.batch_examples = batch_examples


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: CUDA's (and other accelerators') OutOfMemoryError, the CPU
    allocator's "can't allocate memory", cuBLAS failing to get its workspace."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text
    )


def what_it_asked(e: BaseException) -> str:
    """The allocator's own figures, in a clause (empty when it gave none)."""
    text = str(e)
    cpu = re.search(r"tried to allocate (\d+) bytes", text)
    if cpu is not None:
        return f": it asked for {int(cpu.group(1)) / 2**20:,.0f} MiB more"
    gpu = re.search(r"Tried to allocate ([\d.]+ [KMGT]?i?B)", text)
    if gpu is None:
        return ""
    free = re.search(r"total capacity of ([\d.]+ [KMGT]?i?B) of which ([\d.]+ [KMGT]?i?B) is free", text)
    left = f" with {free.group(2)} of {free.group(1)} free" if free is not None else ""
    return f": it asked for {gpu.group(1)} more{left}"


@contextmanager
def naming_the_step(where: Callable[[], str], batch: Batch | None = None) -> Iterator[None]:
    """An allocation that fails inside: :class:`OutOfMemory`, saying ``where()`` it happened."""
    try:
        yield
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        examples = len(batch.example_ids) if batch is not None else 0
        raise OutOfMemory(where(), what_it_asked(e), examples) from None


def batch_words(batch: Batch) -> str:
    """A micro-batch as its memory sees it: examples, rows and their width."""
    rows, width = batch.input_ids.shape
    shape = f"{rows} rows of {width:,} positions"
    examples = len(batch.example_ids)
    return shape if examples == rows else f"{examples} examples packed in {shape}"


def what_to_lower(cfg: TrainConfig, device: torch.device, batched: bool) -> str:
    """The settings that lower this run's memory (``batched``: what ran out held several examples)."""
    return memory_advice(cfg, on_gpu=device.type == "cuda", batched=batched)


@contextmanager
def said_plainly(cfg: TrainConfig, device: torch.device) -> Iterator[None]:
    """A run's memory that runs out, or its disk that fills, as one sentence (exit 2)."""
    with resumable_when_full(Path(cfg.checkpoint.output_dir)):
        try:
            yield
        except OutOfMemory as e:
            raise UserError(f"{e}{what_to_lower(cfg, device, e.batch_examples > 1)}") from None
        except RuntimeError as e:  # outside a step: loading, evaluating, generating
            if not is_out_of_memory(e):
                raise
            outside = "outside a training step (loading, reference log-probs, evaluating, sampling)"
            raise UserError(
                f"out of memory on {device} {outside}{what_it_asked(e)}{what_to_lower(cfg, device, True)}"
            ) from None
