"""train(config): the composition root that builds every part and runs fit."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lmtune import faults
from lmtune.attention import attention_description
from lmtune.best import BEST_FILE, BestTracker
from lmtune.build import (
    BATCHING_NAMES,
    apply_chat_template_option,
    autocast_context,
    batching_of,
    build_model,
    data_cache_dir,
    environment_info,
    make_loader,
    prepare_data,
)
from lmtune.chat import end_of_turn_ids, set_stop_tokens, stop_ids
from lmtune.checkpoint import (
    FINGERPRINT_FILE,
    TrainerState,
    load_checkpoint,
    save_checkpoint,
    save_final,
    save_hf_folder,
)
from lmtune.config import (
    SAMPLE_DATA,
    TrainConfig,
    epochs,
    micro_batch_size,
    to_dict,
    validate,
    warmup_steps,
)
from lmtune.data.collate import Collator, StepCollator
from lmtune.data.prepare import cache_root
from lmtune.data.sample import addition_examples, split_prompt
from lmtune.data.sampling import EvalSampler, TrainSampler
from lmtune.distributed import (
    CollectiveTimeouts,
    DistEnv,
    all_gather_object,
    barrier,
    cpu_threads_per_process,
    process_group,
    read_dist_env,
)
from lmtune.doctor import DoctorSettings, check_or_fail
from lmtune.errors import UserError
from lmtune.evaluate import EvalResult, evaluate
from lmtune.generate import complete
from lmtune.generations import Sampler, SampleSettings, read_prompts
from lmtune.health import Heartbeat, StragglerWatch
from lmtune.launch import report_stopped, warn
from lmtune.loop import FitHooks, fit, plan_steps
from lmtune.lora import merged_model
from lmtune.metrics import RunLog, SampleLog, read_metrics
from lmtune.modeling import load_model
from lmtune.optim import build_optimizer, build_schedule, optimizer_state_bytes
from lmtune.parallel import resolve_strategy, unwrap
from lmtune.perf import (
    PEAKS_FILE,
    PhaseTimer,
    best_peak_flops,
    peak_memory_bytes,
    train_flops_per_token,
)
from lmtune.reporters import open_reporters, parse_report_to
from lmtune.resume import continue_from, fingerprint, resume_point
from lmtune.rundir import acquire, prepare_output
from lmtune.step import StepResult
from lmtune.stopping import StopRequest

LORA_MIN_DEFAULT_LR = 2e-4


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
    if cfg.precision == "fp16" and env.device.type != "cuda":
        raise UserError(
            "--precision fp16 needs a CUDA GPU (its gradient scaler is for GPUs); use bf16 on CPU"
        )
    strategy = resolve_strategy(cfg.strategy, env)
    threads = cpu_threads_per_process(env, cfg.threads_per_process)
    if env.device.type == "cpu":
        torch.set_num_threads(threads)
    output_dir = Path(cfg.output_dir)
    # Before anything is written: one run per folder (lmtune's launcher may hold it for the job).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    lock = acquire(output_dir, run_id, warn) if env.is_main else nullcontext()
    heartbeat = Heartbeat.from_env(env.rank)
    try:
        with lock, process_group(env), RunLog(env, output_dir, cfg.progress) as log, StopRequest() as stop:
            if cfg.doctor:
                cache = None if cfg.cache_per_node else str(data_cache_dir(cfg))  # node-local: not shared
                settings = DoctorSettings(cfg.output_dir, cache, cfg.data, cfg.model)
                check_or_fail(env, settings)
            return _run(cfg, env, strategy, threads, output_dir, log, stop, heartbeat)
    finally:
        heartbeat.close()


def _run(
    cfg: TrainConfig,
    env: DistEnv,
    strategy: str,
    threads: int,
    output_dir: Path,
    log: RunLog,
    stop: StopRequest,
    heartbeat: Heartbeat,
) -> TrainResult:
    started = time.time()
    prepare_output(
        output_dir, resume=cfg.resume, overwrite=cfg.overwrite, config=to_dict(cfg), env=env, warn=warn
    )
    heartbeat.beat("load")
    loaded = load_model(cfg.model, cfg.seed, cfg.trust_remote_code)
    tokenizer = loaded.tokenizer
    if cfg.chat_template is not None:
        apply_chat_template_option(cfg, loaded.model, tokenizer, log)
    heartbeat.beat("data-prep")
    train_data, eval_data, data_info = prepare_data(cfg, tokenizer, env, log, stop.raise_if_requested)
    heartbeat.beat("load")
    if "messages" in data_info["train"]["formats"]:
        # The reply's end-of-turn token trains; saved models must also stop generating there.
        stops = set_stop_tokens(loaded.model, tokenizer, end_of_turn_ids(tokenizer))
        log.info(f"chat data: saved models stop at {tokenizer.convert_ids_to_tokens(stops)}")
    micro = micro_batch_size(cfg, env.world_size)
    plan = plan_steps(
        len(train_data), cfg.global_batch_size, micro, env.world_size, epochs(cfg), cfg.max_steps, cfg.data
    )
    # Adapters start at zero and need a larger step than full fine-tuning of pretrained weights.
    default_lr = max(loaded.default_lr, LORA_MIN_DEFAULT_LR) if cfg.lora else loaded.default_lr
    lr = cfg.lr if cfg.lr is not None else default_lr
    model, parts, loss = build_model(cfg, loaded.model, strategy, env, log)
    loss_module, trained = parts.root, parts.model
    # After wrapping: FSDP2 replaces the parameters by their shards, which the optimizer must hold.
    optimizer = build_optimizer(
        cfg.optimizer,
        loss_module,
        lr,
        cfg.weight_decay,
        (cfg.adam_beta1, cfg.adam_beta2),
        cfg.adam_eps,
        cfg.momentum,
    )
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    run_fp = fingerprint(
        cfg,
        data_key=data_info["train"]["key"],
        examples=len(train_data),
        model_config=loaded.model.config,
        lr=lr,
        total_steps=plan.total_steps,
    )
    state = TrainerState(
        step=0,
        epoch=0,
        step_in_epoch=0,
        global_batch_size=cfg.global_batch_size,
        world_size=env.world_size,
        seed=cfg.seed,
        examples=len(train_data),
    )
    resume_from = resume_point(cfg, output_dir, env)
    if resume_from is not None:
        state = continue_from(
            resume_from,
            now=run_fp,
            cfg=cfg,
            parts=parts,
            optimizer=optimizer,
            env=env,
            scaler=scaler,
            log=log,
        )
        if state.step >= plan.total_steps and (output_dir / "final").is_dir():
            log.info(
                f"{output_dir} holds a finished run (step {state.step} of {plan.total_steps}; the model "
                f"is in {output_dir / 'final'}): nothing to do. Raise --max-steps or --epochs to train on"
            )
            return TrainResult(output_dir, state.step, float("nan"), None)
    scheduler = build_schedule(
        optimizer,
        name=cfg.lr_schedule,
        total_steps=plan.total_steps,
        warmup_steps=warmup_steps(cfg, plan.total_steps),
        min_ratio=cfg.min_lr_ratio,
        decay_ratio=cfg.decay_ratio,
        lr=lr,
        start_step=state.step,
    )
    log.open_metrics(state.step)
    if env.is_main:
        names = parse_report_to(cfg.report_to)
        # A resumed run's history (metrics.jsonl keeps the rows up to its checkpoint).
        history = read_metrics(output_dir, kind=None) if state.step else []
        log.add_reporters(open_reporters(names, output_dir, to_dict(cfg), history))

    batching = batching_of(cfg, data_info["train"]["formats"])
    step_collate = StepCollator(tokenizer.pad_token_id, micro, batching, cfg.max_length)
    sampler = TrainSampler(
        len(train_data),
        cfg.global_batch_size,
        env.rank,
        env.world_size,
        cfg.seed,
        train_data.lengths().tolist(),
    )
    # One loader item is one rank's share of one optimizer step, already cut into micro-batches.
    loader = make_loader(
        train_data, sampler, cfg.global_batch_size // env.world_size, step_collate, env, cfg.num_workers
    )
    autocast = partial(autocast_context, cfg.precision, env.device)
    timeouts = CollectiveTimeouts(env, cfg.collective_timeout)
    run_eval: Callable[[], EvalResult] | None = None
    if eval_data is not None:
        eval_sampler = EvalSampler(len(eval_data), env.rank, env.world_size)
        eval_loader = make_loader(eval_data, eval_sampler, micro, Collator(tokenizer.pad_token_id), env, 0)

        def run_eval() -> EvalResult:
            with timeouts.patient():
                beat = partial(heartbeat.beat, "eval")
                return evaluate(unwrap(model), eval_loader, env, autocast(), parts.sharded, beat)

    best = None
    if cfg.metric_for_best is not None:
        best = BestTracker(
            cfg.metric_for_best,
            cfg.greater_is_better,
            cfg.early_stopping_patience,
            cfg.early_stopping_threshold,
        )
        if resume_from is not None:
            best.restore(resume_from)

    def save(at: TrainerState) -> None:
        with timeouts.patient():
            _save(at)

    def _save(at: TrainerState) -> None:
        records: dict[str, Any] = {FINGERPRINT_FILE: run_fp.to_json()}
        if best is not None:
            records[BEST_FILE] = best.to_json()
        path = save_checkpoint(
            output_dir,
            at,
            parts,
            tokenizer,
            optimizer,
            env,
            keep_last=cfg.keep_last,
            records=records,
            scaler=scaler,
            protect=Path(best.best.checkpoint) if best is not None and best.best is not None else None,
        )
        log.info(f"step {at.step}: saved checkpoint {path}")

    samples = SampleLog(output_dir, env.rank, state.step) if cfg.record_samples else None
    flops_per_token = partial(train_flops_per_token, loaded.model)
    peak = best_peak_flops(
        env.device, cfg.precision, threads, cache_root() / PEAKS_FILE if env.is_main else None
    )
    over_peak: list[float] = []  # MFU readings above 100%, warned about once

    def mfu(r: StepResult, seconds: float) -> float | None:
        """Model FLOPs per second of this step over the measured peak of all devices; None (and a
        warning) where that is over 100%: the peak was measured low, not the step faster than it."""
        mean_length = r.tokens / max(r.examples, 1)
        value = flops_per_token(round(mean_length)) * r.tokens / max(seconds, 1e-9) / (peak * env.world_size)
        if value <= 1.0:
            return value
        if not over_peak:
            log.info(
                f"warning: MFU would read {100 * value:.0f}%: the matmul peak measured at start "
                f"({peak / 1e9:,.1f} GFLOP/s) is below what this step reached (measured while the machine "
                "was busy?); MFU is left out. Re-measure it: lmtune bench --measure-peak"
            )
        over_peak.append(value)
        return None

    faults.install_slow_or_stuck_rank(loss_module, env.rank, lambda: heartbeat.step)
    timer = PhaseTimer(env.device, timed=cfg.profile, beat=heartbeat.beat)
    after_step: list[Callable[[TrainerState, bool], None]] = [timeouts]
    if cfg.sample_prompts is not None:
        sample_settings = SampleSettings(
            prompts=read_prompts(
                Path(cfg.sample_prompts).expanduser(), tokenizer, cfg.max_length - cfg.sample_max_new_tokens
            ),
            every=cfg.sample_every,
            max_new_tokens=cfg.sample_max_new_tokens,
            temperature=cfg.sample_temperature,
            seed=cfg.seed,
        )
        stops = stop_ids(loaded.model, tokenizer)
        after_step.append(
            Sampler(sample_settings, unwrap(model), tokenizer, stops, env, log, parts.sharded, autocast)
        )
    hooks = FitHooks(
        autocast=autocast,
        run_eval=run_eval,
        save=save,
        record_samples=samples,
        stop_requested=stop,
        poison_step=faults.nan_step(),
        scaler=scaler,
        mfu=mfu,
        timer=timer,
        best=best,
        after_step=tuple(after_step),
        heartbeat=heartbeat,
        stragglers=StragglerWatch() if env.world_size > 1 else None,
    )

    run_info: dict[str, Any] = {
        "config": to_dict(cfg),
        "resolved": {
            "strategy": strategy,
            "micro_batch_size": micro,
            "batching": batching,
            "attention": attention_description(loaded.model) if loss_module.varlen else "masked",
            "loss": loss.description,
            "lr": lr,
            "model_source": loaded.source,
            **asdict(plan),
            "parameters": _count(loaded.model.parameters()),
            "trainable_parameters": _count(p for p in loss_module.parameters() if p.requires_grad),
            "resumed_from": str(resume_from) if resume_from else None,
            "peak_flops_per_device": peak,
        },
        "data": data_info,
        "environment": environment_info(env, threads),
    }
    log.write_json("run.json", run_info)
    log.info(
        f"lmtune: {loaded.source}, {run_info['resolved']['parameters']:,} parameters, {strategy} on "
        f"{env.world_size} x {env.device.type}; global batch "
        f"{cfg.global_batch_size} = {micro} x {env.world_size} x {plan.accumulation} "
        f"accumulation ({BATCHING_NAMES[batching]}, {run_info['resolved']['attention']} attention); "
        f"{plan.total_steps} steps; loss: {loss.description}"
    )
    try:
        result = fit(
            model,
            optimizer,
            scheduler,
            loader,
            sampler,
            plan,
            env,
            log,
            state,
            hooks,
            cfg.max_grad_norm,
            cfg.on_nan,
            cfg.eval_every,
            cfg.save_every,
            cfg.log_every,
        )
    finally:
        if samples is not None:
            samples.close()
    timeouts.end()
    heartbeat.beat("save")
    final_eval = result.evals[-1] if result.evals else None
    peaks = all_gather_object(peak_memory_bytes(env.device), env)
    log.info("peak memory per rank: " + ", ".join(f"{p / 2**20:,.0f} MiB" for p in peaks))
    run_info["result"] = {
        "peak_memory_per_rank": peaks,
        "optimizer_state_bytes_per_rank": all_gather_object(optimizer_state_bytes(optimizer), env),
        "steps": result.steps,
        "last_loss": result.last_loss,
        "skipped_steps": result.skipped_steps,
        "stopped_early": result.stopped_early,
        "early_stopped": result.early_stopped,
        "best": asdict(best.best) if best is not None and best.best is not None else None,
        "eval": asdict(final_eval) if final_eval else None,
        "wall_time_s": time.time() - started,
    }
    log.write_json("run.json", run_info)
    if result.stopped_early:
        log.info(f"stopped at step {result.steps}; run the same command again to resume")
        if env.is_main:
            report_stopped(result.steps)
        return TrainResult(output_dir, result.steps, result.last_loss, final_eval, stopped_early=True)
    final_dir = output_dir / "final"
    trained_here = (
        f"loss {result.last_loss:.4f} at step {result.steps}"
        if result.steps > state.step
        else f"step {result.steps}, no steps left to train"
    )
    if cfg.load_best_at_end and best is not None and best.best is not None and best.best.step != result.steps:
        load_checkpoint(Path(best.best.checkpoint), parts, optimizer, env, scaler)
        trained_here = f"the best model: step {best.best.step}, {best.best.metric} {best.best.value:.4f}"
    save_final(parts, tokenizer, final_dir, env)
    what = "LoRA adapter (PEFT format)" if cfg.lora else "model"
    log.info(f"saved the {what} to {final_dir} ({trained_here})")
    if cfg.merge_lora and env.is_main:
        merged = merged_model(load_model(cfg.model, cfg.seed, cfg.trust_remote_code).model, final_dir)
        save_hf_folder(merged, tokenizer, final_dir / "merged")
        log.info(f"saved the base model with the adapter merged to {final_dir / 'merged'}")
    barrier(env)
    if env.is_main and cfg.data == SAMPLE_DATA:
        answering = _final_model(cfg, final_dir) if parts.sharded else trained
        _show_answers(answering, tokenizer, addition_examples()[1], log)
    return TrainResult(output_dir, result.steps, result.last_loss, final_eval)


def _count(params: Iterable[torch.nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def _final_model(cfg: TrainConfig, final_dir: Path) -> torch.nn.Module:
    """The trained model read back from ``final/`` (under FSDP no rank holds it whole)."""
    if cfg.lora:
        return merged_model(load_model(cfg.model, cfg.seed, cfg.trust_remote_code).model, final_dir)
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(final_dir)
    return model


def _show_answers(model: torch.nn.Module, tokenizer: Any, texts: list[str], log: RunLog, n: int = 50) -> None:
    """The demo's proof of learning: answer held-out sums the model never trained on."""
    right = 0
    lines: list[str] = []
    for text in texts[:n]:
        prompt, expected = split_prompt(text)
        got = complete(model, tokenizer, prompt, max_new_tokens=8)
        right += got == expected
        if len(lines) < 5:
            lines.append(f"  {prompt}{got:<4} {'ok' if got == expected else 'expected ' + expected}")
    log.info(f"held-out answers: {right}/{n} correct\n" + "\n".join(lines))
