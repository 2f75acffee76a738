"""Tokenized examples stored back to back in flat arrays, on disk and memory-mapped."""

from __future__ import annotations

import json
import os
from contextlib import suppress
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from lmtune.config.files import is_int, read_json_object
from lmtune.data.mixture import SourceIndex
from lmtune.data.tokenize import IGNORE_INDEX, Encoded
from lmtune.errors import UserError

IDS_FILE, MASK_FILE, OFFSETS_FILE, META_FILE = "input_ids.bin", "trainable.bin", "offsets.npy", "meta.json"
PARTS_FILE = "pairs.npy"  # preference pairs: each pair's prompt and chosen lengths


class Example(NamedTuple):
    input_ids: np.ndarray
    labels: np.ndarray  # IGNORE_INDEX where the position does not train
    example_id: int  # position in the data set, to record which samples a step consumed


class PairExample(Example):
    """A preference pair (lmtune.data.pairs), still an :class:`Example` of three fields:
    ``input_ids`` are its prompt, chosen and rejected tokens back to back, ``parts`` the prompt's
    and the chosen answer's lengths, ``reference`` the reference model's log-probs of the chosen
    and the rejected answer when they were precomputed."""

    parts: tuple[int, int]
    reference: tuple[float, float] | None

    def __new__(
        cls,
        input_ids: np.ndarray,
        labels: np.ndarray,
        example_id: int,
        parts: tuple[int, int],
        reference: tuple[float, float] | None = None,
    ) -> PairExample:
        pair = super().__new__(cls, input_ids, labels, example_id)
        pair.parts, pair.reference = parts, reference
        return pair

    def __reduce__(self) -> tuple[Any, ...]:
        return (PairExample, (*self, self.parts, self.reference))


