"""`lmtune doctor` (and `lmtune train --doctor`): check a machine or cluster before a run.

Every rank takes part; rank 0 prints one table. Checks: versions and hosts (differences across
ranks flagged), device and free memory, matmul peak (a device far below the others flagged), the
CPU's matrix units (AMX, AVX-512 BF16, AVX2) and the bf16 paths they choose,
all-reduce correctness and speed, the output and cache folders (writable, and the same folder on
every node: rank 0 writes a token the others must see), free disk against the checkpoint the
model implies, the data readable on every rank, clock offsets.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import statistics
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lmtune.errors import UserError, megabytes, room
from lmtune.parallel.distributed import DistEnv, all_gather_object, all_reduce_sum, barrier, broadcast_object

if TYPE_CHECKING:
    from lmtune.config.settings import TrainConfig

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str


@dataclass(frozen=True)
class DoctorSettings:
    output_dir: str | None = None
    cache_dir: str | None = None
    data: str | None = None
    model: str | None = None
    default_cache: bool = False  # cache_dir is lmtune's default, not one the user named
    keep_last: int = 3  # train's --keep-last, whose checkpoints the disk holds at once
    saves: bool = True  # train saves checkpoints (--save-every is not 0)

    @classmethod
    def of_run(cls, cfg: TrainConfig, cache_dir: str | None) -> DoctorSettings:
        """What ``train --doctor`` checks: the run's output folder (sized for its checkpoints),
        ``cache_dir``, its data and its model."""
        c = cfg.checkpoint
        keep, saves = c.keep_last, c.save_every > 0
        return cls(c.output_dir, cache_dir, cfg.data.train, cfg.model.name, keep_last=keep, saves=saves)


def _rank_facts(env: DistEnv) -> dict[str, Any]:
    import transformers

    from lmtune import __version__

    facts: dict[str, Any] = {
        "host": socket.gethostname(),
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, lmtune {__version__}",
        "device": str(env.device),
    }
    if env.device.type == "cuda":
        free = torch.cuda.mem_get_info(env.device)[0]
        facts["device"] = f"{torch.cuda.get_device_name(env.device)} ({env.device})"
        facts["free_memory"] = free
    else:
        facts["free_memory"] = _available_ram()
    return facts


def _available_ram() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _by_rank(values: list[Any]) -> str:
    """``value (ranks 0-3)``, one group per distinct value."""
    groups: dict[str, list[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(str(v), []).append(rank)
    return "; ".join(f"{v} (rank{'s' if len(r) > 1 else ''} {_ranks(r)})" for v, r in groups.items())


def _ranks(ranks: list[int]) -> str:
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1))
        else ", ".join(map(str, ranks))
    )


def _environment(env: DistEnv) -> list[Check]:
    facts = all_gather_object(_rank_facts(env), env)
    hosts = sorted({f["host"] for f in facts})
    versions = [f["versions"] for f in facts]
    memory = [f["free_memory"] for f in facts]
    checks = [
        Check("hosts", OK, f"{len(hosts)} host(s): {', '.join(hosts)}; {env.world_size} ranks"),
        Check(
            "versions",
            OK if len(set(versions)) == 1 else FAIL,
            _by_rank(versions)
            + ("" if len(set(versions)) == 1 else ": install the same versions everywhere"),
        ),
        Check("devices", OK, _by_rank([f["device"] for f in facts])),
        Check(
            "free memory",
            OK if min(memory) > 0.5 * max(memory) else WARN,
            f"{min(memory) / 2**30:,.1f} to {max(memory) / 2**30:,.1f} GiB per rank",
        ),
    ]
    return checks


def _matmul(env: DistEnv) -> Check:
    from lmtune.training.perf import Probe, measure_peak_flops

    peaks = all_gather_object(measure_peak_flops(Probe(env.device, "fp32"), 0.3), env)
    median = statistics.median(peaks)
    slow = [r for r, p in enumerate(peaks) if p < 0.5 * median]
    detail = f"fp32 {min(peaks) / 1e9:,.1f} to {max(peaks) / 1e9:,.1f} GFLOP/s per rank"
    if slow:
        return Check(
            "matmul peak", WARN, f"{detail}; rank(s) {_ranks(slow)} under half the median (busy or slower)"
        )
    return Check("matmul peak", OK, detail)


def _cpu_units(env: DistEnv) -> Check:
    """The CPU's matrix units and the bf16 paths they choose (lmtune.model.paths), per rank: a
    report from a user's machine then says which branch its runs take."""
    from lmtune.model.paths import bf16_plan, cpu_units

    units = cpu_units()
    found = all_gather_object(f"{units.describe()}: {bf16_plan(units)}", env)
    return Check("CPU matrix units", OK, _by_rank(found))


