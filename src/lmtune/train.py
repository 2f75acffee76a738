"""train(cfg): the composition root. build -> resume -> fit -> record -> finish, each in its module;
here they are put together, and the loop's components registered (one line each)."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lmtune.checkpoint.manager import CheckpointManager, Trainable
from lmtune.checkpoint.resume import recorded_paths, restart_settings
from lmtune.checkpoint.rundir import final_problem, job_lock, prepare_output
from lmtune.checkpoint.state import TrainerState
from lmtune.config.python_values import in_python_names
from lmtune.config.settings import TrainConfig, to_dict
from lmtune.config.verbosity import run_quiet_restored
from lmtune.data.prepare import cache_root, data_cache_dir
from lmtune.model.precision import check_device
from lmtune.outputs.reporters import open_reporters, parse_report_to
from lmtune.outputs.runlog import ExampleOrderLog, RunLog, loss_at, read_metrics
from lmtune.parallel.distributed import (
    CollectiveTimeouts,
    cpu_threads_per_process,
    process_group,
    read_dist_env,
    refused_by_main,
    stop_if_signalled,
)
from lmtune.parallel.health import Heartbeat
from lmtune.parallel.launch import report_outcome, stop_advice, warn
from lmtune.parallel.launched import run_id
from lmtune.parallel.wrap import resolve_strategy, unwrap
from lmtune.testing.faults import install as install_faults
from lmtune.tools.doctor import DoctorSettings, check_or_fail, check_shared_output
from lmtune.training import callbacks as cb
from lmtune.training.best import BestTracker, best_tracker
from lmtune.training.build import Built, build_parts, loaders, schedule
from lmtune.training.context import CallableModule, RunContext
from lmtune.training.evaluate import EvalResult, evaluate
from lmtune.training.failures import said_plainly
from lmtune.training.finish import TrainResult, finish, finished_result, recorded_outcome
from lmtune.training.loop import FitSettings, LoopParts, fit
from lmtune.training.optim import set_hyperparameters
from lmtune.training.perf import PEAKS_FILE, MfuMeter, PhaseTimer, Probe, best_peak_flops, mfu_meter
from lmtune.training.preflight import check_same_settings, checked, validate
from lmtune.training.record import result_record, run_record
from lmtune.training.reference import attach_references
from lmtune.training.samples import sample_generator
from lmtune.training.signals import StopRequest, ctrl_c_raised, threads_kept
from lmtune.training.step import StepOptions, Trainee


def train(cfg: TrainConfig, given: frozenset[str] | None = None) -> TrainResult:
    """Fine-tune ``cfg.model.name`` on ``cfg.data.train`` in this process (a rank of a job, or alone);
    ``given``: the settings the user gave, for the start's notes (None: not known, as from Python).

    Raises:
        UserError: for invalid settings, data or paths.
        TrainingStopped: when training cannot go on (a non-finite loss with --on-nan stop).
        KeyboardInterrupt: from Python (``given`` None), after Ctrl+C stopped it (signals.py).
    """
    python = given is None
    stop = StopRequest()
    with threads_kept(), run_quiet_restored(), ctrl_c_raised(stop, python) as finished:
        with in_python_names(python):
            result = _train(cfg, given, stop)
        finished.append(result.stopped_by != "signal")
        return result


def _train(cfg: TrainConfig, given: frozenset[str] | None, stop: StopRequest) -> TrainResult:
    env = read_dist_env(checked(cfg).model.device)
    validate(cfg, env.world_size, in_process=True, given=given)
    check_device(cfg.model.precision, env.device)
    strategy = resolve_strategy(cfg.launch.strategy, env)
    threads = cpu_threads_per_process(env, cfg.launch.threads_per_process)
    if env.device.type == "cpu":
        torch.set_num_threads(threads)
    output_dir = Path(cfg.checkpoint.output_dir)
    restart = restart_settings(cfg.checkpoint, env)
    heartbeat = Heartbeat.from_env(env.rank)
    try:
        with (
            process_group(env),
            # Before anything is written: one run per folder (lmtune's launcher may hold it for the job).
            job_lock(output_dir, run_id(), env, warn),
            RunLog(env, output_dir, cfg.logging.progress) as log,
            stop,
            said_plainly(cfg, env.device),
        ):
            run = RunContext(
                cfg=cfg,
                env=env,
                strategy=strategy,
                threads=threads,
                log=log,
                stop=stop,
                heartbeat=heartbeat,
                given=given,
                restart=restart,
            )
            if cfg.health.doctor:
                cache = None if cfg.data.cache_per_node else str(data_cache_dir(cfg.data))  # node-local
                check_or_fail(env, DoctorSettings.of_run(cfg, cache))
            return _run(run)
    finally:
        heartbeat.close()


def _run(run: RunContext) -> TrainResult:
    cfg, env, log, output_dir = run.cfg, run.env, run.log, run.output_dir
    started = time.time()
    check_same_settings(cfg, env, run.strategy)
    if env.world_size > env.local_world_size:  # several nodes: one folder for all
        check_shared_output(env, output_dir)
    replace_earlier_run = prepare_output(
        output_dir,
        resume=run.checkpointing.resume,
        overwrite=run.checkpointing.overwrite,
        config=to_dict(cfg),
        env=env,
        warn=warn,
    )
    built = build_parts(run, recorded_paths=recorded_paths(run.checkpointing, env))
    replace_earlier_run(run.stop.pending())  # --overwrite: only now that the model and data are loaded
    best = best_tracker(cfg.eval)
    timeouts = CollectiveTimeouts(env, cfg.health.collective_timeout)
    checkpoints = _checkpoints(run, built, best, timeouts)
    earlier = checkpoints.finished_or_checked(built.layout.total_steps)
    if earlier is not None:
        return finished_result(run, earlier.step)  # as run.json has it
    refused_by_main(lambda: final_problem(output_dir), env)  # a finished run that trains on replaces it
    reference = attach_references(run, built, data_cache_dir(cfg.data))  # before a resume's weights
    fresh = TrainerState.fresh(cfg.batch.global_batch_size, env.world_size, cfg.seed, len(built.train_data))
    state = checkpoints.resume(fresh, built.layout.total_steps, reference)
    # A loaded optimizer state brings the saved hyperparameters back; this run's settings rule.
    set_hyperparameters(built.optimizer, cfg.optim)
    checkpoints.check_room(state, built.layout.total_steps, cfg.optim, merged=cfg.lora.merge)
    trainee = Trainee(built.model, built.optimizer, schedule(cfg, built, state.step), built.scaler)
    log.open_metrics(state.step, last=state.step >= built.layout.total_steps)
    history = read_metrics(output_dir, kind=None) if env.is_main and state.step else []
    data, eval_loader = loaders(run, built)
    probe = Probe(env.device, cfg.model.precision, run.threads, built.products.fp32)
    peak = best_peak_flops(probe, cache_root() / PEAKS_FILE, store=env.is_main, info=log.info)
    mfu = mfu_meter(built.loaded.model, bool(built.loss.chunk), peak.flops, env.world_size, log)
    loop = LoopParts(
        callbacks=_components(run, built, state, mfu, timeouts),
        evaluator=_evaluator(run, built, eval_loader, best, timeouts),
        saver=checkpoints,
    )
    install_faults(built.parts.root, env.rank, lambda: run.heartbeat.step)  # what LMTUNE_FAULT_* asks
    timer = PhaseTimer(env.device, timed=cfg.logging.profile, beat=run.heartbeat.beat)
    step = StepOptions(cfg.optim.max_grad_norm, built.autocast, timer, built.objective, built.token_seed)
    run_info = run_record(run, built, checkpoints, peak)
    stop_if_signalled(run.stop.pending() if state.step else 0, env)  # a resume stopped now keeps run.json
    log.write_json("run.json", run_info)
    # Opened once run.json names the folder a run's: a mistake found while the run is built (a bad
    # --sample-prompts file) left their files in a folder lmtune then refused as not a run's.
    if env.is_main:
        log.add_reporters(
            open_reporters(parse_report_to(cfg.logging.report_to), output_dir, to_dict(cfg), history)
        )
    result = fit(trainee, data, state, loop, FitSettings(env, step, run.stop, run.stop.before_first_step))
    if result.state.step == state.step:  # no step left to train here: the loss logged at that step
        result = replace(result, last_loss=loss_at(history, state.step))
    run_info["result"] = result_record(result, built, run) | {"wall_time_s": time.time() - started}
    peaks = run_info["result"]["peak_memory_per_rank"]
    log.info("peak memory per rank: " + ", ".join(f"{p / 2**20:,.0f} MiB" for p in peaks))
    log.write_json("run.json", run_info)
    last_eval = result.evals[-1] if result.evals else None
    done = TrainResult(output_dir, result.state.step, result.last_loss, last_eval)
    if result.stop == "signal":
        log.info(f"stopped at step {result.state.step}; {stop_advice(cfg.checkpoint, run.given is None)}")
        report_outcome(result.state.step, stopped=True, env=env, given=cfg.checkpoint)
        return replace(done, stopped_by="signal")
    finish(run, built, result, checkpoints, trained_from=state.step, record=run_info)
    run_info["result"]["finished"] = checkpoints.finished_record(result.state.step, built.layout.total_steps)
    log.write_json("run.json", run_info)
    report_outcome(result.state.step, stopped=False, env=env)
    return replace(done, **recorded_outcome(run_info["result"]))


def _checkpoints(
    run: RunContext, built: Built, best: BestTracker | None, timeouts: CollectiveTimeouts
) -> CheckpointManager:
    return CheckpointManager(
        output_dir=run.output_dir,
        settings=run.checkpointing,
        env=run.env,
        trainable=Trainable(built.parts, built.optimizer, built.tokenizer, built.scaler),
        fingerprint=built.fingerprint,
        log=run.log,
        records=[built.paths, *([best] if best is not None else [])],
        protected_step=lambda: best.best.step if best is not None and best.best is not None else None,
        patient=timeouts.patient,
        beat=run.heartbeat.beat,
    )


def _components(
    run: RunContext, built: Built, start: TrainerState, mfu: MfuMeter, timeouts: CollectiveTimeouts
) -> list[cb.Callback]:
    """The loop's components, in the order they see each step; a new one is one line here."""
    cfg, env, log = run.cfg, run.env, run.log
    components: list[cb.Callback | None] = [
        cb.HeartbeatStep(run.heartbeat),
        cb.NanPolicy(cfg.health.on_nan, log, run.output_dir),
        cb.StepLogger(log, cfg.logging.log_every, mfu, env.device),
        cb.ExampleOrder(ExampleOrderLog(run.output_dir, env.rank, start.step, built.train_data.sources))
        if cfg.logging.record_samples
        else None,
        cb.StragglerReport(log) if env.world_size > 1 else None,
        cb.CollectiveTimeoutSwitch(timeouts),
        sample_generator(run, built) if cfg.samples.prompts is not None else None,
        cb.EpochSummary(log),
        cb.SignalStop(log),
    ]
    return [c for c in components if c is not None]


def _evaluator(
    run: RunContext,
    built: Built,
    eval_loader: DataLoader[Any] | None,
    best: BestTracker | None,
    timeouts: CollectiveTimeouts,
) -> cb.Evaluator | None:
    if eval_loader is None:
        return None

    def run_eval() -> EvalResult:
        with timeouts.patient():
            beat = partial(run.heartbeat.beat, "eval")
            root, sharded = unwrap(built.model), built.parts.sharded
            sources = built.eval_data.sources if built.eval_data is not None else None
            return evaluate(
                root, eval_loader, run.env, built.autocast(), sharded, beat, built.objective, sources
            )

    return cb.Evaluator(run_eval, run.log, run.cfg.eval, best, unit=built.objective.unit)


sys.modules[__name__].__class__ = CallableModule  # lmtune.train(cfg) runs train(cfg)
