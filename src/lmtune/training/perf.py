"""Model FLOPs and the peak this device really reaches, for MFU (model FLOPs utilisation)."""

from __future__ import annotations

import json
import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from lmtune.config.files import read_json
from lmtune.errors import UserError
from lmtune.model.paths import cpu_name
from lmtune.model.precision import DTYPES
from lmtune.model.products import Fp32Products
from lmtune.model.quantization import parameter_count
from lmtune.outputs.runlog import InfoLog


def _synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work, so wall time measures it (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token: 6 per weight, plus the attention scores.

    6N counts the matrix products with the weights (2 forward, 4 backward); attention adds
    ``12 * layers * hidden * seq_len`` for QK^T and the weighted sum of V, which scale with the
    sequence length (PaLM, appendix B). Embedding lookups do no products and are left out.
    """
    config: Any = getattr(model, "config", None)
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    skip = {id(p) for p in embeddings.parameters()} if isinstance(embeddings, nn.Module) else set()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = parameter_count(model, skip)
    if tied and isinstance(embeddings, nn.Module):  # the tied output projection still multiplies
        weights += sum(p.numel() for p in embeddings.parameters())
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return 6.0 * weights + 12.0 * layers * hidden * seq_len


def mfu_meter(model: nn.Module, chunked: bool, peak: float, devices: int, log: InfoLog) -> MfuMeter:
    """The run's MFU meter. Under the chunked loss the output layer multiplies only positions
    with a target, so its products count per target token: counted per token, a 2-block model with
    a 32,000-entry head and prompts 2/3 of its tokens read 137% and blamed the measured peak."""
    get_output = getattr(model, "get_output_embeddings", None)
    out = get_output() if callable(get_output) else None
    head = 6.0 * sum(p.numel() for p in out.parameters()) if chunked and isinstance(out, nn.Module) else 0.0
    return MfuMeter(lambda n: train_flops_per_token(model, n) - head, peak, devices, log, head)


@dataclass(frozen=True)
class Probe:
    """What a matmul peak is measured for: a device at a precision, with this many CPU threads,
    and (a CPU bf16 run, lmtune.model.products) whether its products run in fp32."""

    device: torch.device
    precision: str
    threads: int = 0
    fp32_products: bool = False


def measure_peak_flops(probe: Probe, seconds: float = 0.5) -> float:
    """Matrix-multiply FLOP/s this device reaches at the probe's precision, measured, never looked up.

    Square products large enough to be compute-bound, in the layout a linear layer uses (``x @ W.T``):
    on CPUs without native bf16 support PyTorch's plain ``a @ b`` takes a path 20x slower than the
    one linear layers take, which made MFU read 500%. The products run as the run's do (fp32
    products of bf16 operands included). The best of several timed batches.
    """
    return probe_peak(probe, seconds)[0]


QUIET_SHARE = 0.9  # of its threads' time a CPU probe must get to count as taken on a quiet machine


def probe_peak(probe: Probe, seconds: float) -> tuple[float, bool]:
    """(:func:`measure_peak_flops`, whether the machine was quiet): on the CPU, whether the probe's
    threads ran for QUIET_SHARE of its wall time. Other processes on the cores make a probe read
    low, and an early run's low reading kept as settled made every later MFU on the machine read
    ~3x high (96% where 30% was true)."""
    wall, cpu = time.perf_counter(), time.process_time()
    flops = _linear_flops(probe, seconds)
    if probe.device.type != "cpu":
        return flops, True
    share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads())
    return flops, share >= QUIET_SHARE


def _linear_flops(probe: Probe, seconds: float) -> float:
    device = probe.device
    size = 4096 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=DTYPES[probe.precision])
    b = torch.randn(size, size, device=device, dtype=DTYPES[probe.precision])
    with Fp32Products() if probe.fp32_products else nullcontext():
        for _ in range(2):  # warm-up: kernels selected, caches filled
            torch.nn.functional.linear(a, b)
        _synchronize(device)
        best = 0.0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            reps = 4
            start = time.perf_counter()
            for _ in range(reps):
                torch.nn.functional.linear(a, b)
            _synchronize(device)
            best = max(best, reps * 2 * size**3 / (time.perf_counter() - start))
    return best


PEAKS_FILE = "peaks.json"


def _peak_key(probe: Probe) -> str:
    """What a measured peak holds for: this machine, device model, precision, threads, torch."""
    import socket

    device = probe.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    # Threads matter on the CPU only.
    threads_part = "" if device.type == "cuda" else f" | {probe.threads} threads"
    precision = probe.precision + (" fp32 products" if probe.fp32_products else "")
    return f"{socket.gethostname()} | {name} | {precision}{threads_part} | torch {torch.__version__}"


SETTLED_PROBES = 3  # quiet probes of the peak on a machine; later runs take the best kept (no probe)


def _read_peaks(path: Path) -> dict[str, tuple[float, int]]:
    """Each key's best peak and how many quiet probes it is the best of (:func:`probe_peak`; an
    entry of an earlier format has none: its probes may have been taken on a busy machine)."""
    try:
        raw = read_json(path, limit=1 << 20)
    except (OSError, UserError):
        return {}
    if not isinstance(raw, dict):
        return {}
    peaks = {}
    for key, value in raw.items():
        flops, quiet = (
            (value.get("flops"), value.get("quiet_probes", 0)) if isinstance(value, dict) else (value, 0)
        )
        if isinstance(flops, (int, float)) and math.isfinite(flops) and flops > 0 and isinstance(quiet, int):
            peaks[str(key)] = (float(flops), quiet)
    return peaks


class Peak(NamedTuple):
    flops: float
    busy: bool  # not settled, and probed while other processes held the cores: MFU may read high


def best_peak_flops(
    probe: Probe, cache: Path, store: bool = True, info: Callable[[str], None] = lambda _: None
) -> Peak:
    """The matmul peak for MFU: the best of this run's probe and every earlier one cached for the
    same machine, device, precision and thread count. One short probe at a busy moment reads low
    (3x apart between runs on a loaded machine), which made MFU read over 100%; the best kept over
    runs converges on what the device reaches. Once SETTLED_PROBES runs have probed on a quiet
    machine, later runs take the best kept without a probe (0.3 s of every start). ``store``
    False: read the cache, leave it to another rank to write. ``info`` hears when the peak is
    unsettled and this probe found other processes on the cores: MFU may read high."""
    key = _peak_key(probe)
    known, quiet = _read_peaks(cache).get(key, (0.0, 0))
    if quiet >= SETTLED_PROBES:
        return Peak(known, False)
    measured, was_quiet = probe_peak(probe, seconds=0.3)
    if not was_quiet:
        info(
            f"mfu: the matmul peak ({max(measured, known) / 1e9:,.1f} GFLOP/s) was probed while other "
            "processes held the cores, so MFU may read high until a run on a quiet machine probes it "
            "(or lmtune bench --measure-peak)"
        )
    if store:
        with suppress(OSError):  # a read-only cache costs only the remembering
            _store_peak(cache, key, max(measured, known), quiet + was_quiet)
    return Peak(max(measured, known), not was_quiet)


def measure_and_store_peak(probe: Probe, cache: Path) -> tuple[float, bool]:
    """`lmtune bench --measure-peak`: several longer probes. Where one ran on a quiet machine, the
    result replaces the cached peak, settled (runs take it without probing); otherwise it only
    raises it. Returns the peak now cached and whether the machine was quiet."""
    readings = [probe_peak(probe, 1.0) for _ in range(5)]
    measured, quiet = max(r[0] for r in readings), any(r[1] for r in readings)
    key = _peak_key(probe)
    known, settled = _read_peaks(cache).get(key, (0.0, 0))
    if quiet:
        known, settled = 0.0, SETTLED_PROBES
    _store_peak(cache, key, max(measured, known), settled)
    return max(measured, known), quiet


def _store_peak(cache: Path, key: str, flops: float, quiet: int) -> None:
    """Replace one entry of the peaks file, atomically (ranks and runs may read it meanwhile)."""
    peaks: dict[str, object] = {
        k: {"flops": f, "quiet_probes": n} for k, (f, n) in _read_peaks(cache).items()
    }
    peaks[key] = {"flops": flops, "quiet_probes": quiet}
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(peaks, indent=1), encoding="utf-8")
    tmp.replace(cache)


class PhaseTimer:
    """Phase boundaries of a step (data, forward, backward, optimizer): told to the heartbeat (the
    hang watchdog's), and with ``timed`` (``--profile``, `lmtune bench`) timed.

    When timed, the device is synchronised at every boundary, so GPU work counts in the phase that
    launched it; DDP's all-reduce overlaps the backward pass, so the part it does not hide shows in
    ``backward``.
    """

    def __init__(self, device: torch.device, timed: bool = True, beat: Callable[[str], None] | None = None):
        self.device, self.timed, self.beat = device, timed, beat
        self.seconds: dict[str, float] = {}
        self.current = ""  # the phase entered last (an error names it)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.current = name
        if self.beat is not None:
            self.beat(name)
        if not self.timed:
            yield
            return
        _synchronize(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def take(self) -> dict[str, float]:
        taken, self.seconds = self.seconds, {}
        return taken


def phase(timer: PhaseTimer | None, name: str) -> AbstractContextManager[None]:
    """``timer.phase(name)``, or nothing when the run is not timed."""
    return timer.phase(name) if timer is not None else nullcontext()


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated CUDA memory on a GPU, resident set size on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    """The peak resident set size of this process's own memory. Linux's ``ru_maxrss`` keeps the
    peak of the process it was started from across ``exec``: lmtune run by a large Python process
    (a notebook, pytest, a sweep driver) reported that parent's size. ``VmHWM`` is the high-water
    mark of the memory map this program runs in."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MfuMeter:
    """Model FLOPs per second of a step over the measured peak of all devices. A reading over
    100% is None (and a warning, once): the peak was measured low, not the step faster than it.
    ``head_per_target``: FLOPs counted per target token rather than per token (the output layer's
    under the chunked loss, which projects only positions with a target)."""

    def __init__(
        self,
        flops_per_token: Callable[[int], float],
        peak: float,
        devices: int,
        log: InfoLog,
        head_per_target: float = 0.0,
    ):
        self.flops_per_token, self.peak, self.devices, self.log = flops_per_token, peak, devices, log
        self.head_per_target = head_per_target
        self.over_peak: list[float] = []

    def __call__(self, tokens: int, examples: int, seconds: float, targets: int) -> float | None:
        mean_length = tokens / max(examples, 1)
        flops = self.flops_per_token(round(mean_length)) * tokens + self.head_per_target * targets
        value = flops / max(seconds, 1e-9) / (self.peak * self.devices)
        if value <= 1.0:
            return value
        if not self.over_peak:
            self.log.info(
                f"warning: MFU would read {100 * value:.0f}%: the matmul peak measured at start "
                f"({self.peak / 1e9:,.1f} GFLOP/s) is below what this step reached (measured while the "
                "machine was busy?); MFU is left out. Re-measure it: lmtune bench --measure-peak"
            )
        self.over_peak.append(value)
        return None
