"""Which kernels a CPU bf16 run takes for its matrix products and its attention, decided once and
kept: by rule where the CPU's matrix units decide, by a careful timing only where they do not.

A start-up timing on a busy 2-core machine flipped between identical runs (per-example attention
chosen twice, bf16 attention once, 12.7 s against 17.5 s), and a flip changes a resumed run's
numerics. So, in this order:

- ``LMTUNE_CPU_PRODUCTS`` / ``LMTUNE_CPU_ATTENTION`` (auto | fp32 | bf16) override;
- a resumed run takes the paths its checkpoint recorded (``paths.json``), unless this CPU cannot
  run a recorded bf16 path (then the rule below, and the log says so);
- rules: without oneDNN bf16 kernels PyTorch multiplies bf16 in reference loops (~30x slower than
  fp32), so products run in fp32 of bf16 operands; with AMX the products are oneDNN's bf16 kernels
  (3x fp32's speed here); attention runs in fp32 without AMX and, with AMX, for heads narrower
  than :data:`WIDE_HEAD` (bf16 measured slower on varied example lengths; see the figures there);
- otherwise (products on AVX-512 BF16 without AMX; attention with heads of 128 or more on AMX) a
  timing on the run's own shapes, the two ways alternated over several rounds, the default kept
  unless the other is faster by :data:`MARGIN`; rank 0 times, every rank takes its answer, and it
  is cached per machine, threads, model shape and torch version beside the matmul peaks
  (``paths.json`` in lmtune's cache), so later runs take it without timing.
"""

from __future__ import annotations

import json
import os
import platform
import random
import socket
import statistics
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from lmtune.config import environment
from lmtune.errors import one_line
from lmtune.model.attention import CPU_ATTENTION_ENV, SEGMENTS, Segments, bucketed_attention, varlen_attention
from lmtune.model.products import (
    PRODUCTS_ENV,
    Products,
    cpu_bf16_products,
    linear_seconds,
    native_products,
    onednn_bf16,
    token_bucket,
)
from lmtune.parallel.distributed import DistEnv, broadcast_object

PATHS_FILE = "paths.json"  # in a checkpoint (the run's paths) and in lmtune's cache (timed ones)
MARGIN = 0.10  # a timed alternative replaces the default only when this much faster
BF16, FP32 = "bf16", "fp32"
_ROUNDS, _BUDGET_S = 5, 3.0  # timed rounds after a warm-up one: at least this many, more within the budget


@dataclass(frozen=True)
class CpuUnits:
    """The matrix units of this CPU that decide its bf16 paths."""

    amx: bool  # AMX bf16 tiles (Sapphire Rapids and later)
    avx512_bf16: bool  # AVX-512 BF16 dot products (Cooper Lake, Zen 4, ...)
    avx2: bool

    @property
    def bf16(self) -> bool:
        return self.amx or self.avx512_bf16

    def describe(self) -> str:
        units = (("AMX", self.amx), ("AVX-512 BF16", self.avx512_bf16), ("AVX2", self.avx2))
        found = [name for name, present in units if present]
        return ", ".join(found) if found else "none of AMX, AVX-512 BF16, AVX2"


def cpu_units() -> CpuUnits:
    """This CPU's matrix units that PyTorch's kernels may use: its flags (PyTorch's CPU probe, else
    /proc/cpuinfo), less those ``ONEDNN_MAX_CPU_ISA`` keeps oneDNN from (which also emulates a CPU
    without them, for tests)."""
    try:
        caps: dict[str, Any] = dict(torch._C._cpu._get_cpu_capability())
        flags = {name for name, present in caps.items() if present is True}
    except (AttributeError, RuntimeError, TypeError):
        flags = _cpuinfo_flags()
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    amx = "amx_bf16" in flags and (cap in ("ALL", "DEFAULT") or "AMX" in cap)
    avx512_bf16 = "avx512_bf16" in flags and (amx or cap in ("ALL", "DEFAULT") or _bf16_isa(cap))
    return CpuUnits(amx=amx, avx512_bf16=avx512_bf16, avx2="avx2" in flags)


def _bf16_isa(cap: str) -> bool:
    """Whether oneDNN's ISA ``cap`` includes AVX-512 BF16 (AVX512_CORE_BF16 and the ones above it)."""
    return cap.startswith(("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX10"))


def _cpuinfo_flags() -> set[str]:
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_name() -> str:
    """The CPU's model name (``model name`` of /proc/cpuinfo where there is one)."""
    with suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@dataclass(frozen=True)
class Decision:
    """One path of a run: its choice (``bf16`` or ``fp32``) and how it was decided."""

    choice: str
    how: str
    # A rule's fp32 because this CPU has no kernels or units for bf16 at all (rather than because
    # bf16 measured slower): a checkpoint's recorded bf16 is then set aside.
    no_bf16_here: bool = False


