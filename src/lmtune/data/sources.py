"""Where examples come from: files, globs, folders and Hugging Face data sets, read as records.

Every record keeps its file and line (or record number), so any later complaint about it can name
the place a person has to look. Records are read lazily: a corpus larger than memory streams
through.
"""

from __future__ import annotations

import codecs
import csv
import difflib
import glob
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmtune.config.mixture import named_items
from lmtune.config.settings import SAMPLE_DATA as SAMPLE
from lmtune.config.settings import SAMPLE_EVAL
from lmtune.data.addition import SAMPLE_SEED, addition_examples
from lmtune.errors import SettingError, UserError

EXTENSIONS = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".txt")


@dataclass(frozen=True)
class Record:
    """One example's raw fields and where it was read."""

    source: str
    line: int  # 1-based line of a text file, or record number of a table or data set
    fields: dict[str, Any]
    item: int = 0  # its number in a file where records share a line (a JSON list on one line)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}" + (f" (record {self.item})" if self.item else "")


@dataclass
class BadLines:
    """Lines that could not be read. With ``skip`` they are counted and passed over, else raised."""

    skip: bool
    count: int = 0
    messages: list[str] = field(default_factory=list)
    keep: int = 20

    def report(self, message: str) -> None:
        if not self.skip:
            raise UserError(message)
        self.count += 1
        if len(self.messages) < self.keep:
            self.messages.append(message)


def skipped_lines(count: int) -> str:
    """How the log says ``count`` bad lines were passed over (--skip-bad-lines)."""
    return f"{count} bad line{'s' * (count != 1)} skipped"


def first_places(where: Mapping[str, list[str]], kind: str, count: int) -> str:
    """``at f.jsonl:3, f.jsonl:9 and 4 more``: where the first of ``count`` examples of a ``kind``
    of loss are (:attr:`EncodeStats.where`, or a cache's meta of it), or "" when none is known."""
    places = where.get(kind, [])
    if not places or not count:
        return ""
    more = f" and {count - len(places):,} more" if count > len(places) else ""
    return f"at {', '.join(places)}{more}"


def in_parentheses(text: str) -> str:
    """`` (text)``, or "" for no text."""
    return f" ({text})" if text else ""


@dataclass(frozen=True)
class Source:
    """One input: a file (``kind`` is its reader), a saved data set folder, a hub data set or the sample."""

    kind: str  # jsonl | json | parquet | csv | txt | hf_disk | hf_hub | sample
    name: str
    split: str | None = None

    def fingerprint(self) -> str:
        """Identifies the content, for the cache key: a file's bytes, a data set's fingerprint."""
        if self.kind == "sample":
            return f"sample-{SAMPLE_SEED}-{self.split}"
        if self.kind == "hf_hub":
            return f"hub:{self.name}:{self.split}"
        path = Path(self.name)
        digest = hashlib.blake2b(digest_size=16)
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if path.is_dir():  # names order a folder's files; a single file is its content alone
                digest.update(str(f.relative_to(path)).encode())
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    digest.update(chunk)
        return f"{self.kind}:{digest.hexdigest()}:{self.split}"


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


# What makes a folder a model's (a run's final/, an export, a checkpoint, a PEFT adapter): its JSON
# files are configs, not records.
_MODEL_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_config.json",
)


