"""fit: the training loop over optimizer steps.

After every step, in this order: the components (logging, policies, samples, ...), the evaluation
(which may find a new best, or stop the run early), the checkpoint (asked for, or due), then the
stop. fit returns where training stands, the evaluations and the best one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch
from torch.utils.data import DataLoader

from lmtune.checkpoint.state import TrainerState
from lmtune.data.batch import Batch
from lmtune.data.sampling import TrainSampler
from lmtune.model.dropout import step_stream_seed
from lmtune.parallel.distributed import DistEnv, all_reduce_max, stop_if_signalled
from lmtune.training.batch_layout import BatchLayout
from lmtune.training.best import Best
from lmtune.training.callbacks import Callback, Control, Evaluator, StepEnd
from lmtune.training.evaluate import EvalResult
from lmtune.training.perf import phase
from lmtune.training.step import StepInput, StepOptions, StepResult, Trainee, train_step


@dataclass(frozen=True)
class FitData:
    """The training data as the loop walks it: one loader item is one rank's share of one
    optimizer step, already cut into micro-batches."""

    loader: DataLoader[list[Batch]]
    sampler: TrainSampler
    layout: BatchLayout


class Saver(Protocol):
    """What fit asks of the checkpoints (:class:`lmtune.checkpoint.manager.CheckpointManager`)."""

    def after_step(self, state: TrainerState, *, asked: bool, last: bool) -> Path | None: ...

    def at_end(self, state: TrainerState, *, asked: bool) -> Path | None: ...


class NoSaves:
    """A loop that keeps no checkpoints (tests, measurements)."""

    def after_step(self, state: TrainerState, *, asked: bool, last: bool) -> Path | None:
        return None

    def at_end(self, state: TrainerState, *, asked: bool) -> Path | None:
        return None


@dataclass(frozen=True)
class LoopParts:
    """What runs around the steps, in fit's order: components, evaluation, checkpoints."""

    callbacks: Sequence[Callback] = ()
    evaluator: Evaluator | None = None
    saver: Saver = field(default_factory=NoSaves)


@dataclass(frozen=True)
class FitSettings:
    env: DistEnv
    step: StepOptions
    stop_requested: Callable[[], bool] = lambda: False  # this rank got SIGTERM/SIGINT
    # The signal this rank got before its first step, 0 if none (StopRequest.before_first_step; its
    # argument: this is the last look, a signal from then on finishes its step and saves).
    signal_before_training: Callable[[bool], int] = lambda last: 0


@dataclass(frozen=True)
class FitResult:
    state: TrainerState  # where training stands at the end
    last_loss: float
    stop: str | None = None  # "signal": saved, the same command resumes; "early": finished
    evals: list[EvalResult] = field(default_factory=list)  # this attempt's, in order
    best: Best | None = None  # the best evaluation (of the whole run, a resumed one included)


def fit(
    trainee: Trainee,
    data: FitData,
    start: TrainerState,
    parts: LoopParts,
    settings: FitSettings,
) -> FitResult:
    """Train from ``start`` to ``data.layout.total_steps``; ``parts`` do the rest, in fit's order."""
    env, layout, callbacks = settings.env, data.layout, parts.callbacks
    for c in callbacks:
        c.on_train_begin(start, layout)
    control, evals = Control(), []
    state, last_loss = start, float("nan")
    trainee.model.train()
    # A signal that came while the run was being built (or its baseline evaluated) stops it here, on
    # every rank alike: a first step would delay a preemption's exit by a whole step, for a
    # checkpoint of one step.
    stop_if_signalled(settings.signal_before_training(False), env)
    if parts.evaluator is not None and (ev := parts.evaluator.at_start(start)) is not None:
        evals.append(ev)
        stop_if_signalled(settings.signal_before_training(False), env)
    stop_if_signalled(settings.signal_before_training(True), env)
    started = last = time.perf_counter()
    while state.step < layout.total_steps and control.stop is None:
        data.sampler.set_epoch(state.epoch, state.step_in_epoch)
        batches = iter(data.loader)
        epoch_done = finished = False
        while not (epoch_done or finished or control.stop):
            for c in callbacks:
                c.on_step_begin(state.step + 1)
            # Timed from the end of the last step: waiting for data counts against tokens/s.
            data_started = time.perf_counter()
            with phase(settings.step.timer, "data"):
                micro = [b.to(env.device) for b in next(batches)]
            lr = float(trainee.scheduler.get_last_lr()[0])
            step_input = StepInput(
                micro,
                stop_requested=settings.stop_requested,
                data_s=time.perf_counter() - data_started,
                step=state.step + 1,
            )
            # What the step draws from the process's stream (functional and attention dropout)
            # follows from the step, not from what drew before it: a resume's start-up draws too.
            torch.manual_seed(step_stream_seed(state.seed, env.rank, state.step + 1))
            r = train_step(trainee, step_input, env, settings.step)
            now = time.perf_counter()
            state = replace(_advance(state, r, layout), train_seconds=start.train_seconds + now - started)
            finished = state.step == layout.total_steps
            epoch_done = state.step_in_epoch == 0
            end = StepEnd(
                state=state,
                result=r,
                lr=lr,
                seconds=max(now - last, 1e-9),
                elapsed=state.train_seconds,
                finished=finished,
                epoch_done=epoch_done,
                example_ids=[i for b in micro for i in b.example_ids],
            )
            last, last_loss = now, r.loss
            control.save = False
            for c in callbacks:
                c.on_step_end(end, control)
            evals += _evaluate_and_save(end, control, parts, settings)
    control.save = False
    for c in callbacks:
        c.on_train_end(state, control)
    if parts.evaluator is not None and (ev := parts.evaluator.at_end(state, control)) is not None:
        evals.append(ev)
    if control.stop is None:
        parts.saver.at_end(state, asked=control.save)
    best = parts.evaluator.best if parts.evaluator is not None else None
    return FitResult(state, last_loss, control.stop, evals, best.best if best is not None else None)


def _evaluate_and_save(
    end: StepEnd, control: Control, parts: LoopParts, settings: FitSettings
) -> list[EvalResult]:
    """A step's evaluation and checkpoint. A signal that comes during either stops the run at this
    step (saved), as one during the step does; agreed in one more all-reduce, only after them."""
    ev = parts.evaluator.after_step(end, control) if parts.evaluator is not None else None
    asked = control.save or control.stop is not None
    saved = parts.saver.after_step(end.state, asked=asked, last=end.finished)
    if control.stop is None and not end.finished and (ev is not None or saved is not None):
        signalled = torch.tensor([float(settings.stop_requested())], device=settings.env.device)
        if all_reduce_max(signalled, settings.env).item() > 0:
            control.stop = "signal"
            parts.saver.after_step(end.state, asked=True, last=False)
    return [ev] if ev is not None else []


def _advance(state: TrainerState, r: StepResult, layout: BatchLayout) -> TrainerState:
    """The state after a step: counted, skipped when no update was applied, the epoch closed."""
    state = replace(state, step=state.step + 1, step_in_epoch=state.step_in_epoch + 1)
    if r.nonfinite:
        state = replace(state, skipped_steps=state.skipped_steps + 1)
    if state.step_in_epoch == layout.steps_per_epoch:
        state = replace(state, epoch=state.epoch + 1, step_in_epoch=0)
    return state
