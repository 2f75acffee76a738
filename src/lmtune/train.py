"""train(cfg): the composition root. build -> resume -> fit -> record -> finalize, each in its module;
here they are put together, and the loop's components registered (one line each)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lmtune import callbacks as cb
from lmtune import faults
from lmtune.best import BEST_FILE, BestTracker, best_tracker
from lmtune.build import Built, Run, build, data_cache_dir, loaders, schedule
from lmtune.chat import stop_ids
from lmtune.checkpoint.layout import FINGERPRINT_FILE, SCALER_FILE
from lmtune.checkpoint.state import TrainerState
from lmtune.checkpoint.store import prune, save_checkpoint
from lmtune.config import TrainConfig, to_dict
from lmtune.data.prepare import cache_root
from lmtune.evaluate import EvalResult, evaluate
from lmtune.finish import finalize
from lmtune.generations import Sampler, SampleSettings, read_prompts
from lmtune.loop import FitSettings, fit
from lmtune.metrics import RunLog, SampleLog, read_metrics
from lmtune.model.paths import PATHS_FILE
from lmtune.model.precision import check_device
from lmtune.parallel.distributed import (
    CollectiveTimeouts,
    cpu_threads_per_process,
    process_group,
    read_dist_env,
)
from lmtune.parallel.health import Heartbeat
from lmtune.parallel.launch import report_stopped, warn
from lmtune.parallel.wrap import resolve_strategy, unwrap
from lmtune.perf import PEAKS_FILE, MfuMeter, PhaseTimer, Probe, best_peak_flops, train_flops_per_token
from lmtune.record import result_record, run_record
from lmtune.reporters import open_reporters, parse_report_to
from lmtune.resume import recorded_paths, resume_point, starting_state
from lmtune.rundir import acquire, prepare_output
from lmtune.step import StepOptions, Trainee
from lmtune.stopping import StopRequest
from lmtune.tools.doctor import DoctorSettings, check_or_fail
from lmtune.validate import validate


@dataclass(frozen=True)
class TrainResult:
    output_dir: Path
    steps: int
    last_loss: float
    eval: EvalResult | None
    stopped_early: bool = False


def train(cfg: TrainConfig) -> TrainResult:
    """Fine-tune ``cfg.model`` on ``cfg.data`` in this process (one rank of a launched job or alone).

    Raises:
        UserError: for invalid settings, data or paths.
        TrainingStopped: when training cannot go on (a non-finite loss with --on-nan stop).
    """
    env = read_dist_env(cfg.device)
    validate(cfg, env.world_size)
    check_device(cfg.precision, env.device)
    strategy = resolve_strategy(cfg.strategy, env)
    threads = cpu_threads_per_process(env, cfg.threads_per_process)
    if env.device.type == "cpu":
        torch.set_num_threads(threads)
    # Before anything is written: one run per folder (lmtune's launcher may hold it for the job).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    lock = acquire(Path(cfg.output_dir), run_id, warn) if env.is_main else nullcontext()
    heartbeat = Heartbeat.from_env(env.rank)
    try:
        with (
            lock,
            process_group(env),
            RunLog(env, Path(cfg.output_dir), cfg.progress) as log,
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
            )
            if cfg.doctor:
                cache = None if cfg.cache_per_node else str(data_cache_dir(cfg))  # node-local: not shared
                check_or_fail(
                    env,
                    DoctorSettings(
                        output_dir=cfg.output_dir, cache_dir=cache, data=cfg.data, model=cfg.model
                    ),
                )
            return _run(run)
    finally:
        heartbeat.close()


def _run(run: Run) -> TrainResult:
    cfg, env, log, output_dir = run.cfg, run.env, run.log, run.output_dir
    started = time.time()
    prepare_output(
        output_dir, resume=cfg.resume, overwrite=cfg.overwrite, config=to_dict(cfg), env=env, warn=warn
    )
    resume_from = resume_point(cfg, output_dir, env)
    b = build(run, recorded_paths(resume_from, env))  # a resumed run takes its checkpoint's paths
    state, resume_from = starting_state(
        cfg,
        env,
        b.fingerprint,
        examples=len(b.train_data),
        parts=b.parts,
        optimizer=b.optimizer,
        scaler=b.scaler,
        log=log,
        folder=resume_from,
    )
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
        log.add_reporters(open_reporters(parse_report_to(cfg.report_to), output_dir, to_dict(cfg), history))
    best = best_tracker(cfg, resume_from)
    data, eval_loader = loaders(run, b)
    peak = best_peak_flops(
        Probe(env.device, cfg.precision, run.threads, b.products.fp32),
        cache_root() / PEAKS_FILE if env.is_main else None,
    )
    mfu = MfuMeter(partial(train_flops_per_token, b.loaded.model), peak, env.world_size, log)
    components, evaluator = _components(run, b, state, best, mfu, eval_loader)
    faults.install_slow_or_stuck_rank(b.parts.root, env.rank, lambda: run.heartbeat.step)
    timer = PhaseTimer(env.device, timed=cfg.profile, beat=run.heartbeat.beat)
    settings = FitSettings(
        env=env,
        step=StepOptions(cfg.max_grad_norm, b.autocast, timer),
        stop_requested=run.stop,
        poison_step=faults.nan_step(),
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
    )
    if result.stop == "signal":
        log.info(f"stopped at step {result.state.step}; run the same command again to resume")
        if env.is_main:
            report_stopped(result.state.step)
        return replace(done, stopped_early=True)
    finalize(run, b, result, best, trained_from=state.step)
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
    timeouts = CollectiveTimeouts(env, cfg.collective_timeout)
    evaluator = None
    if eval_loader is not None:

        def run_eval() -> EvalResult:
            with timeouts.patient():
                beat = partial(run.heartbeat.beat, "eval")
                return evaluate(unwrap(b.model), eval_loader, env, b.autocast(), b.parts.sharded, beat)

        evaluator = cb.Evaluator(run_eval, log, cfg.eval_every, best)
    callbacks: list[cb.Callback | None] = [
        cb.NanPolicy(cfg.on_nan, log),
        cb.StepLogger(log, cfg.log_every, mfu, env.device),
        cb.ExampleOrder(SampleLog(run.output_dir, env.rank, start.step)) if cfg.record_samples else None,
        cb.StragglerReport(log) if env.world_size > 1 else None,
        cb.CollectiveTimeoutSwitch(timeouts),
        _sampler(run, b) if cfg.sample_prompts is not None else None,
        cb.EpochSummary(log),
        evaluator,
        cb.SignalStop(log),
        cb.Checkpointer(_saver(run, b, best, timeouts), cfg.save_every),
    ]
    return [c for c in callbacks if c is not None], evaluator


def _saver(
    run: Run, b: Built, best: BestTracker | None, timeouts: CollectiveTimeouts
) -> Callable[[TrainerState], None]:
    """Saves a checkpoint with the run's records; keeps the newest --keep-last and the best."""

    def save(at: TrainerState) -> None:
        records: dict[str, Any] = {FINGERPRINT_FILE: b.fingerprint.to_json(), PATHS_FILE: b.paths.to_json()}
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
            prune(run.output_dir, run.cfg.keep_last, protect)
        run.log.info(f"step {at.step}: saved checkpoint {path}")

    return save


def _sampler(run: Run, b: Built) -> Sampler:
    cfg = run.cfg
    assert cfg.sample_prompts is not None
    settings = SampleSettings(
        prompts=read_prompts(
            Path(cfg.sample_prompts).expanduser(), b.tokenizer, cfg.max_length - cfg.sample_max_new_tokens
        ),
        every=cfg.sample_every,
        max_new_tokens=cfg.sample_max_new_tokens,
        temperature=cfg.sample_temperature,
        seed=cfg.seed,
    )
    stops = stop_ids(b.loaded.model, b.tokenizer)
    return Sampler(
        settings, unwrap(b.model), b.tokenizer, stops, run.env, run.log, b.parts.sharded, b.autocast
    )