@dataclass(frozen=True)
class Paths:
    """A run's decided paths; None where there is nothing to decide (not a CPU bf16 run; attention
    that is not per example)."""

    units: CpuUnits  # of this machine
    products: Decision | None = None
    attention: Decision | None = None
    # A checkpoint record (lmtune.checkpoint.manager): saved with every checkpoint; read back
    # before the model is built (lmtune.checkpoint.resume.recorded_paths), so not restored after.
    file_name: ClassVar[str] = PATHS_FILE

    def restore(self, record: dict[str, Any], step: int) -> None:
        """Nothing: a resumed run was built with the recorded paths already."""

    def to_json(self) -> dict[str, Any]:
        """run.json's ``resolved.paths`` and a checkpoint's ``paths.json``."""
        record: dict[str, Any] = {"cpu_matrix_units": self.units.describe()}
        for name, decision in (("products", self.products), ("attention", self.attention)):
            record[name] = None if decision is None else {"choice": decision.choice, "decided": decision.how}
        return record

    def line(self) -> str:
        """The start line's account: units found, paths taken and why."""
        parts = [f"CPU matrix units: {self.units.describe()}"]
        for name, decision in (("products", self.products), ("attention", self.attention)):
            if decision is not None:
                parts.append(f"{name} {decision.choice} ({decision.how})")
        return "; ".join(parts)


def products_of(paths: Paths, precision: str) -> Products:
    """How the run multiplies matrices, from its decided products path. Token counts are bucketed
    wherever oneDNN's bf16 kernels run: its products' (bf16 products), and on a CPU with bf16 units
    also sdpa's in rows that are not flattened (PyTorch's flash attention then keeps a kernel per
    length: +4.5 MB per new length here, flat with oneDNN held to AVX2)."""
    if paths.products is None:
        return native_products(precision)
    fp32 = paths.products.choice == FP32
    return cpu_bf16_products(fp32=fp32, bucketed=not fp32 or paths.units.bf16)


@dataclass(frozen=True)
class Workload:
    """The run's own shapes, for a timing: the model's config and a few micro-batches, each as its
    examples' token counts."""

    config: Any
    micro_batches: list[list[int]]


@dataclass(frozen=True)
class Question:
    """What a run asks to be decided."""

    cpu_bf16: bool  # a CPU run under bf16 autocast, not compiled (else nothing to decide)
    attention: bool  # the model runs per-example attention, in fp32 or bf16
    recorded: dict[str, Any] | None = None  # the paths.json of the checkpoint the run resumes
    cache: Path | None = None  # lmtune's cache file of timed decisions (None: not kept)
    threads: int = 0  # CPU threads of the run: a timing holds for them


def decide_paths(question: Question, workload: Workload, env: DistEnv) -> Paths:
    """The run's paths (collective on a CPU bf16 run: rank 0's timed decisions go to every rank)."""
    units = cpu_units()
    if not question.cpu_bf16:
        return Paths(units)
    recorded = question.recorded or {}
    products = _decide(
        "products", _forced(PRODUCTS_ENV), _products_rule(units), recorded.get("products"), default=BF16
    )
    attention = None
    if question.attention:
        rule = _attention_rule(units, _shape(workload.config).head_dim)
        attention = _decide(
            "attention", _forced(CPU_ATTENTION_ENV), rule, recorded.get("attention"), default=FP32
        )
    local = Paths(units, products, attention)
    timed = _rank0_timings(local, question, workload, env)
    return Paths(
        units,
        timed.products if products is not None and products.how == _UNDECIDED else products,
        timed.attention if attention is not None and attention.how == _UNDECIDED else attention,
    )


_UNDECIDED = "to be timed"


def bf16_plan(units: CpuUnits) -> str:
    """What a CPU bf16 run takes on a CPU with ``units``, before any model is known (`lmtune
    doctor`): the rules' and overrides' choices, or that a timing decides (once per model)."""
    products = _decide("products", _forced(PRODUCTS_ENV), _products_rule(units), None, default=BF16)
    attention = _decide(
        "attention", _forced(CPU_ATTENTION_ENV), _attention_rule(units, None), None, default=FP32
    )

    def said(decision: Decision) -> str:
        if decision is attention and decision.how == _UNDECIDED:
            return (
                f"fp32 for heads narrower than {WIDE_HEAD} (rule), timed for wider ones per model at its "
                "first run (cached; fp32 unless bf16 is faster)"
            )
        if decision.how == _UNDECIDED:
            return f"timed per model at its first run (cached; {decision.choice} unless the other is faster)"
        return f"{decision.choice} ({decision.how})"

    return f"--precision bf16 takes products {said(products)}, attention {said(attention)}"


def _forced(variable: str) -> str | None:
    return environment.cpu_path(variable)


