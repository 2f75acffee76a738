"""run.json: the settings, what they resolved to, the data, the environment, and the result."""

from __future__ import annotations

import math
import os
import platform
import socket
import sys
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lmtune import __version__
from lmtune.checkpoint.card_rows import OBJECTIVE_WEIGHTS
from lmtune.checkpoint.manager import CheckpointManager
from lmtune.checkpoint.state import optimizer_state_bytes
from lmtune.config.groups import ObjectiveSettings
from lmtune.config.run_groups import names_checkpoint
from lmtune.config.settings import TrainConfig, given_names, setting_named, to_dict, warmup_steps
from lmtune.config.threads import busy_at_start, spinning_among_others, thread_wait
from lmtune.data.pairs import examples_noun
from lmtune.model.attention import attention_description
from lmtune.model.compiled import compile_record
from lmtune.model.quantization import footprint, parameter_count
from lmtune.objectives.base import Objective
from lmtune.parallel.distributed import DistEnv, all_gather_object, threads_note
from lmtune.training.batch_layout import BATCHING_NAMES, BatchLayout
from lmtune.training.build import Built
from lmtune.training.context import RunContext
from lmtune.training.loop import FitResult
from lmtune.training.optim import default_lr
from lmtune.training.perf import Peak, peak_memory_bytes
from lmtune.training.reference import needs_reference


