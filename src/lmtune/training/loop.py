"""fit: the training loop over optimizer steps; what happens around the steps is in callbacks."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from torch.utils.data import DataLoader

from lmtune.checkpoint.state import TrainerState
from lmtune.data.batch import Batch
from lmtune.data.sampling import TrainSampler
from lmtune.parallel.distributed import DistEnv
from lmtune.parallel.health import Heartbeat
from lmtune.training.batch_layout import BatchLayout
from lmtune.training.callbacks import Callback, Control, StepEnd
from lmtune.training.perf import phase
from lmtune.training.step import StepInput, StepOptions, StepResult, Trainee, train_step


@dataclass(frozen=True)
class FitData:
    """The training data as the loop walks it: one loader item is one rank's share of one
    optimizer step, already cut into micro-batches."""

    loader: DataLoader[list[Batch]]
    sampler: TrainSampler
    layout: BatchLayout


@dataclass(frozen=True)
class FitSettings:
    env: DistEnv
    step: StepOptions
    stop_requested: Callable[[], bool] = lambda: False  # this rank got SIGTERM/SIGINT
    heartbeat: Heartbeat | None = None  # step and phase for the launcher's hang watchdog


@dataclass(frozen=True)
class FitResult:
    state: TrainerState  # where training stands at the end
    last_loss: float
    stop: str | None = None  # "signal": saved, the same command resumes; "early": finished


def fit(
    trainee: Trainee,
    data: FitData,
    start: TrainerState,
    callbacks: Sequence[Callback],
    settings: FitSettings,
) -> FitResult:
    """Train from ``start`` to ``data.layout.total_steps``; ``callbacks`` do the rest, in order."""
    env, layout, beat = settings.env, data.layout, _beater(settings.heartbeat)
    for c in callbacks:
        c.on_train_begin(start, layout)
    control = Control()
    state, last_loss = start, float("nan")
    trainee.model.train()
    started = last = time.perf_counter()
    while state.step < layout.total_steps and control.stop is None:
        data.sampler.set_epoch(state.epoch, state.step_in_epoch)
        batches = iter(data.loader)
        epoch_done = finished = False
        while not (epoch_done or finished or control.stop):
            if settings.heartbeat is not None:
                settings.heartbeat.step = state.step + 1
            # Timed from the end of the last step: waiting for data counts against tokens/s.
            data_started = time.perf_counter()
            with phase(settings.step.timer, "data"):
                micro = [b.to(env.device) for b in next(batches)]
            lr = float(trainee.scheduler.get_last_lr()[0])
            step_input = StepInput(
                micro,
                stop_requested=settings.stop_requested(),
                data_s=time.perf_counter() - data_started,
            )
            r = train_step(trainee, step_input, env, settings.step)
            state = _advance(state, r, layout)
            now = time.perf_counter()
            finished = state.step == layout.total_steps
            epoch_done = state.step_in_epoch == 0
            ids = [i for b in micro for i in b.example_ids]
            end = StepEnd(
                state=state,
                result=r,
                lr=lr,
                seconds=max(now - last, 1e-9),
                elapsed=now - started,
                finished=finished,
                epoch_done=epoch_done,
                example_ids=ids,
            )
            last, last_loss = now, r.loss
            control.save = False
            for c in callbacks:
                beat(c.phase)
                c.on_step_end(end, control)
    control.save = False
    for c in callbacks:
        beat(c.phase)
        c.on_train_end(state, control)
    return FitResult(state, last_loss, control.stop)


def _advance(state: TrainerState, r: StepResult, layout: BatchLayout) -> TrainerState:
    """The state after a step: counted, skipped when no update was applied, the epoch closed."""
    state = replace(state, step=state.step + 1, step_in_epoch=state.step_in_epoch + 1)
    if r.nonfinite:
        state = replace(state, skipped_steps=state.skipped_steps + 1)
    if state.step_in_epoch == layout.steps_per_epoch:
        state = replace(state, epoch=state.epoch + 1, step_in_epoch=0)
    return state


def _beater(heartbeat: Heartbeat | None) -> Callable[[str | None], None]:
    def beat(phase_name: str | None) -> None:
        if heartbeat is not None and phase_name is not None:
            heartbeat.beat(phase_name)

    return beat
