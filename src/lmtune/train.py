"""train(cfg): the composition root. build -> resume -> fit -> record -> finalize, each in its module;
here they are put together, and the loop's components registered (one line each)."""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lmtune.checkpoint.layout import FINGERPRINT_FILE, SCALER_FILE
from lmtune.checkpoint.resume import starting_state
from lmtune.checkpoint.rundir import acquire, prepare_output
from lmtune.checkpoint.state import TrainerState
from lmtune.checkpoint.store import prune, save_checkpoint
from lmtune.config.settings import TrainConfig, to_dict
from lmtune.data.prepare import cache_root
from lmtune.model.precision import check_device
from lmtune.model.products import choose_products
from lmtune.model.tokens import stop_ids
from lmtune.outputs.hub import check_push, push_final
from lmtune.outputs.reporters import open_reporters, parse_report_to
from lmtune.outputs.runlog import RunLog, SampleLog, read_metrics
from lmtune.parallel.distributed import (
    CollectiveTimeouts,
    cpu_threads_per_process,
    process_group,
    read_dist_env,
)
from lmtune.parallel.health import Heartbeat
from lmtune.parallel.launch import report_stopped, warn
from lmtune.parallel.wrap import resolve_strategy, unwrap
from lmtune.testing.faults import requested as faults_requested
from lmtune.tools.doctor import DoctorSettings, check_or_fail
from lmtune.training import callbacks as cb
from lmtune.training.best import BEST_FILE, BestTracker, best_tracker
from lmtune.training.build import Built, Run, build, data_cache_dir, loaders, schedule
from lmtune.training.evaluate import EvalResult, evaluate
from lmtune.training.finish import finalize
from lmtune.training.loop import FitSettings, fit
from lmtune.training.optim import set_hyperparameters
from lmtune.training.perf import (
    PEAKS_FILE,
    MfuMeter,
    PhaseTimer,
    Probe,
    best_peak_flops,
    train_flops_per_token,
)
from lmtune.training.preflight import validate
from lmtune.training.record import result_record, run_record
from lmtune.training.samples import SamplePlan, Sampler, read_prompts
from lmtune.training.signals import StopRequest
from lmtune.training.step import StepOptions, Trainee


@dataclass(frozen=True)
class TrainResult:
    output_dir: Path
    steps: int
    last_loss: float
    eval: EvalResult | None
    stopped_by: str | None = None  # signal | early_stopping: ended before its last step


def train(cfg: TrainConfig) -> TrainResult:
    """Fine-tune ``cfg.model.name`` on ``cfg.data.train`` in this process (a rank of a job, or alone).

    Raises:
        UserError: for invalid settings, data or paths.
        TrainingStopped: when training cannot go on (a non-finite loss with --on-nan stop).
    """
    env = read_dist_env(cfg.model.device)
    validate(cfg, env.world_size)
    if cfg.checkpoint.push_to_hub is not None and env.is_main:  # the rank that uploads, at the end
        check_push(cfg.checkpoint.push_to_hub)  # a missing token is found now, not after training
    check_device(cfg.model.precision, env.device)
    strategy = resolve_strategy(cfg.launch.strategy, env)
    threads = cpu_threads_per_process(env, cfg.launch.threads_per_process)
    if env.device.type == "cpu":
        torch.set_num_threads(threads)
    # Before anything is written: one run per folder (lmtune's launcher may hold it for the job).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    lock = acquire(Path(cfg.checkpoint.output_dir), run_id, warn) if env.is_main else nullcontext()
    heartbeat = Heartbeat.from_env(env.rank)
    try:
        with (
            lock,
            process_group(env),
            RunLog(env, Path(cfg.checkpoint.output_dir), cfg.logging.progress) as log,
            StopRequest() as stop,
        ):
            run = Run(
                cfg=cfg,
                env=env,
                strategy=strategy,
                threads=threads,
                log=log,
                stop=stop,
                heartbeat=heartbeat,
                products=choose_products(cfg.model.precision, env.device, cfg.model.compile),
            )
            if cfg.health.doctor:
                cache = (
                    None if cfg.data.cache_per_node else str(data_cache_dir(cfg.data))
                )  # node-local: not shared
                check_or_fail(
                    env,
                    DoctorSettings(
                        output_dir=cfg.checkpoint.output_dir,
                        cache_dir=cache,
                        data=cfg.data.train,
                        model=cfg.model.name,
                    ),
                )
            return _run(run)
    finally:
        heartbeat.close()


