"""Tokenize a data set once, into flat arrays that batches slice without re-tokenizing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

IGNORE_INDEX = -100


@dataclass
class TokenizedDataset:
    """Examples stored back to back: example ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``.

    ``labels`` has the same layout; a position is trained unless its label is ``IGNORE_INDEX``.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    truncated: int

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[lo:hi], self.labels[lo:hi]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def tokenize_texts(texts: Sequence[str], tokenizer: Any, max_length: int) -> TokenizedDataset:
    """Tokenize plain texts for causal LM training: every token is a target, and EOS is appended.

    The EOS teaches the model to stop. An example longer than ``max_length`` is cut on the right
    and counted; it then keeps no EOS, since the text did not end there.
    """
    encoded = tokenizer(list(texts), add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    pieces: list[list[int]] = []
    truncated = 0
    for ids in encoded:
        ids = [*ids, eos]
        if len(ids) > max_length:
            ids = ids[:max_length]
            truncated += 1
        pieces.append(ids)
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((t for p in pieces for t in p), dtype=np.int64, count=int(offsets[-1]))
    return TokenizedDataset(flat, flat.copy(), offsets, truncated)
