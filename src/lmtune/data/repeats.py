"""Records that train on what an earlier one trains on (`lmtune data audit`): each copy trains, so a
data set concatenated twice, or one example pasted a thousand times, weighs more than it seems.
Compared by what trains (lmtune.data.formats.trained_content), so copies that differ only in an
id or another field no format reads are found too."""

from __future__ import annotations

import bisect
import hashlib
import json
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from lmtune.data.formats import FieldMap, trained_content
from lmtune.data.sources import Record

PLACES_KEPT = 3  # repeats named in the report, as for the other kinds of loss


@dataclass
class Repeats:
    """Counts the records that repeat an earlier one, keeping a few places of each pair. Per record
    24 bytes (its digest, line and item): a dict of digests held ~120 MiB per million records."""

    names: FieldMap  # the data set's names for lmtune's fields (--field-map)
    _digests: array[int] = field(default_factory=lambda: array("Q"))
    _lines: array[int] = field(default_factory=lambda: array("q"))
    _items: array[int] = field(default_factory=lambda: array("q"))  # a record's number on a shared line
    _starts: list[int] = field(default_factory=list)  # the first record number of each source
    _sources: list[str] = field(default_factory=list)

    def tap(self, records: Iterable[Record]) -> Iterator[Record]:
        """``records`` as they are, what each one trains on noted."""
        for record in records:
            content = trained_content(record, self.names)
            if content is None:  # a bad line: not trained, so no copy of another that trains
                yield record
                continue
            if not self._sources or self._sources[-1] != record.source:
                self._sources.append(record.source)
                self._starts.append(len(self._lines))
            self._lines.append(record.line)
            self._items.append(record.item)
            text = json.dumps(content, sort_keys=True, ensure_ascii=False, default=str)
            digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
            self._digests.append(int.from_bytes(digest, "little"))
            yield record

    def found(self) -> tuple[int, list[tuple[str, str]]]:
        """How many records repeat an earlier one, and (repeat, first) for the first of them."""
        digests = self._digest_array()
        order = np.argsort(digests, kind="stable")  # equal digests in record order
        ordered = digests[order]
        repeat = np.zeros(len(order), dtype=bool)
        repeat[1:] = ordered[1:] == ordered[:-1]
        # Each position's group starts at the last position that repeats nothing before it.
        group = np.maximum.accumulate(np.where(repeat, 0, np.arange(len(order))))
        later, first = order[repeat], order[group[repeat]]
        shown = np.argsort(later, kind="stable")[:PLACES_KEPT]
        places = [(self._where(int(later[i])), self._where(int(first[i]))) for i in shown]
        return int(repeat.sum()), places

    def also_in(self, other: Repeats) -> tuple[int, list[tuple[str, str]]]:
        """How many of these records train on what one of ``other``'s does (evaluation records
        that are training's too), and (this one, other's) for the first of them."""
        theirs, mine = other._digest_array(), self._digest_array()
        order = np.argsort(theirs, kind="stable")
        at = np.minimum(np.searchsorted(theirs[order], mine), max(len(order) - 1, 0))
        shared = np.flatnonzero(theirs[order][at] == mine) if len(order) else np.zeros(0, np.int64)
        places = [(self._where(int(i)), other._where(int(order[at[i]]))) for i in shared[:PLACES_KEPT]]
        return len(shared), places

    def _digest_array(self) -> np.ndarray:
        """The records' digests, in record order, as an array (numpy reads none from an empty buffer)."""
        return np.frombuffer(self._digests, dtype=np.uint64) if self._digests else np.zeros(0, np.uint64)

    def _where(self, number: int) -> str:
        source = self._sources[bisect.bisect_right(self._starts, number) - 1]
        return Record(source, self._lines[number], {}, self._items[number]).where

    def line(self) -> str:
        """The report's line: how many records repeat an earlier one, and the first few."""
        count, places = self.found()
        if not count:
            return "  repeated records    0"
        shown = ", ".join(f"{later} = {first}" for later, first in places)
        more = f" and {count - len(places):,} more" if count > len(places) else ""
        noun = "record repeats" if count == 1 else "records repeat"
        return (
            f"  repeated records    {count:,} {noun} what an earlier one trains on ({shown}{more}; "
            "fields no format reads, such as an id, aside); each copy trains (a copy held out by "
            "--eval-split is trained on as well)"
        )