def _cpu_threads(env: DistEnv) -> Check:
    """How compute threads wait (lmtune.config.threads): passive means the CPUs were busy with other
    work when this process started, which slows every run on them."""
    from lmtune.config.threads import busy_at_start, thread_wait

    threads = torch.get_num_threads()
    said = f"{threads} thread{'s' if threads != 1 else ''}, waiting {thread_wait()}"
    found = all_gather_object((said, busy_at_start()), env)
    lines = _by_rank([line for line, _ in found])
    if any(busy for _, busy in found):
        return Check("CPU threads", WARN, f"{lines}; other work competes for the CPUs")
    return Check("CPU threads", OK, lines)


def _all_reduce(env: DistEnv) -> list[Check]:
    if not env.distributed:
        return [Check("all-reduce", OK, "one process: nothing to reduce")]
    t = torch.full((1024,), float(env.rank + 1), device=env.device)
    all_reduce_sum(t, env)
    expected = env.world_size * (env.world_size + 1) / 2
    wrong = all_gather_object(bool((t != expected).any()), env)
    if any(wrong):
        return [
            Check(
                "all-reduce", FAIL, f"wrong sums on rank(s) {_ranks([r for r, w in enumerate(wrong) if w])}"
            )
        ]
    sizes = (2**10, 2**20, 2**24) if env.device.type == "cuda" else (2**10, 2**18, 2**22)
    rows = []
    for size in sizes:
        x = torch.ones(size // 4, device=env.device)
        all_reduce_sum(x, env)  # warm-up
        barrier(env)
        start = time.perf_counter()
        for _ in range(5):
            all_reduce_sum(x, env)
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)
        seconds = (time.perf_counter() - start) / 5
        # Bus bandwidth, as nccl-tests: what each link carries in a ring.
        bus = size * 2 * (env.world_size - 1) / env.world_size / seconds
        rows.append(f"{_size(size)} {seconds * 1e3:.2f} ms ({bus / 1e9:.2f} GB/s)")
    return [Check("all-reduce", OK, "sums right; " + ", ".join(rows))]


def check_shared_output(env: DistEnv, folder: Path) -> None:
    """A job of several nodes writes one output folder (collective): where a node sees another
    folder (not shared storage), its checkpoints were its own, a resume failed on files rank 0 had
    written elsewhere, and its unfinished saves were never cleaned up.

    Raises:
        UserError: on every rank, naming the ranks and hosts that see another folder.
    """
    remedy = "give every node one folder of storage they all mount (an absolute path there)"
    check = _shared_folder(env, folder, "--output-dir", remedy)
    if check.status == FAIL:
        raise UserError(f"--output-dir {check.detail}")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 2**20 else f"{n >> 10} KiB"


