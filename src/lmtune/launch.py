"""Re-launch `lmtune train` as N processes through torch.distributed.run (what `torchrun` is)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from lmtune.errors import USER_ERROR_EXIT_CODE

# Workers started by `relaunch` leave user-error messages here instead of printing them, so the
# launcher prints each distinct message once rather than once per rank.
ERROR_DIR_ENV = "LMTUNE_ERROR_DIR"


def report_user_error(message: str) -> None:
    """Print a user error, or hand it to the launcher that started this worker."""
    from lmtune.distributed import launched_rank

    error_dir = os.environ.get(ERROR_DIR_ENV)
    rank = launched_rank()
    if error_dir and rank is not None and Path(error_dir).is_dir():
        (Path(error_dir) / f"rank-{rank}.txt").write_text(message, encoding="utf-8")
        return
    prefix = f"error (rank {rank})" if rank else "error"
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)


def relaunch(argv: list[str], nproc_per_node: int) -> int:
    """Run ``lmtune <argv>`` in ``nproc_per_node`` local processes; return the exit code.

    The rendezvous endpoint is ``localhost:0`` so the OS picks a free port: two runs on one machine
    never collide. When one worker fails the launcher stops the others, so no rank is left hanging.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    error_dir = tempfile.mkdtemp(prefix="lmtune-errors-")
    os.environ[ERROR_DIR_ENV] = error_dir
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc_per_node,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
    )
    # The agent logs every stop of a worker; we report failures ourselves, once, below.
    elastic_log = logging.getLogger("torch.distributed.elastic")
    previous_level = elastic_log.level
    elastic_log.setLevel(logging.CRITICAL)
    try:
        elastic_launch(config, sys.executable)("-m", "lmtune", *argv)
        return 0
    except ChildFailedError as e:
        messages = _user_errors(Path(error_dir))
        if messages:
            for message in messages:
                print(f"error: {message}", file=sys.stderr, flush=True)
            return USER_ERROR_EXIT_CODE
        for rank, failure in sorted(e.failures.items()):
            print(f"lmtune: rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return 1
    except SignalException as e:
        # Ctrl+C or a scheduler's SIGTERM: the agent has already stopped the workers.
        print(f"lmtune: stopped by {e.sigval.name}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        elastic_log.setLevel(previous_level)
        os.environ.pop(ERROR_DIR_ENV, None)
        shutil.rmtree(error_dir, ignore_errors=True)


def _user_errors(error_dir: Path) -> list[str]:
    seen: list[str] = []
    for path in sorted(error_dir.glob("rank-*.txt"), key=lambda p: int(p.stem.split("-")[1])):
        message = path.read_text(encoding="utf-8")
        if message not in seen:
            seen.append(message)
    return seen
