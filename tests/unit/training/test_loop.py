"""fit, train_step, the loop's components and checkpoint store/export, in this process (world size 1).

The distributed CLI tests prove N ranks == 1 process; these pin the single-process pieces down
directly, so a failure names the piece.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from lmtune.checkpoint.export import export
from lmtune.checkpoint.layout import list_checkpoints, step_folder, verify
from lmtune.checkpoint.manager import CheckpointManager, Trainable
from lmtune.checkpoint.state import TrainerState
from lmtune.checkpoint.store import load_checkpoint, prune, save_checkpoint
from lmtune.config.run_groups import EvalSettings
from lmtune.config.settings import TrainConfig
from lmtune.data.collate import StepCollator
from lmtune.errors import StoppedBySignal, TrainingStopped
from lmtune.model.precision import autocast_context
from lmtune.outputs.runlog import RunLog
from lmtune.parallel.distributed import read_dist_env
from lmtune.parallel.health import Heartbeat
from lmtune.testing.faults import install as install_faults
from lmtune.training.batch_layout import BatchLayout
from lmtune.training.best import BestTracker
from lmtune.training.build import Built, build, loaders, schedule
from lmtune.training.callbacks import (
    Callback,
    Control,
    EpochSummary,
    Evaluator,
    HeartbeatStep,
    NanPolicy,
    SignalStop,
    StepEnd,
)
from lmtune.training.context import RunContext as Run
from lmtune.training.evaluate import EvalResult
from lmtune.training.loop import FitResult, FitSettings, LoopParts, NoSaves, Saver, fit
from lmtune.training.signals import StopRequest
from lmtune.training.step import StepInput, StepOptions, StepResult, Trainee, train_step
from tests.conftest import uneven_texts, write_jsonl

ENV = read_dist_env("cpu")
# Plain, and with what is drawn per example: NEFTune's noise, LoRA's dropout masks.
KEYED = pytest.mark.parametrize(
    "settings",
    [{}, {"neftune_alpha": 5.0}, {"lora": True, "lora_dropout": 0.2}],
    ids=["plain", "neftune", "lora_dropout"],
)
STEPS = 7  # 24 examples / 8 per step: 3 steps per epoch, so the run crosses two epoch ends


@contextlib.contextmanager
def _built(tmp_path: Path, name: str, **settings: Any) -> Iterator[tuple[Run, Built]]:
    data = write_jsonl(tmp_path / "data.jsonl", uneven_texts(24, seed=3))
    values = {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": STEPS, "max_length": 64, **settings}
    cfg = TrainConfig(model="tiny", data=str(data), output_dir=str(tmp_path / name), progress=False, **values)
    with RunLog(ENV, Path(cfg.output_dir), progress=False) as log, StopRequest() as stop:
        run = Run(
            cfg=cfg,
            env=ENV,
            strategy="single",
            threads=1,
            log=log,
            stop=stop,
            heartbeat=Heartbeat(None, 0),
        )
        yield run, build(run)


def _manager(run: Run, b: Built) -> CheckpointManager:
    return CheckpointManager(
        output_dir=run.output_dir,
        settings=run.cfg.checkpoint,
        env=ENV,
        trainable=Trainable(b.parts, b.optimizer, b.tokenizer, b.scaler),
        fingerprint=b.fingerprint,
        log=run.log,
    )


def _fresh_state(b: Built) -> TrainerState:
    return TrainerState(
        step=0,
        epoch=0,
        step_in_epoch=0,
        global_batch_size=8,
        world_size=1,
        seed=42,
        examples=len(b.train_data),
    )


def _fit(
    run: Run,
    b: Built,
    start: TrainerState,
    callbacks: list[Callback],
    saver: Saver | None = None,
    evaluator: Evaluator | None = None,
    **kw: Any,
) -> FitResult:
    trainee = Trainee(b.model, b.optimizer, schedule(run.cfg, b, start.step), b.scaler)
    data, _ = loaders(run, b)
    autocast = lambda: autocast_context("fp32", ENV.device)  # noqa: E731
    options = StepOptions(run.cfg.max_grad_norm, autocast, token_seed=b.token_seed)
    parts = LoopParts(callbacks=callbacks, evaluator=evaluator, saver=saver or NoSaves())
    return fit(trainee, data, start, parts, FitSettings(env=ENV, step=options, **kw))


def _weights(b: Built) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in b.parts.model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@dataclass
class Recorder(Callback):
    """Records what the loop tells its components; stops the run after ``stop_at`` if set."""

    stop_at: int | None = None
    began: list[tuple[int, BatchLayout]] = field(default_factory=list)
    steps: list[StepEnd] = field(default_factory=list)
    ended: list[tuple[int, str | None]] = field(default_factory=list)

    def on_train_begin(self, state: TrainerState, layout: BatchLayout) -> None:
        self.began.append((state.step, layout))

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        self.steps.append(step)
        if step.state.step == self.stop_at:
            control.stop = "early"

    def on_train_end(self, state: TrainerState, control: Control) -> None:
        self.ended.append((state.step, control.stop))


def test_fit_takes_the_same_steps_as_train_step_by_hand(tmp_path: Path) -> None:
    with _built(tmp_path, "fit") as (run, b):
        recorder = Recorder()
        result = _fit(run, b, _fresh_state(b), [recorder])
        by_fit = _weights(b)
    with _built(tmp_path, "by-hand") as (run2, b2):
        trainee = Trainee(b2.model, b2.optimizer, schedule(run2.cfg, b2, 0))
        data, _ = loaders(run2, b2)
        options = StepOptions(1.0, lambda: autocast_context("fp32", ENV.device))
        losses = []
        for epoch in range(3):
            data.sampler.set_epoch(epoch, 0)
            for micro in list(data.loader)[: STEPS - 3 * epoch]:
                losses.append(train_step(trainee, StepInput(micro), ENV, options).loss)
        assert _same(by_fit, _weights(b2))
    assert [s.result.loss for s in recorder.steps] == losses
    assert result.state == replace(_fresh_state(b), step=7, epoch=2, step_in_epoch=1)
    assert [s.state.step for s in recorder.steps if s.epoch_done] == [3, 6]
    elapsed = [s.elapsed for s in recorder.steps]
    assert elapsed == sorted(elapsed) and result.state.train_seconds == elapsed[-1] > 0
    assert [s.finished for s in recorder.steps] == [False] * 6 + [True]
    assert recorder.began == [(0, b.layout)] and recorder.ended == [(7, None)]
    assert recorder.steps[0].example_ids and all(s.seconds > 0 for s in recorder.steps)


def test_a_resumed_run_goes_on_counting_its_training_time(tmp_path: Path) -> None:
    """metrics.jsonl's elapsed_s, run.json's train_seconds and the card's training time are the
    run's, over its attempts: a resume starts from the time its checkpoint had trained."""
    with _built(tmp_path, "resumed") as (run, b):
        recorder = Recorder()
        start = replace(_fresh_state(b), step=4, epoch=1, step_in_epoch=1, train_seconds=100.0)
        result = _fit(run, b, start, [recorder])
    assert all(s.elapsed > 100.0 for s in recorder.steps) and result.state.train_seconds > 100.0


