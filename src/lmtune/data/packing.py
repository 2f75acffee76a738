"""Sequence packing: several examples per row, with no attention across their boundaries.

Each row carries per-example position ids (restarting at 0) and segment ids; the model sees a
block-diagonal causal mask built from the segment ids, so an example attends only to itself. The
first token of every example gets no label, as in an unpacked row where position 0 is never a
target: the loss and the target-token count are exactly those of the examples unpacked.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmtune.data.batch import Batch
from lmtune.data.dataset import Example
from lmtune.data.tokenize import IGNORE_INDEX


def pack_bins(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Group example indices into rows of at most ``max_length`` tokens (best-fit decreasing).

    Deterministic: the same lengths give the same rows, whatever the world size.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        need = int(lengths[i])
        at = bisect.bisect_left(free, (need, -1))
        if at < len(free):
            room, chosen = free.pop(at)
            bins[chosen].append(i)
            bisect.insort(free, (room - need, chosen))
        else:
            bins.append([i])
            bisect.insort(free, (max_length - need, len(bins) - 1))
    for row in bins:
        row.sort()
    return bins


@dataclass(frozen=True)
class PackedCollator:
    """Concatenates each row's examples; pads rows to the longest with a segment of their own."""

    pad_token_id: int

    def __call__(self, rows: Sequence[list[Example]]) -> Batch:
        width = max(sum(len(e.input_ids) for e in row) for row in rows)
        shape = (len(rows), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        segment_ids = torch.full(shape, -1, dtype=torch.long)  # padding: one segment of its own
        example_ids: list[int] = []
        for r, row in enumerate(rows):
            at = 0
            for s, (ids, lab, example_id) in enumerate(row):
                n = len(ids)
                input_ids[r, at : at + n] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
                labels[r, at : at + n] = torch.from_numpy(np.asarray(lab, dtype=np.int64))
                labels[r, at] = IGNORE_INDEX  # nothing of this example precedes its first token
                attention_mask[r, at : at + n] = 1
                position_ids[r, at : at + n] = torch.arange(n)
                segment_ids[r, at : at + n] = s
                example_ids.append(example_id)
                at += n
            position_ids[r, at:] = torch.arange(width - at)
        return Batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            example_ids=example_ids,
            position_ids=position_ids,
            segment_ids=segment_ids,
        )
