"""Supervised fine-tuning: next-token cross-entropy on the trained positions, normalised by the
global number of target tokens (after the causal shift, over all micro-steps and ranks)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from lmtune.data.batch import Batch
from lmtune.data.collate import Collator, StepCollator
from lmtune.model.loss import LossModule
from lmtune.objectives.base import LossSetup


class SummedLoss(LossModule):
    """The summed next-token loss of a micro-batch, shape ``[1]``."""

    def loss_output(self, labels: torch.Tensor, segments: Any, inputs: dict[str, Any]) -> torch.Tensor:
        return torch.stack([self.token_loss_sum(labels, inputs)])  # not a view: FSDP2 hooks the output


class SupervisedObjective:
    """``--objective sft``: see the module docstring."""

    name = "sft"
    unit = "target_tokens"
    metric_names: tuple[str, ...] = ()

    def count(self, batch: Batch) -> int:
        return batch.target_tokens()

    def loss_module(self, model: nn.Module, setup: LossSetup) -> nn.Module:
        return SummedLoss(
            model,
            setup.varlen,
            setup.loss_chunk,
            setup.fp32_products,
            setup.bucket_tokens,
            setup.neftune_alpha,
        )

    def step_collator(self, pad_token_id: int, micro_batch_size: int, mode: str, max_length: int) -> Any:
        return StepCollator(
            pad_token_id=pad_token_id, micro_batch_size=micro_batch_size, mode=mode, max_length=max_length
        )

    def eval_collator(self, pad_token_id: int) -> Any:
        return Collator(pad_token_id)

    def report(self, loss: float, means: dict[str, float], count: int, prefix: str) -> dict[str, float]:
        if not prefix:
            return {"loss": loss}
        return {f"{prefix}loss": loss, f"{prefix}perplexity": math.exp(min(loss, 700.0))}
