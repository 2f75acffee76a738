"""Data preparation: read, render and tokenize once, cache on disk, and share among ranks.

Exactly one process builds a cache entry (global rank 0, or local rank 0 of each node with
``--cache-per-node`` for node-local disks); the others poll the file system for it instead of
waiting in a collective, so tokenizing a large corpus never runs into the process-group timeout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lmtune.data.dataset import META_FILE, DatasetWriter, TokenizedDataset
from lmtune.data.formats import ensure_chat_template
from lmtune.data.sources import BadLines, Record, Source, iter_records, resolve_sources
from lmtune.data.tokenize import Encoded, EncodeStats, chunks, encode_chunk
from lmtune.distributed import DistEnv, broadcast_object
from lmtune.errors import UserError

CACHE_VERSION = 1
CACHE_ENV = "LMTUNE_CACHE_DIR"


@dataclass(frozen=True)
class DataSettings:
    """How records become training examples; every field is part of the cache key."""

    format: str = "auto"
    text_field: str = "text"
    max_length: int = 512
    truncation: str = "right"
    skip_bad_lines: bool = False
    txt_mode: str = "line"


@dataclass(frozen=True)
class Prepared:
    dataset: TokenizedDataset
    built: bool  # this process tokenized it (False: it read the cache)
    key: str
    folder: Path


class Sink(Protocol):
    def write(self, examples: list[Encoded]) -> None: ...


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmtune"
    )
    return Path(root) / "data"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    digest = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    digest.update(f"{type(tokenizer).__name__}|{ids}|{getattr(tokenizer, 'chat_template', None)}".encode())
    return digest.hexdigest()


def cache_key(sources: list[Source], tokenizer: Any, settings: DataSettings) -> str:
    """Changes when the data's content, the tokenizer, its template or any setting changes."""
    parts = {
        "version": CACHE_VERSION,
        "sources": [s.fingerprint() for s in sources],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": dataclasses.asdict(settings),
    }
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=12).hexdigest()


def records(sources: list[Source], settings: DataSettings, bad: BadLines) -> Iterator[Record]:
    for source in sources:
        yield from iter_records(source, settings.text_field, bad, settings.txt_mode)


def encode_into(
    recs: Iterable[Record], tokenizer: Any, settings: DataSettings, sink: Sink, bad: BadLines
) -> EncodeStats:
    """Stream records through rendering and tokenization into ``sink``, a chunk at a time."""
    stats = EncodeStats()
    for chunk in chunks(recs):
        encoded, chunk_stats = encode_chunk(
            chunk,
            tokenizer,
            settings.format,
            settings.text_field,
            settings.max_length,
            settings.truncation,
            bad,
        )
        sink.write(encoded)
        stats.merge(chunk_stats)
    return stats


class _ListSink:
    def __init__(self) -> None:
        self.examples: list[Encoded] = []

    def write(self, examples: list[Encoded]) -> None:
        self.examples += examples


def encode_in_memory(
    recs: Iterable[Record], tokenizer: Any, settings: DataSettings
) -> tuple[TokenizedDataset, EncodeStats]:
    """Tokenize records without a cache: for small data, tests and tools."""
    ensure_chat_template(tokenizer)
    sink = _ListSink()
    stats = encode_into(recs, tokenizer, settings, sink, BadLines(skip=settings.skip_bad_lines))
    return TokenizedDataset.from_encoded(sink.examples), stats


def _build(
    sources: list[Source], tokenizer: Any, settings: DataSettings, folder: Path, spec: str, option: str
) -> None:
    started = time.perf_counter()
    bad = BadLines(skip=settings.skip_bad_lines)
    writer = DatasetWriter(folder)
    stats = encode_into(records(sources, settings, bad), tokenizer, settings, writer, bad)
    if stats.examples == 0:
        raise UserError(
            f"{option} {spec}: no examples left ({stats.dropped_too_long} longer than --max-length, "
            f"{stats.dropped_no_targets} with no trainable tokens, {bad.count} bad lines skipped)"
        )
    writer.close(
        {
            **dataclasses.asdict(stats),
            "bad_lines": bad.count,
            "bad_line_examples": bad.messages,
            "sources": [s.name for s in sources],
            "settings": dataclasses.asdict(settings),
            "build_seconds": time.perf_counter() - started,
        }
    )


def _wait_for(folder: Path, error_file: Path, poll_s: float = 0.1) -> None:
    while not (folder / META_FILE).is_file():
        if error_file.is_file():
            raise UserError(error_file.read_text(encoding="utf-8"))
        time.sleep(poll_s)


def prepare(
    spec: str,
    tokenizer: Any,
    settings: DataSettings,
    env: DistEnv,
    cache_dir: Path,
    per_node: bool = False,
    option: str = "--data",
) -> Prepared:
    """Return the tokenized data set for ``spec``, building the cache entry once if it is missing."""
    ensure_chat_template(tokenizer)
    sources = resolve_sources(spec, option)
    # Rank 0 hashes the inputs once; a nonce per run keeps error markers of runs apart.
    mine = (cache_key(sources, tokenizer, settings), uuid.uuid4().hex[:8]) if env.is_main else ("", "")
    key, nonce = broadcast_object(mine, env)
    folder = cache_dir / key
    error_file = cache_dir / f"{key}.error-{nonce}"
    builder = env.is_main or (per_node and env.local_rank == 0)
    built = False
    if builder and not (folder / META_FILE).is_file():
        tmp = cache_dir / f"{key}.tmp-{nonce}-{env.rank}"
        try:
            _build(sources, tokenizer, settings, tmp, spec, option)
        except UserError as e:
            error_file.parent.mkdir(parents=True, exist_ok=True)
            error_file.write_text(str(e), encoding="utf-8")
            raise
        finally:
            if not (tmp / META_FILE).is_file():
                shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.rename(folder)
        except OSError:  # another node's builder finished first on a shared disk
            shutil.rmtree(tmp, ignore_errors=True)
        built = True
    else:
        _wait_for(folder, error_file)
    return Prepared(TokenizedDataset.open(folder), built, key, folder)