class TokenizedDataset:
    """Example ``i`` is ``input_ids[offsets[i]:offsets[i + 1]]``; ``trainable`` marks the targets.

    The arrays may be ``np.memmap`` views of a cache folder, so every rank shares one copy in the
    page cache and a corpus larger than memory still trains.

    A data set of preference pairs also has ``parts`` (per pair: the prompt's and the chosen
    answer's lengths) and, once computed, ``reference`` (per pair: the reference model's log-probs
    of both answers, set by :meth:`set_reference`).
    """

    def __init__(
        self,
        input_ids: np.ndarray,
        trainable: np.ndarray,
        offsets: np.ndarray,
        meta: dict[str, Any] | None = None,
        parts: np.ndarray | None = None,
    ):
        self.input_ids, self.trainable, self.offsets = input_ids, trainable, offsets
        self.meta = meta or {}
        self.parts = parts
        # Shared with the views of this data set (SplitView), so a reference set once reaches them.
        self.extras: dict[str, np.ndarray] = {}
        self.sources: SourceIndex | None = None  # kept per source (a mixture): which id is whose

    def source_sizes(self) -> list[int]:
        """How many of this set's examples each source holds (with :attr:`sources`)."""
        assert self.sources is not None
        return [int(n) for n in np.diff(self.sources.bounds)]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Example:
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        ids = self.input_ids[lo:hi].astype(np.int64)
        labels = np.where(self.trainable[lo:hi], ids, IGNORE_INDEX)
        if self.parts is None:
            return Example(ids, labels, i)
        parts = (int(self.parts[i, 0]), int(self.parts[i, 1]))
        reference = self.extras.get("reference")
        refs = None if reference is None else (float(reference[i, 0]), float(reference[i, 1]))
        return PairExample(ids, labels, i, parts, refs)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def digests(self) -> np.ndarray:
        """A 64-bit digest of each example's tokens (a polynomial hash, vectorised), to find the
        examples two data sets share."""
        ids = self.input_ids.astype(np.uint64) + np.uint64(1)
        starts, lengths = self.offsets[:-1], np.diff(self.offsets)  # all of the arrays' examples
        position = np.arange(len(ids), dtype=np.uint64) - np.repeat(starts, lengths).astype(np.uint64)
        with np.errstate(over="ignore"):
            weighted = ids * np.power(np.uint64(1_000_003), position, dtype=np.uint64)
        sums = np.add.reduceat(weighted, starts) if len(ids) else np.zeros(0, np.uint64)
        digests: np.ndarray = sums ^ (lengths.astype(np.uint64) << np.uint64(48))
        return digests

    def pair_lengths(self) -> np.ndarray:
        """Per pair: its prompt's, chosen and rejected answer's token counts (``[len, 3]``)."""
        assert self.parts is not None
        prompt, chosen = self.parts[:, 0], self.parts[:, 1]
        return np.stack([prompt, chosen, np.diff(self.offsets) - prompt - chosen], axis=1)

    @property
    def is_pairs(self) -> bool:
        return self.parts is not None

    def set_reference(self, logps: np.ndarray) -> None:
        """The reference log-probs of every pair (``[len, 2]``: chosen, rejected), by position."""
        assert self.parts is not None and logps.shape == (len(self.parts), 2)
        self.extras["reference"] = logps

    def base(self) -> TokenizedDataset:
        """The whole data set this one is (a view's is the set it views)."""
        return self

    @classmethod
    def from_encoded(cls, examples: list[Encoded], meta: dict[str, Any] | None = None) -> TokenizedDataset:
        lengths = np.fromiter((len(e.ids) for e in examples), dtype=np.int64, count=len(examples))
        offsets = np.zeros(len(examples) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.concatenate([e.ids for e in examples]) if examples else np.zeros(0, np.int32)
        mask = np.concatenate([e.trainable for e in examples]) if examples else np.zeros(0, bool)
        return cls(ids.astype(np.int32), mask.astype(bool), offsets, meta, _parts_of(examples))

    @classmethod
    def open(cls, folder: Path, vocab_size: int | None = None) -> TokenizedDataset:
        """A cache entry, checked first (:func:`check_entry`); a damaged one is a :class:`UserError`
        naming the folder."""
        meta, offsets = check_entry(folder, vocab_size)
        parts = read_parts(folder / PARTS_FILE, offsets)
        total = int(offsets[-1])
        if total == 0:
            return cls(np.zeros(0, np.int32), np.zeros(0, bool), offsets, meta, parts)
        ids = np.memmap(folder / IDS_FILE, dtype=np.int32, mode="r", shape=(total,))
        mask = np.memmap(folder / MASK_FILE, dtype=np.bool_, mode="r", shape=(total,))
        return cls(ids, mask, offsets, meta, parts)


def _parts_of(examples: list[Encoded]) -> np.ndarray | None:
    """The pairs' parts as one array, or None for single examples; a data set holds one kind."""
    kinds = {e.parts is None for e in examples}
    if len(kinds) > 1:
        raise UserError("the data mixes preference pairs with single examples; a data set holds one kind")
    if not examples or examples[0].parts is None:
        return None
    return np.asarray([e.parts for e in examples], dtype=np.int64).reshape(-1, 2)


# What every cache entry's meta.json records (read by the run log and run.json).
META_COUNTS = (
    *("examples", "tokens", "target_tokens", "truncated", "dropped_too_long", "dropped_no_targets"),
    *("eos_trained", "bad_lines"),
)
_SCAN = 1 << 24  # tokens checked per slice: bounded memory whatever the entry's size


def check_entry(folder: Path, vocab_size: int | None) -> tuple[dict[str, Any], np.ndarray]:
    """(meta, offsets) of a cache entry whose structure checks out: regular files (no links) of the
    sizes the offsets imply, offsets from 0 rising with every example, token ids inside the
    vocabulary, and every example with a trainable token. It reads the entry once (a few seconds
    for a billion tokens), so a truncated file, an edited id or mask never trains silently.

    Raises:
        UserError: naming the folder and what is wrong.
    """
    try:
        meta = read_json_object(folder / META_FILE, limit=64 << 20)
        seconds = meta.get("build_seconds")
        if not (all(is_int(meta.get(k)) for k in META_COUNTS) and isinstance(meta.get("formats"), dict)):
            raise UserError(f"{folder / META_FILE}: counts missing or not whole numbers")
        if not isinstance(seconds, (int, float)) or not 0 <= seconds < 1e9:
            raise UserError(f"{folder / META_FILE}: build_seconds is not a duration")
        offsets = read_offsets(folder / OFFSETS_FILE)
        total = int(offsets[-1])
        for name, width in ((IDS_FILE, 4), (MASK_FILE, 1)):
            path = folder / name
            if path.is_symlink() or not path.is_file() or path.stat().st_size != total * width:
                raise UserError(f"{path}: not the {total * width:,} bytes its offsets imply (cut short?)")
        if meta["examples"] != len(offsets) - 1 or meta["tokens"] != total:
            raise UserError(f"{folder / META_FILE}: its counts do not match the arrays")
        if total:
            _check_arrays(folder, offsets, vocab_size)
    except FileNotFoundError as e:
        raise UserError(
            f"damaged data cache entry {folder}: {Path(str(e.filename)).name} is missing"
        ) from None
    except (UserError, OSError, ValueError) as e:
        raise UserError(f"damaged data cache entry {folder}: {e}") from None
    return meta, offsets


def read_offsets(path: Path) -> np.ndarray:
    """An entry's offsets, checked: a regular file (no link) of int64 from 0, rising."""
    if path.is_symlink() or not path.is_file():
        raise UserError(f"{path}: not a regular file")
    # Mapped first: a header claiming more than the file holds fails here, before any allocation.
    offsets = np.array(np.load(path, allow_pickle=False, mmap_mode="r"))
    if offsets.dtype != np.int64 or offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0:
        raise UserError(f"{path}: not the offsets lmtune writes (int64 from 0)")
    if len(offsets) > 1 and not bool((np.diff(offsets) > 0).all()):
        raise UserError(f"{path}: offsets do not rise with every example")
    return offsets


def read_parts(path: Path, offsets: np.ndarray) -> np.ndarray | None:
    """A pair entry's parts (per pair: the prompt's and the chosen answer's lengths), checked
    against its offsets: both answers of every pair have tokens; None for an entry of single
    examples (no file)."""
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        raise UserError(f"{path}: not a regular file")
    parts = np.array(np.load(path, allow_pickle=False, mmap_mode="r"))
    lengths = np.diff(offsets)
    if parts.dtype != np.int64 or parts.shape != (len(lengths), 2):
        raise UserError(f"{path}: not the pair lengths lmtune writes ({len(lengths)} x 2 int64)")
    fits = (parts[:, 0] >= 0) & (parts[:, 1] > 0) & (parts.sum(axis=1) < lengths)
    if not bool(fits.all()):
        raise UserError(f"{path}: pair lengths that do not fit their examples")
    return parts


def _check_arrays(folder: Path, offsets: np.ndarray, vocab_size: int | None) -> None:
    total = int(offsets[-1])
    ids = np.memmap(folder / IDS_FILE, dtype=np.int32, mode="r", shape=(total,))
    mask = np.memmap(folder / MASK_FILE, dtype=np.uint8, mode="r", shape=(total,))
    high = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
    counts = np.zeros(len(offsets) - 1, dtype=np.int64)
    starts = offsets[:-1]
    for lo in range(0, total, _SCAN):
        hi = min(lo + _SCAN, total)
        chunk = ids[lo:hi]
        if int(chunk.min()) < 0 or int(chunk.max()) >= high:
            bad = int(chunk.min()) if int(chunk.min()) < 0 else int(chunk.max())
            raise UserError(f"{folder / IDS_FILE}: token id {bad} is outside the vocabulary (0..{high - 1})")
        flags = mask[lo:hi]
        if int(flags.max(initial=0)) > 1:
            raise UserError(f"{folder / MASK_FILE}: not a mask of 0s and 1s")
        # Trainable tokens per example, summed slice by slice.
        first = np.searchsorted(starts, lo, side="right") - 1
        last = np.searchsorted(starts, hi, side="left")
        edges = np.clip(starts[first:last], lo, hi) - lo
        counts[first:last] += np.add.reduceat(flags.astype(np.int64), edges) if len(edges) else 0
    empty = np.flatnonzero(counts == 0)
    if len(empty):
        raise UserError(f"{folder / MASK_FILE}: example {int(empty[0])} has no trainable token")


class DatasetWriter:
    """Appends encoded examples to a folder's flat files, so memory stays bounded by one chunk."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._ids = (folder / IDS_FILE).open("wb")
        self._mask = (folder / MASK_FILE).open("wb")
        self._lengths: list[int] = []
        self._parts: list[tuple[int, int] | None] = []

    @property
    def examples(self) -> int:
        """Examples written so far."""
        return len(self._lengths)

    def write(self, examples: list[Encoded]) -> None:
        for e in examples:
            if self._parts and (self._parts[0] is None) != (e.parts is None):
                raise UserError(
                    "the data mixes preference pairs with single examples; a data set holds one kind"
                )
            self._ids.write(e.ids.astype(np.int32).tobytes())
            self._mask.write(e.trainable.astype(np.bool_).tobytes())
            self._lengths.append(len(e.ids))
            self._parts.append(e.parts)
        # Ranks waiting for this folder take a changing file time as the builder's sign of life.
        self._ids.flush()
        self._mask.flush()

    def abandon(self) -> None:
        """Close the files of a build that failed (open, they would keep a full disk's space taken
        after the folder is removed)."""
        for f in (self._ids, self._mask):
            with suppress(OSError):
                f.close()

    def close(self, meta: dict[str, Any]) -> None:
        """Finish the folder; ``meta.json`` is written last and marks it complete. Every file is
        on disk (fsync) before it: a crash leaves an entry without meta.json, never a short one."""
        for f in (self._ids, self._mask):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        offsets = np.zeros(len(self._lengths) + 1, dtype=np.int64)
        np.cumsum(np.asarray(self._lengths, dtype=np.int64), out=offsets[1:])
        with (self.folder / OFFSETS_FILE).open("wb") as f:
            np.save(f, offsets)
            f.flush()
            os.fsync(f.fileno())
        if self._parts and self._parts[0] is not None:
            with (self.folder / PARTS_FILE).open("wb") as f:
                np.save(f, np.asarray(self._parts, dtype=np.int64).reshape(-1, 2))
                f.flush()
                os.fsync(f.fileno())
        with (self.folder / META_FILE).open("w", encoding="utf-8") as text:
            text.write(json.dumps(meta, indent=2))
            text.flush()
            os.fsync(text.fileno())


class SplitView(TokenizedDataset):
    """Some of a data set's examples, by their positions in it; example ids stay the positions in
    the whole set, so records of what trained name the same examples as the data file does."""

    def __init__(self, base: TokenizedDataset, indices: np.ndarray):
        super().__init__(base.input_ids, base.trainable, base.offsets, base.meta, base.parts)
        self.extras = base.extras
        self.sources = base.sources
        self.indices = indices
        self._base = base

    def __len__(self) -> int:
        return len(self.indices)

    def source_sizes(self) -> list[int]:
        assert self.sources is not None
        return self.sources.sizes_in(self.indices)  # indices are sorted: each source's are contiguous

    def __getitem__(self, i: int) -> Example:
        return super().__getitem__(int(self.indices[i]))

    def lengths(self) -> np.ndarray:
        kept: np.ndarray = super().lengths()[self.indices]
        return kept

    def digests(self) -> np.ndarray:
        kept: np.ndarray = super().digests()[self.indices]
        return kept

    def pair_lengths(self) -> np.ndarray:
        kept: np.ndarray = super().pair_lengths()[self.indices]
        return kept

    def base(self) -> TokenizedDataset:
        return self._base


def held_out_count(share: float, n: int) -> int:
    """How many of ``n`` examples --eval-split ``share`` holds out: a fraction below 1, else a count."""
    return round(share * n) if share < 1 else int(share)


def split_off(data: TokenizedDataset, share: float, seed: int) -> tuple[SplitView, SplitView]:
    """(training, held out): ``share`` of the examples (a fraction below 1, else a count) held out.

    The choice depends only on the data set's size and the seed: the same examples whatever the
    number of processes, and again on resume.
    """
    n = len(data)
    if data.sources is not None:
        held = held_per_source(data.sources, share, seed)
    else:
        count = held_out_count(share, n)
        if not 1 <= count < n:
            raise ValueError(f"holds out {count} of {n} examples{_what_is_left(count, n)}")
        held = np.sort(np.random.default_rng(seed).permutation(n)[:count])
    kept = np.setdiff1d(np.arange(n), held, assume_unique=True)
    return SplitView(data, kept), SplitView(data, held)


def _what_is_left(count: int, n: int) -> str:
    if count < 1:
        return ": the share rounds to none; give a larger fraction, or a number of examples"
    return (
        f", leaving none to train on; hold out fewer (a fraction below 1, or a number of examples below {n})"
        if n > 1
        else ", the only one: there is none to spare"
    )


def held_per_source(sources: SourceIndex, share: float, seed: int) -> np.ndarray:
    """A data set kept per source holds out ``share`` of each source (a fraction of it, or a count
    from each), chosen within the source by the seed and its place."""
    held = []
    for i, (name, lo, hi) in enumerate(zip(sources.names, sources.bounds, sources.bounds[1:], strict=False)):
        n = hi - lo
        count = held_out_count(share, n)
        if not 1 <= count < n:
            raise ValueError(
                f"holds out {count} of the {n} examples of source {name!r}{_what_is_left(count, n)}"
            )
        held.append(lo + np.sort(np.random.default_rng([seed, i]).permutation(n)[:count]))
    return np.concatenate(held)


def shared_examples(
    train: TokenizedDataset, held: TokenizedDataset, most_tokens: int = 50_000_000
) -> int | None:
    """How many of ``held``'s examples are ``train``'s too (the same tokens); None past
    ``most_tokens`` of both together, where the digests would cost more than a warning is worth."""
    if len(train.input_ids) + len(held.input_ids) > most_tokens or not len(train) or not len(held):
        return None
    return int(np.isin(held.digests(), train.digests()).sum())


def named_here(dataset: TokenizedDataset, names: list[str]) -> TokenizedDataset:
    """A cache entry's places (``file:line``) under this run's ``names`` for its files: an entry of
    the same content, built from files named otherwise, named those in this run's log and run.json."""
    meta = dataset.meta
    built = meta.get("sources", [])
    if built == names or len(built) != len(names):
        return dataset
    swap = dict(zip(built, names, strict=True))

    def here(place: str) -> str:
        name = next((b for b in swap if place.startswith(f"{b}:")), None)
        return place if name is None else swap[name] + place[len(name) :]

    where = {kind: [here(p) for p in places] for kind, places in meta.get("where", {}).items()}
    examples = [here(m) for m in meta.get("bad_line_examples", [])]
    dataset.meta = {**meta, "sources": names, "where": where, "bad_line_examples": examples}
    return dataset
