"""Data preparation: read, render and tokenize once, cache on disk, and share among ranks.

Exactly one process builds a cache entry (global rank 0, or local rank 0 of each node with
``--cache-per-node`` for node-local disks); the others poll the file system for it instead of
waiting in a collective, so tokenizing a large corpus never runs into the process-group timeout.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lmtune.config import environment
from lmtune.config.files import read_text
from lmtune.config.groups import DataSettings, ExampleSettings
from lmtune.data.builders import NODE_COPY_DIFFERS, tell_waiters
from lmtune.data.dataset import META_FILE, DatasetWriter, TokenizedDataset, named_here
from lmtune.data.formats import FieldMap, ensure_chat_template
from lmtune.data.leftovers import CACHE_WAIT_TIMEOUT_ENV, CACHE_WAIT_TIMEOUT_S, remove_entry, remove_stale
from lmtune.data.mixture import COMPONENTS_META
from lmtune.data.readers import records
from lmtune.data.sources import (
    BadLines,
    Record,
    Source,
    files_read,
    first_places,
    in_parentheses,
    resolve_components,
    skipped_lines,
)
from lmtune.data.tokenize import Encoded, EncodeStats, chunks, encode_chunk
from lmtune.errors import SettingError, UserError, megabytes, out_of_space
from lmtune.parallel.distributed import DistEnv, available_cores, decided_by_main
from lmtune.parallel.launch import warn

# The entries' version, bumped when the same data tokenizes otherwise (2: an opening assistant turn
# trains without its header; tool calls refused; 3: a pair of whole texts splits at HH's last
# assistant marker or a word's start; 4: preference records count an unread system field; 5:
# conversations count theirs, and instruction records an unread context; 6: the EOS a tokenizer
# appends itself trains; 7: Phi-3's empty replies train their own end of turn, conversations count
# a system turn their template leaves out); a checkpoint's data key keeps 1: older runs resume.
CACHE_VERSION, _KEY_VERSION = 7, 1
LARGE_INPUT_BYTES = 16 << 20
CACHE_ENV = environment.CACHE_DIR
# A waiting rank gives up when the builder has written nothing for this long (it died, or hangs).


@dataclass(frozen=True)
class Prepared:
    dataset: TokenizedDataset
    built: bool  # this process tokenized it (False: it read the cache)
    key: str  # the data's, as a checkpoint's fingerprint records it
    folder: Path  # the cache entry
    files: tuple[str, ...] = ()  # the spec's folders' and globs' files, as this run resolved them


@dataclass(frozen=True)
class Wanted:
    """What :func:`prepare` tokenizes: a --data or --eval-data value, the option that gave it, and
    whether its sources are kept apart (a mixture, per-source evaluation): then each is tokenized
    in turn and the entry's meta counts the examples of each (``component_examples``)."""

    spec: str
    option: str = "--data"
    per_source: bool = False


class Sink(Protocol):
    def write(self, examples: list[Encoded]) -> None: ...


def cache_root() -> Path:
    """lmtune's cache: $LMTUNE_CACHE_DIR, else ~/.cache/lmtune."""
    chosen = environment.folder(CACHE_ENV, must_exist=False)
    if chosen is not None:
        return chosen
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lmtune")


def default_cache_dir() -> Path:
    return cache_root() / "data"


def data_cache_dir(data: DataSettings) -> Path:
    """--cache-dir, else lmtune's default cache of tokenized data; created here, so a folder that
    cannot be is named by what chose it (a traceback from deep in the build would not)."""
    path = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if data.cache_dir:
            raise SettingError(
                "cache_dir", "--cache-dir", f"{path}: cannot create it ({e.strerror})"
            ) from None
        chosen = CACHE_ENV if os.environ.get(CACHE_ENV) else f"lmtune's cache ({CACHE_ENV} chooses another)"
        raise UserError(f"{chosen}: {path}: cannot create it ({e.strerror})") from None
    return path


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


def cache_key(
    sources: list[Source], tokenizer: Any, settings: ExampleSettings, components: list[int] | None = None
) -> tuple[str, str]:
    """The data's key and its cache entry's name (also :data:`CACHE_VERSION`'s), changed by the data's
    content, the tokenizer, its template or any setting; an entry kept per source (``components``:
    the files of each) is another than the whole. (A mixture's weights do not change the tokens.)"""
    parts: dict[str, Any] = {
        "sources": [s.fingerprint() for s in sources],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "settings": dataclasses.asdict(settings),
    }
    if components is not None:  # absent otherwise: the keys of entries built before stay valid
        parts["components"] = components
    texts = (json.dumps({**parts, "version": v}, sort_keys=True) for v in (_KEY_VERSION, CACHE_VERSION))
    key, entry = (hashlib.blake2b(s.encode(), digest_size=12).hexdigest() for s in texts)
    return key, entry


