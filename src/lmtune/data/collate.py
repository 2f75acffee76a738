"""Dynamic padding of a list of examples into one batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from lmtune.data.batch import Batch
from lmtune.data.dataset import Example
from lmtune.data.packing import PackedCollator, pack_bins
from lmtune.data.tokenize import IGNORE_INDEX

T = TypeVar("T")


PACK_ABOVE_PADDING = 0.10


@dataclass(frozen=True)
class StepCollator:
    """Turns one rank's examples of an optimizer step into its micro-batches.

    ``pad``: micro-batches in sampler order, padded to their longest example. ``group``: sorted by
    length first, so examples of similar length share a micro-batch and little is padded.
    ``pack``: several examples per row up to ``max_length`` (see :mod:`lmtune.data.packing`), then
    ``micro_batch_size`` rows per forward. ``auto``: pack a step only when grouping would still
    leave more than ``PACK_ABOVE_PADDING`` of padding; examples of nearly equal length run faster
    unpacked, without the block mask. Every mode trains on the same examples with the same loss;
    they differ only in how much padding the model computes on.
    """

    pad_token_id: int
    micro_batch_size: int
    mode: str = "pad"
    max_length: int = 0

    def __call__(self, examples: Sequence[Example]) -> list[Batch]:
        mode = self.mode
        if mode == "auto":
            lengths = sorted((len(e.input_ids) for e in examples), reverse=True)
            padded = sum(chunk[0] * len(chunk) for chunk in chunks(lengths, self.micro_batch_size))
            mode = "pack" if padded > (1 + PACK_ABOVE_PADDING) * sum(lengths) else "group"
        if mode == "pack":
            rows = pack_bins([len(e.input_ids) for e in examples], self.max_length)
            packed = [[examples[i] for i in row] for row in rows]
            collate_rows = PackedCollator(self.pad_token_id)
            return [collate_rows(chunk) for chunk in chunks(packed, self.micro_batch_size)]
        ordered = list(examples)
        if mode == "group":
            ordered.sort(key=lambda e: -len(e.input_ids))
        collate = Collator(self.pad_token_id)
        return [collate(chunk) for chunk in chunks(ordered, self.micro_batch_size)]


def chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    """Consecutive slices of ``size`` items (the last may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


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
        return Batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            example_ids=[e.example_id for e in examples],
        )
