"""Tokenize rendered examples: token ids, which positions train, and truncation."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lmtune.data.formats import Rendered, render
from lmtune.data.sources import BadLines, Record
from lmtune.errors import UserError

IGNORE_INDEX = -100
TRUNCATIONS = ("right", "left", "drop", "error")
CHUNK = 2048  # records per tokenizer call: large enough for the Rust side to use every core


@dataclass
class EncodeStats:
    """What happened to the examples on their way to the token arrays."""

    examples: int = 0  # kept
    tokens: int = 0
    target_tokens: int = 0  # trained positions after the causal shift
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_targets: int = 0
    eos_trained: int = 0  # kept examples that end in an EOS which keeps its label
    formats: dict[str, int] = field(default_factory=dict)

    def merge(self, other: EncodeStats) -> None:
        for name in (
            "examples",
            "tokens",
            "target_tokens",
            "truncated",
            "dropped_too_long",
            "dropped_no_targets",
            "eos_trained",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.formats.items():
            self.formats[k] = self.formats.get(k, 0) + v


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray  # int32
    trainable: np.ndarray  # bool, same length


def _mask(offsets: np.ndarray, spans: tuple[tuple[int, int], ...]) -> np.ndarray:
    """A token trains when it covers text and starts inside a trainable span."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    inside = np.zeros(len(offsets), dtype=bool)
    for lo, hi in spans:
        inside |= (starts >= lo) & (starts < hi)
    return inside & (ends > starts)


def truncate(
    ids: np.ndarray, trainable: np.ndarray, max_length: int, mode: str, where: str
) -> tuple[np.ndarray, np.ndarray] | None:
    """Apply ``--truncation`` to one over-long example; None means drop it."""
    if mode == "right":
        return ids[:max_length], trainable[:max_length]
    if mode == "left":  # keeps the end, where a prompt-completion example has its answer
        return ids[-max_length:], trainable[-max_length:]
    if mode == "drop":
        return None
    raise UserError(
        f"{where}: {len(ids)} tokens, more than --max-length {max_length} (--truncation error); "
        "raise --max-length or choose --truncation right, left or drop"
    )


def encode_chunk(
    chunk: list[Record],
    tokenizer: Any,
    fmt: str,
    text_field: str,
    max_length: int,
    truncation: str,
    bad: BadLines,
) -> tuple[list[Encoded], EncodeStats]:
    """Render and tokenize a list of records; returns the kept examples and the counts.

    A record that cannot be rendered (missing field, unknown role, ...) goes to ``bad``, which
    raises unless bad lines are being skipped.
    """
    stats = EncodeStats()
    records: list[Record] = []
    rendered: list[Rendered] = []
    for record in chunk:
        try:
            rendered.append(render(record, fmt, text_field, tokenizer))
            records.append(record)
        except UserError as e:
            bad.report(str(e))
    eos = tokenizer.eos_token_id
    out: list[Encoded] = []
    by_special: dict[bool, list[int]] = {}
    for i, r in enumerate(rendered):
        by_special.setdefault(r.add_special_tokens, []).append(i)
        stats.formats[r.format] = stats.formats.get(r.format, 0) + 1
    encoded: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}
    for special, idx in by_special.items():
        batch = tokenizer(
            [rendered[i].text for i in idx], add_special_tokens=special, return_offsets_mapping=True
        )
        for j, i in enumerate(idx):
            encoded[i] = (batch["input_ids"][j], batch["offset_mapping"][j])
    for i, (rec, r) in enumerate(zip(records, rendered, strict=True)):
        token_ids, offsets = encoded[i]
        ids = np.asarray(token_ids, dtype=np.int32)
        trainable = _mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), r.spans)
        if r.append_eos and not (len(ids) and ids[-1] == eos):
            ids = np.append(ids, np.int32(eos))
            trainable = np.append(trainable, True)
        if len(ids) > max_length:
            try:
                cut = truncate(ids, trainable, max_length, truncation, rec.where)
            except UserError as e:
                bad.report(str(e))
                continue
            if cut is None:
                stats.dropped_too_long += 1
                continue
            ids, trainable = cut
            stats.truncated += 1
        targets = int(trainable[1:].sum())  # position 0 is never predicted
        if targets == 0:
            stats.dropped_no_targets += 1  # would train as a loss of 0 on nothing
            continue
        stats.examples += 1
        stats.tokens += len(ids)
        stats.target_tokens += targets
        stats.eos_trained += bool(ids[-1] == eos and trainable[-1])
        out.append(Encoded(ids, trainable))
    return out, stats


def chunks(records: Iterable[Record], size: int = CHUNK) -> Iterator[list[Record]]:
    batch: list[Record] = []
    for r in records:
        batch.append(r)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