def _model_files(folder: Path) -> str:
    """The model file ``folder`` holds beside a config ("" when none)."""
    configs = (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()
    return next((name for name in _MODEL_FILES if configs and (folder / name).is_file()), "")


def _file_source(path: Path, option: str) -> Source:
    suffix = path.suffix.lower()
    if suffix not in EXTENSIONS:
        raise _refused(
            option,
            f"{path}: unsupported file type '{suffix or '(none)'}'; use one of {', '.join(EXTENSIONS)}",
        )
    kind = "jsonl" if suffix == ".ndjson" else suffix[1:]
    return Source(kind, str(path))


def resolve_sources(spec: str, option: str = "--data") -> list[Source]:
    """Turn ``--data`` into sources: comma-separated files, globs, folders or data set names.

    A folder is a saved Hugging Face data set when it has one, else every supported file in it.
    A name that is no path is a hub data set, ``NAME`` or ``NAME:SPLIT`` (split ``train`` by default).
    An item may be named, ``NAME=ITEM`` (a mixture's source).
    """
    sources = [s for _, part in resolve_components(spec, option) for s in part]
    if not sources:
        raise UserError(f"{option}: no data given")
    return sources


def resolve_components(spec: str, option: str = "--data") -> list[tuple[str, list[Source]]]:
    """Each named item of ``spec`` (lmtune.config.mixture.named_items) with its sources; a source
    reached twice (``a.jsonl,a.jsonl``, a file and a glob that matches it) is refused: each of its
    examples would count twice, unasked."""
    parts = [(name, _item_sources(item, option)) for name, item in named_items(spec)]
    seen: set[tuple[str, str, str | None]] = set()
    for source in (s for _, part in parts for s in part):
        local = source.kind not in ("hf_hub", "sample")
        key = (source.kind, str(Path(source.name).resolve()) if local else source.name, source.split)
        if key in seen:
            twice = {"--data": "trained twice an epoch", "--eval-data": "evaluated twice"}.get(
                option, "counted twice"
            )
            raise _refused(
                option,
                f"{source.name} is named twice (each of its examples would be {twice}); give it once"
                + (", and --data-weights to draw it more often" if option == "--data" else ""),
            )
        seen.add(key)
    return parts


def _item_sources(item: str, option: str) -> list[Source]:
    if item in (SAMPLE, SAMPLE_EVAL):
        return [Source("sample", SAMPLE, "eval" if item == SAMPLE_EVAL else "train")]
    path = Path(item).expanduser()
    if any(ch in item for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not matches:
            raise _refused(option, f"{item}: no file matches")
        return [_file_source(p, option) for p in matches]
    if path.is_dir():
        if _is_saved_dataset(path):
            return [Source("hf_disk", str(path))]
        if weights := _model_files(path):
            said = f"{item}: a model folder (it holds {weights}), not data; a model is given with --model"
            raise _refused(option, said)
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in EXTENSIONS)
        if not files:
            raise _refused(option, f"{item}: folder has no {', '.join(EXTENSIONS)} files")
        inside = next((d for d in dict.fromkeys(f.parent for f in files) if _model_files(d)), None)
        if inside is not None:
            said = f"{item}: holds a model ({inside}), not only data; a model is given with --model"
            raise _refused(option, said)
        return [_file_source(p, option) for p in files]
    if path.is_file():
        return [_file_source(path, option)]
    near = _near_names(path)
    # A path by its form (a file-like name: the hub's data sets are ORG/NAME), or a near miss of a
    # file that is there: said now, not after the hub's retries (seconds offline).
    filelike = "/" not in item and re.fullmatch(r".+\.[A-Za-z0-9]{1,5}", item) is not None
    if item.startswith((".", "/", "~")) or path.suffix.lower() in EXTENSIONS or filelike or near:
        # Written as the value must be: a comma lists sources, and one inside a name is \,.
        escaped = [name.replace(",", "\\,") for name in near]
        commas = " A comma inside a name is written \\,." if escaped != near else ""
        hint = f" (did you mean {' or '.join(escaped)}?{commas})" if near else ""
        if not path.is_absolute() and not item.startswith("~"):  # a --config file's too: not beside it
            hint += f" (in the working folder {Path.cwd()})"
        raise _refused(option, f"no such file or folder: {item}{hint}")
    name, _, split = item.partition(":")
    return [Source("hf_hub", name, split or "train")]


def _refused(option: str, reason: str) -> UserError:
    """A data setting's error: the CLI names the --config file's line when the value came from there."""
    setting = {"--data": "data", "--eval-data": "eval_data"}.get(option)
    return SettingError(setting, option, reason) if setting else UserError(f"{option}: {reason}")


def _near_names(path: Path) -> list[str]:
    """Files and folders beside ``path`` whose names are close to its name (a typo of one)."""
    folder = path.parent
    try:
        names = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    except OSError:
        return []
    # By the whole name (a.jsnl: a.jsonl) or the name without its extension (trian: train.jsonl).
    stems = {Path(n).stem: n for n in names if Path(n).stem != n}
    close = difflib.get_close_matches(path.name, [*names, *stems], n=2, cutoff=0.8)
    found = list(dict.fromkeys(stems.get(c, c) if c not in names else c for c in close))
    return [str(folder / name) if str(folder) != "." else name for name in found]


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
        "txt": lambda: _txt(source.name, text_field, txt_mode, bad, json_as_text),
        "hf_disk": lambda: _hf_disk(source.name, source.split),
        "hf_hub": lambda: _hf_hub(source.name, source.split or "train"),
        "sample": lambda: _sample(source.split or "train", text_field),
    }
    yield from readers[source.kind]()


