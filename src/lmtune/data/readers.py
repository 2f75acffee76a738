"""Reading a source's records: JSON Lines, JSON, Parquet, CSV and text files, saved and hub data
sets, the built-in sample. Each record keeps its file and line (or record number); a line that
cannot be read goes to :class:`BadLines`."""

from __future__ import annotations

import codecs
import csv
import io
import itertools
import json
import re
from collections import Counter
from collections.abc import Generator, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtune.config.groups import ExampleSettings
from lmtune.config.settings import SAMPLE_DATA as SAMPLE
from lmtune.config.settings import SAMPLE_EVAL
from lmtune.data import opening
from lmtune.data.addition import addition_examples
from lmtune.data.opening import check_utf8, compressed_hint, opened
from lmtune.data.sources import BadLines, Record, Source
from lmtune.errors import UserError, brief


def records(sources: list[Source], settings: ExampleSettings, bad: BadLines) -> Iterator[Record]:
    """Every source's records in turn, read as ``settings`` say."""
    as_text = settings.format == "text"  # a .txt of JSON objects too
    for source in sources:
        yield from iter_records(source, settings.text_field, bad, settings.txt_mode, as_text)


def iter_records(
    source: Source, text_field: str, bad: BadLines, txt_mode: str = "line", json_as_text: bool = False
) -> Iterator[Record]:
    """The records of one source, in order; unreadable lines go to ``bad``. ``json_as_text``: a
    ``.txt`` of JSON Lines is text all the same (``--data-format text``), not refused."""
    readers = {
        "jsonl": lambda: _jsonl(source.name, bad),
        "json": lambda: _json(source.name, bad),
        "parquet": lambda: _parquet(source.name),
        "csv": lambda: _csv(source.name, bad),
        "tsv": lambda: _csv(source.name, bad, "\t"),
        "txt": lambda: _txt(source.name, text_field, txt_mode, bad, json_as_text),
        "hf_disk": lambda: _hf_disk(source.name, source.split),
        "hf_hub": lambda: _hf_hub(source.name, source.split or "train"),
        "sample": lambda: _sample(source.split or "train", text_field),
    }
    if source.kind in ("jsonl", "json", "csv", "tsv", "txt"):
        check_utf8(source.name)
    # Damaged bytes in an archive read as bad lines before its check at the end fails: said as
    # the damage, with the first line it spoilt (skipped lines were counted, the error stops here).
    try:
        yield from readers[source.kind]()
    except opening.Undecompressable as e:
        spoilt = [m for m in bad.messages if m.startswith(f"{source.name}:")]
        if not spoilt:
            raise
        raise opening.spoilt(source.name, str(e).removeprefix(f"{source.name}: "), spoilt[0]) from None
    except UserError as e:
        damage = opening.damage(source.name) if Path(source.name).suffix.lower() in opening.OPENERS else None
        if damage is None:
            raise
        raise opening.spoilt(source.name, f"cannot be decompressed ({damage})", str(e)) from None


def _decoded_lines(path: str, bad: BadLines) -> Iterator[tuple[int, str]]:
    with opened(path) as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):  # editors on Windows write one
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                hint = compressed_hint(raw) if lineno == 1 else ""
                bad.report(f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line){hint}")


