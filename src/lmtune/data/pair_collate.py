"""Micro-batches of preference pairs: both answers of a pair in one forward pass, after one copy of
their prompt.

A pair runs as one sequence, its prompt, chosen and rejected tokens back to back, as it is stored.
Position ids restart after the prompt for the rejected answer, and attention keeps the answers apart
(:func:`lmtune.model.masks.pair_causal_mask`, or per example in lmtune.model.attention): the rejected
tokens see the prompt and themselves, never the chosen ones. Each answer's tokens are then computed
exactly as if it followed its own copy of the prompt, and the prompt is computed once.

``segment_ids`` carry the layout: ``3 k``, ``3 k + 1``, ``3 k + 2`` for the prompt, chosen and
rejected tokens of a row's ``k``-th pair, -1 for padding. Rows hold one pair each, or several whole
pairs (packed); ``Batch.reference`` has a row per pair in row order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lmtune.data.batch import Batch
from lmtune.data.collate import PACK_ABOVE_PADDING, chunks
from lmtune.data.dataset import Example, PairExample
from lmtune.data.packing import pack_bins
from lmtune.data.tokenize import IGNORE_INDEX

PROMPT, CHOSEN, REJECTED = 0, 1, 2  # a pair's parts, as segment_ids % 3 tells them


def sequences(pair: Example) -> tuple[Example, Example]:
    """A pair as two sequences (prompt + chosen, prompt + rejected), each an Example of the pair's
    id: what the shared layout computes, spelled out."""
    assert isinstance(pair, PairExample), "not a preference pair"
    p, c = pair.parts
    ids, labels = pair.input_ids, pair.labels
    rest = np.r_[0:p, p + c : len(ids)]
    return Example(ids[: p + c], labels[: p + c], pair.example_id), Example(
        ids[rest], labels[rest], pair.example_id
    )


def cost(pair: Example) -> int:
    """Tokens the pair's forward runs: its prompt once, both answers."""
    return len(pair.input_ids)


def _layout(pair: PairExample, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, position ids, segment ids) of the ``k``-th pair of a row."""
    p, c = pair.parts
    r = len(pair.input_ids) - p - c
    positions = np.concatenate([np.arange(p + c), np.arange(p, p + r)])
    segments = 3 * k + np.repeat([PROMPT, CHOSEN, REJECTED], [p, c, r])
    labels = pair.labels.copy()
    labels[0] = IGNORE_INDEX  # nothing precedes a pair's first token
    if p == 0 and r:  # nor the rejected answer's first one without a prompt
        labels[c] = IGNORE_INDEX
    return labels, positions, segments


def _reference(pairs: Sequence[PairExample]) -> torch.Tensor:
    """``[pairs, 2]`` float64: the precomputed reference log-probs, zeros where there are none."""
    values = [p.reference or (0.0, 0.0) for p in pairs]
    return torch.tensor(values, dtype=torch.float64).reshape(len(pairs), 2)


@dataclass(frozen=True)
class PairCollator:
    """Rows of whole pairs (one pair per row unless packed) to one micro-batch."""

    pad_token_id: int

    def __call__(self, rows: Sequence[Example] | Sequence[list[Example]]) -> Batch:
        grouped = [list(r) if isinstance(r, list) else [r] for r in rows]
        pairs = [p for row in grouped for p in row]
        assert all(isinstance(p, PairExample) for p in pairs), "not preference pairs"
        width = max(sum(len(p.input_ids) for p in row) for row in grouped)
        shape = (len(grouped), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        segment_ids = torch.full(shape, -1, dtype=torch.long)
        for i, row in enumerate(grouped):
            at = 0
            for k, pair in enumerate(row):
                assert isinstance(pair, PairExample)
                n = len(pair.input_ids)
                label, positions, segments = _layout(pair, k)
                input_ids[i, at : at + n] = torch.from_numpy(np.asarray(pair.input_ids, dtype=np.int64))
                labels[i, at : at + n] = torch.from_numpy(label)
                position_ids[i, at : at + n] = torch.from_numpy(positions)
                segment_ids[i, at : at + n] = torch.from_numpy(segments)
                attention_mask[i, at : at + n] = 1
                at += n
        return Batch(
            input_ids=input_ids,
            attention_mask=attention_mask,
            labels=labels,
            example_ids=[p.example_id for p in pairs],
            position_ids=position_ids,
            segment_ids=segment_ids,
            reference=_reference(pairs),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class PairStepCollator:
    """One rank's pairs of an optimizer step to its micro-batches of ``micro_batch_size`` pairs
    (the modes of :class:`lmtune.data.collate.StepCollator`): ``pad`` in sampler order, ``group``
    sorted by length first, ``pack`` whole pairs into rows of up to ``2 * max_length`` tokens,
    ``micro_batch_size`` rows per forward; ``auto`` packs a step only where grouping would leave
    over ``PACK_ABOVE_PADDING`` of padding."""

    pad_token_id: int
    micro_batch_size: int
    mode: str = "pad"
    max_length: int = 0

    def __call__(self, pairs: Sequence[Example]) -> list[Batch]:
        mode = self.mode
        if mode == "auto":
            lengths = sorted((cost(p) for p in pairs), reverse=True)
            padded = sum(chunk[0] * len(chunk) for chunk in chunks(lengths, self.micro_batch_size))
            mode = "pack" if padded > (1 + PACK_ABOVE_PADDING) * sum(lengths) else "group"
        collate = PairCollator(self.pad_token_id)
        if mode == "pack":
            rows = pack_bins([cost(p) for p in pairs], 2 * self.max_length)
            packed = [[pairs[i] for i in row] for row in rows]
            return [collate(chunk) for chunk in chunks(packed, self.micro_batch_size)]
        ordered = list(pairs)
        if mode == "group":
            ordered.sort(key=lambda p: -cost(p))
        return [collate(chunk) for chunk in chunks(ordered, self.micro_batch_size)]
