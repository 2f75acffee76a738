"""Micro-batches of preference pairs: both answers of a pair in one forward pass.

Each pair becomes two sequences, its prompt followed by the chosen answer and its prompt followed
by the rejected one. In a batch the sequences come, in row order (and within a packed row, in
segment order), as chosen then rejected of each pair in turn, and ``Batch.reference`` holds a row
per pair in that same order: the loss module tells the sequences apart by their order alone.
Padded rows hold one sequence each; packed rows keep a pair's two sequences side by side in one
row, with per-example attention, so no padding comes between them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmtune.data.batch import Batch
from lmtune.data.collate import PACK_ABOVE_PADDING, Collator, chunks
from lmtune.data.dataset import Example, PairExample
from lmtune.data.packing import PackedCollator, pack_bins


def sequences(pair: Example) -> tuple[Example, Example]:
    """A pair as its two sequences (prompt + chosen, prompt + rejected), each an Example of the pair's id."""
    assert isinstance(pair, PairExample), "not a preference pair"
    p, c = pair.parts
    ids, labels = pair.input_ids, pair.labels
    chosen = Example(ids[: p + c], labels[: p + c], pair.example_id)
    rejected = Example(
        np.concatenate([ids[:p], ids[p + c :]]),
        np.concatenate([labels[:p], labels[p + c :]]),
        pair.example_id,
    )
    return chosen, rejected


def cost(pair: Example) -> int:
    """Tokens the pair's forward runs: its prompt twice, both answers once."""
    assert isinstance(pair, PairExample)
    return len(pair.input_ids) + pair.parts[0]


def _reference(pairs: Sequence[Example]) -> torch.Tensor:
    """``[pairs, 2]`` float64: the precomputed reference log-probs, zeros where there are none."""
    values = [(p.reference if isinstance(p, PairExample) else None) or (0.0, 0.0) for p in pairs]
    return torch.tensor(values, dtype=torch.float64).reshape(len(pairs), 2)


@dataclass(frozen=True)
class PairCollator:
    """Pairs to one micro-batch of padded rows: chosen, rejected, chosen, rejected, ..."""

    pad_token_id: int

    def __call__(self, pairs: Sequence[Example]) -> Batch:
        rows = [s for pair in pairs for s in sequences(pair)]
        batch = Collator(self.pad_token_id)(rows)
        batch.example_ids = [p.example_id for p in pairs]
        batch.reference = _reference(pairs)
        return batch


@dataclass(frozen=True)
class PackedPairCollator:
    """Rows of whole pairs to one micro-batch of packed rows (two segments per pair)."""

    pad_token_id: int

    def __call__(self, rows: Sequence[list[Example]]) -> Batch:
        batch = PackedCollator(self.pad_token_id)(
            [[s for pair in row for s in sequences(pair)] for row in rows]
        )
        ordered = [pair for row in rows for pair in row]
        batch.example_ids = [p.example_id for p in ordered]
        batch.reference = _reference(ordered)
        return batch


@dataclass(frozen=True)
class PairStepCollator:
    """One rank's pairs of an optimizer step to its micro-batches of ``micro_batch_size`` pairs
    (the modes of :class:`lmtune.data.collate.StepCollator`): ``pad`` in sampler order, ``group``
    sorted by cost first, ``pack`` whole pairs into rows of up to twice ``max_length`` (each of
    their sequences fits ``max_length``), ``micro_batch_size`` rows per forward; ``auto`` packs a
    step only where grouping would leave over ``PACK_ABOVE_PADDING`` of padding."""

    pad_token_id: int
    micro_batch_size: int
    mode: str = "pad"
    max_length: int = 0

    def __call__(self, pairs: Sequence[Example]) -> list[Batch]:
        mode = self.mode
        if mode == "auto":
            ordered = sorted(pairs, key=lambda p: -cost(p))
            padded = sum(
                2 * len(chunk) * max(len(s.input_ids) for p in chunk for s in sequences(p))
                for chunk in chunks(ordered, self.micro_batch_size)
            )
            mode = "pack" if padded > (1 + PACK_ABOVE_PADDING) * sum(cost(p) for p in pairs) else "group"
        if mode == "pack":
            rows = pack_bins([cost(p) for p in pairs], 2 * self.max_length)
            packed = [[pairs[i] for i in row] for row in rows]
            collate_rows = PackedPairCollator(self.pad_token_id)
            return [collate_rows(chunk) for chunk in chunks(packed, self.micro_batch_size)]
        ordered = list(pairs)
        if mode == "group":
            ordered.sort(key=lambda p: -cost(p))
        collate = PairCollator(self.pad_token_id)
        return [collate(chunk) for chunk in chunks(ordered, self.micro_batch_size)]
