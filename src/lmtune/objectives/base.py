"""The seam between the training loop and what it optimises.

An :class:`Objective` says how a micro-batch becomes a loss and what the loss is normalised by:

- its loss module (the one module DataParallel, DDP and FSDP2 wrap) returns, per micro-batch, a
  vector ``[loss_sum, *metric_sums]``: the loss summed over the objective's units (target tokens
  for supervised fine-tuning, preference pairs for DPO) and named sums (reward margins, ...);
- ``count(batch)`` is how many units a micro-batch holds, counted before its forward pass.

``train_step`` adds the counts of every micro-batch on every rank and divides each summed loss by
that global count, so the gradient of N ranks x GA k equals one process's on the whole batch for
every objective; metric sums are added over micro-steps and ranks and reported per unit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from lmtune.data.batch import Batch


@dataclass(frozen=True)
class LossSetup:
    """How a loss module runs the model (the same for every objective)."""

    varlen: bool = False  # per-example attention on flattened rows (lmtune.model.attention)
    loss_chunk: int = 0  # tokens per chunk of the output layer; 0: full logits
    fp32_products: bool = False  # a CPU bf16 run's products in fp32 (lmtune.model.products)
    bucket_tokens: bool = False  # token counts bucketed for oneDNN's bf16 kernels (same module)
    neftune_alpha: float = 0.0  # NEFTune's noise on the input embeddings (lmtune.model.neftune); 0: none


class Objective(Protocol):
    """A training objective; see the module docstring."""

    name: str  # as --objective names it
    unit: str  # what the loss is normalised by, as metrics rows name its count ("target_tokens")
    metric_names: tuple[str, ...]  # the sums the loss module returns after the loss

    def count(self, batch: Batch) -> int:
        """The units of ``batch`` (its summed loss is divided by the global count of them)."""
        ...

    def loss_module(self, model: nn.Module, setup: LossSetup) -> nn.Module:
        """The module strategies wrap: ``forward(*batch.model_inputs())`` returns
        ``[loss_sum, *metric_sums]``; it holds the Hugging Face model as ``.model``."""
        ...

    def step_collator(self, pad_token_id: int, micro_batch_size: int, mode: str, max_length: int) -> Any:
        """Turns one rank's examples of an optimizer step into its micro-batches."""
        ...

    def eval_collator(self, pad_token_id: int) -> Any:
        """Turns a list of examples into one evaluation micro-batch."""
        ...

    def report(self, loss: float, means: dict[str, float], count: int, prefix: str) -> dict[str, float]:
        """The metrics of a step or an evaluation (``prefix`` "" or "eval_"): the loss per unit,
        and what the objective derives from its metrics per unit (perplexity, reward accuracy...)."""
        ...


def split_output(output: torch.Tensor, metric_count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss module's output as (loss sum, metric sums): DataParallel gathers one vector per
    replica end to end, so the replicas' vectors are added first."""
    summed = output.reshape(-1, 1 + metric_count).sum(0)
    return summed[0], summed[1:]


def named(names: Sequence[str], values: Sequence[float]) -> dict[str, float]:
    return dict(zip(names, values, strict=True))