def test_a_component_stops_the_run_after_its_step(tmp_path: Path) -> None:
    with _built(tmp_path, "stop") as (run, b):
        recorder = Recorder(stop_at=4)
        later = Recorder()
        result = _fit(run, b, _fresh_state(b), [recorder, later])
    assert (result.state.step, result.stop) == (4, "early")
    # Every component still sees the step that asked to stop, and the end with the reason.
    assert [s.state.step for s in later.steps] == [1, 2, 3, 4]
    assert recorder.ended == later.ended == [(4, "early")]


@KEYED
def test_resume_from_a_checkpoint_in_process_is_bit_identical(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    """NEFTune's noise and dropout's masks too: the resumed steps draw what the uninterrupted
    run's did."""
    with _built(tmp_path, "straight", **settings) as (run, b):
        assert (b.token_seed is not None, b.parts.root.neftune_alpha) == (
            bool(settings),
            settings.get("neftune_alpha", 0.0),
        )
        _fit(run, b, _fresh_state(b), [])
        straight, straight_opt = _weights(b), b.optimizer.state_dict()
    with _built(tmp_path, "resumed", **settings) as (run, b):
        manager = _manager(run, b)
        result = _fit(run, b, _fresh_state(b), [Recorder(stop_at=4)], saver=manager)
        assert [p.name for p in list_checkpoints(run.output_dir)] == [
            "step-000004"
        ] and result.stop == "early"
    folder = step_folder(tmp_path / "resumed", 4)
    assert verify(folder) is None
    torch.manual_seed(1234)  # disturbed: the checkpoint's RNG state must be what counts
    with _built(tmp_path, "resumed", **settings) as (run, b):
        start = _manager(run, b).resume(_fresh_state(b), STEPS)
        assert (start.step, start.epoch, start.step_in_epoch) == (4, 1, 1)
        _fit(run, b, start, [])
        assert _same(straight, _weights(b))
        resumed_opt = b.optimizer.state_dict()
    for k, v in straight_opt["state"].items():
        assert all(torch.equal(v[name], resumed_opt["state"][k][name]) for name in v)


def _functional_dropout(b: Built) -> None:
    """Dropout drawn from the process's stream, as SDPA's dropout_p and OPT's F.dropout draw it."""
    for module in b.model.modules():
        if type(module).__name__ == "LlamaMLP":
            module.register_forward_hook(lambda m, _, out: torch.nn.functional.dropout(out, 0.1, m.training))


def test_functional_dropout_resumes_bit_identical(tmp_path: Path) -> None:
    """GPT-2's attention dropout and OPT's functional dropout resumed with other masks (3e-3 apart
    by the end): the resumed run's new data iterator drew from the stream after its restore."""
    with _built(tmp_path, "straight") as (run, b):
        _functional_dropout(b)
        _fit(run, b, _fresh_state(b), [])
        straight = _weights(b)
    with _built(tmp_path, "resumed") as (run, b):
        _functional_dropout(b)
        _fit(run, b, _fresh_state(b), [Recorder(stop_at=4)], saver=_manager(run, b))
    with _built(tmp_path, "resumed") as (run, b):
        _functional_dropout(b)
        start = _manager(run, b).resume(_fresh_state(b), STEPS)
        assert start.step_in_epoch == 1  # mid-epoch: the resumed run opens a new iterator there
        _fit(run, b, start, [])
        assert _same(straight, _weights(b))


@KEYED
def test_gradient_accumulation_is_one_step_over_the_whole_batch(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    """Four micro-batches of two give the update of one micro-batch of eight (token-weighted),
    with NEFTune's noise and LoRA's dropout too (drawn per example, whatever its micro-batch)."""
    results: list[StepResult] = []
    weights = []
    for micro in (8, 2):
        with _built(tmp_path, f"accumulate-{micro}", optimizer="sgd", momentum=0.0, **settings) as (run, b):
            examples = [b.train_data[i] for i in range(8)]
            collate = StepCollator(b.tokenizer.pad_token_id, micro, "group", 64)
            trainee = Trainee(b.model, b.optimizer, schedule(run.cfg, b, 0))
            assert b.parts.root.neftune_alpha == settings.get("neftune_alpha", 0.0)
            assert b.token_seed == (run.cfg.seed if settings else None)
            options = StepOptions(0.0, lambda: autocast_context("fp32", ENV.device), token_seed=b.token_seed)
            results.append(train_step(trainee, StepInput(collate(examples), step=1), ENV, options))
            weights.append(_weights(b))
    full, accumulated = results
    assert accumulated.loss == pytest.approx(full.loss, rel=1e-6)
    assert (accumulated.target_tokens, accumulated.examples) == (full.target_tokens, full.examples)
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], rtol=1e-5, atol=1e-6)