def _decoded_lines(path: str, bad: BadLines) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):  # editors on Windows write one
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                bad.report(f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line)")


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
        try:
            record = _parse_json(line.rstrip("\r\n"), f"{path}:{lineno}")
        except UserError as e:
            bad.report(str(e))
            continue
        if not isinstance(record, dict):
            bad.report(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            continue
        yield Record(path, lineno, record)


def _json(path: str, bad: BadLines) -> Iterator[Record]:
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise UserError(f"{path}: not valid UTF-8") from None
    first = next((line for line in text.splitlines() if line.strip()), "")
    if first.lstrip().startswith("{") and _one_object(first):  # JSON Lines named .json, as HF reads it
        yield from _jsonl(path, bad)
        return
    data = _parse_json(text, path)
    if not isinstance(data, list):
        raise UserError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
    lines = list(_element_lines(text))
    shared = {line for line, count in Counter(lines).items() if count > 1}
    for (i, record), line in zip(enumerate(data, start=1), lines, strict=True):
        if not isinstance(record, dict):  # a bad line, as in JSONL: --skip-bad-lines passes over it
            bad.report(f"{path}:{line}: record {i} is not a JSON object ({type(record).__name__})")
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


def _csv(path: str, bad: BadLines) -> Iterator[Record]:
    # Python's default, 128 KiB a field, refused a long document that a JSONL line may hold.
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
    reader = None
    try:
        # Bytes that are not UTF-8 kept as escapes: the row holding them is a bad line, not the file.
        with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
            reader = csv.DictReader(f)
            for record in reader:
                # A row ends on line_num; one with line breaks inside quotes began that many earlier.
                texts = [v for v in record.values() if isinstance(v, str)]
                line = reader.line_num - sum(v.count("\n") for v in texts)
                # DictReader files a row's extra fields under None and fills missing ones with None:
                # a comma in an unquoted field would otherwise cut a text short without a word.
                extra = record.pop(None, None)  # type: ignore[call-overload]
                missing = sum(value is None for value in record.values())
                if extra or missing:
                    header = len(record)
                    hint = " (quote a field that holds a comma)" if extra else ""
                    found = header + len(extra or ()) - missing
                    fields = f"{found} field" + ("s" if found != 1 else "")
                    bad.report(f"{path}:{line}: {fields} where the header has {header}{hint}")
                    continue
                if any(_NOT_UTF8.search(v) for v in texts):
                    bad.report(f"{path}:{line}: not valid UTF-8")
                    continue
                yield Record(path, line, dict(record))
    except csv.Error as e:
        at = f":{reader.line_num}" if reader is not None and reader.line_num else ""
        raise UserError(f"{path}{at}: not valid CSV ({e})") from None


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

    loaded = load_from_disk(path)  # memory-mapped Arrow: nothing is read into RAM up front
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
