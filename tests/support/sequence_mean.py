"""A second training objective for the tests, to prove the objective seam: each example's loss is
the mean over its own target tokens, and a step's loss is normalised by the global number of
examples (a per-sequence mean), not of tokens. It also returns a metric sum (each example's
target tokens), which the loop must add over micro-steps and ranks and report per example."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmtune.data.batch import Batch
from lmtune.data.collate import Collator, StepCollator
from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.loss import LossModule
from lmtune.objectives.base import LossSetup


class SequenceMeanLoss(LossModule):
    """``[sum over rows of each row's mean token loss, sum over rows of its target tokens]``; every
    row is one example (the objective's collators never pack)."""

    def loss_output(self, labels: torch.Tensor, segments: Any, inputs: dict[str, Any]) -> torch.Tensor:
        assert segments is None, "one example per row"
        logits = self.model(**inputs, use_cache=False).logits.float()
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        ).reshape(targets.shape)
        counts = (targets != IGNORE_INDEX).sum(1)
        trained = counts > 0
        means = per_token.sum(1)[trained] / counts[trained]
        return torch.stack([means.sum(), counts.sum().to(means.dtype)])


class SequenceMeanObjective:
    name = "sequence_mean"
    unit = "sequences"
    metric_names = ("target_tokens",)

    def count(self, batch: Batch) -> int:
        return int(((batch.labels[:, 1:] != IGNORE_INDEX).sum(1) > 0).sum())

    def loss_module(self, model: nn.Module, setup: LossSetup) -> nn.Module:
        return SequenceMeanLoss(model)

    def step_collator(self, pad_token_id: int, micro_batch_size: int, mode: str, max_length: int) -> Any:
        return StepCollator(pad_token_id=pad_token_id, micro_batch_size=micro_batch_size, mode="pad")

    def eval_collator(self, pad_token_id: int) -> Any:
        return Collator(pad_token_id)

    def report(self, loss: float, means: dict[str, float], count: int, prefix: str) -> dict[str, float]:
        return {f"{prefix}loss": loss, f"{prefix}tokens_per_sequence": means["target_tokens"]}