def _poison_step_2(run: Run, b: Built, monkeypatch: pytest.MonkeyPatch) -> HeartbeatStep:
    """Fault injection as the tests' subprocesses get it: step 2's loss becomes NaN (the fault
    reads the step in progress from the heartbeat, which its component keeps)."""
    monkeypatch.setenv("LMTUNE_FAULT_NAN_AT_STEP", "2")
    install_faults(b.parts.root, 0, lambda: run.heartbeat.step)
    return HeartbeatStep(run.heartbeat)


def test_a_poisoned_step_is_not_applied_and_the_policy_decides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _built(tmp_path, "skip", on_nan="skip") as (run, b):
        recorder = Recorder()
        beat = _poison_step_2(run, b, monkeypatch)
        result = _fit(run, b, _fresh_state(b), [beat, NanPolicy("skip", run.log, run.output_dir), recorder])
        assert result.state.step == STEPS and result.state.skipped_steps == 1
        assert [s.result.nonfinite for s in recorder.steps][:3] == [False, True, False]
    # Without a checkpoint it said "the last checkpoint is intact", and what it advised was refused.
    none_yet = r"step 2; .* no checkpoint was saved yet: start again with a lower --lr, .*--overwrite"
    with _built(tmp_path, "stop") as (run, b), pytest.raises(TrainingStopped, match=none_yet):
        policy = NanPolicy("stop", run.log, run.output_dir)
        _fit(run, b, _fresh_state(b), [_poison_step_2(run, b, monkeypatch), policy])