# A JSON escape of a UTF-16 surrogate; only when one is present can a parsed string hold a lone one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _parse_json(text: str, where: str) -> Any:
    """One JSON document, or a UserError at ``where`` (``:LINE`` added for a multi-line text)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        line = f":{e.lineno}" if "\n" in text.rstrip("\r\n") else ""
        # json's "Invalid control character at" is completed by a position it leaves out of msg.
        raise UserError(
            f"{where}{line}: not valid JSON ({e.msg.removesuffix(' at')}, column {e.colno})"
        ) from None
    except RecursionError:
        raise UserError(f"{where}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise UserError(f"{where}: not valid JSON here ({str(e).split(':')[0]})") from None
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            lone = e.object[e.start : e.end]
            raise UserError(
                f"{where}: holds an unpaired UTF-16 surrogate ({lone!a}), not valid text"
            ) from None
    return value


def _jsonl(path: str, bad: BadLines) -> Iterator[Record]:
    for lineno, line in _decoded_lines(path, bad):
        if not line.strip():
            continue
        # A file that is one JSON array of records is read as JSON by its .json name.
        array = (
            " (a JSON array of records? name the file .json)"
            if lineno == 1 and line.lstrip()[:1] == "["
            else ""
        )
        try:
            record = _parse_json(line.rstrip("\r\n"), f"{path}:{lineno}")
        except UserError as e:
            bad.report(f"{e}{array}")
            continue
        if not isinstance(record, dict):
            bad.report(f"{path}:{lineno}: expected a JSON object, got {json_kind(record)}{array}")
            continue
        yield Record(path, lineno, record)


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words (Python's "NoneType" and "str" said nothing to
    a data set's author)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = {str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def _json(path: str, bad: BadLines) -> Iterator[Record]:
    with opened(path) as f:
        data = f.read()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{path}: not valid UTF-8{compressed_hint(data)}") from None
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first.lstrip().startswith("{") and _one_object(first):  # JSON Lines named .json, as HF reads it
        yield from _jsonl(path, bad)
        return
    data = _parse_json(text, path)
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of records, got {json_kind(data)}")
    lines = list(_element_lines(text))
    shared = {line for line, count in Counter(lines).items() if count > 1}
    for (i, record), line in zip(enumerate(data, start=1), lines, strict=True):
        if not isinstance(record, dict):  # a bad line, as in JSONL: --skip-bad-lines passes over it
            bad.report(f"{path}:{line}: record {i} is not a JSON object (it is {json_kind(record)})")
            continue
        yield Record(path, line, record, i if line in shared else 0)


def _one_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


def _element_lines(text: str) -> Iterator[int]:
    """The line each element of the JSON list ``text`` (valid: parsed already) starts on."""
    decoder = json.JSONDecoder()
    at, line, counted = text.index("[") + 1, 1, 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ","):
            at += 1
        if at >= len(text) or text[at] == "]":
            return
        line, counted = line + text.count("\n", counted, at), at
        yield line
        at = decoder.raw_decode(text, at)[1]


def _parquet(path: str) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    row = 0
    for batch in table.iter_batches(batch_size=4096):
        for record in batch.to_pylist():
            row += 1
            yield Record(path, row, record)


# A byte that is not UTF-8, as the surrogateescape error handler keeps it.
_NOT_UTF8 = re.compile("[\udc80-\udcff]")


def _csv(path: str, bad: BadLines, delimiter: str = ",") -> Iterator[Record]:
    """Rows of a CSV file (a TSV one with ``delimiter`` a tab), quoted as pandas and HF's csv
    loader read them by default; a row whose quote is left open is a bad line, and reading goes on
    from the line after it (pandas would read the lines it swallows into one field)."""
    # Python's default, 128 KiB a field, refused a long document that a JSONL line may hold.
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
    # Bytes that are not UTF-8 kept as escapes: the row holding them is a bad line, not the file.
    with opened(path) as raw, io.TextIOWrapper(raw, "utf-8-sig", "surrogateescape", newline="") as f:
        part: _CsvPart | None = _CsvPart(f, None, 0)
        while part is not None:
            part = yield from _csv_part(path, part, bad, delimiter)


@dataclass(frozen=True)
class _CsvPart:
    """Where reading a CSV file goes on: its lines from there, the header's names (None: the
    header is the first line), and the file's line number before the first."""

    lines: Iterable[str]
    fieldnames: list[str] | None
    offset: int


def _csv_part(
    path: str, part: _CsvPart, bad: BadLines, delimiter: str
) -> Generator[Record, None, _CsvPart | None]:
    """The rows of ``part`` up to one whose quote is left open, and where reading goes on after it."""
    lines = _RowLines(part.lines, header=part.fieldnames is None)
    reader = csv.DictReader(lines, fieldnames=part.fieldnames, delimiter=delimiter)
    try:
        for record in reader:
            # A row ends on line_num; one with line breaks inside quotes began that many earlier.
            held = lines.take()
            row, spans = "".join(held), len(held)
            line = part.offset + reader.line_num - spans + 1
            if '"' in row and (broken := _broken_quote(row, delimiter, spans)) is not None:
                bad.report(f"{path}:{line}: {broken}")
                rest = itertools.chain(held[1:], lines.lines)  # the lines as the file splits them
                return _CsvPart(rest, list(reader.fieldnames or []), line)
            texts = [v for v in record.values() if isinstance(v, str)]
            # DictReader files a row's extra fields under None and fills missing ones with None:
            # a comma in an unquoted field would otherwise cut a text short without a word.
            extra = record.pop(None, None)  # type: ignore[call-overload]
            missing = sum(value is None for value in record.values())
            if extra or missing:
                header = len(record)
                mark = "a comma" if delimiter == "," else "a tab"
                hint = f" (quote a field that holds {mark})" if extra else ""
                found = header + len(extra or ()) - missing
                fields = f"{found} field" + ("s" if found != 1 else "")
                bad.report(f"{path}:{line}: {fields} where the header has {header}{hint}")
                continue
            if any(_NOT_UTF8.search(v) for v in texts):
                bad.report(f"{path}:{line}: not valid UTF-8")
                continue
            yield Record(path, line, dict(record))
    except csv.Error as e:
        at = f":{part.offset + reader.line_num}" if reader.line_num else ""
        raise UserError(f"{path}{at}: not valid {'CSV' if delimiter == ',' else 'TSV'} ({e})") from None
    return None


class _RowLines:
    """A CSV file's lines as its reader takes them, keeping those of the row being read."""

    def __init__(self, f: Iterable[str], header: bool):
        self.lines, self.held, self.header = iter(f), list[str](), header

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        line = next(self.lines)
        self.held.append(line)
        return line

    def take(self) -> list[str]:
        """The lines of the row just read (a header's left out)."""
        held, self.held = self.held[1:] if self.header else self.held, []
        self.header = False
        return held


_QUOTE_FIX = 'close it, or double a quote inside a quoted field: ""'