def _encode(
    chunk: list[Record], tokenizer: Any, settings: ExampleSettings, bad: BadLines
) -> tuple[list[Encoded], EncodeStats]:
    return encode_chunk(chunk, tokenizer, settings, FieldMap.of(settings), bad)


# Set once in each pool worker by its initializer: the tokenizer is sent to a worker once, not
# with every chunk.
_worker_state: tuple[Any, ExampleSettings] | None = None


def _worker_init(tokenizer: Any, settings: ExampleSettings) -> None:
    global _worker_state
    _worker_state = (tokenizer, settings)


def _worker_encode(chunk: list[Record]) -> tuple[list[Encoded], EncodeStats, list[str]]:
    assert _worker_state is not None
    collected = BadLines(skip=True, keep=len(chunk))
    encoded, stats = _encode(chunk, *_worker_state, collected)
    return encoded, stats, collected.messages


def encode_into(
    recs: Iterable[Record],
    tokenizer: Any,
    settings: ExampleSettings,
    sink: Sink,
    bad: BadLines,
    workers: int = 1,
    check_stop: Callable[[], None] = lambda: None,
) -> EncodeStats:
    """Stream records through rendering and tokenization into ``sink``, a chunk at a time.

    With ``workers > 1`` chunks are rendered and tokenized in that many processes (chat templates
    render in Python, so one core would be the limit); results come back in order, and a bad
    record stops the build exactly as it would in one process. ``check_stop`` runs between chunks
    (it raises to end the build when the run is asked to stop).
    """
    stats = EncodeStats()
    if workers <= 1:
        for chunk in chunks(recs):
            check_stop()
            encoded, chunk_stats = _encode(chunk, tokenizer, settings, bad)
            sink.write(encoded)
            stats.merge(chunk_stats)
        return stats
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch threads
    with (
        _main_not_rerun(),
        ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer, settings)) as pool,
    ):
        for encoded, chunk_stats, messages in pool.imap(_worker_encode, chunks(recs)):
            check_stop()
            for message in messages:
                bad.report(message)
            sink.write(encoded)
            stats.merge(chunk_stats)
    return stats


@contextmanager
def _main_not_rerun() -> Iterator[None]:
    """Spawned workers that do not run the user's script again. Spawn re-imports ``__main__`` in
    every worker, for functions defined there; lmtune's workers need none, and a script without an
    ``if __name__ == "__main__":`` guard (the README's Python example) called lmtune.train in each
    one: the worker failed on the run's lock, the pool started another, without end."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    names: tuple[str, ...] = ("__file__", "__spec__")
    hidden = {name: main.__dict__.pop(name) for name in names if name in main.__dict__}
    main.__spec__ = None  # spawn reads the attribute; absent, and no __file__: nothing to re-import
    try:
        yield
    finally:
        del main.__spec__
        main.__dict__.update(hidden)


def build_workers(sources: list[Source]) -> int:
    """Processes for tokenizing: every core for large inputs; one for small ones, where starting
    the workers would cost more than it saves."""
    total = 0
    for s in sources:
        path = Path(s.name)
        if s.kind == "hf_hub":
            total += LARGE_INPUT_BYTES
        elif path.is_dir():
            total += sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            total += path.stat().st_size
    return available_cores() if total >= LARGE_INPUT_BYTES else 1


class _ListSink:
    def __init__(self) -> None:
        self.examples: list[Encoded] = []

    def write(self, examples: list[Encoded]) -> None:
        self.examples += examples


def encode_in_memory(
    recs: Iterable[Record], tokenizer: Any, settings: ExampleSettings, bad: BadLines | None = None
) -> tuple[TokenizedDataset, EncodeStats]:
    """Tokenize records without a cache: for small data, tests and tools."""
    ensure_chat_template(tokenizer)
    sink = _ListSink()
    bad = bad if bad is not None else BadLines(skip=settings.skip_bad_lines)
    stats = encode_into(recs, tokenizer, settings, sink, bad)
    return TokenizedDataset.from_encoded(sink.examples), stats


@contextmanager
def _said_for_the_cache(folder: Path) -> Iterator[None]:
    """A read-only or full cache disk while ``folder`` is built, said in a sentence (what was written
    removed first, so that the sentence can be recorded for the ranks that wait)."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise UserError(
                f"--cache-dir {folder.parent}: cannot write the tokenized data there ({e.strerror}); give "
                "--cache-dir (or LMTUNE_CACHE_DIR) a folder this process can write"
            ) from None
        if not out_of_space(e, folder):
            raise
        written = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
        shutil.rmtree(folder, ignore_errors=True)
        raise UserError(
            f"no space left on device while caching the tokenized data in {folder.parent} (it needs more "
            f"than the {megabytes(written)} it wrote before the disk filled, now removed; "
            f"{megabytes(_free(folder.parent))} is free): free some space there, or give --cache-dir (or "
            "LMTUNE_CACHE_DIR) a folder on a disk with room"
        ) from None


