"""Batch: the tensors of one micro-batch (padded or packed rows) and which examples they hold."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmtune.data.tokenize import IGNORE_INDEX


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    example_ids: list[int]  # which examples of the data set, in row order
    # Packed rows only: positions restart at every example; segments tell the examples apart.
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    # Preference pairs (lmtune.data.pair_collate): the rows' sequences, in row order, are each
    # pair's chosen then rejected answer after its prompt; ``[pairs, 2]`` reference log-probs of
    # them (zeros where the objective needs none, or computes them in the step).
    reference: torch.Tensor | None = None

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return Batch(
            input_ids=fn(self.input_ids),
            attention_mask=fn(self.attention_mask),
            labels=fn(self.labels),
            example_ids=self.example_ids,
            position_ids=opt(self.position_ids),
            segment_ids=opt(self.segment_ids),
            reference=opt(self.reference),
        )

    def to(self, device: torch.device) -> Batch:
        return self._map(lambda t: t.to(device, non_blocking=device.type == "cuda"))

    def pin_memory(self) -> Batch:
        return self._map(lambda t: t.pin_memory())

    def model_inputs(self) -> tuple[torch.Tensor | None, ...]:
        """Positional arguments of the loss module (DataParallel scatters each along dim 0)."""
        if self.reference is not None:  # position and segment ids may be None
            return (
                self.input_ids,
                self.attention_mask,
                self.labels,
                self.position_ids,
                self.segment_ids,
                self.reference,
            )
        if self.segment_ids is None:
            return self.input_ids, self.attention_mask, self.labels
        assert self.position_ids is not None
        return self.input_ids, self.attention_mask, self.labels, self.position_ids, self.segment_ids

    def token_examples(self) -> torch.Tensor:
        """Per token of the rows, the index of its example in ``example_ids`` (-1 on padding)."""
        real = self.attention_mask.bool()
        if self.segment_ids is None:  # one example per row
            index = torch.arange(real.size(0), device=real.device)[:, None].expand_as(real)
        else:  # packed: a row's segments 0, 1, ... are its examples in order
            per_row = self.segment_ids.amax(dim=1) + 1
            index = (torch.cumsum(per_row, 0) - per_row)[:, None] + self.segment_ids
        return torch.where(real, index, -1)

    @property
    def pairs(self) -> int:
        """Preference pairs in the batch (0 for single examples)."""
        return 0 if self.reference is None else int(self.reference.size(0))

    def target_tokens(self) -> int:
        """Positions that contribute to the loss after the causal shift."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def idle_batch() -> Batch:
    """One token with no target: a forward (and backward) that joins FSDP's collectives on a rank
    with fewer micro-batches than the others, and adds nothing to the loss or the gradients."""
    one = torch.ones(1, 1, dtype=torch.long)
    return Batch(
        input_ids=one, attention_mask=one.clone(), labels=torch.full((1, 1), IGNORE_INDEX), example_ids=[]
    )
