"""`lmtune plan`: predict the peak memory per device of a training setup before loading any weight,
and list the setups that fit (the memory model is :mod:`lmtune.tools.memory`).

On a GPU the allocator's peak counts the tensors the model predicts and cuBLAS's workspaces, which
are measured (``memory.cuda_workspaces``). On CPU the measured
peak is the resident size, which adds the process itself (Python, torch, transformers, kernel code)
and the C heap's habit of keeping freed activations resident; both are measured, not assumed, by
training two real steps of the same setup twice, on cuts of the model (``measure_host``).

``--calibrate`` trains two real steps at two micro-batch sizes and fits the activation scale and a
fixed offset to what was measured; every candidate's prediction is then corrected with them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lmtune.config.io import MEASURING_RUN, to_argv
from lmtune.config.settings import SAMPLE_DATA, TrainConfig, micro_batch_size
from lmtune.errors import UserError
from lmtune.model.precision import check_device
from lmtune.parallel.wrap import effective_strategy, resolve_strategy
from lmtune.tools.memory import (
    Estimate,
    Host,
    ModelFacts,
    Setup,
    cuda_workspaces,
    estimate,
    loss_chunk,
    model_facts,
)
from lmtune.tools.rows import model_obstacle, row_length
from lmtune.tools.trace import cut_layers

MIB = 2**20
UNITS = {"b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """``"24GiB"``, ``"80GB"``, ``"512M"`` -> bytes (binary units: G = GiB). A bare number is refused:
    24 is more likely 24 GiB than 24 bytes."""
    match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*(?:([kmgtKMGT])(?:i?[bB])?|([bB]))\s*", text)
    if not match:
        raise UserError(
            f"--memory-per-device: expected a size with its unit, such as 24GiB or 512MiB, got {text!r}"
        )
    size = int(float(match.group(1)) * UNITS[(match.group(2) or match.group(3)).lower()])
    if size <= 0:
        raise UserError(f"--memory-per-device: must be more than 0, got {text!r}")
    return size


def measure_host(
    cfg: TrainConfig,
    setup: Setup,
    config: Any,
    predict_cut: Callable[[Any, Setup], Estimate],
    workdir: Path,
) -> Host:
    """On CPU: train two real steps of this setup twice and solve measured = runtime + allocator x
    tensors from the two peaks, on the model cut to 1 and to 3 decoder blocks (random weights,
    saved as a model folder) or, where the blocks' tensors are the smaller difference (a small
    model, a large vocabulary), on the 1-block cut at the micro-batch and at half of it. Two points
    whose tensors differ by little made the factor noise: a 2-block model's plan came out at 918
    MiB, once 1,433. Cheap next to the real model, and measured on this machine, not assumed."""
    from transformers import AutoModelForCausalLM

    from lmtune.model.modeling import load_tokenizer

    tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
    if cfg.data.train == SAMPLE_DATA and setup.objective == "sft":
        cfg = _planned_rows(cfg, setup, workdir)
    first, last = 1, max(2, min(3, int(config.num_hidden_layers)))
    rows = setup.micro_batch_size
    designs = [([(first, rows), (last, rows)], f"{first}- and {last}-block cuts of the model")]
    if rows >= 2:
        designs.append(
            ([(first, rows), (first, rows // 2)], f"a 1-block cut at micro-batches {rows} and {rows // 2}")
        )

    def tensors(n: int, b: int) -> int:
        return predict_cut(cut_layers(config, n), replace(setup, micro_batch_size=b)).tensors

    pairs, measured_on = max(designs, key=lambda d: abs(tensors(*d[0][1]) - tensors(*d[0][0])))
    points = []
    for n, b in pairs:
        folder = workdir / f"cut-{n}"
        if not folder.exists():
            with torch.random.fork_rng(devices=[]):
                model = AutoModelForCausalLM.from_config(cut_layers(config, n))  # type: ignore[no-untyped-call]
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            del model
        what = f"{n} decoder block{'s' if n > 1 else ''}" + (f", micro-batch {b}" if b != rows else "")
        run = f"plan measures this machine's memory use by training two steps of {setup.label()} on "
        run += f"the model cut to {what}"
        points.append(
            (tensors(n, b), measure_peak(cfg, replace(setup, micro_batch_size=b), workdir, str(folder), run))
        )
    (t1, m1), (t2, m2) = points
    allocator = (m2 - m1) / (t2 - t1) if t2 != t1 else 1.0
    if not 1.0 <= allocator <= 3.0 or m1 < allocator * t1:
        # Noise larger than the tensors' difference: solved, a random 18M model's plan came out as
        # "0 MiB of its own, 3.00 bytes per tensor byte", 28% over its run. Each byte resident once,
        # with the process's own memory what the larger run's tensors leave (no run predicted low).
        allocator = 1.0
        measured_on += "; the two runs' difference was noise, so each tensor byte is counted once"
    return Host(
        runtime=max(0, int(max(m1 - allocator * t1, m2 - allocator * t2))),
        allocator=allocator,
        measured_on=measured_on,
    )


def _planned_rows(cfg: TrainConfig, setup: Setup, workdir: Path) -> TrainConfig:
    """Without --data, plan sizes rows of --max-length tokens; the measuring runs must train such
    rows too (the built-in sample's examples are a few tokens: a runtime solved from their peaks
    against the planned tensors came out too small). Texts of a word per token at least, cut to
    --max-length."""
    data = workdir / "planned-rows.jsonl"
    rows = 2 * setup.micro_batch_size * setup.world_size * setup.accumulation
    text = json.dumps({"text": " ".join(["plan"] * setup.length)})
    data.write_text((text + "\n") * rows, encoding="utf-8")
    return cfg.replace(data=str(data), truncation="right", max_length=setup.length)


@dataclass(frozen=True)
class Calibration:
    activation_scale: float
    offset: int
    points: list[tuple[int, int, int]]  # micro-batch size, predicted, measured


def apply(e: Estimate, c: Calibration | None) -> Estimate:
    return e if c is None else replace(e, activation_scale=c.activation_scale, offset=c.offset)


def calibrate(
    setup: Setup, predict: Callable[[Setup], Estimate], measure: Callable[[Setup], int]
) -> Calibration:
    """Two real runs of two steps, at the micro-batch size and at half (or double) of it; fit the
    activation scale and an offset so both measured peaks are matched."""
    other = setup.micro_batch_size // 2 if setup.micro_batch_size > 1 else 2
    points = []
    for b in (setup.micro_batch_size, other):
        s = replace(setup, micro_batch_size=b)
        points.append((b, predict(s), measure(s)))
    (_, e1, m1), (_, e2, m2) = points
    dynamic1 = e1.host.allocator * (e1.activations + e1.logits)
    dynamic2 = e2.host.allocator * (e2.activations + e2.logits)
    scale = (m1 - m2) / (dynamic1 - dynamic2) if dynamic1 != dynamic2 else 1.0
    scale = min(max(scale, 0.25), 4.0)  # a noisy pair must not turn the model upside down
    offset = m1 - apply(e1, Calibration(scale, 0, [])).total
    return Calibration(scale, offset, [(b, e.total, m) for b, e, m in points])


# What a calibration run changes beyond the setup: two steps on this machine, nothing kept.
CALIBRATION_RUN: dict[str, Any] = {
    **MEASURING_RUN,
    "max_steps": 2,
    "eval_every": 0,
    "early_stopping_patience": 0,
}


def measure_peak(
    cfg: TrainConfig, setup: Setup, workdir: Path, model: str | None = None, run: str = ""
) -> int:
    """Train two real steps with ``setup`` and return the largest peak of any rank.

    Raises:
        UserError: when that run fails, naming ``run`` (what it was for) and its own error.
    """
    out = workdir / f"run-{setup.micro_batch_size}-{Path(model).name if model else 'model'}"
    # The user's settings, with the setup's choices, two steps long, alone on this machine, and
    # without side effects (no reporting, samples, checkpoints).
    real = cfg.replace(
        model=model or cfg.model.name,
        micro_batch_size=setup.micro_batch_size,
        global_batch_size=setup.micro_batch_size * setup.world_size * setup.accumulation,
        strategy=setup.strategy,
        precision=setup.precision,
        optimizer=setup.optimizer,
        lora=setup.lora,
        **quantization_settings(setup.quantization),
        activation_checkpointing=setup.activation_checkpointing,
        loss_chunk_size=setup.loss_chunk,
        nproc_per_node=setup.world_size,
        **CALIBRATION_RUN,
        output_dir=str(out),
    )
    args = ["train", *to_argv(real)]
    proc = subprocess.run([sys.executable, "-m", "lmtune", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        size = setup.micro_batch_size
        what = run or f"--calibrate trains two steps of {setup.label()} at micro-batch {size}"
        raise UserError(f"{what}; that run failed (exit code {proc.returncode}): {_failure(proc, workdir)}")
    record = json.loads((out / "run.json").read_text())
    return int(max(record["result"]["peak_memory_per_rank"]))


def _failure(proc: subprocess.CompletedProcess[str], workdir: Path) -> str:
    """A failed run's own error lines (else the end of its output), without plan's scratch paths."""
    lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    errors = [line.split(": ", 1)[-1] for line in lines if line.startswith("error")]
    text = " | ".join(errors or lines[-3:]) or "no output"
    return text.replace(str(workdir) + "/", "").replace(str(workdir), "(plan's scratch folder)")


def quantization_settings(quantization: str) -> dict[str, Any]:
    """The settings that load the base as ``Setup.quantization`` says."""
    return {
        "load_in_4bit": quantization in ("nf4", "fp4"),
        "load_in_8bit": quantization == "int8",
        "bnb_4bit_quant_type": quantization if quantization in ("nf4", "fp4") else "nf4",
    }


def quantization_of(cfg: TrainConfig) -> str:
    """``Setup.quantization`` of these settings: nf4 | fp4 | int8 | "" (full precision)."""
    if cfg.model.load_in_4bit:
        return cfg.model.bnb_4bit_quant_type
    return "int8" if cfg.model.load_in_8bit else ""


def setup_from(
    cfg: TrainConfig,
    world_size: int,
    length: int,
    chunk: int = 0,
    pairs_apart: bool = False,
    most_rows: int = 0,
) -> Setup:
    """The setup ``lmtune train`` would run with these settings on ``world_size`` processes (rows
    of ``length`` tokens, at most ``most_rows`` of them packed: :func:`lmtune.tools.rows.row_length`)."""
    strategy = effective_strategy(cfg.launch.strategy, world_size)
    micro = micro_batch_size(cfg, world_size)
    return Setup(
        strategy=strategy,
        optimizer=cfg.optim.name,
        lora=cfg.lora.enabled,
        activation_checkpointing=cfg.model.activation_checkpointing,
        precision=cfg.model.precision,
        micro_batch_size=micro,
        length=length,
        world_size=world_size,
        accumulation=max(1, cfg.batch.global_batch_size // (micro * world_size)),
        loss_chunk=chunk,
        quantization=quantization_of(cfg),
        objective=cfg.objective.name,
        live_reference=cfg.objective.name in ("dpo", "ipo") and cfg.objective.reference == "live",
        pairs_apart=pairs_apart,
        most_rows=most_rows,
    )


def largest_micro_batch(setup: Setup, predict: Callable[[Setup], Estimate], memory: int, limit: int) -> int:
    """The largest micro-batch dividing ``limit`` (the global batch per device) whose predicted peak
    fits ``memory``; 0 if none."""
    best = 0
    lo, hi = 1, limit
    while lo <= hi:  # the peak grows with the micro-batch, so bisect
        mid = (lo + hi) // 2
        # As if accumulating (gradients alive beside activations): the safe side of either case.
        if predict(replace(setup, micro_batch_size=mid, accumulation=2)).total <= memory:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    # One that divides the global batch per device, as training takes it (19 of 32 was offered).
    return max((d for d in range(1, best + 1) if limit % d == 0), default=0)


def candidates(setup: Setup) -> list[Setup]:
    """Alternatives to the requested setup: strategy x optimizer x checkpointing x LoRA, and LoRA
    on a 4-bit base (QLoRA; the requested quantization when there is one)."""
    strategies = ["ddp", "fsdp"] if setup.world_size > 1 else ["single"]
    quantized = setup.quantization or "nf4"
    out = []
    for strategy in strategies:
        for optimizer in ("adamw", "adamw8bit"):
            if strategy == "fsdp" and optimizer == "adamw8bit":
                continue  # bitsandbytes' 8-bit update does not take FSDP2's sharded parameters
            for lora, quantization in ((False, ""), (True, ""), (True, quantized)):
                if strategy == "fsdp" and quantization == "int8":
                    continue  # FSDP2 gathers int8 weights without their scales
                for ckpt in (False, True):
                    out.append(
                        replace(
                            setup,
                            strategy=strategy,
                            optimizer=optimizer,
                            lora=lora,
                            quantization=quantization,
                            activation_checkpointing=ckpt,
                        )
                    )
    return out


def format_row(e: Estimate, width: int = 40) -> str:
    parts = [
        f"{e.setup.label():<{width}}",
        f"B={e.setup.micro_batch_size:<4}",
        *(
            f"{getattr(e, k) / MIB:>9,.0f}"
            for k in ("weights", "gradients", "optimizer", "activations", "logits", "buffers")
        ),
        f"{e.host.runtime / MIB:>9,.0f}",
        f"{e.total / MIB:>10,.0f}",
    ]
    return " ".join(parts)


def header(width: int = 40) -> str:
    """The table's head over :func:`format_row`'s rows of the same ``width`` (the longest setup's)."""
    return (
        f"{'setup':<{width}} {'micro':<6}"
        + "".join(f"{h:>10}" for h in ("weights", "grads", "optim", "activ.", "logits", "buffers", "runtime"))
        + f"{'total MiB':>11}"
    )


def to_json(e: Estimate) -> dict[str, Any]:
    return {**asdict(e), "total": e.total}


def device_memory(device_type: str, local_processes: int) -> int:
    """Memory one device offers: the GPU's, or this machine's RAM shared by its processes."""
    if device_type == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_processes, 1)