def _products_rule(units: CpuUnits) -> Decision | None:
    if not onednn_bf16():
        return Decision(
            FP32, "rule: PyTorch has no bf16 matrix kernels for this CPU (reference loops)", no_bf16_here=True
        )
    if units.amx:
        return Decision(BF16, "rule: AMX")
    return None


# Per-example attention, forward and backward, fp32 against bf16 (over bucketed shapes), measured on
# an AMX CPU, 2 threads: with varied example lengths fp32 won at every head size (head 64: 57 vs
# 100 ms, 104 vs 160 ms; head 128: 45 vs 83 ms, 204 vs 226 ms); bf16 won only on long examples of
# one length with heads of 128 (512 tokens: 392 vs 228 ms; 1,024: 1,134 vs 521 ms); on AVX-512
# BF16 without AMX bf16 was 2-3x slower (heads of 32 and 64).
WIDE_HEAD = 128


def _attention_rule(units: CpuUnits, head_dim: int | None) -> Decision | None:
    """fp32 by rule, except for heads of WIDE_HEAD or more on AMX (their examples' lengths decide:
    timed); ``head_dim`` None (no model yet): the rule for the units alone."""
    if not units.bf16:
        return Decision(FP32, "rule: no bf16 matrix units", no_bf16_here=True)
    if not units.amx:
        return Decision(FP32, "rule: AVX-512 BF16 without AMX (bf16 attention measured 2-3x slower)")
    if head_dim is not None and head_dim < WIDE_HEAD:
        return Decision(FP32, f"rule: heads of {head_dim} (< {WIDE_HEAD}; bf16 attention measured slower)")
    return None


def _decide(name: str, forced: str | None, rule: Decision | None, recorded: Any, default: str) -> Decision:
    """Override, then the checkpoint's record (unless the rule says this CPU has no bf16 for it: a
    rule that only prefers fp32 keeps the record, so the resume stays bit-identical), then the
    rule; else undecided (to be timed against ``default``)."""
    if forced is not None:
        variable = PRODUCTS_ENV if name == "products" else CPU_ATTENTION_ENV
        return Decision(forced, f"set by {variable}")
    saved = recorded.get("choice") if isinstance(recorded, dict) else None
    if saved in (BF16, FP32):
        if saved == BF16 and rule is not None and rule.no_bf16_here:
            return replace(rule, how=f"{rule.how}; the checkpoint's bf16 set aside: no units for it here")
        earlier = one_line(str(recorded.get("decided", "recorded")), 120)  # a file's text, bounded
        how = earlier if earlier.startswith("from the checkpoint") else f"from the checkpoint ({earlier})"
        return Decision(saved, how)
    return rule if rule is not None else Decision(default, _UNDECIDED)


def _rank0_timings(local: Paths, question: Question, workload: Workload, env: DistEnv) -> Paths:
    """Rank 0's answers for what no override, record or rule decided: cached, else timed (then
    cached). Every rank takes them, so the replicas run alike."""
    answer: dict[str, tuple[str, str]] = {}
    if env.is_main:
        for name, decision in (("products", local.products), ("attention", local.attention)):
            if decision is not None:
                found = decision if decision.how != _UNDECIDED else _cached_or_timed(name, question, workload)
                answer[name] = (found.choice, found.how)
    if env.world_size > 1:
        answer = broadcast_object(answer, env)

    def take(name: str) -> Decision | None:
        return Decision(*answer[name]) if name in answer else None

    return Paths(local.units, take("products"), take("attention"))


def _cached_or_timed(name: str, question: Question, workload: Workload) -> Decision:
    key = _cache_key(name, workload.config, question.threads)
    cached = _read_cache(question.cache).get(key) if question.cache is not None else None
    if isinstance(cached, dict) and cached.get("choice") in (BF16, FP32):
        return Decision(str(cached["choice"]), f"cached, {cached.get('decided', 'timed')}")
    decided = time_products(workload) if name == "products" else time_attention(workload)
    if question.cache is not None:
        with suppress(OSError):  # a read-only cache costs only the remembering
            _store(question.cache, key, {"choice": decided.choice, "decided": decided.how})
    return decided


def _cache_key(name: str, config: Any, threads: int) -> str:
    """What a timed decision holds for: this machine, its threads, the model's shape, torch."""
    shape = _shape(config)
    described = (
        f"hidden {shape.hidden}, mlp {shape.mlp}, heads {shape.heads}/{shape.kv_heads} x {shape.head_dim}"
    )
    machine = f"{socket.gethostname()} | {cpu_name()} | {threads} threads | torch {torch.__version__}"
    return f"{machine} | {name} | {described}"


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _store(path: Path, key: str, value: dict[str, str]) -> None:
    """Replace one entry of the cache, atomically (other runs may read it meanwhile)."""
    entries = _read_cache(path)
    entries[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1), encoding="utf-8")
    tmp.replace(path)


