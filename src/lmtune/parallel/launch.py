"""Re-launch `lmtune train` as N processes through torch.distributed.run (what `torchrun` is)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from lmtune.config import environment
from lmtune.config.advice import memory_advice
from lmtune.config.run_groups import CheckpointSettings, LaunchSettings
from lmtune.config.settings import TrainConfig, micro_batch_size, parse_nnodes
from lmtune.errors import USER_ERROR_EXIT_CODE, UserError
from lmtune.parallel.failure_report import (
    CLOSED_ELSEWHERE,
    RESUMES,
    RestartNotes,
    failed,
    lost_connections,
    oom_kills,
    out_of_memory_kills,
    reported_errors,
)
from lmtune.parallel.health import HEALTH_DIR_ENV, Watchdog, read_beats
from lmtune.parallel.launched import proc_stat

if TYPE_CHECKING:
    from lmtune.parallel.distributed import DistEnv

# Workers started by `relaunch` leave their error messages here instead of printing them, so the
# launcher prints each distinct message once rather than once per rank.
ERROR_DIR_ENV = environment.ERROR_DIR


def report_error(message: str, exit_code: int, lost: bool = False) -> None:
    """Print an error that ends the run, or hand it to the launcher that started this worker
    (``lost``: a collective failed because another rank had gone, whose end is the cause)."""
    from lmtune.parallel.distributed import launched_rank

    error_dir = os.environ.get(ERROR_DIR_ENV)
    rank = launched_rank()
    if error_dir and rank is not None and Path(error_dir).is_dir():
        report = json.dumps({"message": message, "exit_code": exit_code, "lost": lost})
        (Path(error_dir) / f"rank-{rank}.json").write_text(report, encoding="utf-8")
        return
    prefix = f"error (rank {rank})" if rank else "error"
    print(f"{prefix}: {message}", file=sys.stderr, flush=True)


def report_stopped(message: str) -> None:
    """A stop before training (every rank stops alike): said once, by lmtune's launcher for its
    workers, else by rank 0 or a process run alone."""
    from lmtune.parallel.distributed import launched_rank

    rank = launched_rank()
    if rank or (rank is not None and os.environ.get(ERROR_DIR_ENV)):
        return
    print(f"lmtune: {message}", file=sys.stderr, flush=True)


def resume_advice(overwrite: bool, where: str = "", python: bool = False, never: bool = False) -> str:
    """How to continue a run stopped by a signal: its command (``python``: its call of
    ``lmtune.train``) again, less --overwrite (which would start it over, deleting the checkpoint it
    just saved) and --resume never (``never``: which would refuse that checkpoint)."""
    if python:
        names = [name for name, on in (("overwrite=True", overwrite), ("resume='never'", never)) if on]
        less = f" without {' and '.join(names)}" if names else ""
        return f"call lmtune.train with the same settings again{less} to resume"
    if overwrite or never:
        flags = [flag for flag, on in (("--overwrite", overwrite), ("--resume never", never)) if on]
        then = "the run starts over" if overwrite else "the run refuses its checkpoints"
        return f"run the same command without {' and '.join(flags)}{where} to resume (with it, {then})"
    return f"run the same command again{where} to resume"


def stop_advice(given: CheckpointSettings, python: bool = False) -> str:
    """:func:`resume_advice` for a run of these checkpoint settings (as the user gave them)."""
    return resume_advice(given.overwrite, python=python, never=given.resume == "never")


def report_outcome(
    step: int, *, stopped: bool, env: DistEnv, given: CheckpointSettings | None = None
) -> None:
    """Tell this node's launcher how the job ended (``stopped``: by a signal, with a checkpoint of
    ``step`` saved; ``given``: the run's checkpoint settings as the user gave them, for the advice).
    The first rank of every node does, so a node that does not run rank 0, or whose launcher was
    not the one signalled, says so too."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    overwrite, never = (given.overwrite, given.resume == "never") if given else (False, False)
    record = {"step": step, "stopped": stopped, "main": env.is_main, "overwrite": overwrite, "never": never}
    if env.local_rank == 0 and error_dir and Path(error_dir).is_dir():
        (Path(error_dir) / OUTCOME_FILE).write_text(json.dumps(record), encoding="utf-8")
    elif env.local_rank == 0 and (line := _from_elsewhere(record)):  # under torchrun: said here
        print(line, file=sys.stderr, flush=True)


