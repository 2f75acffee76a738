"""The distributed environment: the only reader of RANK / LOCAL_RANK / WORLD_SIZE.

A single process is ``world_size == 1`` of the same code path: it never starts a process group and
every collective helper below degrades to the identity.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore
from torch.distributed import DistError, DistNetworkError, DistStoreError

from lmtune.config import environment
from lmtune.errors import SettingError, StoppedBySignal, UserError

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None when world_size == 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchEnv:
    """What a launcher (torchrun, lmtune's own, SLURM scripts) put in the environment, checked."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def launch_env() -> LaunchEnv:
    """The checked launch variables; none set means a single process.

    Raises:
        UserError: naming the variables that are missing, not integers or out of range, so a
            half-set environment fails at once instead of waiting for peers that never come.
    """
    present = {name: os.environ[name] for name in LAUNCH_VARIABLES if name in os.environ}
    if not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(present):
        return LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1)
    values: dict[str, int] = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        if name in present:
            try:
                values[name] = int(present[name])
            except ValueError:
                raise UserError(f"environment variable {name}={present[name]!r} is not an integer") from None
    needed = ["RANK", "WORLD_SIZE"]
    if values.get("WORLD_SIZE", 1) > 1:
        needed += ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
    missing = [n for n in needed if n not in present]
    if missing:
        raise UserError(
            f"incomplete launch environment: {', '.join(sorted(present))} set but not {', '.join(missing)}; "
            "start the job with torchrun or lmtune --nproc-per-node, or unset these variables"
        )
    world, rank = values["WORLD_SIZE"], values["RANK"]
    local_rank = values.get("LOCAL_RANK", 0)
    local_world = values.get("LOCAL_WORLD_SIZE", world)
    problems = [
        f"WORLD_SIZE={world} must be >= 1" if world < 1 else "",
        f"RANK={rank} must be in [0, WORLD_SIZE={world})" if not 0 <= rank < world else "",
        f"LOCAL_WORLD_SIZE={local_world} must be in [1, WORLD_SIZE]" if not 1 <= local_world <= world else "",
        f"LOCAL_RANK={local_rank} must be in [0, LOCAL_WORLD_SIZE={local_world})"
        if not 0 <= local_rank < local_world
        else "",
        f"MASTER_PORT={values['MASTER_PORT']} is not a port"
        if not 0 < values.get("MASTER_PORT", 1) < 65536
        else "",
    ]
    problems = [p for p in problems if p]
    if problems:
        raise UserError("invalid launch environment: " + "; ".join(problems))
    return LaunchEnv(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world)


def launched_rank() -> int | None:
    """RANK set by torchrun, or None when not launched by it (or not readable: for error reports,
    which must not fail themselves)."""
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer") from None


def read_dist_env(device: str = "auto") -> DistEnv:
    """Read the launcher's environment and pick the device for this process.

    Args:
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
    """
    launched = launch_env()
    world_size, rank = launched.world_size, launched.rank
    local_rank, local_world_size = launched.local_rank, launched.local_world_size
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        build = (
            f" (this PyTorch, {torch.__version__}, is built for the CPU alone)"
            if torch.version.cuda is None
            else ""
        )
        raise SettingError("device", "--device", f"cuda: no CUDA device is available on this machine{build}")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise UserError(
                f"local rank {local_rank} has no GPU: only {torch.cuda.device_count()} visible; "
                "start at most one process per GPU"
            )
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    backend = None if world_size == 1 else ("nccl" if use_cuda else "gloo")
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        device=dev,
        backend=backend,
    )


