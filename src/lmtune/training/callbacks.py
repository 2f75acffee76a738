"""The loop's extension points: the Callback protocol, the components every run registers, and the
evaluator.

:func:`lmtune.training.loop.fit` runs optimizer steps; what a run does around them is a component
with its own cadence: the heartbeat, metrics rows and the progress bar, the NaN policy, stopping
on a signal, the example-order record, stragglers, the collective timeout, and (in its own file)
sample generations. A new one subclasses :class:`Callback`, overrides what it needs, and is
registered in one line of ``train.py``. After every step the components run in registration
order, then the :class:`Evaluator`, then the checkpoint manager saves, then the loop stops if
asked: that order is fit's, not a list's.

Components steer the loop only through :class:`Control`: ask for a checkpoint of this step, or to
stop after it (every rank must decide alike: decide from values all ranks share, such as the
step's all-reduced results or an evaluation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmtune.checkpoint.layout import saved_checkpoints
from lmtune.checkpoint.state import TrainerState
from lmtune.config.run_groups import EvalSettings
from lmtune.data.pairs import examples_noun
from lmtune.errors import TrainingStopped
from lmtune.outputs.runlog import ExampleOrderLog, RunLog, read_metrics
from lmtune.parallel.distributed import CollectiveTimeouts
from lmtune.parallel.health import Heartbeat, StragglerWatch
from lmtune.training.batch_layout import BatchLayout
from lmtune.training.best import BestTracker
from lmtune.training.evaluate import EvalResult
from lmtune.training.perf import peak_memory_bytes
from lmtune.training.step import StepResult


@dataclass(frozen=True)
class StepEnd:
    """One finished optimizer step, as components see it."""

    state: TrainerState  # after the step (the next epoch's, when it ended one)
    result: StepResult
    lr: float  # the learning rate the step used
    seconds: float  # since the end of the previous step: its data wait counts
    elapsed: float  # seconds of training, over every attempt of the run (a resume goes on counting)
    finished: bool  # the run's last step
    epoch_done: bool  # the step ended an epoch
    example_ids: list[int]  # the examples this rank trained on in it


@dataclass
class Control:
    """What the components ask of the loop after a step; the loop resets ``save`` every step."""

    save: bool = False  # checkpoint this step (once, whoever asks)
    stop: str | None = None  # "signal" (resumable) or "early" (finished): leave after this step


class Callback:
    """A component of the loop; every method is optional. A component whose work takes long beats
    the heartbeat's phase for it (the launcher's hang watchdog allows eval, save and sample more
    time)."""

    def on_train_begin(self, state: TrainerState, layout: BatchLayout) -> None:
        """Before the first step of this attempt (``state``: where it starts)."""

    def on_step_begin(self, step: int) -> None:
        """Before optimizer step ``step`` (from 1) reads its data."""

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        """After every optimizer step."""

    def on_train_end(self, state: TrainerState, control: Control) -> None:
        """After the last step, or after a stop (``control.stop`` says which)."""


class StepLogger(Callback):
    """metrics.jsonl train rows (every ``every`` steps and the last) and the progress bar. A row of
    several steps holds their mean loss, as the HF Trainer's logging_steps log it (``loss_steps``:
    how many; since the resume for the first row of a resumed run), and its last step's other
    figures (``step_loss``: that step's own loss)."""

    def __init__(
        self,
        log: RunLog,
        every: int,
        mfu: Callable[[int, int, float, int], float | None],  # tokens, examples, seconds, targets
        device: torch.device,
    ):
        self.log, self.every, self.mfu, self.device = log, every, mfu, device
        self.losses: list[float] = []  # the finite step losses since the last row

    def on_train_begin(self, state: TrainerState, layout: BatchLayout) -> None:
        self.log.start_progress(layout.total_steps, initial=state.step)

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        r = step.result
        self.losses += [] if r.nonfinite else [r.loss]
        if step.state.step % self.every and not step.finished:
            self.log.advance()  # the bar counts every step, the figures are the logged step's
            return
        mfu = self.mfu(r.tokens, r.examples, step.seconds, r.target_tokens)
        row = step_row(step, mfu, peak_memory_bytes(self.device))
        if self.every > 1:
            mean = sum(self.losses) / len(self.losses) if self.losses else r.loss
            row |= {"loss": mean, "loss_steps": len(self.losses), "step_loss": r.loss}
        self.losses = []
        self.log.record(row)
        shown = {
            "loss": f"{row['loss']:.4f}",
            "lr": f"{step.lr:.2e}",
            "tok/s": f"{r.tokens / step.seconds:,.0f}",
        }
        if mfu is not None:
            shown["mfu"] = f"{100 * mfu:.0f}%"
        self.log.advance(shown)

    def on_train_end(self, state: TrainerState, control: Control) -> None:
        self.log.end_progress()


class EpochSummary(Callback):
    """The log line closing each epoch: its mean train loss (per target token, per pair...)."""

    def __init__(self, log: RunLog):
        self.log = log
        self.loss_sum, self.loss_tokens, self.epochs = 0.0, 0, 0
        self.partial_from: int | None = None  # the epoch's first step in the mean, when not its first

    def on_train_begin(self, state: TrainerState, layout: BatchLayout) -> None:
        self.epochs = layout.epochs
        if not (state.step_in_epoch and self.log.active):
            return
        # A resumed epoch's mean takes in its steps before the checkpoint (metrics.jsonl holds them,
        # unless the checkpoint came from another folder: then the line says which steps it covers).
        begun = state.step - state.step_in_epoch
        rows = [r for r in read_metrics(self.log.output_dir) if begun < r["step"] <= state.step]
        if len({r["step"] for r in rows}) < state.step_in_epoch:
            self.partial_from = state.step + 1
            return
        for row in rows:
            if not row.get("skipped"):
                units = row.get("units", row.get("target_tokens", 0))
                self.loss_sum += row["loss"] * units
                self.loss_tokens += units

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        r = step.result
        if not r.nonfinite:  # weighted by the objective's units: target tokens, pairs
            self.loss_sum += r.loss * r.count
            self.loss_tokens += r.count
        if step.epoch_done:
            mean = self.loss_sum / max(self.loss_tokens, 1)
            steps = f" (steps {self.partial_from}-{step.state.step})" if self.partial_from else ""
            self.log.info(f"epoch {step.state.epoch}/{self.epochs}: train loss {mean:.4f}{steps}")
            self.loss_sum, self.loss_tokens, self.partial_from = 0.0, 0, None


def step_row(step: StepEnd, mfu: float | None, memory: int) -> dict[str, object]:
    """The metrics.jsonl row of a train step."""
    r = step.result
    return {
        "kind": "train",
        "step": step.state.step,
        "epoch": step.state.epochs_done,
        "loss": r.loss,
        **r.metrics,  # the objective's (rewards/margins, ... for preference tuning)
        "lr": step.lr,
        "grad_norm": r.grad_norm,
        "tokens": r.tokens,
        "target_tokens": r.target_tokens,
        "units": r.count,  # what the loss is a mean over: target tokens, or pairs
        "tokens_per_s": r.tokens / step.seconds,
        "mfu": mfu,
        "peak_memory_bytes": memory,
        **{f"time_{name}_s": seconds for name, seconds in r.phases.items()},
        **_rank_times(r),
        "elapsed_s": step.elapsed,
        "skipped": r.nonfinite,
    }


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


class NanPolicy(Callback):
    """--on-nan: a step whose loss or gradient norm was not finite (no rank applied its update)
    stops the run, or is counted and logged."""

    def __init__(self, on_nan: str, log: RunLog, output_dir: Path):
        self.on_nan, self.log, self.output_dir = on_nan, log, output_dir

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        if not step.result.nonfinite:
            return
        state = step.state
        if self.on_nan == "stop":
            saved = saved_checkpoints(self.output_dir)
            # It said "the last checkpoint is intact" where none was saved; and a changed setting
            # cannot continue a run that has none.
            then = (
                f"the newest checkpoint, {saved[-1]}, is finite, though the run may have diverged before "
                "it (metrics.jsonl has its losses): continue from it with a lower --lr, start again with "
                "--overwrite, or give --on-nan skip to skip such steps"
                if saved
                else "no checkpoint was saved yet: start again with a lower --lr, or --on-nan skip to skip "
                "such steps (with --overwrite, as this run has nothing to continue)"
            )
            raise TrainingStopped(
                f"non-finite loss or gradient norm at step {state.step}; the update was not applied and "
                f"training stopped; {then}"
            )
        self.log.info(
            f"step {state.step}: non-finite loss or gradient norm, update skipped "
            f"({state.skipped_steps} so far)"
        )


class Evaluator:
    """Evaluation every ``every`` steps and at the end (with ``on_start``, also before the first
    step); with a best-model tracker, a checkpoint of each new best is asked for, and the run stops
    early when the metric stops improving. The loop runs it after the components and before saving,
    and keeps what it returns."""

    def __init__(
        self,
        run_eval: Callable[[], EvalResult],
        log: RunLog,
        when: EvalSettings,  # its every and on_start
        best: BestTracker | None,
        unit: str = "target_tokens",  # the objective's: a preference objective's eval line counts pairs
    ):
        self.run_eval, self.log, self.every, self.best = run_eval, log, when.every, best
        self.noun = examples_noun(unit)
        self.on_start = when.on_start

    def at_start(self, state: TrainerState) -> EvalResult | None:
        """The starting model's figures, as step 0: a baseline for the curve, not a candidate for the
        best checkpoint (there is no checkpoint of step 0). A resumed run logged them already."""
        if not self.on_start or state.step:
            return None
        return self._evaluate(state, Control(), baseline=True)

    def after_step(self, step: StepEnd, control: Control) -> EvalResult | None:
        if self.every and step.state.step % self.every == 0 and not step.finished:
            return self._evaluate(step.state, control)
        return None

    def at_end(self, state: TrainerState, control: Control) -> EvalResult | None:
        return self._evaluate(state, control) if control.stop is None else None

    def _evaluate(self, state: TrainerState, control: Control, baseline: bool = False) -> EvalResult:
        ev = self.run_eval()
        self.log.record(
            {
                "kind": "eval",
                "step": state.step,
                "epoch": state.epochs_done,
                **ev.metrics,
                "eval_tokens": ev.target_tokens,
                "eval_examples": ev.examples,
            }
        )
        suffixes = tuple(f"/{name}" for name in ev.sources)
        more = "".join(
            f", {name.removeprefix('eval_')} {value:.3f}"
            for name, value in ev.metrics.items()
            if name != "eval_loss" and not (suffixes and name.endswith(suffixes))
        )
        noun = self.noun if ev.examples != 1 else self.noun.removesuffix("s")
        counts = f"{ev.examples:,} {noun}, {ev.target_tokens:,} target tokens"
        per_source = ", ".join(f"{name} {ev.metrics[f'eval_loss/{name}']:.4f}" for name in ev.sources)
        more += f"; per source: {per_source}" if per_source else ""
        when = "before training" if baseline else f"step {state.step}"
        self.log.info(f"{when}: eval loss {ev.loss:.4f}{more} ({counts})")
        best = self.best
        if best is None or baseline:
            return ev
        control.save |= best.observe(state.step, ev.value(best.metric))
        if best.should_stop and control.stop is None:  # all ranks evaluated alike: all stop here
            assert best.best is not None
            control.stop = "early"
            self.log.info(
                f"stopping early at step {state.step}: {best.metric} has not improved"
                + (f" by more than {best.threshold:g}" if best.threshold else "")
                + f" for {best.without_improvement} evaluation{'s' if best.without_improvement != 1 else ''} "
                f"(best {best.best.value:.4f} at step {best.best.step})"
            )
        return ev


class SignalStop(Callback):
    """SIGTERM/SIGINT on any rank (agreed in the step's all-reduce): save this step and leave."""

    def __init__(self, log: RunLog):
        self.log = log

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        if step.result.stop:
            control.stop, control.save = "signal", True
            self.log.info(f"stopping at step {step.state.step} as asked (signal): saving a checkpoint")


class ExampleOrder(Callback):
    """--record-samples: the example ids of every step, per rank (to audit the data order)."""

    def __init__(self, samples: ExampleOrderLog):
        self.samples = samples

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        self.samples(step.state.step, step.example_ids)

    def on_train_end(self, state: TrainerState, control: Control) -> None:
        self.samples.close()


@dataclass
class StragglerReport(Callback):
    """Names a rank in the log that is slow step after step (several processes only)."""

    log: RunLog
    watch: StragglerWatch = field(default_factory=StragglerWatch)

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        for rank in self.watch.observe(step.result.rank_work_s):
            self.log.info(
                f"step {step.state.step}: rank {rank} is a straggler: its data wait and forward took "
                f"over {self.watch.ratio:.1f}x the median of the ranks for {self.watch.steps} steps in a "
                "row (metrics.jsonl: step_time_*)"
            )


class CollectiveTimeoutSwitch(Callback):
    """--collective-timeout: the short timeout from the end of the first step on, the long one
    again after the last (the final save and a merge may take long)."""

    def __init__(self, timeouts: CollectiveTimeouts):
        self.timeouts = timeouts

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        self.timeouts.after_step()

    def on_train_end(self, state: TrainerState, control: Control) -> None:
        self.timeouts.end()


class HeartbeatStep(Callback):
    """The step in progress, for the launcher's hang watchdog (its phases are beaten by the step's
    phase timer and by the components that take long)."""

    def __init__(self, heartbeat: Heartbeat):
        self.heartbeat = heartbeat

    def on_step_begin(self, step: int) -> None:
        self.heartbeat.step = step