def _run(run: Run) -> TrainResult:
    cfg, env, log, output_dir = run.cfg, run.env, run.log, run.output_dir
    started = time.time()
    prepare_output(
        output_dir,
        resume=cfg.checkpoint.resume,
        overwrite=cfg.checkpoint.overwrite,
        config=to_dict(cfg),
        env=env,
        warn=warn,
    )
    b = build(run)
    state, resume_from = starting_state(
        cfg,
        env,
        b.fingerprint,
        examples=len(b.train_data),
        parts=b.parts,
        optimizer=b.optimizer,
        scaler=b.scaler,
        log=log,
    )
    # A loaded optimizer state brings the saved hyperparameters back; this run's settings rule.
    set_hyperparameters(b.optimizer, cfg.optim)
    if resume_from is not None and state.step >= b.layout.total_steps and (output_dir / "final").is_dir():
        log.info(
            f"{output_dir} holds a finished run (step {state.step} of {b.layout.total_steps}; the model "
            f"is in {output_dir / 'final'}): nothing to do. Raise --max-steps or --epochs to train on"
        )
        return TrainResult(output_dir=output_dir, steps=state.step, last_loss=float("nan"), eval=None)
    trainee = Trainee(
        model=b.model, optimizer=b.optimizer, scheduler=schedule(cfg, b, state.step), scaler=b.scaler
    )
    log.open_metrics(state.step)
    if env.is_main:  # a resumed run's history too (metrics.jsonl keeps the rows up to its checkpoint)
        history = read_metrics(output_dir, kind=None) if state.step else []
        log.add_reporters(
            open_reporters(parse_report_to(cfg.logging.report_to), output_dir, to_dict(cfg), history)
        )
    best = best_tracker(cfg, resume_from)
    data, eval_loader = loaders(run, b)
    peak = best_peak_flops(
        Probe(env.device, cfg.model.precision, run.threads, run.products.fp32),
        cache_root() / PEAKS_FILE if env.is_main else None,
    )
    mfu = MfuMeter(partial(train_flops_per_token, b.loaded.model), peak, env.world_size, log)
    components, evaluator = _components(run, b, state, best, mfu, eval_loader)
    if faults_requested():
        from lmtune.testing.faults import install

        install(b.parts.root, env.rank, lambda: run.heartbeat.step)
    timer = PhaseTimer(env.device, timed=cfg.logging.profile, beat=run.heartbeat.beat)
    settings = FitSettings(
        env=env,
        step=StepOptions(cfg.optim.max_grad_norm, run.autocast, timer),
        stop_requested=run.stop,
        heartbeat=run.heartbeat,
    )
    run_info = run_record(run, b, resume_from, peak)
    log.write_json("run.json", run_info)
    result = fit(trainee, data, state, components, settings)
    run.heartbeat.beat("save")
    evals = evaluator.evals if evaluator is not None else []
    run_info["result"] = result_record(result, evals, best, b.optimizer, env) | {
        "wall_time_s": time.time() - started
    }
    peaks = run_info["result"]["peak_memory_per_rank"]
    log.info("peak memory per rank: " + ", ".join(f"{p / 2**20:,.0f} MiB" for p in peaks))
    log.write_json("run.json", run_info)
    done = TrainResult(
        output_dir=output_dir,
        steps=result.state.step,
        last_loss=result.last_loss,
        eval=evals[-1] if evals else None,
        stopped_by=run_info["result"]["stopped_by"],
    )
    if result.stop == "signal":
        log.info(f"stopped at step {result.state.step}; run the same command again to resume")
        if env.is_main:
            report_stopped(result.state.step)
        return done
    finalize(run, b, result, best, trained_from=state.step)
    if cfg.checkpoint.push_to_hub is not None and env.is_main:
        run.heartbeat.beat("upload")  # as long as the network takes: not watched as a hang
        push_final(output_dir, cfg.checkpoint, cfg.lora.merge, log)
    return done


