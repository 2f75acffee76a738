"""One optimizer step over the micro-batches of one global batch."""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import nn

from lmtune.data.batch import Batch, idle_batch
from lmtune.model.neftune import token_seeds
from lmtune.objectives.base import Objective, split_output
from lmtune.objectives.sft import SupervisedObjective
from lmtune.parallel.distributed import DistEnv, all_reduce_max, all_reduce_sum
from lmtune.parallel.wrap import is_sharded, no_sync
from lmtune.training.failures import batch_words, naming_the_step
from lmtune.training.perf import PhaseTimer, phase

SUPERVISED = SupervisedObjective()


@dataclass(frozen=True)
class StepResult:
    loss: float  # the step's loss per unit of its objective (per target token for sft), all ranks
    grad_norm: float
    target_tokens: int  # trained positions after the causal shift, all ranks and micro-steps
    tokens: int  # non-padding input tokens, all ranks and micro-steps
    examples: int  # all ranks and micro-steps
    nonfinite: bool  # some rank saw a non-finite loss or gradient norm; the update was not applied
    stop: bool  # some rank was asked to stop (SIGTERM/SIGINT)
    count: int = 0  # the objective's units (target tokens for sft, pairs for dpo), all ranks
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's per unit, by name
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase, when timed
    # Per rank: this step's data wait plus forward time (the work before its first collective
    # under DDP, where a slow rank shows), and the data wait alone.
    rank_work_s: list[float] = field(default_factory=list)
    rank_data_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Trainee:
    """What an optimizer step changes."""

    model: nn.Module  # the strategy's wrapper around the loss module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None = None  # fp16 only


@dataclass(frozen=True)
class StepOptions:
    """How every step of a run is taken."""

    max_grad_norm: float  # 0: no clipping
    autocast: Callable[[], AbstractContextManager[object]]
    timer: PhaseTimer | None = None  # per-phase times (--profile) and heartbeat phases
    objective: Objective = SUPERVISED  # what the loss module returns, and what it is normalised by
    # The run's seed that NEFTune's noise and keyed dropout's masks are drawn from (by example and
    # step: lmtune.model.neftune); None: the run has neither.
    token_seed: int | None = None


@dataclass(frozen=True)
class StepInput:
    """One rank's share of one optimizer step."""

    micro_batches: list[Batch]
    # Whether this rank got SIGTERM/SIGINT, read once its micro-batches are done: a signal during
    # them stops the run at this step.
    stop_requested: Callable[[], bool] = lambda: False
    data_s: float = 0.0  # how long this rank waited for the batches
    step: int = 0  # the optimizer step this is, from 1 (NEFTune's noise and dropout are keyed by it)


def train_step(trainee: Trainee, step: StepInput, env: DistEnv, options: StepOptions) -> StepResult:
    """Forward/backward every micro-batch, then clip and step.

    Every micro-step's summed loss is divided by the number of the objective's units (target
    tokens, pairs) in the whole optimizer step, counted over all micro-steps and ranks before the
    first forward. The gradient is then exactly that of one process on the whole global batch,
    whatever the world size or the padding; a mean of per-batch means would weight units
    differently with N ranks than with one.

    Whether to apply the update is agreed by all ranks in one collective before the optimizer
    runs: one rank skipping alone would leave the replicas apart.
    """
    micro_batches, timer, model = step.micro_batches, options.timer, trainee.model
    objective, metrics = options.objective, len(options.objective.metric_names)
    local = [
        sum(objective.count(b) for b in micro_batches),
        sum(b.target_tokens() for b in micro_batches),
        sum(int(b.attention_mask.sum()) for b in micro_batches),
        sum(len(b.example_ids) for b in micro_batches),
    ]
    counts = torch.tensor(local, dtype=torch.int64, device=env.device)
    count, target_tokens, tokens, examples = (int(x) for x in all_reduce_sum(counts, env).tolist())
    # DDP averages gradients over ranks; multiplying by world_size turns that average into the sum.
    scale = env.world_size / max(count, 1)
    sums = torch.zeros(1 + metrics, dtype=torch.float64, device=env.device)
    if is_sharded(model):
        micro_batches = _lockstep(micro_batches, env)
    last = len(micro_batches) - 1
    work_s = step.data_s
    for i, batch in enumerate(micro_batches):
        where = partial(_micro_step, env, step.step, i, len(micro_batches), batch, timer)
        with no_sync(model, sync=i == last), naming_the_step(where, batch):
            started = time.perf_counter()
            keyed = (
                {}
                if options.token_seed is None
                else {"token_seeds": token_seeds(batch, options.token_seed, step.step)}
            )
            with phase(timer, "forward"), options.autocast():
                micro_loss, metric_sums = split_output(
                    model(*batch.model_inputs(), **keyed), len(objective.metric_names)
                )
            work_s += time.perf_counter() - started
            scaled = micro_loss * scale
            with phase(timer, "backward"):
                backward = trainee.scaler.scale(scaled) if trainee.scaler is not None else scaled
                backward.backward()  # type: ignore[no-untyped-call]
        sums[0] += micro_loss.detach().double()
        sums[1:] += metric_sums.detach().double()
    where = partial(_update_step, env, step.step)
    with phase(timer, "optimizer"), naming_the_step(where):
        tally = _Tally(
            sums=sums,
            stop_requested=step.stop_requested(),
            counts=(count, target_tokens, tokens, examples),
            times=(work_s, step.data_s),
        )
        result = _update(trainee, env, options, tally)
    return replace(result, phases=timer.take()) if timer is not None else result