@dataclass(frozen=True)
class _Shape:
    hidden: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int


def _shape(config: Any) -> _Shape:
    hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 64)
    heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 0) or 1)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(config, "head_dim", 0) or hidden // heads)
    mlp = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * hidden)
    return _Shape(hidden, mlp, heads, kv_heads, head_dim)


def time_products(workload: Workload) -> Decision:
    """The model's widest linear layer (hidden -> MLP) forward and backward on the micro-batches'
    bucketed token counts, in oneDNN's bf16 kernels and in fp32 of bf16 operands; bf16 (PyTorch's own
    kernels) is kept unless fp32 is faster by MARGIN."""
    shape = _shape(workload.config)
    weight = torch.randn(shape.mlp, shape.hidden)
    inputs = [torch.randn(token_bucket(max(sum(mb), 1)), shape.hidden) for mb in workload.micro_batches]

    def way(fp32: bool) -> Callable[[], float]:
        return lambda: sum(linear_seconds(x, weight, fp32) for x in inputs)

    return _timed(default=(BF16, way(False)), other=(FP32, way(True)), what="per micro-batch's products")


class _AttentionLayer(nn.Module):
    """What transformers' sdpa attention reads from a layer."""

    def __init__(self, groups: int):
        super().__init__()
        self.is_causal = True
        self.num_key_value_groups = groups


def time_attention(workload: Workload) -> Decision:
    """Per-example attention, forward and backward, on the micro-batches' examples with the model's
    heads: fp32 per example (the default) against bf16 over bucketed shapes."""
    shape = _shape(workload.config)
    layer = _AttentionLayer(max(shape.heads // shape.kv_heads, 1))
    cases = []
    for lengths in workload.micro_batches:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        segments = Segments(tuple(offsets), torch.tensor(offsets, dtype=torch.int32))
        tokens = offsets[-1]
        q = torch.randn(1, shape.heads, tokens, shape.head_dim, dtype=torch.bfloat16)
        kv = [torch.randn(1, shape.kv_heads, tokens, shape.head_dim, dtype=torch.bfloat16) for _ in range(2)]
        cases.append((q, kv[0], kv[1], segments))

    def way(attend: Callable[..., tuple[torch.Tensor, None]]) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for q, k, v, segments in cases:
                q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = attend(layer, q, k, v, None, **{SEGMENTS: segments})[0]
                out.float().sum().backward()  # type: ignore[no-untyped-call]
            return time.perf_counter() - start

        return run

    return _timed(
        default=(FP32, way(varlen_attention)), other=(BF16, way(bucketed_attention)), what="per step"
    )


def _timed(
    default: tuple[str, Callable[[], float]], other: tuple[str, Callable[[], float]], what: str
) -> Decision:
    """The two ways alternated (ABBA) after a warm-up round of each, for at least ``_ROUNDS`` rounds
    and more within ``_BUDGET_S``; the medians compared with MARGIN."""
    (name_a, a), (name_b, b) = default, other
    a(), b()  # warm-up: kernels compiled, caches filled
    times_a: list[float] = []
    times_b: list[float] = []
    deadline = time.perf_counter() + _BUDGET_S
    while len(times_a) < _ROUNDS or (time.perf_counter() < deadline and len(times_a) < 4 * _ROUNDS):
        first, second = (a, b) if len(times_a) % 2 == 0 else (b, a)
        one, two = first(), second()
        times_a.append(one if first is a else two)
        times_b.append(two if first is a else one)
    median_a, median_b = statistics.median(times_a), statistics.median(times_b)
    choice = name_b if median_b < (1 - MARGIN) * median_a else name_a
    return Decision(
        choice,
        f"timed: {name_a} {median_a * 1e3:.2f} ms, {name_b} {median_b * 1e3:.2f} ms {what}, median of "
        f"{len(times_a)}; {name_a} unless {name_b} is {MARGIN:.0%} faster",
    )


def sample_micro_batches(
    lengths: list[int], micro_batch_size: int, packed_length: int | None
) -> list[list[int]]:
    """A few micro-batches as the run will see them, drawn (seeded) from its examples' lengths:
    ``micro_batch_size`` examples, or with packing as many rows of up to ``packed_length`` tokens."""
    rng = random.Random(0)
    pool = [n for n in lengths if n > 0] or [1]
    batches = []
    for _ in range(4):
        if packed_length is None:
            batches.append([rng.choice(pool) for _ in range(micro_batch_size)])
            continue
        batch: list[int] = []
        for _ in range(micro_batch_size):
            row = 0
            while row < packed_length:
                n = min(rng.choice(pool), packed_length - row)
                batch.append(n)
                row += n
        batches.append(batch)
    return batches