def environment_info(env: DistEnv, threads: int) -> dict[str, Any]:
    import transformers

    return {
        "lmtune": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "working_folder": os.getcwd(),  # what its relative paths are read from (--config run.json)
        "world_size": env.world_size,
        "device": str(env.device),
        "backend": env.backend,
        "threads_per_process": threads,
        # How idle compute threads wait (lmtune.config.threads): passive when the CPUs were busy at start.
        "thread_wait": thread_wait(),
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def count(params: Iterable[torch.nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def result_record(result: FitResult, built: Built, run: RunContext) -> dict[str, Any]:
    """run.json's ``result`` (collective: every rank's peak memory and optimizer state)."""
    state, optimizer, env = result.state, built.optimizer, run.env
    compiled = compile_record(built.parts.model) if run.cfg.model.compile else None
    if compiled is not None and not compiled["graphs"] and math.isfinite(result.last_loss):
        run.log.info(
            "--compile: torch.compile made no graph (each failed at its first call), so the run went "
            "on eagerly; TORCH_LOGS=graph_breaks says why"
        )
    return {
        "peak_memory_per_rank": all_gather_object(peak_memory_bytes(env.device), env),
        "optimizer_state_bytes_per_rank": all_gather_object(optimizer_state_bytes(optimizer), env),
        "steps": state.step,
        # None where no step ran (a resume past its last step): JSON has no NaN.
        "last_loss": result.last_loss if math.isfinite(result.last_loss) else None,
        "skipped_steps": state.skipped_steps,
        "train_seconds": state.train_seconds,  # every attempt's; wall_time_s is this process's
        # Why it ended before its last step: a signal (it saved; run again to resume), early stopping.
        "stopped_by": {"signal": "signal", "early": "early_stopping"}.get(result.stop or ""),
        "best": asdict(result.best) if result.best is not None else None,
        "eval": result.evals[-1].record() if result.evals else None,
        # Whether --compile compiled: its log line says when it could not start; no graphs after
        # training say every one failed at its first call and ran eagerly.
        "compile": compiled,
    }


def _optimizer_part(name: str, optimizer: torch.optim.Optimizer) -> str:
    """The optimizer as it runs, read from the one built (training/optim.py pages state only on a
    GPU, where bitsandbytes has memory to page it to)."""
    if name == "paged_adamw8bit" and type(optimizer).__name__ != "PagedAdamW8bit":
        return "adamw8bit (paged_adamw8bit pages state on a GPU only)"
    return name


def _objective_line(o: ObjectiveSettings, reference: str | None) -> str:
    """A preference run's weights, as the objective reads them, and its reference."""
    smoothing = f"label smoothing {o.label_smoothing}"  # dpo's and simpo's (validate.py)
    more = {"dpo": [smoothing], "simpo": [f"gamma {o.simpo_gamma}", smoothing]}
    # ORPO's one weight is lambda (TRL's ORPOConfig.beta); --beta does not apply to it.
    knobs = [f"lambda {o.orpo_lambda}"] if o.name == "orpo" else [f"beta {o.beta}"]
    knobs += more.get(o.name, [])
    return f"objective {o.name}: {', '.join(knobs)}" + (f"; reference: {reference}" if reference else "")


def run_record(run: RunContext, built: Built, resumed: CheckpointManager, peak: Peak) -> dict[str, Any]:
    """run.json before training; ``resumed``: the checkpoints (after resume(): what the run continues,
    what each resume changed, how each earlier attempt ended). The start line says it in short."""
    cfg, env, layout = run.cfg, run.env, built.layout
    quantization, given = built.loaded.quantization, cfg.checkpoint.resume
    attention = attention_description(built.loaded.model) if built.parts.root.varlen else "masked"
    resolved = {
        "objective": built.objective.name,
        "reference": reference_description(cfg, built.objective),
        "strategy": run.strategy,
        "batching": built.batching,
        "attention": attention,
        "loss": built.loss.description,
        "products": built.products.description,
        "paths": built.paths.to_json(),  # the CPU bf16 paths and how each was decided (lmtune.model.paths)
        "lr": built.lr,
        "model_source": built.loaded.source,
        **asdict(layout),
        "parameters": parameter_count(built.loaded.model),
        "quantization": quantization.description if quantization else None,
        # Bytes of the quantized layers, of the rest of the base and of the adapters (a quantized base).
        "base_bytes": _base_bytes(built.loaded.model) if quantization else None,
        "trainable_parameters": count(p for p in built.parts.root.parameters() if p.requires_grad),
        "resumed_from": str(resumed.resumed_from) if resumed.resumed_from else None,
        "resume_path": str(Path(given).resolve()) if names_checkpoint(given) else None,  # any cwd's
        # What each resume changed, from which step: the settings above are the last attempt's.
        "changed_on_resume": resumed.changed,
        "attempts": resumed.attempts,  # how each earlier attempt ended, and where the next took up
        "peak_flops_per_device": peak.flops,
        "peak_flops_busy": peak.busy,  # the matmul peak is not settled and was probed on busy cores
    }
    units = f" ({built.paths.units.describe()})" if env.device.type == "cpu" else ""
    run.log.info(
        f"lmtune: {built.loaded.source}, {_parameters(resolved, cfg.lora.enabled)}"
        + (f" (base in {quantization.bits} bits)" if quantization else "")
        + f", {run.strategy}{_one_process_note(cfg.launch.strategy, run.strategy)} on "
        f"{env.world_size} x {env.device.type}{units}; global batch {_batch_line(layout)} "
        f"({BATCHING_NAMES[built.batching]}, {attention} attention); {layout.total_steps} "
        f"step{'s' if layout.total_steps != 1 else ''} at lr {built.lr:.3g} "
        f"({cfg.schedule.name}{_lr_note(cfg, built)}); precision {cfg.model.precision}"
        + f"; optimizer {_optimizer_part(cfg.optim.name, built.optimizer)}"
        + ("; activation checkpointing" if cfg.model.activation_checkpointing else "")
        + ("; compiled per block (the first steps compile)" if cfg.model.compile else "")
        + f"; {_loss_part(cfg, built)}"
        + (f"; NEFTune noise alpha {cfg.objective.neftune_alpha:g}" if cfg.objective.neftune_alpha else "")
    )
    notes = (
        # A resume keeps its batch.
        None if resumed.resumed_from else _default_batch_note(layout, cfg, run.given),
        threads_note(env, cfg.launch.threads_per_process, run.threads) if env.device.type == "cpu" else None,
        _left_out_note(layout, built.objective.unit),
        _warmup_note(cfg, layout.total_steps, built.lr),
        _packed_batch_note(cfg, built, layout),
    )
    for note in notes:
        if note:
            run.log.info(note)
    if env.device.type == "cpu" and busy_at_start():
        run.log.info(f"CPU threads wait {thread_wait()}; OMP_WAIT_POLICY=ACTIVE overrides")
    elif (
        env.device.type == "cpu"
        and env.is_main
        and run.given is None
        and (spinning := spinning_among_others())
    ):
        run.log.info(spinning)
    if built.paths.products is not None:  # a CPU bf16 run: which paths its CPU's units chose, and how
        run.log.info(f"{built.paths.line()}; matrix products: {built.products.description}")
    if built.objective.unit == "pairs":
        run.log.info(_objective_line(cfg.objective, resolved["reference"]))
    return {
        "config": to_dict(cfg),
        "resolved": resolved,
        "data": built.data_info,
        "environment": environment_info(env, run.threads),
    }


def _parameters(resolved: dict[str, Any], lora: bool) -> str:
    """``1,050,112 parameters (163,840 trainable: 15.6%, the LoRA adapters)``."""
    total, trainable = resolved["parameters"], resolved["trainable_parameters"]
    if trainable == total:
        return f"{total:,} parameters, all trainable"
    share = 100 * trainable / max(total, 1)
    what = ", the LoRA adapters" if lora else ""
    return f"{total:,} parameters ({trainable:,} trainable: {share:.{2 if share < 1 else 1}f}%{what})"


def reference_description(cfg: TrainConfig, objective: Objective) -> str | None:
    """What a preference objective compares the policy with (None: no reference)."""
    if not needs_reference(objective):
        return None
    model = cfg.objective.reference_model or "the starting model"
    if cfg.objective.reference == "logprobs":
        return f"{model}, log-probs precomputed"
    if cfg.lora.enabled and cfg.objective.reference_model is None:
        return "the base model with the LoRA adapter disabled, in every step"
    return f"{model}, frozen, in every step"


def _batch_line(layout: BatchLayout) -> str:
    return (
        f"{layout.global_batch_size} = {layout.micro_batch_size} x {layout.world_size} x "
        f"{layout.accumulation} accumulation"
    )


def _loss_part(cfg: TrainConfig, built: Built) -> str:
    """The start line's loss: supervised, how it is computed; a preference objective, its weights
    and how the log-probs it compares are computed (by the same head)."""
    name = built.objective.name
    if name == "sft":
        return f"loss: {built.loss.description}"
    flat = to_dict(cfg)
    weights = ", ".join(f"{k} {flat[k]:g}" for k in OBJECTIVE_WEIGHTS.get(name, ()) if flat.get(k))
    return (
        f"objective {name}"
        + (f" ({weights})" if weights else "")
        + f", log-probs by {built.loss.description}"
    )


def _default_batch_note(layout: BatchLayout, cfg: TrainConfig, given: frozenset[str] | None) -> str | None:
    """Where only the micro-batch was given: HF's per_device_train_batch_size alone means one
    micro-batch per step there, while here the global batch rules and its default is easy to miss."""
    default = setting_named("global_batch_size").default
    given = given_names(cfg) if given is None else given  # from Python: the names TrainConfig took
    if "global_batch_size" in given or cfg.batch.micro_batch_size is None or layout.accumulation == 1:
        return None
    return (
        f"global batch {default} is the default: --micro-batch-size (HF's per_device_train_batch_size) "
        f"sets only the micro-batch, so each step accumulates {layout.accumulation * layout.world_size} of "
        f"them; give --global-batch-size {layout.micro_batch_size * layout.world_size} for one per step"
    )


def _packed_batch_note(cfg: TrainConfig, built: Built, layout: BatchLayout) -> str | None:
    """Packing asked for: the batch sizes still count examples, where TRL's packed batch counts
    rows (its per_device_train_batch_size of packed rows trains several times the examples)."""
    if cfg.batch.packing != "on" or built.batching != "pack":
        return None
    return (
        f"packing: the global batch counts examples ({layout.global_batch_size} a step, packed into rows "
        f"of up to --max-length {cfg.examples.max_length} tokens), not packed rows as TRL's "
        "per_device_train_batch_size does under packing; a step trains what its examples would unpacked"
    )


def _warmup_note(cfg: TrainConfig, total: int, lr: float) -> str | None:
    """A warmup as long as the run or longer: the learning rate never reaches --lr (the HF Trainer
    says nothing of it)."""
    warmup = warmup_steps(cfg.schedule, total)
    if warmup < total:
        return None
    if total == 1 and cfg.schedule.name == "wsd" and cfg.schedule.min_lr_ratio > 0:
        return (  # transformers' wsd warms up from lr x min_lr_ratio, its other schedules from 0
            "warning: the warmup (1 step) is as long as the run: its one step runs at learning rate "
            f"{lr * cfg.schedule.min_lr_ratio:.3g} (wsd's warmup starts at --lr x --min-lr-ratio); give "
            "--warmup-steps 0 for a step at the learning rate"
        )
    if total == 1:  # the warmup starts from 0, as transformers' does
        return (
            "warning: the warmup (1 step) is as long as the run: its one step runs at learning rate 0 "
            "and trains nothing; give --warmup-steps 0 for a step at the learning rate"
        )
    return (
        f"warning: the warmup ({warmup} steps) is as long as the run ({total}) or longer: the learning "
        f"rate is still rising at the last step and never reaches {lr:.3g}"
    )


def _left_out_note(layout: BatchLayout, unit: str) -> str | None:
    """Examples that do not fill a last global batch sit the epoch out: said, not left to be found."""
    left, per_epoch = layout.left_out_per_epoch, layout.steps_per_epoch * layout.global_batch_size
    noun = examples_noun(unit)
    if not left or layout.total_steps < layout.steps_per_epoch:  # no epoch ends in this run
        return None
    return (
        f"each epoch trains {per_epoch:,} of the {per_epoch + left:,} {noun} ({layout.steps_per_epoch:,} "
        f"step{'s' if layout.steps_per_epoch != 1 else ''} of {layout.global_batch_size}): the {left:,} "
        "left over, fewer than one global batch, sit "
        "that epoch out (other ones each epoch: the order is reshuffled); a --global-batch-size that "
        "divides the data trains them all"
    )


def _base_bytes(model: torch.nn.Module) -> dict[str, int]:
    quantized, full_precision, adapters = footprint(model)
    return {"quantized": quantized, "full_precision": full_precision, "adapters": adapters}


def _lr_note(cfg: TrainConfig, built: Built) -> str:
    """Where the learning rate came from when --lr was not given."""
    return "" if cfg.optim.lr is not None else ", " + default_lr(cfg, built.loaded, built.objective.unit)[1]


def _one_process_note(asked: str, runs: str) -> str:
    """--strategy ddp or fsdp in one process runs the single-process path (nothing to shard)."""
    return f" (--strategy {asked} in one process)" if asked in ("ddp", "fsdp") and asked != runs else ""
