"""Where examples come from: files, globs, folders and Hugging Face data sets, read as records.

Every record keeps its file and line (or record number), so any later complaint about it can name
the place a person has to look. Records are read lazily (lmtune.data.readers): a corpus larger
than memory streams through.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmtune.config.mixture import named_items
from lmtune.config.settings import SAMPLE_DATA as SAMPLE
from lmtune.config.settings import SAMPLE_EVAL
from lmtune.data.addition import SAMPLE_SEED
from lmtune.errors import SettingError, UserError

EXTENSIONS = (".jsonl", ".ndjson", ".json", ".parquet", ".csv", ".tsv", ".txt")
# Read through, as HF's loaders do (train.jsonl.gz); Parquet compresses inside its own format.
COMPRESSIONS = (".gz", ".bz2", ".xz")


def data_suffix(path: Path) -> str:
    """The suffix that says a file's format, past a compression's (``train.jsonl.gz``: ``.jsonl``)."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        return suffixes[-2] if len(suffixes) > 1 and suffixes[-2] != ".parquet" else ""
    return path.suffix.lower()


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
    then: str = ""  # after the message that stops: what to do (training's: the audit, the skip)

    def report(self, message: str) -> None:
        if not self.skip:
            raise UserError(message + self.then)
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

    kind: str  # jsonl | json | parquet | csv | tsv | txt | hf_disk | hf_hub | sample
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
    suffix = data_suffix(path)
    if suffix not in EXTENSIONS:
        shown = "".join(path.suffixes[-2:]) if path.suffix.lower() in COMPRESSIONS else path.suffix
        raise _refused(
            option,
            f"{path}: unsupported file type '{shown or '(none)'}'; use one of {', '.join(EXTENSIONS)} "
            f"(all but .parquet also compressed: {', '.join(COMPRESSIONS)})",
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
    _refuse_split_name(spec, option)
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


def files_read(spec: str, parts: list[tuple[str, list[Source]]]) -> tuple[str, ...]:
    """The files the folders and globs of ``spec`` read, ``parts`` its items' sources as
    :func:`resolve_components` gave them (() where it names each file itself)."""
    files: list[str] = []
    expanded = False
    for (_, sources), (_, item) in zip(parts, named_items(spec), strict=True):
        local = [s.name for s in sources if s.kind not in ("sample", "hf_hub", "hf_disk")]
        files += local
        expanded |= len(sources) != 1 or (bool(local) and Path(local[0]) != Path(item).expanduser())
    return tuple(files) if expanded else ()


def _refuse_split_name(spec: str, option: str) -> None:
    """A file whose name holds a comma, given as it is (``a,b.jsonl``): its pieces were sought as
    files ("no such file: a", with a near name of another file)."""
    items = [item for _, item in named_items(spec)]
    for first, second in itertools.pairwise(items):
        whole = f"{first},{second}"
        if not Path(first).expanduser().exists() and Path(whole).expanduser().exists():
            raise _refused(
                option,
                f"no such file or folder: {first} (did you mean {whole.replace(',', chr(92) + ',')}? A comma "
                "inside a name is written \\,)",
            )


def _item_sources(item: str, option: str) -> list[Source]:
    if item in (SAMPLE, SAMPLE_EVAL):
        return [Source("sample", SAMPLE, "eval" if item == SAMPLE_EVAL else "train")]
    path = Path(item).expanduser()
    if any(ch in item for ch in "*?["):
        found = [Path(p) for p in glob.glob(str(path), recursive=True)]
        _refuse_unreadable(found, option)
        matches = sorted(p for p in found if p.is_file())
        if not matches:
            raise _refused(option, f"{item}: no file matches")
        if len(matches) > 1:  # a glob over a data set's split files, as a folder of them
            common = Path(os.path.commonpath(matches))
            _refuse_splits(item, common, matches, option)
            _refuse_notes(item, common, matches, option, "matches")
        return [_file_source(p, option) for p in matches]
    if path.is_dir():
        if _is_saved_dataset(path):
            return [Source("hf_disk", str(path))]
        if weights := _model_files(path):
            said = f"{item}: a model folder (it holds {weights}), not data; a model is given with --model"
            raise _refused(option, said)
        files = _folder_files(path, option)
        if not files:
            raise _refused(option, f"{item}: folder has no {', '.join(EXTENSIONS)} files")
        _refuse_splits(item, path, files, option)
        _refuse_notes(item, path, files, option)
        inside = next((d for d in dict.fromkeys(f.parent for f in files) if _model_files(d)), None)
        if inside is not None:
            said = f"{item}: holds a model ({inside}), not only data; a model is given with --model"
            raise _refused(option, said)
        return [_file_source(p, option) for p in files]
    if path.is_file():
        return [_file_source(path, option)]
    if path.exists():  # a FIFO, a device, a socket: it said "no such file" and suggested itself
        raise _refused(option, f"{item}: not a regular file (a FIFO, device or socket is not read)")
    near = _near_names(path)
    # A path by its form (a file-like name: the hub's data sets are ORG/NAME), or a near miss of a
    # file that is there: said now, not after the hub's retries (seconds offline).
    filelike = "/" not in item and re.fullmatch(r".+\.[A-Za-z0-9]{1,5}", item) is not None
    folder = item.endswith("/")  # a hub id never ends so (it went to the hub: "Couldn't reach")
    if item.startswith((".", "/", "~")) or folder or data_suffix(path) in EXTENSIONS or filelike or near:
        # Written as the value must be: a comma lists sources, and one inside a name is \,.
        escaped = [name.replace(",", "\\,") for name in near]
        commas = " A comma inside a name is written \\,." if escaped != near else ""
        hint = f" (did you mean {' or '.join(escaped)}?{commas})" if near else ""
        if not path.is_absolute() and not item.startswith("~"):  # a --config file's too: not beside it
            hint += f" (in the working folder {Path.cwd()})"
        raise _refused(option, f"no such file or folder: {item}{hint}")
    name, _, split = item.partition(":")
    if name.lower() in BUILDERS:  # datasets' loader of that format: it reads what the working folder holds
        raise _refused(
            option,
            f"{item}: the datasets library's {name} loader (load_dataset('{name}', data_files=...)), not a "
            "data set: give the files themselves (FILE,FILE,...: their names say their format)",
        )
    return [Source("hf_hub", name, split or "train")]


# A data set's papers, not its records: a LICENSE.txt beside the .jsonl files trained as text.
_NOT_RECORDS = frozenset(
    {"readme", "license", "licence", "notice", "citation", "copying", "changelog", "authors"}
    | {"dataset_infos", "dataset_info", "dataset_dict", "state"}  # a hub data set's or datasets' metadata
)


def _folder_files(folder: Path, option: str) -> list[Path]:
    """The data files a folder given as data holds, in order of their names: not hidden ones nor
    those in hidden folders (a notebook's .ipynb_checkpoints copies, macOS's ._ files, .git), nor
    a README, LICENSE and the like."""
    named = [
        p
        for p in folder.rglob("*")
        if data_suffix(p) in EXTENSIONS
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
        and p.name.split(".")[0].lower() not in _NOT_RECORDS
    ]
    _refuse_unreadable(named, option)
    return sorted(p for p in named if p.is_file())


def _refuse_unreadable(paths: list[Path], option: str) -> None:
    """A data file of a folder or glob that is no file to read (a FIFO, a device, a socket, a
    link to nothing): it was passed over without a word, its records left out."""
    for path in paths:
        if path.is_symlink() and not path.exists():
            raise _refused(option, f"{path}: a link to {os.readlink(path)}, which is not there")
        if path.exists() and not path.is_file() and not path.is_dir():
            raise _refused(option, f"{path}: not a regular file (a FIFO, device or socket is not read)")


# The words that name a split in a file's name, as the datasets library reads a folder's files.
_SPLIT_WORDS = {
    "train": "train", "training": "train",
    "test": "held out", "testing": "held out", "validation": "held out", "valid": "held out",
    "val": "held out", "dev": "held out", "eval": "held out", "evaluation": "held out",
}  # fmt: skip


def _refuse_splits(item: str, folder: Path, files: list[Path], option: str) -> None:
    """A folder whose file names split it (train.jsonl beside test.jsonl, as a hub data set's are)
    is refused: read whole, its held-out split trained with the rest, unsaid."""
    splits: dict[str, list[Path]] = {}
    for f in files:
        words = re.split(r"[^a-z]+", str(f.relative_to(folder)).lower())
        kind = next((_SPLIT_WORDS[w] for w in words if w in _SPLIT_WORDS), None)
        if kind is not None:
            splits.setdefault(kind, []).append(f)
    if len(splits) < 2:
        return

    def listed(kind: str) -> str:
        return ",".join(str(f).replace(",", "\\,") for f in splits[kind])

    train, held = listed("train"), listed("held out")
    give = {
        "--data": f"give --data {train} and --eval-data {held}",
        "--eval-data": f"give --eval-data {held} (and --data {train})",
    }.get(option, f"give one split's files ({train}, or {held})")
    raise _refused(
        option,
        f"{item}: holds a train split and a held-out one by their file names (read whole, the held-out "
        f"files would train too): {give}",
    )


def _refuse_notes(item: str, folder: Path, files: list[Path], option: str, holds: str = "holds") -> None:
    """A folder of records (.jsonl, .parquet, ...) that holds plain text too (a notes.txt), or a
    glob that matches both, is refused: read whole, each line of the text trained as an example
    beside the records."""
    text = [f for f in files if data_suffix(f) == ".txt"]
    if not text or len(text) == len(files):
        return
    records = [f for f in files if data_suffix(f) != ".txt"]

    def named(some: list[Path]) -> str:
        shown = ", ".join(str(f.relative_to(folder)) for f in some[:3])
        return shown + (f" and {len(some) - 3} more" if len(some) > 3 else "")

    raise _refused(
        option,
        f"{item}: {holds} plain text ({named(text)}) beside records ({named(records)}); read whole, each "
        f"line of the text would train as an example: give the files to read ({option} FILE,FILE,...)",
    )


# The datasets library's packaged loaders: load_dataset("json") without data_files reads every such
# file under the working folder (Axolotl's datasets: path: json with data_files).
BUILDERS = frozenset(
    {"arrow", "audiofolder", "cache", "csv", "generator", "hdf5", "imagefolder", "json", "pandas", "parquet"}
    | {"pdffolder", "spark", "sql", "text", "videofolder", "webdataset", "xml"}
)


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