def _micro_step(env: DistEnv, step: int, i: int, n: int, batch: Batch, timer: PhaseTimer | None) -> str:
    said = f"on {env.device} in step {step}, micro-batch {i + 1} of {n} ({batch_words(batch)})"
    return said + (f", in its {timer.current}" if timer is not None and timer.current else "")


def _update_step(env: DistEnv, step: int) -> str:
    # The optimizer's state is allocated at its first update: two fp32 copies of the trained weights
    # under AdamW.
    return f"on {env.device} in step {step}'s optimizer update"


def _lockstep(micro_batches: list[Batch], env: DistEnv) -> list[Batch]:
    """FSDP gathers parameters in every forward and backward, so all ranks must run as many
    micro-steps; under packing a rank may have fewer, and pads with idle ones."""
    most = int(all_reduce_max(torch.tensor([len(micro_batches)], device=env.device), env).item())
    return micro_batches + [idle_batch().to(env.device) for _ in range(most - len(micro_batches))]


@dataclass(frozen=True)
class _Tally:
    """This rank's part of a step, agreed across ranks in one all-reduce."""

    sums: torch.Tensor  # this rank's summed loss, then its metric sums
    stop_requested: bool
    counts: tuple[int, int, int, int]  # units, target tokens, tokens, examples: summed over ranks
    times: tuple[float, float]  # this rank's work and data wait


def _update(trainee: Trainee, env: DistEnv, options: StepOptions, tally: _Tally) -> StepResult:
    """Clip, agree across ranks whether to apply the update, then apply it (or not). The same
    all-reduce carries the loss and metric sums and every rank's step times (each rank fills its
    own slots), for stragglers."""
    optimizer, scaler, sums = trainee.optimizer, trainee.scaler, tally.sums
    count, target_tokens, tokens, examples = tally.counts
    if scaler is not None:
        scaler.unscale_(optimizer)  # clip and judge the true gradients
    params = [p for p in trainee.model.parameters() if p.grad is not None]
    max_norm = options.max_grad_norm
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, already reduced over the shards
        grad_norm = grad_norm.full_tensor()
    # Under fp16 an infinite gradient is the scaler's business (it skips the step and lowers the
    # scale); only a non-finite loss is the model's.
    local_bad = not torch.isfinite(sums[0]) or (scaler is None and not torch.isfinite(grad_norm))
    per_rank = torch.zeros(2 * env.world_size, dtype=torch.float64, device=env.device)
    per_rank[env.rank], per_rank[env.world_size + env.rank] = tally.times
    flags = torch.tensor(
        [float(local_bad), float(tally.stop_requested)], dtype=torch.float64, device=env.device
    )
    summed = all_reduce_sum(torch.cat([sums, flags, per_rank]), env).tolist()
    n = len(sums)
    total_loss, metric_sums, (bad_ranks, stopping) = summed[0], summed[1:n], summed[n : n + 2]
    nonfinite = bad_ranks > 0
    if scaler is not None:
        if not nonfinite:
            scaler.step(optimizer)
        scaler.update()
    elif not nonfinite:
        optimizer.step()
    _advance(trainee.scheduler)
    optimizer.zero_grad(set_to_none=True)
    names = options.objective.metric_names
    return StepResult(
        loss=total_loss / max(count, 1),
        grad_norm=float(grad_norm),
        target_tokens=target_tokens,
        tokens=tokens,
        examples=examples,
        nonfinite=nonfinite,
        stop=stopping > 0,
        count=count,
        metrics={name: value / max(count, 1) for name, value in zip(names, metric_sums, strict=True)},
        rank_work_s=summed[n + 2 : n + 2 + env.world_size],
        rank_data_s=summed[n + 2 + env.world_size :],
    )


def _advance(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """The schedule follows the step count, so a skipped update does not shift later learning
    rates. When the first update was skipped (non-finite, or fp16's scaler) torch warns that the
    schedule stepped first: that order is deliberate here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
        scheduler.step()
