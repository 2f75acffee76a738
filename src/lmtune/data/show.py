"""``lmtune data show``: records as training sees them, after rendering (chat templates, prompt and
completion), tokenizing and truncation, with the tokens that train marked (Axolotl's preprocess
--debug does the same for its data)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmtune.config.groups import ExampleSettings
from lmtune.data.formats import CHAT_FORMATS, FieldMap, ensure_chat_template
from lmtune.data.readers import records
from lmtune.data.sources import BadLines, Record, resolve_sources
from lmtune.data.tokenize import Encoded, EncodeStats, encode_chunk
from lmtune.errors import UserError


@dataclass(frozen=True)
class Marks:
    """How trained text is set apart: colour on a terminal, brackets elsewhere (a file, a pipe)."""

    start: str
    end: str

    @classmethod
    def choose(cls, terminal: bool) -> Marks:
        return cls("\x1b[32m", "\x1b[0m") if terminal else cls("[[", "]]")

    @property
    def legend(self) -> str:
        if self.start.startswith("\x1b"):
            return f"trained tokens are {self.start}green{self.end}"
        return f"trained tokens are between {self.start} and {self.end}"


def shown_records(
    spec: str, tokenizer: Any, settings: ExampleSettings, start: int, count: int, marks: Marks, tokens: bool
) -> Iterator[str]:
    """The records ``start`` (1-based, in the order training reads the sources) to ``start + count
    - 1`` of ``spec``, each as a block of text. A record training would drop says why instead, and
    a bad line among them is said where it is (training stops there, or passes over it with
    --skip-bad-lines); bad lines before them are not read as far as shown.

    Raises:
        UserError: fewer records than ``start``.
    """
    ensure_chat_template(tokenizer)
    bad = BadLines(skip=True, keep=100)
    label = _bad_label(settings.skip_bad_lines)
    names = FieldMap.of(settings)
    number, said = 0, 0
    formats: set[str] = set()
    # One record at a time, as training encodes it; a too-long one is shown as --truncation treats it.
    sources = resolve_sources(spec, "lmtune data show")
    for number, record in enumerate(records(sources, settings, bad), start=1):
        if number < start:
            bad.messages.clear()  # lines passed over before the records shown are not shown
            continue
        if number >= start + count:
            break
        yield from _passed_over(bad, said, label)
        said = len(bad.messages)
        kept, stats = encode_chunk([record], tokenizer, settings, names, bad)
        if len(bad.messages) > said:  # the record itself is a bad line
            yield from _passed_over(bad, said, label)
            said = len(bad.messages)
            continue
        formats.update(stats.formats)
        yield _block(record, kept[0] if kept else None, stats, tokenizer, settings, marks, tokens)
    else:
        if number >= start:  # past the records shown: it said a bad line, then that none is there
            yield from _passed_over(bad, said, label)
    if settings.chat_template is not None and formats and not formats & set(CHAT_FORMATS):
        # Shown templated by nothing: training refuses the option for data of no conversation.
        yield (
            f"note: --chat-template {settings.chat_template} applies to conversations (messages records), "
            f"and these records hold {', '.join(sorted(formats))}: training refuses it for such data"
        )
    if not number and bad.count:  # every line is bad: the first is the one training would stop at
        more = bad.count - 1
        rest = f"; and {more} more bad line{'s' * (more != 1)} (lmtune data audit lists them)" if more else ""
        raise UserError(f"lmtune data show: {spec} holds no record that can be read: {bad.messages[0]}{rest}")
    if not number:  # no --start reaches into an empty file: it was named when none was given
        raise UserError(f"lmtune data show: {spec} holds no records (empty)")
    if number < start:
        held = f"{number} record{'s' * (number != 1)}"
        if after := len(bad.messages):  # bad lines after the last record (those before were cleared)
            held += f" and {after} bad line{'s' * (after != 1)} after them (lmtune data audit lists them)"
        raise UserError(f"lmtune data show: --start {start}: {spec} holds {held}")


def _bad_label(skipped: bool) -> str:
    if skipped:
        return "skipped (--skip-bad-lines)"
    return "a bad line: training stops here (--skip-bad-lines passes over it)"


def _passed_over(bad: BadLines, said: int, label: str) -> Iterator[str]:
    for message in bad.messages[said:]:
        yield f"== {label}: {message}"


def _block(
    record: Record,
    example: Encoded | None,
    stats: EncodeStats,
    tokenizer: Any,
    settings: ExampleSettings,
    marks: Marks,
    tokens: bool,
) -> str:
    fmt = next(iter(stats.formats), "?")
    if example is None:
        return f"== {record.where} ({fmt}): not trained: {_dropped(stats, settings)}"
    # The first token is never predicted (nothing precedes it): without a BOS, a text trains from its second.
    trainable = example.trainable.copy()
    trainable[:1] = False
    trained = int(trainable.sum())
    cut = ", truncated" if stats.truncated else ""
    if stats.documents_split:  # one record's examples: its pieces; the first is shown
        cut = f", the first of its {stats.examples:,} pieces (--truncation split)"
    if example.parts is None:
        size = f"{len(example.ids)} tokens"
    else:  # --max-length holds the prompt and the longer answer
        prompt, chosen = example.parts
        size = f"prompt {prompt} + chosen {chosen} + rejected {len(example.ids) - prompt - chosen} tokens"
    head = f"== {record.where} ({fmt}, {size}, {trained} trained{cut})"
    if tokens:
        return "\n".join([head, *_token_rows(example.ids, trainable, tokenizer)])
    if example.parts is None:
        return f"{head}\n{_marked(example.ids, trainable, tokenizer, marks)}"
    parts = {
        "prompt": (0, prompt),
        "chosen": (prompt, prompt + chosen),
        "rejected": (prompt + chosen, len(example.ids)),
    }
    lines = [head]
    for name, (a, b) in parts.items():
        lines.append(f"-- {name}:\n{_marked(example.ids[a:b], trainable[a:b], tokenizer, marks)}")
    return "\n".join(lines)


def _dropped(stats: EncodeStats, settings: ExampleSettings) -> str:
    """Why training drops a record that encoded to nothing."""
    if not stats.dropped_too_long:
        return "nothing to train in it (no answer, or an empty one)"
    if settings.truncation == "drop":
        return f"longer than --max-length {settings.max_length} (--truncation drop)"
    cut = f"--max-length {settings.max_length} (--truncation {settings.truncation})"
    return f"cut to {cut}, nothing to train is left"


def _marked(ids: np.ndarray, trainable: np.ndarray, tokenizer: Any, marks: Marks) -> str:
    """The text of ``ids``, each run of trained tokens between the marks (runs decoded whole, so a
    character of several byte tokens shows as itself)."""
    out: list[str] = []
    edges = [0, *(np.flatnonzero(np.diff(trainable.astype(np.int8))) + 1).tolist(), len(ids)]
    for a, b in itertools.pairwise(edges):
        text = tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        out.append(f"{marks.start}{text}{marks.end}" if trainable[a] else text)
    return "".join(out)


def _token_rows(ids: np.ndarray, trainable: np.ndarray, tokenizer: Any) -> list[str]:
    """One line per token: position, id, the token as the vocabulary writes it, trained or not."""
    pieces = tokenizer.convert_ids_to_tokens(ids.tolist())
    return [
        f"{i:6d} {int(t):8d}  {'train' if trainable[i] else '     '}  {piece!r}"
        for i, (t, piece) in enumerate(zip(ids, pieces, strict=True))
    ]