def _shared_folder(env: DistEnv, folder: Path, name: str, remedy: str = "") -> Check:
    """Writable on every rank, and the same folder on all: rank 0's token must be seen by all. The
    folders it makes for that (a run's output folder is made by the run) are removed after."""
    why = ""  # why this rank cannot write there; every rank goes on to the collectives below
    made = [f for f in (folder, *folder.parents) if not f.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".lmtune-doctor-{uuid.uuid4().hex}"
        probe.write_text("x")
        probe.unlink()
    except OSError as e:
        why = "not a folder" if folder.exists() and not folder.is_dir() else e.strerror or type(e).__name__
    writable = not why
    token = broadcast_object(uuid.uuid4().hex, env)
    marker = folder / f".lmtune-doctor-{token}"
    if env.is_main and writable:
        marker.write_text(token)
    barrier(env)
    seen = marker.is_file() and marker.read_text(errors="replace") == token
    results = all_gather_object((socket.gethostname(), writable, seen, why), env)
    barrier(env)
    if env.is_main and writable:
        marker.unlink(missing_ok=True)
    barrier(env)
    for path in made:
        try:
            path.rmdir()  # only while empty: another rank (or anything else) may have written there
        except OSError:
            break
    not_writable = [r for r, (_, w, _, _) in enumerate(results) if not w]
    blind = [r for r, (_, _, s, _) in enumerate(results) if not s]
    if not_writable:
        hosts = sorted({results[r][0] for r in not_writable})
        ranks = f"rank(s) {_ranks(not_writable)} ({', '.join(hosts)})"
        return Check(name, FAIL, f"{folder}: not writable on {ranks}: {results[not_writable[0]][3]}")
    if blind:
        hosts = sorted({results[r][0] for r in blind})
        return Check(
            name,
            FAIL,
            f"{folder}: rank(s) {_ranks(blind)} ({', '.join(hosts)}) see another folder than rank 0 "
            f"(not shared storage); {remedy or 'put it on a file system every node mounts'}",
        )
    return Check(name, OK, f"{folder}: writable and the same folder on every rank")


def _disk(env: DistEnv, folder: Path, model: str | None, keep_last: int, saves: bool) -> Check:
    # The folder may not exist (yet): its disk is that of the nearest folder above it that does.
    base = next(f for f in (folder, *folder.parents) if f.exists())
    free = shutil.disk_usage(base).free
    named = model
    if model is None:  # train's: a 12 MB disk passed as "ok", and the run failed writing final/
        from lmtune.config.groups import ModelSettings

        model = ModelSettings().name
        named = f"{model} (train's default model; --model sizes yours)"
    params = _parameters(model)
    # A full fine-tuning checkpoint: fp32 weights and AdamW's two moments, then final/ (fp32). As
    # train's own check counts: each new checkpoint is written before the oldest beyond --keep-last
    # goes (0 keeps every one: at least one, then more).
    checkpoint = params * 12
    copies = (keep_last + 1 if keep_last else 1) if saves else 0
    need = copies * checkpoint + params * 4
    kept = (
        "with --save-every 0 only final/"
        if not saves
        else f"{copies} at once (--keep-last {keep_last}, and the next before the oldest goes) and final/"
        if keep_last
        else "one and final/ (--keep-last 0 keeps every one: more)"
    )
    # With train's margin (room): a disk doctor passes is one train's own check passes; a run
    # that saves fewer checkpoints than --keep-last keeps needs less, and may still fit.
    status = OK if free >= room(need) else FAIL
    where = folder if base == folder else f"{base} (where {folder} would be made)"
    fewer = "" if status == OK or copies < 2 else "; a smaller --keep-last needs fewer"
    return Check(
        "free disk",
        status,
        f"{_disk_size(free)} free in {where}; a checkpoint of {named} ({params / 1e6:,.0f}M parameters) "
        f"takes ~{_disk_size(checkpoint)}; {kept}: ~{_disk_size(room(need))} in all, with room to "
        f"spare{fewer}",
    )


def _disk_size(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 1 << 30 else megabytes(n)


def _parameters(model: str) -> int:
    """``model``'s parameter count, from its config alone (refused as train refuses the model)."""
    from lmtune.model.modeling import load_config
    from lmtune.tools.trace import fake_device, fake_model

    config = load_config(model)
    with fake_device("cpu"):
        return sum(p.numel() for p in fake_model(config).parameters())


def _data(env: DistEnv, spec: str) -> Check:
    from lmtune.data.sources import resolve_sources

    problem = ""
    try:
        for source in resolve_sources(spec):
            if source.kind not in ("sample", "hf_hub"):
                path = Path(source.name)
                with path.open("rb") if path.is_file() else open(os.devnull, "rb") as f:
                    f.read(4096)
    except (UserError, OSError) as e:
        problem = str(e)
    problems = all_gather_object(problem, env)
    bad = [r for r, p in enumerate(problems) if p]
    if bad:
        return Check("data", FAIL, f"rank(s) {_ranks(bad)}: {problems[bad[0]]}")
    return Check("data", OK, f"{spec}: readable on every rank")


def _clocks(env: DistEnv) -> Check:
    barrier(env)
    now = all_gather_object(time.time(), env)
    offsets = [t - now[0] for t in now]
    worst = max(abs(o) for o in offsets)
    return Check(
        "clocks",
        OK if worst < 1.0 else WARN,
        f"largest offset from rank 0: {worst * 1e3:,.0f} ms"
        + ("" if worst < 1.0 else " (sync the clocks: logs will not line up)"),
    )


def run_checks(env: DistEnv, settings: DoctorSettings) -> list[Check]:
    checks = [*_environment(env), _matmul(env)]
    if env.device.type == "cpu":
        checks += [_cpu_units(env), _cpu_threads(env)]
    checks += _all_reduce(env)
    if settings.output_dir:
        output = Path(settings.output_dir).expanduser()
        checks.append(folder := _shared_folder(env, output, "output folder"))
        # A folder that cannot be made has no disk to judge (it read "0.0 MB free in /proc").
        if folder.status != FAIL and (output.is_dir() or not output.exists()):
            checks.append(_disk(env, output, settings.model, settings.keep_last, settings.saves))
    if settings.model and not settings.output_dir:  # no folder to size its checkpoints in: it loads
        params = _parameters(settings.model)
        checks.append(Check("model", OK, f"{settings.model}: {params / 1e6:,.1f}M parameters"))
    if settings.cache_dir and settings.default_cache:
        remedy = (
            "train and doctor need --cache-dir on a file system every node mounts, or train --cache-per-node"
        )
        checks.append(
            _shared_folder(env, Path(settings.cache_dir), "cache folder (lmtune's default)", remedy)
        )
    elif settings.cache_dir:
        checks.append(_shared_folder(env, Path(settings.cache_dir).expanduser(), "cache folder"))
    if settings.data:
        checks.append(_data(env, settings.data))
    checks.append(_clocks(env))
    return checks


def format_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.status:<5} {c.name:<{width}}  {c.detail}" for c in checks)


def check_or_fail(env: DistEnv, settings: DoctorSettings, print_table: bool = True) -> list[Check]:
    """Run the checks; rank 0 prints the table; any failure is a UserError on every rank."""
    checks = run_checks(env, settings)
    if env.is_main and print_table:
        print("lmtune doctor\n" + format_table(checks), flush=True)
    failed = [c for c in checks if c.status == FAIL]
    if failed:
        raise UserError("doctor: " + "; ".join(f"{c.name}: {c.detail}" for c in failed))
    sys.stdout.flush()
    return checks