def test_a_signal_saves_the_step_and_stops(tmp_path: Path) -> None:
    with _built(tmp_path, "signal") as (run, b):
        asked = iter([False, False, True] + [False] * 10)
        saver = SaveRecorder()
        result = _fit(
            run, b, _fresh_state(b), [SignalStop(run.log)], saver, stop_requested=lambda: next(asked)
        )
    assert (result.state.step, result.stop) == (3, "signal")
    assert saver.calls[-1] == ("after_step", 3, True) and "at_end" not in [c[0] for c in saver.calls]


def test_a_signal_before_the_first_step_stops_fit_with_nothing_trained_or_saved(tmp_path: Path) -> None:
    import signal

    with _built(tmp_path, "early-signal") as (run, b):
        before = _weights(b)
        stop = StopRequest()
        stop._handle(signal.SIGTERM, None)
        saver = SaveRecorder()
        with pytest.raises(StoppedBySignal, match="SIGTERM before training began"):
            _fit(
                run,
                b,
                _fresh_state(b),
                [],
                saver,
                stop_requested=stop,
                signal_before_training=stop.before_first_step,
            )
        assert saver.calls == [] and _same(before, _weights(b))
    # Without a signal, fit's last look lets it train, and a signal from then on saves its step.
    stop = StopRequest()
    assert stop.before_first_step() == 0 and stop.stepping


def test_a_signal_during_a_step_or_its_evaluation_stops_the_run_at_that_step(tmp_path: Path) -> None:
    """The flag is read when the step's micro-batches are done (not when it begins), and once more
    after an evaluation or a checkpoint: the run stops, saved, at the step the signal came in."""
    import signal

    began: list[int] = []

    class Began(Callback):
        def on_step_begin(self, step: int) -> None:
            began.append(step)

    def signal_in_step_2(stop: StopRequest) -> Callable[..., None]:
        def send(*_: Any) -> None:
            if began[-1] == 2 and not stop.requested:
                stop._handle(signal.SIGTERM, None)

        return send

    with _built(tmp_path, "signal-in-step") as (run, b):
        stop, saver = StopRequest(), SaveRecorder()
        hook = b.model.register_forward_pre_hook(signal_in_step_2(stop))
        in_step = _fit(run, b, _fresh_state(b), [Began(), SignalStop(run.log)], saver, stop_requested=stop)
        hook.remove()
    assert (in_step.state.step, in_step.stop) == (2, "signal")
    assert saver.calls[-1] == ("after_step", 2, True)

    stop = StopRequest()

    def run_eval() -> EvalResult:
        signal_in_step_2(stop)()
        return EvalResult(loss=1.0, target_tokens=1, examples=1, count=1, metrics={"eval_loss": 1.0})

    with _built(tmp_path, "signal-in-eval") as (run, b):
        began.clear()
        saver, evaluator = SaveRecorder(), Evaluator(run_eval, run.log, EvalSettings(every=2), best=None)
        in_eval = _fit(
            run, b, _fresh_state(b), [Began(), SignalStop(run.log)], saver, evaluator, stop_requested=stop
        )
    assert (in_eval.state.step, in_eval.stop, len(in_eval.evals)) == (2, "signal", 1)
    assert saver.calls == [("after_step", 1, False), ("after_step", 2, False), ("after_step", 2, True)]


