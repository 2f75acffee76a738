"""Re-launch `lmtune train` as N processes through torch.distributed.run (what `torchrun` is)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from lmtune.config import TrainConfig, parse_nnodes
from lmtune.errors import USER_ERROR_EXIT_CODE

# Workers started by `relaunch` leave their error messages here instead of printing them, so the
# launcher prints each distinct message once rather than once per rank.
ERROR_DIR_ENV = "LMTUNE_ERROR_DIR"


def report_error(message: str, exit_code: int) -> None:
    """Print an error that ends the run, or hand it to the launcher that started this worker."""
    from lmtune.distributed import launched_rank

    error_dir = os.environ.get(ERROR_DIR_ENV)
    rank = launched_rank()
    if error_dir and rank is not None and Path(error_dir).is_dir():
        report = json.dumps({"message": message, "exit_code": exit_code})
        (Path(error_dir) / f"rank-{rank}.json").write_text(report, encoding="utf-8")
        return
    prefix = f"error (rank {rank})" if rank else "error"
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)


def needs_launcher(cfg: TrainConfig) -> bool:
    """Whether this command must start the job through torch.distributed.run."""
    return cfg.nproc_per_node > 1 or parse_nnodes(cfg.nnodes)[1] > 1 or cfg.max_restarts > 0


def world_size_bounds(cfg: TrainConfig) -> tuple[int, int]:
    low, high = parse_nnodes(cfg.nnodes)
    return low * cfg.nproc_per_node, high * cfg.nproc_per_node


def relaunch(argv: list[str], cfg: TrainConfig) -> int:
    """Run ``lmtune <argv>`` as ``cfg.nproc_per_node`` local workers of the job; return the exit code.

    One machine: the rendezvous endpoint is ``localhost:0`` so the OS picks a free port, and two
    runs never collide. Several machines: c10d rendezvous at ``--rdzv-endpoint``, hosted by node 0.
    When a worker fails the launcher stops the others, so no rank is left hanging; with
    ``--max-restarts`` it starts them all again and they resume from the newest checkpoint.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    error_dir = tempfile.mkdtemp(prefix="lmtune-errors-")
    os.environ[ERROR_DIR_ENV] = error_dir
    min_nodes, max_nodes = parse_nnodes(cfg.nnodes)
    single_node = max_nodes == 1 and cfg.rdzv_endpoint is None
    rdzv_configs: dict[str, object] = {}
    if cfg.node_rank is not None:
        # Every node may resolve the endpoint's host as its own (loopback tests, one-host setups):
        # say which one hosts the store instead of leaving it to a race.
        rdzv_configs["is_host"] = cfg.node_rank == 0
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=cfg.nproc_per_node,
        run_id=str(uuid.uuid4()) if single_node else cfg.rdzv_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0" if single_node else str(cfg.rdzv_endpoint),
        rdzv_configs=rdzv_configs,
        max_restarts=cfg.max_restarts,
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
        reported = _reported_errors(Path(error_dir))
        messages = list(dict.fromkeys(message for message, _ in reported))
        for message in messages:
            print(f"error: {message}", file=sys.stderr, flush=True)
        # By what the workers reported, not by which exit the agent saw first: a worker stopped
        # while it tears down after the error can die of a signal instead.
        codes = {code for _, code in reported} | {f.exitcode for f in e.failures.values()}
        if USER_ERROR_EXIT_CODE in codes:
            return USER_ERROR_EXIT_CODE
        if not messages:
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


def _reported_errors(error_dir: Path) -> list[tuple[str, int]]:
    """(message, exit code) of every worker that reported one, by rank."""
    found = sorted(error_dir.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    reports = [json.loads(p.read_text(encoding="utf-8")) for p in found]
    return [(r["message"], int(r["exit_code"])) for r in reports]
