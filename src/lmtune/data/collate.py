"""Dynamic padding of a list of examples into one batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmtune.data.dataset import Example
from lmtune.data.tokenize import IGNORE_INDEX


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    example_ids: list[int]  # which examples of the data set, in row order

    def to(self, device: torch.device) -> Batch:
        nb = device.type == "cuda"
        return Batch(
            self.input_ids.to(device, non_blocking=nb),
            self.attention_mask.to(device, non_blocking=nb),
            self.labels.to(device, non_blocking=nb),
            self.example_ids,
        )

    def pin_memory(self) -> Batch:
        return Batch(
            self.input_ids.pin_memory(),
            self.attention_mask.pin_memory(),
            self.labels.pin_memory(),
            self.example_ids,
        )

    def target_tokens(self) -> int:
        """Positions that contribute to the loss after the causal shift."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class Collator:
    """Pads to the longest example of the batch (right padding)."""

    pad_token_id: int

    def __call__(self, examples: Sequence[Example]) -> Batch:
        width = max(len(e.input_ids) for e in examples)
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        for row, (ids, lab, _) in enumerate(examples):
            n = len(ids)
            input_ids[row, :n] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
            attention_mask[row, :n] = 1
            labels[row, :n] = torch.from_numpy(np.asarray(lab, dtype=np.int64))
        # Padding is found from the attention mask, never by token id: with pad == eos a search by
        # id would also mask the real EOS and the model would never learn to stop.
        labels[attention_mask == 0] = IGNORE_INDEX
        return Batch(input_ids, attention_mask, labels, [e.example_id for e in examples])
