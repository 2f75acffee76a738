"""`lmtune bench`: throughput, MFU, memory and step-time split per strategy and precision.

Every combination is a real `lmtune train` run (under the launcher when it needs several
processes) on the user's model and data, timed after a warm-up; nothing is simulated.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lmtune.config.io import MEASURING_RUN, to_argv
from lmtune.config.settings import TrainConfig, choices
from lmtune.config.validate import check_settings
from lmtune.errors import UserError
from lmtune.outputs.runlog import read_metrics, tokens_per_second

STRATEGIES = tuple(s for s in choices("strategy") if s != "auto")  # each one is measured as it is
PRECISIONS = choices("precision")
PHASES = ("data", "forward", "backward", "optimizer")


@dataclass
class BenchRow:
    strategy: str
    precision: str
    status: str  # "ok", or why it was skipped or failed
    devices: int = 0
    tokens_per_s: float = 0.0
    tokens_per_s_per_device: float = 0.0
    mfu: float = 0.0
    peak_busy: bool = False  # MFU's peak is not settled and was probed on busy cores: it may read high
    peak_memory_mib: float = 0.0  # largest over the ranks
    step_ms: float = 0.0
    phase_ms: dict[str, float] | None = None


def skip_reason(strategy: str, precision: str, nproc: int) -> str | None:
    """Why a combination cannot run on this machine, or None."""
    gpus = torch.cuda.device_count()
    if strategy == "dp" and gpus < 2:
        return f"skipped: DataParallel needs 2+ CUDA GPUs ({gpus} visible)"
    if strategy in ("ddp", "fsdp") and nproc < 2:
        return f"skipped: {strategy.upper()} needs --nproc-per-node 2 or more"
    if precision == "fp16" and gpus == 0:
        return "skipped: fp16 needs a CUDA GPU (use bf16 on CPU)"
    return None


def _measure(out: Path, warmup: int, devices: int) -> BenchRow:
    rows = read_metrics(out)
    timed = rows[warmup:]
    throughput = tokens_per_second(rows, warmup)
    run = json.loads((out / "run.json").read_text())
    peak = max(run["result"]["peak_memory_per_rank"]) / 2**20
    phases = {p: 1000 * statistics.mean(r.get(f"time_{p}_s", 0.0) for r in timed) for p in PHASES}
    return BenchRow(
        strategy=run["resolved"]["strategy"],
        precision=run["config"]["precision"],
        status="ok",
        devices=devices,
        tokens_per_s=throughput,
        tokens_per_s_per_device=throughput / devices,
        # A step whose MFU was over 100% has none (its peak was measured low): then no mean either.
        mfu=statistics.mean(r["mfu"] if r["mfu"] is not None else math.nan for r in timed),
        peak_busy=bool(run["resolved"].get("peak_flops_busy")),
        peak_memory_mib=peak,
        step_ms=1000 * sum(r["tokens"] for r in timed) / throughput / len(timed),
        phase_ms=phases,
    )


def check_combinations(
    strategies: list[str], precisions: list[str], nproc: int, steps: int, warmup: int
) -> None:
    """Before anything runs or is said: known names, steps, and at least one combination that can
    run here (one of none wrote an empty table over an earlier bench.json, exit 0)."""
    for s in strategies:
        if s not in STRATEGIES:
            raise UserError(f"--strategies: unknown strategy {s!r} (choose from {', '.join(STRATEGIES)})")
    for p in precisions:
        if p not in PRECISIONS:
            raise UserError(f"--precisions: unknown precision {p!r} (choose from {', '.join(PRECISIONS)})")
    if steps < 1 or warmup < 1:
        raise UserError("--steps and --warmup must be >= 1")
    reasons = {skip_reason(s, p, nproc) for s in strategies for p in precisions}
    if None not in reasons:
        said = "; ".join(sorted(str(r).removeprefix("skipped: ") for r in reasons))
        raise UserError(f"no combination of --strategies and --precisions runs here ({said})")


def run_bench(
    base: TrainConfig,
    strategies: list[str],
    precisions: list[str],
    nproc: int,
    steps: int,
    warmup: int,
) -> list[BenchRow]:
    """Run every strategy x precision of ``base`` (``lmtune train``, in a subprocess each); the
    combinations that cannot run here say why."""
    check_combinations(strategies, precisions, nproc, steps, warmup)
    results: list[BenchRow] = []
    with tempfile.TemporaryDirectory(prefix="lmtune-bench-") as tmp:
        for strategy in strategies:
            for precision in precisions:
                reason = skip_reason(strategy, precision, nproc)
                if reason:
                    results.append(BenchRow(strategy, precision, reason))
                    continue
                out = Path(tmp) / f"{strategy}-{precision}"
                try:
                    run = base.replace(
                        strategy=strategy,
                        precision=precision,
                        nproc_per_node=nproc if strategy in ("ddp", "fsdp") else 1,
                        max_steps=warmup + steps,
                        output_dir=str(out),
                        profile=True,
                        **MEASURING_RUN,
                    )
                    check_settings(run, run.launch.nproc_per_node)
                except UserError as e:  # the run's own settings and this combination (adamw8bit and fsdp)
                    results.append(BenchRow(strategy, precision, f"skipped: {e}"))
                    continue
                cmd = [sys.executable, "-m", "lmtune", "train", *to_argv(run)]
                proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
                if proc.returncode != 0:
                    last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                    if proc.returncode == 2:
                        raise UserError(last.removeprefix("error: "))
                    results.append(BenchRow(strategy, precision, f"failed: {last}"))
                    continue
                devices = (
                    nproc
                    if strategy in ("ddp", "fsdp")
                    else max(1, torch.cuda.device_count() if strategy == "dp" else 1)
                )
                results.append(_measure(out, warmup, devices))
    return results


def format_table(rows: list[BenchRow]) -> str:
    head = (
        f"{'strategy':<9}{'precision':<10}{'devices':>8}{'tokens/s':>11}{'/device':>10}{'MFU':>7}"
        f"{'peak MiB':>10}{'step ms':>9}  data / fwd / bwd+comm / optim ms"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.status != "ok":
            lines.append(f"{r.strategy:<9}{r.precision:<10}  {r.status}")
            continue
        ph = r.phase_ms or {}
        split = " / ".join(f"{ph.get(p, 0.0):.1f}" for p in PHASES)
        mfu = f"{100 * r.mfu:>5.0f}%{'*' if r.peak_busy else ' '}" if math.isfinite(r.mfu) else f"{'n/a':>7}"
        lines.append(
            f"{r.strategy:<9}{r.precision:<10}{r.devices:>8}{r.tokens_per_s:>11,.0f}"
            f"{r.tokens_per_s_per_device:>10,.0f}{mfu}{r.peak_memory_mib:>10,.0f}"
            f"{r.step_ms:>9.1f}  {split}"
        )
    if any(r.peak_busy for r in rows if r.status == "ok"):
        lines.append(
            "* the matmul peak MFU divides by was probed while other processes held the cores, so this "
            "MFU may read high: run lmtune bench --measure-peak on a quiet machine"
        )
    return "\n".join(lines)


def measure_peaks(precisions: list[str], nproc: int, device_name: str) -> list[str]:
    """`lmtune bench --measure-peak`: measure the matmul peak again (several longer probes) for each
    precision and each thread count training uses here, and replace the cached ones MFU divides by."""
    import torch

    from lmtune.data.prepare import cache_root
    from lmtune.model.products import onednn_bf16
    from lmtune.parallel.distributed import available_cores, read_dist_env
    from lmtune.training.perf import PEAKS_FILE, Probe, measure_and_store_peak

    device = read_dist_env(device_name).device
    cores = available_cores()
    thread_counts = sorted({cores, max(1, cores // nproc)}) if device.type == "cpu" else [cores]
    lines = []
    for precision in precisions:
        if precision == "fp16" and device.type != "cuda":
            continue
        # A CPU bf16 run takes either products path (lmtune.model.paths): both peaks, where both can
        # run (without oneDNN's bf16 kernels only fp32 products, bf16's are reference loops).
        ways = [False]
        if device.type == "cpu" and precision == "bf16":
            ways = [False, True] if onednn_bf16() else [True]
        for threads in thread_counts:
            if device.type == "cpu":
                torch.set_num_threads(threads)
            where = f"{threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else str(device)
            for fp32_products in ways:
                probe = Probe(device, precision, threads, fp32_products)
                flops, quiet = measure_and_store_peak(probe, cache_root() / PEAKS_FILE)
                how = " (fp32 products of bf16 operands)" if fp32_products else ""
                if not quiet:
                    how += " (other processes held the cores: the higher of this and the cached peak)"
                lines.append(f"peak {precision:<5} {where:<10} {flops / 1e9:>10,.1f} GFLOP/s{how}")
    lines.append(f"stored in {cache_root() / PEAKS_FILE}")
    return lines


def to_json(rows: list[BenchRow]) -> list[dict[str, Any]]:
    """The rows as JSON; a combination that did not run has no figures (null, not 0.0)."""
    named = ("strategy", "precision", "status")  # what a row is; the rest are its figures
    return [
        asdict(r) if r.status == "ok" else {k: v if k in named else None for k, v in asdict(r).items()}
        for r in rows
    ]