def cpu_threads_per_process(env: DistEnv, requested: int = 0) -> int:
    """Threads for this process: the machine's cores shared evenly among the local processes.

    N processes each running as many threads as there are cores oversubscribe the CPU, and DDP on
    CPU then runs several times slower than it should.
    """
    if requested > 0:
        return requested
    return _omp_threads(env) or max(1, available_cores() // env.local_world_size)


def _omp_threads(env: DistEnv) -> int:
    """The user's OMP_NUM_THREADS (0 when unset, not a count, or the 1 that torchrun sets for
    several processes of a machine where the user set none, which would leave cores idle)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    threads = int(value) if value.isdigit() else 0
    return 0 if threads == 1 and env.local_world_size > 1 else threads


def threads_note(env: DistEnv, requested: int, threads: int) -> str | None:
    """What the log says of the threads a CPU process runs, where they are not the plain even share:
    OMP_NUM_THREADS followed or set aside, more threads than cores."""
    cores, value = available_cores(), os.environ.get("OMP_NUM_THREADS", "").strip()
    if threads * env.local_world_size > cores and (requested or _omp_threads(env)):
        given = f"--threads-per-process {requested}" if requested else f"OMP_NUM_THREADS={value}"
        return (
            f"warning: {given}: {threads * env.local_world_size} threads on this machine's {cores} cores "
            "oversubscribe them (a step runs several times slower); leave it out to share the cores"
        )
    if value and not requested and _omp_threads(env) == threads:
        return f"threads: {threads} per process (OMP_NUM_THREADS={value})"
    if value == "1" and not requested:
        return (
            f"threads: {threads} per process, the cores shared among {env.local_world_size} processes "
            f"(OMP_NUM_THREADS={value}, which torchrun sets for several processes, set aside; "
            "--threads-per-process N sets them)"
        )
    if value and not requested:
        return f"threads: {threads} per process (OMP_NUM_THREADS={value} is no count of threads: set aside)"
    return None


def available_cores() -> int:
    """Cores this process may run on (the affinity mask, which containers and SLURM set)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextmanager
def process_group(env: DistEnv, timeout_s: float = 1800.0) -> Iterator[DistEnv]:
    """Start the process group (when there is more than one process) and always destroy it."""
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
    if not env.distributed:
        yield env
        return
    assert env.backend is not None
    timeout = timedelta(seconds=timeout_s)
    # Joining has a bound of its own: a process that was never started should not cost 30 minutes.
    join = timedelta(seconds=environment.join_timeout_s())
    address = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
    try:
        store = _attempt_store(env, join)
        _all_arrived(store, env, join, address)
        # Bounded by the join too: a process that reached the store and stopped before the group
        # connected (SIGSTOP'd at start) held the others in gloo's connect for the collectives' 30
        # minutes, without a word.
        dist.init_process_group(
            backend=env.backend,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
            timeout=join,
            device_id=env.device if env.device.type == "cuda" else None,
        )
    except (DistError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(
            f"the job's {env.world_size} processes did not all meet at {address} within "
            f"{join.total_seconds():.0f}s ({first}); {_why_not_met()}"
        ) from None
    store.set_timeout(timeout)
    dist.distributed_c10d._set_pg_timeout(timeout)
    try:
        yield env
    finally:
        # FSDP and DDP state lives in reference cycles; free it (and the collectives' work objects
        # it holds) while the process group still exists, not at interpreter exit.
        gc.collect()
        dist.destroy_process_group()


def _why_not_met() -> str:
    restarts, nodes = _env_int("TORCHELASTIC_MAX_RESTARTS", 0), _env_int("GROUP_WORLD_SIZE", 1)
    if restarts > 0 and nodes > 1 and not os.environ.get(environment.RDZV_ROUND):  # torchrun's
        return (
            "check that every process was started and can reach it; or, where the job was restarting "
            "(torchrun --max-restarts), one node's process failed alone: torchrun counts restarts per "
            "node, so the nodes meet under different attempt numbers; launch with lmtune's own "
            "--nnodes, --node-rank and --rdzv-endpoint, which restart the job on every node alike"
        )
    return "check that every process was started and can reach it"


# The ranks' meeting in their attempt's namespace: how many arrived, all did, a node's launcher ended.
_ARRIVED, _MET, _ENDED = "arrived", "met", "ended"


def _all_arrived(store: Store, env: DistEnv, join: timedelta, address: str) -> None:
    """Wait in the store until every rank has reached it, before gloo connects them.

    Inside gloo's connect a rank waits out the join timeout (300 s) for one that will never come;
    here the wait ends as soon as a node's launcher that stopped before its ranks met says so
    (:func:`say_round_ended`), or the store's host has gone."""
    store.set(f"{_ARRIVED}-{env.rank}", "")
    if store.add(_ARRIVED, 1) >= env.world_size:
        store.set(_MET, "")
    try:
        store.wait([_MET], join)
    except DistStoreError:  # the join timeout: process_group says it, with the ranks that never came
        if missing := [r for r in range(env.world_size) if not store.check([f"{_ARRIVED}-{r}"])]:
            shown = ", ".join(map(str, missing[:8])) + (
                f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            )
            raise RuntimeError(f"rank{'s' * (len(missing) > 1)} {shown} never joined") from None
    except DistNetworkError:
        raise UserError(
            f"the job's store at {address} closed before its {env.world_size} processes met: the "
            "launcher (or rank) that hosted it ended first, and its output says why"
        ) from None
    if store.check([_ENDED]):
        raise UserError(store.get(_ENDED).decode())


def say_round_ended(why: str) -> None:
    """From a node's launcher ending before the job's ranks met (multi-node): tell the other nodes'
    ranks, waiting in their store (:func:`_all_arrived`), ``why``, so they end now, not after the
    join timeout. Nothing is said where this launcher's workers never had a store or it is gone."""
    address, round_ = os.environ.get(environment.RDZV_STORE), os.environ.get(environment.RDZV_ROUND)
    if not address or not round_:
        return
    host, _, port = address.rpartition(":")
    try:
        client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=3))
        store = _round_namespace(round_, client)
        store.set(_ENDED, why)
        store.set(_MET, "")
    except (DistError, RuntimeError, ValueError):
        pass  # its host ended: the ranks waiting there learn it from the closed connection


