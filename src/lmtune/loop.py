"""fit: the training loop over optimizer steps, with evaluation, checkpoints and logging."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils.data import DataLoader

from lmtune.best import BestTracker
from lmtune.checkpoint import TrainerState
from lmtune.data.collate import Batch
from lmtune.data.sampling import TrainSampler, steps_per_epoch
from lmtune.distributed import DistEnv
from lmtune.errors import TrainingStopped, UserError
from lmtune.evaluate import EvalResult
from lmtune.health import Heartbeat, StragglerWatch
from lmtune.metrics import RunLog
from lmtune.perf import PhaseTimer, peak_memory_bytes, phase
from lmtune.step import StepResult, train_step


@dataclass(frozen=True)
class StepPlan:
    """How the global batch maps onto micro-steps, and how many optimizer steps the run takes."""

    accumulation: int  # micro-steps per optimizer step on each rank (at most this many when packing)
    steps_per_epoch: int
    total_steps: int
    epochs: int


def plan_steps(
    n_examples: int,
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    epochs: int,
    max_steps: int | None,
    data_name: str,
) -> StepPlan:
    per_epoch = steps_per_epoch(n_examples, global_batch_size)
    if per_epoch == 0:
        raise UserError(
            f"--data {data_name}: {n_examples} examples, fewer than one global batch "
            f"(--global-batch-size {global_batch_size})"
        )
    total = max_steps if max_steps is not None else epochs * per_epoch
    return StepPlan(
        accumulation=global_batch_size // (micro_batch_size * world_size),
        steps_per_epoch=per_epoch,
        total_steps=total,
        epochs=-(-total // per_epoch),
    )


@dataclass(frozen=True)
class FitHooks:
    """What fit calls out to; each is optional."""

    autocast: Callable[[], AbstractContextManager[object]]
    run_eval: Callable[[], EvalResult] | None = None
    save: Callable[[TrainerState], None] | None = None
    record_samples: Callable[[int, list[int]], None] | None = None
    stop_requested: Callable[[], bool] = lambda: False
    poison_step: int | None = None  # fault injection: this step's loss becomes NaN on rank 0
    scaler: torch.amp.GradScaler | None = None  # fp16 only
    mfu: Callable[[StepResult, float], float | None] | None = (
        None  # (step, seconds) -> model FLOPs utilisation
    )
    timer: PhaseTimer | None = None  # per-phase step times (--profile)
    best: BestTracker | None = None  # --metric-for-best: saves the best model, may stop early
    # Per-step components (generations, ...): called after every optimizer step with its state
    # and whether it is the last; each decides itself whether this step concerns it.
    after_step: tuple[Callable[[TrainerState, bool], None], ...] = ()
    heartbeat: Heartbeat | None = None  # step and phase for the launcher's hang watchdog
    stragglers: StragglerWatch | None = None  # names a rank that is slow step after step


@dataclass
class FitResult:
    steps: int
    last_loss: float
    skipped_steps: int
    stopped_early: bool = False  # by a signal: saved, the same command resumes
    early_stopped: bool = False  # by --early-stopping-patience: finished
    evals: list[EvalResult] = field(default_factory=list)
    saved_step: int = -1


def _micro_batches(steps: Iterator[list[Batch]], device: torch.device) -> list[Batch]:
    return [b.to(device) for b in next(steps)]


def _skip_or_stop(state: TrainerState, on_nan: str, log: RunLog) -> TrainerState:
    """A step whose loss or gradient norm was not finite (its update was not applied)."""
    if on_nan == "stop":
        raise TrainingStopped(
            f"non-finite loss or gradient norm at step {state.step}; the update was not applied and "
            "training stopped (the last checkpoint is intact; --on-nan skip skips such steps instead)"
        )
    state = replace(state, skipped_steps=state.skipped_steps + 1)
    log.info(
        f"step {state.step}: non-finite loss or gradient norm, update skipped ({state.skipped_steps} so far)"
    )
    return state


def _record_step(
    log: RunLog,
    state: TrainerState,
    r: StepResult,
    lr: float,
    seconds: float,
    elapsed: float,
    mfu: float | None,
    memory: int,
) -> None:
    tokens_per_s = r.tokens / max(seconds, 1e-9)
    log.record(
        {
            "kind": "train",
            "step": state.step,
            "epoch": state.epochs_done,
            "loss": r.loss,
            "lr": lr,
            "grad_norm": r.grad_norm,
            "tokens": r.tokens,
            "target_tokens": r.target_tokens,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "peak_memory_bytes": memory,
            **{f"time_{name}_s": seconds for name, seconds in r.phases.items()},
            **_rank_times(r),
            "elapsed_s": elapsed,
            "skipped": r.nonfinite,
        }
    )
    shown = {"loss": f"{r.loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tokens_per_s:,.0f}"}
    if mfu is not None:
        shown["mfu"] = f"{100 * mfu:.0f}%"
    log.advance(shown)


def _rank_times(r: StepResult) -> dict[str, float | int]:
    """The slowest and fastest rank of a step (data wait and forward), when there are several."""
    work, data = r.rank_work_s, r.rank_data_s
    if len(work) < 2:
        return {}
    return {
        "step_time_min_s": min(work),
        "step_time_max_s": max(work),
        "step_time_max_rank": max(range(len(work)), key=work.__getitem__),
        "data_wait_max_s": max(data),
        "data_wait_max_rank": max(range(len(data)), key=data.__getitem__),
    }


def _record_eval(log: RunLog, state: TrainerState, ev: EvalResult) -> None:
    log.record(
        {
            "kind": "eval",
            "step": state.step,
            "epoch": state.epochs_done,
            "eval_loss": ev.loss,
            "eval_perplexity": ev.perplexity,
            "eval_tokens": ev.target_tokens,
            "eval_examples": ev.examples,
        }
    )
    log.info(
        f"step {state.step}: eval loss {ev.loss:.4f}, perplexity {ev.perplexity:.3f} "
        f"({ev.examples} examples, {ev.target_tokens} tokens)"
    )


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: DataLoader[list[Batch]],
    sampler: TrainSampler,
    plan: StepPlan,
    env: DistEnv,
    log: RunLog,
    start: TrainerState,
    hooks: FitHooks,
    max_grad_norm: float,
    on_nan: str = "stop",
    eval_every: int = 0,
    save_every: int = 0,
    log_every: int = 1,
) -> FitResult:
    """Train from ``start`` to ``plan.total_steps``; evaluate and checkpoint on the way and at the end."""
    result = FitResult(steps=start.step, last_loss=float("nan"), skipped_steps=start.skipped_steps)
    state = start

    def beat(phase_name: str) -> None:
        if hooks.heartbeat is not None:
            hooks.heartbeat.beat(phase_name)

    def save() -> None:
        """A checkpoint of this step, once (a best model and a scheduled save may fall together)."""
        if hooks.save is not None and result.saved_step != state.step:
            beat("save")
            hooks.save(state)
            result.saved_step = state.step

    def evaluate() -> bool:
        """Evaluate; save when it is the best so far; True when the run should stop early."""
        assert hooks.run_eval is not None
        beat("eval")
        result.evals.append(hooks.run_eval())
        _record_eval(log, state, result.evals[-1])
        best = hooks.best
        if best is None:
            return False
        if best.observe(state.step, metric_value(result.evals[-1], best.metric), log.output_dir):
            save()
        return best.should_stop

    log.start_progress(plan.total_steps, initial=start.step)
    model.train()
    started = last = time.perf_counter()
    while state.step < plan.total_steps:
        sampler.set_epoch(state.epoch, state.step_in_epoch)
        batches = iter(loader)
        loss_sum, loss_tokens = 0.0, 0  # this epoch's, for its summary line
        while True:
            if hooks.heartbeat is not None:
                hooks.heartbeat.step = state.step + 1
            # Timed from the end of the last step: waiting for data counts against tokens/s.
            data_started = time.perf_counter()
            with phase(hooks.timer, "data"):
                micro = _micro_batches(batches, env.device)
            data_s = time.perf_counter() - data_started
            lr = float(scheduler.get_last_lr()[0])
            poison = hooks.poison_step == state.step + 1 and env.is_main
            r = train_step(
                model,
                optimizer,
                scheduler,
                micro,
                env,
                max_grad_norm,
                hooks.autocast(),
                hooks.stop_requested(),
                poison,
                hooks.scaler,
                hooks.timer,
                data_s,
            )
            state = replace(state, step=state.step + 1, step_in_epoch=state.step_in_epoch + 1)
            if r.nonfinite:
                state = _skip_or_stop(state, on_nan, log)
            else:
                loss_sum, loss_tokens = loss_sum + r.loss * r.target_tokens, loss_tokens + r.target_tokens
            now = time.perf_counter()
            finished = state.step == plan.total_steps
            if state.step % log_every == 0 or finished:
                mfu = hooks.mfu(r, now - last) if hooks.mfu is not None else None
                memory = peak_memory_bytes(env.device)
                _record_step(log, state, r, lr, now - last, now - started, mfu, memory)
            last = now
            result.steps, result.last_loss, result.skipped_steps = state.step, r.loss, state.skipped_steps
            if hooks.record_samples is not None:
                hooks.record_samples(state.step, [i for b in micro for i in b.example_ids])
            if hooks.stragglers is not None:
                for rank in hooks.stragglers.observe(r.rank_work_s):
                    log.info(
                        f"step {state.step}: rank {rank} is a straggler: its data wait and forward took "
                        f"over {hooks.stragglers.ratio:.1f}x the median of the ranks for "
                        f"{hooks.stragglers.steps} steps in a row (metrics.jsonl: step_time_*)"
                    )
            if hooks.after_step:
                beat("sample")
            for component in hooks.after_step:
                component(state, finished)
            epoch_done = state.step_in_epoch == plan.steps_per_epoch
            if epoch_done:
                log.info(
                    f"epoch {state.epoch + 1}/{plan.epochs}: train loss {loss_sum / max(loss_tokens, 1):.4f}"
                )
                state = replace(state, epoch=state.epoch + 1, step_in_epoch=0)
            stop_early = False
            if hooks.run_eval is not None and eval_every and state.step % eval_every == 0 and not finished:
                stop_early = evaluate()
            if r.stop:  # every rank saw it in the same step: save and leave together
                log.info(f"stopping at step {state.step} as asked (signal): saving a checkpoint")
                save()
                result.stopped_early = True
                log.end_progress()
                return result
            if stop_early:  # every rank evaluated the same loss, so all stop here together
                _log_early_stop(log, state, hooks.best)
                save()
                result.early_stopped = True
                log.end_progress()
                return result
            if save_every and state.step % save_every == 0 and not finished:
                save()
            if epoch_done or finished:
                break
    log.end_progress()
    if hooks.run_eval is not None:
        evaluate()
    if save_every and state.step > start.step:
        save()
    return result


def metric_value(ev: EvalResult, metric: str) -> float:
    """An evaluation's value of ``metric`` (as metrics.jsonl names it)."""
    return {"eval_loss": ev.loss, "eval_perplexity": ev.perplexity}[metric]


def _log_early_stop(log: RunLog, state: TrainerState, best: BestTracker | None) -> None:
    assert best is not None and best.best is not None
    log.info(
        f"stopping early at step {state.step}: {best.metric} has not improved for "
        f"{best.without_improvement} evaluations (best {best.best.value:.4f} at step {best.best.step})"
    )