@dataclass(frozen=True)
class PlanReport:
    model: str  # what --model loads, as the report names it
    requested: Estimate
    candidates: list[tuple[Estimate, int]]  # estimate at the largest fitting micro-batch, that size
    memory: int
    length_reason: str
    calibration: Calibration | None
    micro_limit: int  # the largest micro-batch tried: the global batch per device


def plan(cfg: TrainConfig, memory: int | None, calibrate_runs: bool, workdir: Path) -> PlanReport:
    from lmtune.config.settings import parse_nnodes
    from lmtune.model.modeling import load_config, model_description
    from lmtune.parallel.distributed import read_dist_env
    from lmtune.training.batch_layout import check_model_layout

    config = load_config(cfg.model.name, cfg.model.trust_remote_code)
    world = cfg.launch.nproc_per_node * parse_nnodes(cfg.launch.nnodes)[1]
    env = read_dist_env(cfg.model.device)
    resolve_strategy(cfg.launch.strategy, env)  # dp without GPUs is refused now, not after calibrating
    check_device(cfg.model.precision, env.device)  # as train would, before the measuring runs
    device = env.device.type
    obstacle = model_obstacle(config, env.device.type)
    check_model_layout(cfg, obstacle, False, lambda _: None)  # --packing on refused as train refuses it
    apart = obstacle if cfg.objective.name != "sft" else None
    shape = row_length(cfg, apart, max(1, cfg.batch.global_batch_size // world))
    length, padded, reason = shape.length, shape.padded, shape.reason
    lora = cfg.lora
    facts: dict[tuple[int, bool, str, bool], ModelFacts] = {}

    def predict_for(model_config: Any, setup: Setup, host: Host) -> Estimate:
        key = (int(model_config.num_hidden_layers), setup.lora, setup.precision, bool(setup.quantization))
        if key not in facts:
            adapters = lora if setup.lora else None
            facts[key] = model_facts(model_config, adapters, setup.precision, length, device, key[3])
        return estimate(setup, facts[key], host, padded)

    requested = setup_from(cfg, world, length, loss_chunk(cfg, config, device), apart is not None, shape.most)
    host = Host()
    if device == "cpu":
        host = measure_host(cfg, requested, config, lambda c, s: predict_for(c, s, Host()), workdir)
    elif device == "cuda":
        host = cuda_workspaces(cfg.model.precision)

    def predict(setup: Setup) -> Estimate:
        return predict_for(config, setup, host)

    calibration = None
    if calibrate_runs:
        calibration = calibrate(requested, predict, lambda s: measure_peak(cfg, s, workdir))
    budget = memory if memory is not None else device_memory(device, cfg.launch.nproc_per_node)
    limit = max(1, cfg.batch.global_batch_size // world)
    table = []
    for candidate in candidates(requested):
        best = largest_micro_batch(candidate, lambda s: apply(predict(s), calibration), budget, limit)
        chosen = replace(candidate, micro_batch_size=max(best, 1))
        accumulation = max(1, cfg.batch.global_batch_size // (chosen.micro_batch_size * world))
        table.append((apply(predict(replace(chosen, accumulation=accumulation)), calibration), best))
    return PlanReport(
        model=model_description(cfg.model.name),
        requested=apply(predict(requested), calibration),
        candidates=table,
        memory=budget,
        length_reason=reason,
        calibration=calibration,
        micro_limit=limit,
    )


def format_report(report: PlanReport) -> str:
    r = report.requested
    # A long setup (paged_adamw8bit+lora+nf4+ckpt+dpo) pushed its row's figures out of their columns.
    width = max(40, *(len(e.setup.label()) for e in (r, *(c for c, _ in report.candidates))))
    lines = [
        f"memory plan of {report.model}: {r.setup.label()}, micro-batch {r.setup.micro_batch_size}"
        + (f" pairs = {r.setup.rows} rows" if r.setup.pairs_apart else "")
        + (f" (packed: {r.setup.rows} row{'s' * (r.setup.rows != 1)})" if r.setup.most_rows else "")
        + f" x {r.setup.length} tokens ({report.length_reason}), "
        + f"{r.setup.accumulation} micro-step(s) per step, "
        + (f"loss in chunks of {r.setup.loss_chunk} tokens" if r.setup.loss_chunk else "full logits"),
        "",
        header(width),
        format_row(r, width),
    ]
    if r.host.gpu:
        lines += [
            f"CUDA: {r.host.runtime / MIB:,.0f} MiB of cuBLAS workspaces in the allocator (one for each "
            "thread that multiplies: the forward's and the backward's; measured)"
        ]
    elif r.host.measured_on:
        lines += [
            f"CPU process: {r.host.runtime / MIB:,.0f} MiB of its own, and {r.host.allocator:.2f} "
            f"resident bytes per tensor byte (measured on {r.host.measured_on})"
        ]
    if report.calibration is not None:
        c = report.calibration
        lines += [
            "",
            f"calibrated on two real runs: activations x{c.activation_scale:.2f}, "
            f"offset {c.offset / MIB:+,.0f} MiB",
        ]
        lines += [
            f"  micro-batch {b}: predicted {p / MIB:,.0f} MiB, measured {m / MIB:,.0f} MiB"
            for b, p, m in c.points
        ]
    lines += [
        "",
        f"setups that fit {report.memory / 2**30:,.1f} GiB per device, each with its largest micro-batch "
        f"(at most {report.micro_limit}, the global batch per device)"
        + (
            ", with the CPU process's own memory measured for the setup above:" if r.host.measured_on else ":"
        ),
        header(width),
    ]
    fitting = sorted((x for x in report.candidates if x[1] > 0), key=lambda x: (-x[1], x[0].total))
    lines += [format_row(e, width) for e, _ in fitting] or ["  none: even a micro-batch of 1 does not fit"]
    too_big = [e for e, best in report.candidates if best == 0]
    if too_big:
        lines += ["does not fit at micro-batch 1:"] + [
            f"  {e.setup.label()} ({e.total / MIB:,.0f} MiB)" for e in too_big
        ]
    return "\n".join(lines)


def report_json(report: PlanReport) -> dict[str, Any]:
    return {
        "requested": to_json(report.requested),
        "memory_per_device": report.memory,
        "candidates": [{**to_json(e), "largest_micro_batch": best} for e, best in report.candidates],
        "calibration": asdict(report.calibration) if report.calibration else None,
    }