def _attempt_store(env: DistEnv, timeout: timedelta) -> Store:
    """The rendezvous store, with its keys kept apart per restart of the job.

    Workers restarted by the elastic agent may reach a store that still holds the previous attempt's
    keys (peer addresses, barrier counters); reading those, gloo hangs or is refused. A prefix per
    attempt gives every attempt a clean namespace: under lmtune's launcher the rendezvous round,
    the same on every node; under torchrun its ``TORCHELASTIC_RESTART_COUNT``, which is each node's
    own and differs between nodes once one node's worker has failed (lmtune.parallel.rendezvous).
    """
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _env_int("MASTER_PORT", 29500)
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = TCPStore(
        host,
        port,
        env.world_size,
        is_master=env.rank == 0 and not agent_hosts_it,
        timeout=timeout,
        multi_tenant=True,
    )
    if round_ := os.environ.get(environment.RDZV_ROUND):
        return _round_namespace(round_, store)
    return PrefixStore(f"lmtune/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _round_namespace(round_: str, store: Store) -> Store:
    return PrefixStore(f"lmtune/round-{round_}", store)


def set_collective_timeout(env: DistEnv, seconds: float) -> None:
    """How long a collective may wait for the other ranks before it fails, from now on."""
    if env.distributed:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


class CollectiveTimeouts:
    """Half an hour for a collective while loading and warming up; after the first step
    ``short_s``, so a rank that does not come is noticed in minutes, not half an hour; the long
    bound again around evaluation and saving (a large checkpoint takes time)."""

    def __init__(self, env: DistEnv, short_s: float, long_s: float = 1800.0):
        self.env, self.short_s, self.long_s = env, short_s, long_s
        self.training = False

    def after_step(self) -> None:
        """Shorten once, after the first step."""
        if not self.training:
            self.training = True
            set_collective_timeout(self.env, self.short_s)

    @contextmanager
    def patient(self) -> Iterator[None]:
        set_collective_timeout(self.env, self.long_s)
        try:
            yield
        finally:
            if self.training:
                set_collective_timeout(self.env, self.short_s)

    def end(self) -> None:
        """Training is over: what follows (the final save, a merge) may take long."""
        self.training = False
        set_collective_timeout(self.env, self.long_s)


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over all ranks (in place, also returned); identity for one process."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def stop_if_signalled(signum: int, env: DistEnv) -> None:
    """Raise StoppedBySignal on every rank when any got a signal before training (``signum``: this
    rank's, 0 if none), agreed in one all-reduce: a preemption may reach one rank first."""
    received = all_reduce_max(torch.tensor([float(signum)], device=env.device), env)
    if (agreed := int(received.item())) > 0:
        raise StoppedBySignal(agreed)


def broadcast(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Rank 0's tensor on every rank (in place, also returned)."""
    if env.distributed:
        dist.broadcast(t, src=0)
    return t


def broadcast_object(obj: T, env: DistEnv) -> T:
    """Rank 0's ``obj`` on every rank (a small picklable value)."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def decided_by_main(decide: Callable[[], T], fallback: T, env: DistEnv) -> T:
    """``decide()`` on rank 0, its answer on every rank (``fallback`` stands in elsewhere). A
    UserError it raises is raised on every rank: the others wait in the broadcast, and would
    otherwise see rank 0 leave (a closed connection, which gloo reports with a traceback)."""
    value, problem, error = fallback, "", None
    if env.is_main:
        try:
            value = decide()
        except UserError as e:
            problem, error = str(e), e
    value, problem = broadcast_object((value, problem), env)
    if error is not None:
        raise error  # rank 0's own, with its kind (a SettingError names its file and line)
    if problem:
        raise UserError(problem)
    return value


def refused_by_main(problem: Callable[[], str], env: DistEnv) -> None:
    """Raise on every rank the UserError of what ``problem()`` finds on rank 0 ("": nothing)."""

    def decide() -> None:
        if found := problem():
            raise UserError(found)

    decided_by_main(decide, None, env)


def all_gather_object(obj: T, env: DistEnv) -> list[T]:
    if not env.distributed:
        return [obj]
    out: list[T] = [obj] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()