def test_a_signal_before_a_baseline_evaluation_skips_it_and_one_during_it_trains_nothing(
    tmp_path: Path,
) -> None:
    import signal

    evaluated: list[int] = []

    def evaluations(stop: StopRequest, signal_in_it: bool) -> Evaluator:
        def run_eval() -> EvalResult:
            evaluated.append(1)
            if signal_in_it:
                stop._handle(signal.SIGTERM, None)
            return EvalResult(loss=1.0, target_tokens=1, examples=1, count=1, metrics={"eval_loss": 1.0})

        return Evaluator(run_eval, run.log, EvalSettings(every=2, on_start=True), best=None)

    for signal_in_it in (False, True):
        with _built(tmp_path, f"baseline-{signal_in_it}") as (run, b):
            stop, saver = StopRequest(), SaveRecorder()
            if not signal_in_it:
                stop._handle(signal.SIGTERM, None)  # while the run was built
            before = _weights(b)
            with pytest.raises(StoppedBySignal):
                _fit(
                    run,
                    b,
                    _fresh_state(b),
                    [],
                    saver,
                    evaluations(stop, signal_in_it),
                    stop_requested=stop,
                    signal_before_training=stop.before_first_step,
                )
            assert saver.calls == [] and _same(before, _weights(b))
    assert evaluated == [1]  # the baseline ran only where the signal came during it