def _free(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def _build(
    components: list[list[Source]],
    tokenizer: Any,
    settings: ExampleSettings,
    folder: Path,
    wanted: Wanted,
    check_stop: Callable[[], None],
) -> None:
    """Tokenize ``components`` (one list of every source, or one per source of a mixture) into ``folder``."""
    started = time.perf_counter()
    # The first bad line stops the build: the others are found by the audit, not one run at a time.
    then = "; lmtune data audit lists every bad line, and --skip-bad-lines passes over them"
    bad = BadLines(skip=settings.skip_bad_lines, then=then)
    writer = DatasetWriter(folder)
    sources = [s for part in components for s in part]
    workers = build_workers(sources)
    stats, counts = EncodeStats(), list[int]()
    try:
        for part in components:
            recs = records(part, settings, bad)
            stats.merge(encode_into(recs, tokenizer, settings, writer, bad, workers, check_stop))
            counts.append(writer.examples - sum(counts))
    except BaseException:
        writer.abandon()
        raise
    if stats.examples == 0:
        lost = stats.dropped_too_long + stats.dropped_no_targets
        if lost + bad.count == 0:
            raise UserError(f"{wanted.option} {wanted.spec}: holds no records (empty)")
        fixes = []
        if stats.dropped_too_long:
            fixes.append(f"a larger --max-length (now {settings.max_length}) keeps those too long")
        if stats.dropped_no_targets:  # whatever the length: an empty answer, a chat with no assistant turn
            fixes.append("those with no trainable tokens have no answer to train")
        raise UserError(
            f"{wanted.option} {wanted.spec}: no examples left ({stats.dropped_too_long} longer than "
            f"--max-length{in_parentheses(first_places(stats.where, 'too_long', stats.dropped_too_long))}, "
            f"{stats.dropped_no_targets} with no trainable tokens"
            f"{in_parentheses(first_places(stats.where, 'no_targets', stats.dropped_no_targets))}, "
            f"{skipped_lines(bad.count)})" + "".join(f"; {fix}" for fix in fixes)
        )
    writer.close(
        {
            **dataclasses.asdict(stats),
            "bad_lines": bad.count,
            "bad_line_examples": bad.messages,
            "sources": [s.name for s in sources],
            **({COMPONENTS_META: counts} if wanted.per_source else {}),
            "settings": dataclasses.asdict(settings),
            "build_seconds": time.perf_counter() - started,
            "build_workers": workers,
        }
    )


def _last_write(cache_dir: Path, pattern: str) -> float:
    try:
        return max((f.stat().st_mtime for d in cache_dir.glob(pattern) for f in d.iterdir()), default=0.0)
    except FileNotFoundError:  # renamed into place meanwhile: the next look finds it done
        return time.time()


def _wait_for(
    folder: Path,
    error_file: Path,
    building: str,
    check_stop: Callable[[], None],
    ready: Callable[[], bool] | None = None,
) -> None:
    """Wait for another rank to build ``folder``: until it is there (``ready``), the builder reports
    an error, this run is asked to stop, or the builder has written nothing for the timeout."""
    limit = environment.seconds(CACHE_WAIT_TIMEOUT_ENV, CACHE_WAIT_TIMEOUT_S)
    last_progress = time.time()
    while not (ready() if ready is not None else (folder / META_FILE).is_file()):
        if error_file.is_file():
            try:
                message = read_text(error_file, limit=64 << 10, follow_links=False)
            except (OSError, UserError):
                message = f"the rank that tokenizes into {folder.parent} failed (see its output)"
            raise UserError(message.strip().splitlines()[0] if message.strip() else "tokenizing failed")
        check_stop()
        last_progress = max(last_progress, _last_write(folder.parent, building))
        if time.time() - last_progress > limit:
            raise UserError(
                f"waited {limit:.0f}s for the rank that tokenizes into {folder.parent} and it wrote "
                f"nothing in that time; it died or hangs (see its output), or --cache-dir is not shared "
                "between the nodes (then use --cache-per-node)"
            )
        time.sleep(0.1)


def prepare(
    spec: str | Wanted,
    tokenizer: Any,
    settings: ExampleSettings,
    env: DistEnv,
    cache_dir: Path,
    per_node: bool = False,
    option: str = "--data",
    check_stop: Callable[[], None] = lambda: None,
) -> Prepared:
    """Return the tokenized data set for ``spec`` (given by ``option``, unless a :class:`Wanted`
    says both), building the cache entry once if it is missing or damaged (an entry is checked by
    its builder before any other rank opens it)."""
    ensure_chat_template(tokenizer)
    wanted = spec if isinstance(spec, Wanted) else Wanted(spec, option)
    named = resolve_components(wanted.spec, wanted.option)
    components, files = [part for _, part in named], files_read(wanted.spec, named)
    if not wanted.per_source:
        components = [[s for part in components for s in part]]
    sources = [s for part in components for s in part]
    if not sources:
        raise UserError(f"{wanted.option}: no data given")
    vocab, builder = len(tokenizer), env.is_main or (per_node and env.local_rank == 0)
    dataset: TokenizedDataset | None = None

    split = [len(part) for part in components] if wanted.per_source else None

    def verdict() -> tuple[str, str, str]:  # rank 0's: the others wait for it (and its errors) here
        nonlocal dataset
        # The inputs hashed once; a nonce per run keeps error markers of runs apart.
        (key, entry), nonce = cache_key(sources, tokenizer, settings, split), uuid.uuid4().hex[:8]
        dataset = _reuse(cache_dir, entry, vocab, nonce)
        return key, entry, nonce

    key, entry, nonce = decided_by_main(verdict, ("", "", ""), env)
    folder, error_file = cache_dir / entry, cache_dir / f"{entry}.error-{nonce}"
    if builder and not env.is_main:  # a node's own builder (--cache-per-node), of its own copy
        if cache_key(sources, tokenizer, settings, split)[0] != key:  # built, it would poison the entry
            told = f"{wanted.option} {wanted.spec}: {NODE_COPY_DIFFERS}"
            raise UserError(tell_waiters(error_file, env, told))
        dataset = _reuse(cache_dir, entry, vocab, nonce)
    if not builder:
        dataset = _open_built(folder, vocab, error_file, f"{entry}.tmp-{nonce}-*", check_stop)
    if dataset is not None:  # read from the cache: its places under this run's names for the files
        dataset = named_here(dataset, [s.name for s in sources])
        return Prepared(dataset=dataset, built=False, key=key, folder=folder, files=files)
    tmp = cache_dir / f"{entry}.tmp-{nonce}-{env.rank}"
    try:
        with _said_for_the_cache(tmp):
            _build(components, tokenizer, settings, tmp, wanted, check_stop)
    except UserError as e:
        tell_waiters(error_file, env, str(e))
        raise
    finally:
        if not (tmp / META_FILE).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.rename(folder)
        _fsync_folder(cache_dir)
    except OSError:  # another node's builder finished first on a shared disk
        shutil.rmtree(tmp, ignore_errors=True)
    return Prepared(TokenizedDataset.open(folder, vocab), built=True, key=key, folder=folder, files=files)


def _open_built(
    folder: Path, vocab: int, error_file: Path, building: str, check_stop: Callable[[], None]
) -> TokenizedDataset:
    """A waiting rank's entry, once its builder has it. A node's own builder (--cache-per-node)
    judges its entry after this rank may have looked: an entry that fails here is waited on until
    that builder has put a new one in its place."""
    _wait_for(folder, error_file, building, check_stop)
    try:
        return TokenizedDataset.open(folder, vocab)
    except UserError:
        seen = _identity(folder)
    _wait_for(folder, error_file, building, check_stop, ready=lambda: _identity(folder) not in (None, seen))
    return TokenizedDataset.open(folder, vocab)


def _identity(folder: Path) -> int | None:
    try:
        return (folder / META_FILE).stat().st_ino
    except OSError:
        return None


def _reuse(cache_dir: Path, key: str, vocab: int, nonce: str) -> TokenizedDataset | None:
    """The cached entry when it checks out (None: build it). A damaged one is set aside (and
    removed) with a warning naming it; stale leftovers of killed builders are removed first."""
    remove_stale(cache_dir)
    folder = cache_dir / key
    if not (folder.exists() or folder.is_symlink()):
        return None
    try:
        return TokenizedDataset.open(folder, vocab)
    except UserError as e:
        warn(f"{e}; tokenizing the data again")
    aside = folder.with_name(f"{folder.name}.bad-{nonce}")
    try:
        folder.rename(aside)
    except OSError as e:
        raise UserError(
            f"damaged data cache entry {folder} cannot be set aside ({e.strerror}); delete it"
        ) from None
    remove_entry(aside)
    return None


def _fsync_folder(folder: Path) -> None:
    """The rename of a finished entry, on disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
