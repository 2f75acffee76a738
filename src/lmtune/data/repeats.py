"""Records that repeat an earlier one, field for field (`lmtune data audit`): each copy trains, so a
data set concatenated twice, or one example pasted a thousand times, weighs more than it seems."""

from __future__ import annotations

import bisect
import hashlib
import json
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from lmtune.data.sources import Record

PLACES_KEPT = 3  # repeats named in the report, as for the other kinds of loss


@dataclass
class Repeats:
    """Counts the records that repeat an earlier one, keeping a few places of each pair."""

    count: int = 0
    places: list[tuple[str, str]] = field(default_factory=list)  # (repeat, first) of the first repeats
    # Per record read: its first occurrence's number, by the digest of its fields; and where each
    # record is, as compact arrays (a where string per record held a data set's size in memory).
    _first: dict[bytes, int] = field(default_factory=dict)
    _lines: array[int] = field(default_factory=lambda: array("q"))
    _starts: list[int] = field(default_factory=list)  # the first record number of each source
    _sources: list[str] = field(default_factory=list)

    def tap(self, records: Iterable[Record]) -> Iterator[Record]:
        """``records`` as they are, each compared with the ones before it."""
        for record in records:
            number = len(self._lines)
            if not self._sources or self._sources[-1] != record.source:
                self._sources.append(record.source)
                self._starts.append(number)
            self._lines.append(record.line)
            text = json.dumps(record.fields, sort_keys=True, ensure_ascii=False, default=str)
            first = self._first.setdefault(hashlib.blake2b(text.encode(), digest_size=16).digest(), number)
            if first != number:
                self.count += 1
                if len(self.places) < PLACES_KEPT:
                    self.places.append((self._where(number), self._where(first)))
            yield record

    def _where(self, number: int) -> str:
        source = self._sources[bisect.bisect_right(self._starts, number) - 1]
        return f"{source}:{self._lines[number]}"

    def line(self) -> str:
        """The report's line: how many records repeat an earlier one, and the first few."""
        if not self.count:
            return "  repeated records    0"
        shown = ", ".join(f"{later} = {first}" for later, first in self.places)
        more = f" and {self.count - len(self.places):,} more" if self.count > len(self.places) else ""
        noun = "record repeats" if self.count == 1 else "records repeat"
        return (
            f"  repeated records    {self.count:,} {noun} an earlier one field for field ({shown}{more}); "
            "each copy trains (a copy held out by --eval-split is trained on as well)"
        )