def test_a_signal_says_what_it_will_do_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before the first step nothing is saved; once fit has asked, the step finishes and saves. The
    launcher signals every rank: rank 0 alone says so."""
    import signal

    stop = StopRequest()
    stop._handle(signal.SIGTERM, None)
    assert (
        "SIGTERM received: stopping before training begins, with nothing to save" in capsys.readouterr().err
    )
    stop = StopRequest()
    assert stop() is False
    stop._handle(signal.SIGTERM, None)
    assert (
        capsys.readouterr().err == "lmtune: SIGTERM received: finishing this step and saving a checkpoint\n"
    )
    monkeypatch.setenv("RANK", "1")
    StopRequest()._handle(signal.SIGTERM, None)
    assert capsys.readouterr().err == ""


def _end(step: int, finished: bool = False) -> StepEnd:
    state = TrainerState(
        step=step, epoch=0, step_in_epoch=step, global_batch_size=8, world_size=1, seed=0, examples=800
    )
    result = StepResult(
        loss=1.0, grad_norm=1.0, target_tokens=1, tokens=1, examples=1, nonfinite=False, stop=False
    )
    return StepEnd(
        state=state,
        result=result,
        lr=1e-3,
        seconds=1.0,
        elapsed=float(step),
        finished=finished,
        epoch_done=False,
        example_ids=[],
    )


def test_the_manager_saves_on_schedule_when_asked_and_once_per_step(tmp_path: Path) -> None:
    with _built(tmp_path, "cadence", save_every=3, keep_last=0) as (run, b):
        manager = _manager(run, b)
        manager.resume(_fresh_state(b), STEPS)
        for step in range(1, 8):
            manager.after_step(_end(step).state, asked=step == 5, last=step == 7)
            if step == 5:  # a second request in the same step
                manager.after_step(_end(step).state, asked=True, last=False)
        manager.at_end(_end(7).state, asked=False)
        assert [p.name for p in list_checkpoints(run.output_dir)] == [f"step-00000{n}" for n in (3, 5, 6, 7)]
    with _built(tmp_path, "no-cadence", save_every=0) as (run, b):
        manager = _manager(run, b)
        manager.resume(_fresh_state(b), STEPS)
        manager.at_end(_end(4).state, asked=False)  # without --save-every nothing is due at the end
        assert list_checkpoints(run.output_dir) == []


def _evals_of(losses: list[float]) -> Callable[[], EvalResult]:
    """An evaluation that gives these eval losses in turn."""
    given = iter(losses)

    def run_eval() -> EvalResult:
        loss = next(given)
        return EvalResult(loss=loss, target_tokens=10, examples=2, count=10, metrics={"eval_loss": loss})

    return run_eval


def test_evaluator_asks_to_save_each_best_and_stops_after_the_patience(tmp_path: Path) -> None:
    run_eval = _evals_of([3.0, 2.0, 2.5, 2.6, 1.0])
    with RunLog(ENV, tmp_path, progress=False) as log:
        log.open_metrics(0)
        best = BestTracker(metric="eval_loss", greater_is_better=False, patience=2, threshold=0.0)
        evaluator = Evaluator(run_eval, log, EvalSettings(every=2), best=best)
        decisions, evals = [], []
        for step in range(1, 9):
            control = Control()
            if (ev := evaluator.after_step(_end(step), control)) is not None:
                evals.append(ev)
            decisions.append((control.save, control.stop))
    evaluated = [d for i, d in enumerate(decisions) if (i + 1) % 2 == 0]
    assert evaluated == [(True, None), (True, None), (False, None), (False, "early")]
    assert [e.loss for e in evals] == [3.0, 2.0, 2.5, 2.6]
    assert best.best is not None and best.best.step == 4


def test_the_early_stop_line_says_what_too_small_an_improvement_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_eval = _evals_of([3.0, 2.9])  # better, but by less than the threshold
    with RunLog(ENV, tmp_path, progress=False) as log:
        log.open_metrics(0)
        best = BestTracker(metric="eval_loss", greater_is_better=False, patience=1, threshold=0.5)
        evaluator = Evaluator(run_eval, log, EvalSettings(every=1), best=best)
        for step in (1, 2):
            evaluator.after_step(_end(step), Control())
    assert (
        "stopping early at step 2: eval_loss has not improved by more than 0.5 for 1 evaluation "
        "(best 2.9000 at step 2)"
    ) in capsys.readouterr().out


@dataclass
class SaveRecorder:
    """A saver that records what fit asks of it, and when."""

    calls: list[tuple[str, int, bool]] = field(default_factory=list)
    log: list[str] | None = None

    def after_step(self, state: TrainerState, *, asked: bool, last: bool) -> Path | None:
        self.calls.append(("after_step", state.step, asked))
        if self.log is not None:
            self.log.append(f"save {state.step}")
        return None

    def at_end(self, state: TrainerState, *, asked: bool) -> Path | None:
        self.calls.append(("at_end", state.step, asked))
        return None


def test_after_each_step_components_then_evaluation_then_the_save_then_the_stop(tmp_path: Path) -> None:
    order: list[str] = []

    class Component(Callback):
        def on_step_end(self, step: StepEnd, control: Control) -> None:
            order.append(f"component {step.state.step}")

    def run_eval() -> EvalResult:
        order.append("eval")
        return EvalResult(loss=1.0, target_tokens=1, examples=1, count=1, metrics={"eval_loss": 1.0})

    with _built(tmp_path, "order") as (run, b):
        best = BestTracker(metric="eval_loss", greater_is_better=False, patience=1, threshold=0.0)
        evaluator = Evaluator(run_eval, run.log, EvalSettings(every=2), best=best)
        result = _fit(run, b, _fresh_state(b), [Component()], SaveRecorder(log=order), evaluator)
    # Step 2's evaluation is the first best: saved after it. Step 4's does not improve, so the
    # patience of 1 stops the run: the save of step 4 comes after that evaluation, then fit stops.
    assert order == [
        *("component 1", "save 1", "component 2", "eval", "save 2"),
        *("component 3", "save 3", "component 4", "eval", "save 4"),
    ]
    assert result.stop == "early" and [e.loss for e in result.evals] == [1.0, 1.0]
    assert result.best is not None and result.best.step == 2


def test_store_prunes_to_keep_last_but_keeps_the_protected_and_export_loads(tmp_path: Path) -> None:
    with _built(tmp_path, "store") as (run, b):
        state = _fresh_state(b)
        for step in (1, 2, 3, 4):
            save_checkpoint(
                run.output_dir,
                replace(state, step=step),
                b.parts,
                b.tokenizer,
                b.optimizer,
                ENV,
                keep_last=0,
                records={},
            )
        mine = step_folder(run.output_dir, 0)  # a user's folder named as lmtune names its own
        mine.mkdir()
        (mine / "notes.txt").write_text("mine")
        (step_folder(run.output_dir, 2) / "notes.txt").write_text("mine, put into lmtune's")
        prune(run.output_dir, keep_last=2, protect=step_folder(run.output_dir, 1))
        assert [p.name for p in list_checkpoints(run.output_dir)] == [
            "step-000000",
            "step-000001",
            "step-000002",  # what lmtune wrote in it is gone; the user's notes are not
            "step-000003",
            "step-000004",
        ]
        assert [p.name for p in step_folder(run.output_dir, 2).iterdir()] == ["notes.txt"]
        export(step_folder(run.output_dir, 4), tmp_path / "exported")
        model = b.parts.model
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert _same({k: v for k, v in model.state_dict().items()}, dict(loaded.state_dict()))


def test_a_crafted_scaler_record_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    from lmtune.checkpoint.store import _scaler_state
    from lmtune.errors import UserError

    good = {"scale": 1024.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
    path = tmp_path / "scaler.json"
    path.write_text(json.dumps({**good, "_growth_tracker": 7, "extra": "ignored"}))
    assert _scaler_state(path) == {**good, "_growth_tracker": 7}
    for bad in (
        "[1, 2]",
        json.dumps({**good, "_growth_tracker": "7"}),
        json.dumps(good),
        '{"scale": NaN}',
        "{",
    ):
        path.write_text(bad)
        with pytest.raises(UserError, match=r"scaler\.json"):
            _scaler_state(path)


def test_a_crafted_rng_record_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    from lmtune.checkpoint.layout import write_manifest
    from lmtune.errors import UserError

    with _built(tmp_path, "rng") as (run, b):
        folder = save_checkpoint(
            run.output_dir, _fresh_state(b), b.parts, b.tokenizer, b.optimizer, ENV, keep_last=0, records={}
        )
        for bad in ('{"python": [3, [1, 2], null]}', '{"torch": "AAAA"}', "[]"):
            (folder / "rng-rank-0.json").write_text(bad)
            (folder / "manifest.json").unlink()
            write_manifest(folder)  # a consistent, crafted checkpoint
            with pytest.raises(UserError, match=r"rng-rank-0\.json: not the RNG state"):
                load_checkpoint(folder, b.parts, b.optimizer, ENV)


def test_a_resumed_epochs_loss_takes_in_its_steps_before_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Epoch 2 is steps 3 and 4; resumed from step 3, its line is the mean of both, per unit."""
    rows = [(1, 2.0, 10), (2, 1.8, 10), (3, 1.0, 30)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "step": s, "loss": v, "units": n}) + "\n" for s, v, n in rows)
    )
    at = TrainerState(
        step=3, epoch=1, step_in_epoch=1, global_batch_size=8, world_size=1, seed=0, examples=16
    )
    layout = BatchLayout(8, 8, 1, 1, steps_per_epoch=2, total_steps=4, epochs=2)
    with RunLog(ENV, tmp_path, progress=False) as log:
        log.open_metrics(3)
        summary = EpochSummary(log)
        summary.on_train_begin(at, layout)
        result = StepResult(0.5, 1.0, 10, 10, 8, nonfinite=False, stop=False, count=10)
        after = replace(at, step=4, epoch=2, step_in_epoch=0)
        summary.on_step_end(StepEnd(after, result, 1e-3, 1.0, 1.0, True, True, []), Control())
    assert "epoch 2/2: train loss 0.8750\n" in capsys.readouterr().out  # (1.0 * 30 + 0.5 * 10) / 40
    # Resumed from another folder's checkpoint: no rows of the epoch's first step here.
    (tmp_path / "metrics.jsonl").write_text("")
    with RunLog(ENV, tmp_path, progress=False) as log:
        summary = EpochSummary(log)
        summary.on_train_begin(at, layout)
        summary.on_step_end(StepEnd(after, result, 1e-3, 1.0, 1.0, True, True, []), Control())
    assert "epoch 2/2: train loss 0.5000 (steps 4-4)" in capsys.readouterr().out