def _broken_quote(row: str, delimiter: str, spans: int) -> str | None:
    """What is wrong with a row read leniently (pandas' own default) whose quote is left open, or
    None: a quote never closed takes the rest of the file as its field, and one closed by a later
    field's opening quote takes the lines between; pandas refuses the first, reads the second."""
    try:
        for _ in csv.reader(io.StringIO(row, newline=""), delimiter=delimiter, strict=True):
            pass
    except csv.Error as e:
        if "unexpected end of data" in str(e) and spans == 1:
            return f"a quoted field opens here and the file ends before it closes ({_QUOTE_FIX})"
        if "unexpected end of data" in str(e):
            return (
                f"a quoted field opens here and is never closed: the {spans:,} lines to the end of the "
                f"file would be one field ({_QUOTE_FIX})"
            )
        if spans > 1:
            return (
                f"a quoted field opens here, runs over {spans:,} lines and its closing quote is followed "
                f"by more text: a quote is left open here ({_QUOTE_FIX})"
            )
    return None


def _txt(path: str, text_field: str, mode: str, bad: BadLines, json_as_text: bool) -> Iterator[Record]:
    checked = json_as_text
    if mode == "line":
        for lineno, line in _decoded_lines(path, bad):
            if line.strip():
                checked = checked or _not_json_lines(path, lineno, line)
                yield Record(path, lineno, {text_field: line.rstrip("\r\n")})
        return
    block: list[str] = []
    start = 0
    for lineno, line in _decoded_lines(path, bad):
        if line.strip():
            checked = checked or _not_json_lines(path, lineno, line)
            if not block:
                start = lineno
            block.append(line.rstrip("\r\n"))
        elif block:
            yield Record(path, start, {text_field: "\n".join(block)})
            block = []
    if block:
        yield Record(path, start, {text_field: "\n".join(block)})


def _not_json_lines(path: str, lineno: int, line: str) -> bool:
    """True for a ``.txt`` whose first line is not a JSON object; one that is, is refused: its
    records would train as their JSON text, braces and field names included, without a word."""
    if line.lstrip().startswith("{") and _one_object(line):
        raise UserError(
            f"{path}:{lineno}: a JSON object in a .txt file, which trains each line as plain text; "
            f"name the file .jsonl to read its records, or give --data-format text to train on the JSON text"
        )
    return True


def _rows(dataset: Any, name: str) -> Iterator[Record]:
    for i, row in enumerate(dataset, start=1):
        yield Record(name, i, dict(row))


def _hf_disk(path: str, split: str | None) -> Iterator[Record]:
    from datasets import DatasetDict, load_from_disk

    try:
        loaded = load_from_disk(path)  # memory-mapped Arrow: nothing is read into RAM up front
    except (FileNotFoundError, KeyError, ValueError, TypeError) as e:  # a dataset_dict.json of another kind
        held = "dataset_dict.json" if (Path(path) / "dataset_dict.json").is_file() else "state.json"
        raise UserError(
            f"{path}: holds {held} but is no folder datasets' save_to_disk wrote ({type(e).__name__}: "
            f"{brief(str(e), 80)}); give its data files themselves"
        ) from None
    if isinstance(loaded, DatasetDict):
        if split is None and "train" not in loaded:  # the one to train on is the user's to name
            raise UserError(
                f"{path}: a data set of splits with no 'train' split (splits: {', '.join(loaded)}); name the "
                f"split to use as its folder, such as {Path(path) / next(iter(loaded))}"
            )
        chosen = split or "train"
        if chosen not in loaded:
            raise UserError(f"{path}: no split '{chosen}' (splits: {', '.join(loaded)})")
        loaded = loaded[chosen]
    yield from _rows(loaded, path)


def _hf_hub(name: str, split: str) -> Iterator[Record]:
    from lmtune.config.environment import hub_reachable

    reachable = hub_reachable()
    try:
        from datasets import load_dataset

        with nullcontext() if reachable else _cache_only():
            dataset = load_dataset(name, split=split)
    except Exception as e:  # offline, unknown name, missing split: all say the same to the user
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = "" if reachable else " from the local cache (the hub is out of reach)"
        raise UserError(
            f"--data {name}: not a local file or folder, and loading the Hugging Face data set "
            f"'{name}' (split '{split}'){where} failed: {first}"
        ) from None
    yield from _rows(dataset, name)


@contextmanager
def _cache_only() -> Iterator[None]:
    """The hub clients in offline mode for one load: the local cache at once, not a minute of
    retries against a hub that is out of reach (the mode is read when a load runs)."""
    import datasets.config
    import huggingface_hub.constants

    modules: tuple[Any, ...] = (datasets.config, huggingface_hub.constants)
    before = [m.HF_HUB_OFFLINE for m in modules]
    for m in modules:
        m.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for m, value in zip(modules, before, strict=True):
            m.HF_HUB_OFFLINE = value


def _sample(split: str, text_field: str) -> Iterator[Record]:
    train, held_out = addition_examples()
    for i, text in enumerate(train if split == "train" else held_out, start=1):
        yield Record(SAMPLE if split == "train" else SAMPLE_EVAL, i, {text_field: text})
