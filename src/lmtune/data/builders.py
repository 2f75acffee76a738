"""What a tokenized-data cache entry's builder tells the ranks that wait for it: its error, or that
its node's copy of the data is not rank 0's."""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path

from lmtune.parallel.distributed import DistEnv

NODE_COPY_DIFFERS = (
    "this node's copy of the data differs from rank 0's (other content): every node must read the "
    "same files (its --cache-per-node entry would hold other examples under the same key)"
)


def tell_waiters(error_file: Path, env: DistEnv, message: str) -> str:
    """``message``, written where the ranks waiting for this builder's entry read it (renamed into
    place whole: a waiting rank that saw it half written would report its own vaguer error next to
    this one); returned, for the builder to raise."""
    if env.world_size > 1:
        part = error_file.with_name(f"{error_file.name}.part-{env.rank}")  # node builders share a disk
        try:
            error_file.parent.mkdir(parents=True, exist_ok=True)
            part.write_text(message, encoding="utf-8")
            part.replace(error_file)
        except OSError:  # a disk with no room even for this: the waiting ranks' own timeout says it
            with suppress(OSError):
                part.unlink(missing_ok=True)
    return message