def _outcome(error_dir: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads((error_dir / OUTCOME_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError):  # none (a failure), or being written right now
        return None


def _from_elsewhere(outcome: dict[str, Any] | None) -> str | None:
    """The last line of a node whose ranks did not include rank 0 (rank 0 printed the summary)."""
    if outcome is None or outcome["main"]:
        return None
    if outcome["stopped"]:
        overwrite, never = outcome.get("overwrite") is True, outcome.get("never") is True
        advice = resume_advice(overwrite, " on every node", never=never)
        return (
            f"lmtune: the job was stopped by a signal with a checkpoint of step {outcome['step']}; {advice}"
        )
    return f"lmtune: this node's ranks finished at step {outcome['step']}; rank 0's node printed the summary"


OUTCOME_FILE = "outcome.json"
# After a stop, how long a node's launcher waits for torch's agent to end by itself once its ranks
# are gone, before leaving its exit barrier (below).
_BARRIER_GRACE_S = 5.0
_ELASTIC_LOG = "torch.distributed.elastic"


def _signalled(sigval: signal.Signals, error_dir: Path, user_error: bool) -> int:
    """The exit code of a job its launcher's agent ended on a signal, said in a line."""
    if user_error:  # our own stop: a user error is not worth a restart
        for message in dict.fromkeys(m for m, code in reported_errors(error_dir) if code == 2):
            print(f"error: {message}", file=sys.stderr, flush=True)
        return USER_ERROR_EXIT_CODE
    # Ctrl+C or a scheduler's SIGTERM: the agent has passed it to the workers and waited for them.
    outcome = _outcome(error_dir)
    if outcome is not None and outcome["stopped"]:
        print(
            f"lmtune: stopped by {sigval.name} with a checkpoint of step {outcome['step']}", file=sys.stderr
        )
        return 0
    if outcome is not None:  # it came as the run was ending: the run is whole
        print(f"lmtune: {sigval.name} came as the run finished at step {outcome['step']}", file=sys.stderr)
        return 0
    print(f"lmtune: stopped by {sigval.name}", file=sys.stderr)
    return 128 + int(sigval)


def needs_launcher(launch: LaunchSettings) -> bool:
    """Whether this command must start the job through torch.distributed.run."""
    return launch.nproc_per_node > 1 or parse_nnodes(launch.nnodes)[1] > 1 or launch.max_restarts > 0


def world_size_bounds(launch: LaunchSettings) -> tuple[int, int]:
    low, high = parse_nnodes(launch.nnodes)
    return low * launch.nproc_per_node, high * launch.nproc_per_node


# The output folder's lock token, handed by a launcher that holds the lock to the workers it starts.
LOCK_TOKEN_ENV = environment.LOCK_TOKEN


@dataclass(frozen=True)
class Job:
    """Who this launcher is in its job: the run id shared by its nodes, and whether it hosts the
    job (one machine, or node 0 of several), which takes the output folder's lock for it."""

    run_id: str
    single_node: bool
    hosts: bool


def job_of(launch: LaunchSettings) -> Job:
    single_node = parse_nnodes(launch.nnodes)[1] == 1 and launch.rdzv_endpoint is None
    return Job(
        run_id=str(uuid.uuid4()) if single_node else launch.rdzv_id,
        single_node=single_node,
        hosts=single_node or launch.node_rank == 0,
    )


def relaunch(
    argv: list[str], cfg: TrainConfig, job: Job, lock_token: str | None, release: Callable[[], None]
) -> int:
    """Run ``lmtune <argv>`` as ``--nproc-per-node`` local workers of the job; return the exit code.

    One machine: the rendezvous endpoint is ``localhost:0`` so the OS picks a free port, and two
    runs never collide. Several machines: c10d rendezvous at ``--rdzv-endpoint``, hosted by node 0.
    When a worker fails the launcher stops the others, so no rank is left hanging; with
    ``--max-restarts`` it starts them all again and they resume from the newest checkpoint.
    ``lock_token``: the output folder's lock, taken by the caller for the workers (None: with
    several nodes, rank 0 takes it where no launcher here did); ``release`` gives it back where the
    launcher leaves without returning (after a stop on several nodes).
    """
    if lock_token is not None:
        os.environ[LOCK_TOKEN_ENV] = lock_token
    try:
        return _launch(argv, cfg, job.run_id, job.single_node, release)
    finally:
        os.environ.pop(LOCK_TOKEN_ENV, None)


def relaunch_unlocked(argv: list[str], cfg: TrainConfig) -> int:
    """`relaunch` without taking the output folder: for commands that only look (lmtune doctor)."""
    job = job_of(cfg.launch)
    return _launch(argv, cfg, job.run_id, job.single_node, lambda: None)


def warn(message: str) -> None:
    """A warning line on stderr, from the launcher or a rank (both print it the same way)."""
    print(f"lmtune: warning: {message}", file=sys.stderr, flush=True)


def _watch(cfg: TrainConfig, error_dir: str, ended: threading.Event) -> tuple[Watchdog, threading.Thread]:
    """This launcher's watchdog over its own ranks, whose heartbeats go beside their error reports,
    and the thread it runs in (until ``ended``)."""
    os.environ[HEALTH_DIR_ENV] = error_dir
    flight_recorder(Path(cfg.checkpoint.output_dir))
    watchdog = Watchdog(
        folder=Path(error_dir),
        output_dir=Path(cfg.checkpoint.output_dir),
        floor_s=cfg.health.hang_timeout,
        on_hang=partial(_end_workers, error_dir),
    )
    watching = threading.Thread(target=watchdog.run, args=(ended,), daemon=True, name="lmtune-watchdog")
    watching.start()
    return watchdog, watching


def _launch(
    argv: list[str], cfg: TrainConfig, run_id: str, single_node: bool, release: Callable[[], None]
) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import api as rdzv
    from torch.distributed.launcher.api import elastic_launch

    from lmtune.parallel.rendezvous import launch_config

    error_dir = tempfile.mkdtemp(prefix="lmtune-errors-")
    os.environ[ERROR_DIR_ENV] = error_dir
    config = launch_config(cfg.launch, run_id, single_node)
    # The agent logs every stop of a worker; we report failures ourselves, once, below.
    # (The agent's own module logger has a level of its own, so it is quieted by name too.)
    names = (_ELASTIC_LOG, f"{_ELASTIC_LOG}.agent.server.api", f"{_ELASTIC_LOG}.multiprocessing.api")
    elastic_logs = [logging.getLogger(n) for n in names]
    previous_levels = [log.level for log in elastic_logs]
    for log in elastic_logs:
        log.setLevel(logging.CRITICAL)
    restarts = RestartNotes(single_node, warn, Path(error_dir))
    if cfg.launch.max_restarts > 0:  # the records of a restart reach RestartNotes, which prints none
        for log, level in zip(elastic_logs[1:], (logging.INFO, logging.ERROR), strict=True):
            log.setLevel(level)
            log.addFilter(restarts)
    user_error = threading.Event()
    ended = threading.Event()
    if cfg.launch.max_restarts > 0:
        threading.Thread(
            target=_stop_on_user_error, args=(Path(error_dir), user_error, ended), daemon=True
        ).start()
    watchdog = _watch(cfg, error_dir, ended) if cfg.health.hang_timeout > 0 else None
    if not single_node:
        _meet_other_nodes(cfg.launch, Path(error_dir), ended, release)
    kills_before = oom_kills()
    os.environ[environment.LAUNCHER_PID] = str(os.getpid())
    try:
        elastic_launch(config, sys.executable)("-m", "lmtune", *argv)
        if line := _from_elsewhere(_outcome(Path(error_dir))):
            print(line, file=sys.stderr, flush=True)
        return 0
    except rdzv.RendezvousTimeoutError:
        waited = f"{environment.join_timeout_s():.0f}s ({environment.JOIN_TIMEOUT})"
        raise UserError(
            f"the job's {cfg.launch.nnodes} nodes did not all meet at {cfg.launch.rdzv_endpoint} within "
            f"{waited}; check that every node was started with the same --rdzv-endpoint and --rdzv-id, "
            "and can reach it"
        ) from None
    except rdzv.RendezvousConnectionError as e:
        lost = lost_connections(Path(error_dir))
        if lost or read_beats(Path(error_dir)) or os.environ.get(environment.RDZV_ROUND):
            # The nodes had met (the ranks started): node 0, which hosts the rendezvous, ended meanwhile.
            said = next(iter(lost.values()), None) or _rendezvous_lost(cfg.launch)
            print(f"error: {said}", file=sys.stderr, flush=True)
            return 1
        raise UserError(_unreachable(cfg.launch, e)) from None
    except rdzv.RendezvousClosedError:  # while this node met again for a restart
        print(f"error: {CLOSED_ELSEWHERE}", file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as e:
        ended.set()
        _tell_other_nodes(cfg.launch, single_node, None)
        hung = watchdog is not None and bool(watchdog[0].hangs)
        if watchdog is not None and hung:  # its diagnosis, written as the workers failed: said first
            watchdog[1].join(timeout=30)
        advice = _memory_advice(cfg) if out_of_memory_kills(kills_before) else ""
        return failed(e, Path(error_dir), hung, advice, single_node)
    except SignalException as e:
        ended.set()
        _tell_other_nodes(cfg.launch, single_node, None if user_error.is_set() else e.sigval)
        return _signalled(e.sigval, Path(error_dir), user_error.is_set())
    finally:
        ended.set()
        for log, level in zip(elastic_logs, previous_levels, strict=True):
            log.setLevel(level)
            log.removeFilter(restarts)
        # What this launch set for its workers (the rendezvous handler the round and the store).
        for name in (ERROR_DIR_ENV, HEALTH_DIR_ENV, *environment.SET_FOR_WORKERS):
            os.environ.pop(name, None)
        shutil.rmtree(error_dir, ignore_errors=True)


def _tell_other_nodes(launch: LaunchSettings, single_node: bool, sigval: signal.Signals | None) -> None:
    """This node's launcher ends, stopped by ``sigval`` or its ranks having failed: where the job's
    ranks have not met yet, the other nodes' ranks end now, with a line that says so, instead of
    waiting out the join timeout for ranks that will not come."""
    from lmtune.parallel.distributed import say_round_ended  # torch: not before the C++ logs are set

    if single_node:
        return
    node = "a node of the job" if launch.node_rank is None else f"node {launch.node_rank}"
    if sigval is None:
        say_round_ended(f"{node}'s ranks failed before the job's processes met, and its output says why")
    else:
        say_round_ended(
            f"{node} was stopped by {sigval.name} before the job's processes met; nothing was trained, "
            "and the same command on every node starts the job again"
        )


def _memory_advice(cfg: TrainConfig) -> str:
    import torch

    on_gpu = cfg.model.device == "cuda" or (cfg.model.device == "auto" and torch.cuda.is_available())
    world = cfg.launch.nproc_per_node * parse_nnodes(cfg.launch.nnodes)[1]
    batched = micro_batch_size(cfg, world) > 1
    return memory_advice(cfg, on_gpu=on_gpu, batched=batched, processes=cfg.launch.nproc_per_node)


def _rendezvous_lost(launch: LaunchSettings) -> str:
    return (
        f"this node lost the job's rendezvous at {launch.rdzv_endpoint} after its ranks started: node 0, "
        f"which hosts it, ended first, and its output says why; {RESUMES}"
    )


def _unreachable(launch: LaunchSettings, e: BaseException) -> str:
    """Why this launcher could not host or reach its job's rendezvous, in one line."""
    text = str(e.__cause__ or e).strip()
    cause = text.splitlines()[0].rstrip(".") if text else type(e).__name__
    where = launch.rdzv_endpoint
    if launch.node_rank == 0 or "EADDRINUSE" in cause:
        return (
            f"--rdzv-endpoint {where}: this node could not host the job's rendezvous there ({cause}); "
            "another program (or an earlier run still going) holds that port: choose another port, the "
            "same on every node"
        )
    return (
        f"--rdzv-endpoint {where}: this node could not reach the job's rendezvous there ({cause}); "
        "start node 0 (--node-rank 0) with the same --rdzv-endpoint, and check that this machine can "
        "reach that address and port (a node 0 that was started stopped before the job began: its own "
        "output says why, as a refused --output-dir)"
    )


def flight_recorder(output_dir: Path) -> None:
    """NCCL's flight recorder for the workers (unless set already): the last collectives of every
    rank, dumped under OUTPUT/comm-traces/ when a collective times out (analysed with torchfrtrace).
    Nothing happens on gloo, and the folder is made only where there are GPUs."""
    import torch

    if not torch.cuda.is_available():
        return
    traces = output_dir / "comm-traces"
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(traces / "rank_"))
    with suppress(OSError):
        traces.mkdir(parents=True, exist_ok=True)


def _end_workers(health_dir: str) -> None:
    """After a hang: SIGKILL every worker of this node (a stopped or deadlocked process would not
    act on SIGTERM); the agent then fails the job, or restarts it under --max-restarts."""
    for beat in read_beats(Path(health_dir)).values():
        with suppress(OSError):  # already gone
            os.kill(beat.pid, signal.SIGKILL)


def _stop_on_user_error(error_dir: Path, seen: threading.Event, ended: threading.Event) -> None:
    """Under --max-restarts, end the job when a worker reports a user error: the agent would start
    every worker again only to fail the same way."""
    while not ended.wait(0.2):
        if any(code == USER_ERROR_EXIT_CODE for _, code in reported_errors(error_dir)):
            seen.set()
            os.kill(os.getpid(), signal.SIGTERM)  # the agent stops its workers and raises in the launcher
            return


def _meet_other_nodes(
    launch: LaunchSettings, error_dir: Path, ended: threading.Event, release: Callable[[], None]
) -> None:
    print(f"lmtune: waiting for {launch.nnodes} nodes at {launch.rdzv_endpoint}", file=sys.stderr, flush=True)
    if Path("/proc/self").is_dir():  # where this launcher can see whether its ranks are gone
        leave = partial(_leave_after_a_stop, error_dir, ended, release)
        threading.Thread(target=leave, daemon=True, name="lmtune-leave").start()
        bound = partial(_bound_the_meeting, launch, error_dir, ended, release)
        threading.Thread(target=bound, daemon=True, name="lmtune-meeting").start()


def _bound_the_meeting(
    launch: LaunchSettings, error_dir: Path, ended: threading.Event, release: Callable[[], None]
) -> None:
    """End this launcher (exit 2) when its ranks have not started long after the nodes should have
    met: torch's rendezvous gives up after the join timeout, but its store client can wait without
    end on a port held by a program that accepts and never answers."""
    waited = 2 * environment.join_timeout_s() + 10
    deadline = time.monotonic() + waited
    while not ended.wait(1.0):
        if _children():
            return  # the ranks started: the nodes met
        if time.monotonic() > deadline:
            line = (
                f"error: the job's {launch.nnodes} nodes did not meet at {launch.rdzv_endpoint} within "
                f"{waited:.0f}s; start node 0 (--node-rank 0) with the same --rdzv-endpoint, and check that "
                "no other program holds that port"
            )
            _end_launcher(line, USER_ERROR_EXIT_CODE, error_dir, release)


def _leave_after_a_stop(error_dir: Path, ended: threading.Event, release: Callable[[], None]) -> None:
    """Several nodes: end this launcher once its ranks have stopped on a signal, saved and left.
    torch's agent then waits in an exit barrier for every node's agent, up to 300 s, and one
    that the signal ended never comes: the job would sit silent for five minutes, then exit 0."""
    while not ended.wait(0.5):
        outcome = _outcome(error_dir)
        if outcome is None or not outcome["stopped"] or _children():
            continue
        if ended.wait(_BARRIER_GRACE_S):  # the agent ended by itself (this node was signalled)
            return
        _end_launcher(_from_elsewhere(outcome), 0, error_dir, release)


def _end_launcher(line: str | None, code: int, error_dir: Path, release: Callable[[], None]) -> NoReturn:
    """Say ``line``, give the output folder's lock back, remove the workers' report folder and exit
    with ``code`` from a watcher thread: the agent's main thread is blocked in torch's store, where
    neither an exception nor a signal handler reaches it."""
    if line:
        print(line, file=sys.stderr, flush=True)
    release()
    shutil.rmtree(error_dir, ignore_errors=True)
    sys.stderr.flush()
    os._exit(code)


def _children() -> bool:
    """Whether a live process (a rank) was started by this one."""
    me = os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, ValueError, IndexError):
            state, parent = proc_stat(int(stat.parent.name))[:2]
            if int(parent) == me and state != "Z":
                return True
    return False