def _components(
    run: Run,
    b: Built,
    start: TrainerState,
    best: BestTracker | None,
    mfu: MfuMeter,
    eval_loader: DataLoader[Any] | None,
) -> tuple[list[cb.Callback], cb.Evaluator | None]:
    """The loop's components, in the order they see each step; a new one is one line here."""
    cfg, env, log = run.cfg, run.env, run.log
    timeouts = CollectiveTimeouts(env, cfg.health.collective_timeout)
    evaluator = None
    if eval_loader is not None:

        def run_eval() -> EvalResult:
            with timeouts.patient():
                beat = partial(run.heartbeat.beat, "eval")
                return evaluate(unwrap(b.model), eval_loader, env, run.autocast(), b.parts.sharded, beat)

        evaluator = cb.Evaluator(run_eval, log, cfg.eval.every, best)
    callbacks: list[cb.Callback | None] = [
        cb.NanPolicy(cfg.health.on_nan, log),
        cb.StepLogger(log, cfg.logging.log_every, mfu, env.device),
        cb.ExampleOrder(SampleLog(run.output_dir, env.rank, start.step))
        if cfg.logging.record_samples
        else None,
        cb.StragglerReport(log) if env.world_size > 1 else None,
        cb.CollectiveTimeoutSwitch(timeouts),
        _sampler(run, b) if cfg.samples.prompts is not None else None,
        cb.EpochSummary(log),
        evaluator,
        cb.SignalStop(log),
        cb.Checkpointer(_saver(run, b, best, timeouts), cfg.checkpoint.save_every),
    ]
    return [c for c in callbacks if c is not None], evaluator


def _saver(
    run: Run, b: Built, best: BestTracker | None, timeouts: CollectiveTimeouts
) -> Callable[[TrainerState], None]:
    """Saves a checkpoint with the run's records; keeps the newest --keep-last and the best."""

    def save(at: TrainerState) -> None:
        records: dict[str, Any] = {FINGERPRINT_FILE: b.fingerprint.to_json()}
        if best is not None:
            records[BEST_FILE] = best.to_json()
        if b.scaler is not None:
            records[SCALER_FILE] = b.scaler.state_dict()
        with timeouts.patient():
            path = save_checkpoint(
                run.output_dir, at, b.parts, b.tokenizer, b.optimizer, run.env, keep_last=0, records=records
            )
        if run.env.is_main:
            protect = Path(best.best.checkpoint) if best is not None and best.best is not None else None
            prune(run.output_dir, run.cfg.checkpoint.keep_last, protect)
        run.log.info(f"step {at.step}: saved checkpoint {path}")

    return save


def _sampler(run: Run, b: Built) -> Sampler:
    cfg = run.cfg
    assert cfg.samples.prompts is not None
    room = cfg.examples.max_length - cfg.samples.max_new_tokens
    prompts = read_prompts(Path(cfg.samples.prompts).expanduser(), b.tokenizer, room)
    settings = SamplePlan(prompts=prompts, settings=cfg.samples, seed=cfg.seed)
    stops = stop_ids(b.loaded.model, b.tokenizer)
    return Sampler(
        settings, unwrap(b.model), b.tokenizer, stops, run.env, run.log, b.parts.sharded, run.autocast
    )


class _CallableModule(types.ModuleType):
    """``lmtune.train`` names this module and its :func:`train`: once the module is imported, Python
    binds the name to the module, so calling it runs :func:`train` (``lmtune.train(cfg)`` works
    whichever of the two the name holds)."""

    def __call__(self, cfg: TrainConfig) -> TrainResult:
        return train(cfg)


sys.modules[__name__].__class__ = _CallableModule
