"""check_settings(cfg, world_size): every setting's range and the combinations of settings, each
error naming its option; nothing is read from disk here (lmtune.training.preflight checks the
inputs the settings name).

Allowed values come from the fields' metadata (settings.py lists them once); the checks here are
the ranges and the combinations.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lmtune.config.settings import SAMPLE_DATA, TrainConfig, choices, config_fields, option_name, parse_nnodes
from lmtune.errors import UserError

Need = Callable[[bool, str, str], None]


def check_settings(cfg: TrainConfig, world_size: int) -> None:
    """Reject settings that cannot work, naming the option; ``world_size`` is the process count."""

    def need(ok: bool, name: str, why: str) -> None:
        if not ok:
            raise UserError(f"{option_name(name)}: {why} (got {getattr(cfg, name)!r})")

    for f in config_fields():
        allowed = choices(f.name)
        value = getattr(cfg, f.name)
        need(not allowed or value is None or value in allowed, f.name, f"must be one of {', '.join(allowed)}")
    _check_training(cfg, need)
    _check_data(cfg, need)
    _check_model(cfg, need)
    _check_evaluation(cfg, need)
    _check_processes(cfg, need)
    _check_outputs(cfg, need)
    _check_batch(cfg, world_size)


def _check_training(cfg: TrainConfig, need: Need) -> None:
    need(cfg.lr is None or cfg.lr > 0, "lr", "must be > 0")
    need(cfg.epochs is None or cfg.epochs >= 1, "epochs", "must be >= 1")
    need(cfg.max_steps is None or cfg.max_steps >= 1, "max_steps", "must be >= 1")
    need(cfg.global_batch_size >= 1, "global_batch_size", "must be >= 1")
    need(cfg.micro_batch_size is None or cfg.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
    need(0 <= cfg.seed < 2**32, "seed", "must be in [0, 2**32)")
    need(0 <= cfg.momentum < 1, "momentum", "must be in [0, 1)")
    need(0 <= cfg.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
    need(cfg.warmup_steps is None or cfg.warmup_steps >= 0, "warmup_steps", "must be >= 0")
    need(0 < cfg.decay_ratio <= 1, "decay_ratio", "must be in (0, 1]")
    need(0 <= cfg.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
    need(cfg.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(0 <= cfg.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
    need(0 <= cfg.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
    need(cfg.adam_eps > 0, "adam_eps", "must be > 0")
    need(cfg.max_grad_norm >= 0, "max_grad_norm", "must be >= 0")


def _check_data(cfg: TrainConfig, need: Need) -> None:
    need(bool(cfg.data.strip()), "data", "must name data")
    need(cfg.max_length >= 2, "max_length", "must be >= 2")
    need(bool(cfg.text_field), "text_field", "must not be empty")
    need(cfg.num_workers >= 0, "num_workers", "must be >= 0")
    need(cfg.eval_split is None or cfg.eval_data is None, "eval_split", "is instead of --eval-data: give one")
    need(
        cfg.eval_split is None or 0 < cfg.eval_split < 1 or float(cfg.eval_split).is_integer(),
        "eval_split",
        "must be a fraction in (0, 1) or a whole number of examples",
    )


def _check_model(cfg: TrainConfig, need: Need) -> None:
    need(bool(cfg.model.strip()), "model", "must name a model")
    need(cfg.lora_rank >= 1, "lora_rank", "must be >= 1")
    need(cfg.lora_alpha > 0, "lora_alpha", "must be > 0")
    need(0 <= cfg.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
    need(bool(cfg.lora_target_modules.strip(" ,")), "lora_target_modules", "must name modules or all-linear")
    need(cfg.lora or not cfg.merge_lora, "merge_lora", "needs --lora")
    need(cfg.loss_chunk_size is None or cfg.loss_chunk_size >= 0, "loss_chunk_size", "must be >= 0")


def _check_evaluation(cfg: TrainConfig, need: Need) -> None:
    need(cfg.eval_every >= 0, "eval_every", "must be >= 0")
    evaluates = cfg.eval_data is not None or cfg.eval_split is not None or cfg.data == SAMPLE_DATA
    need(cfg.metric_for_best is None or evaluates, "metric_for_best", "needs --eval-data or --eval-split")
    need(
        not cfg.load_best_at_end or cfg.metric_for_best is not None,
        "load_best_at_end",
        "needs --metric-for-best",
    )
    need(cfg.early_stopping_patience >= 0, "early_stopping_patience", "must be >= 0")
    need(
        not cfg.early_stopping_patience or (cfg.metric_for_best is not None and cfg.eval_every > 0),
        "early_stopping_patience",
        "needs --metric-for-best and --eval-every",
    )
    need(cfg.early_stopping_threshold >= 0, "early_stopping_threshold", "must be >= 0")
    need(cfg.sample_every >= 0, "sample_every", "must be >= 0")
    need(not cfg.sample_every or cfg.sample_prompts is not None, "sample_every", "needs --sample-prompts")
    need(cfg.sample_temperature >= 0, "sample_temperature", "must be >= 0")
    need(1 <= cfg.sample_max_new_tokens <= 4096, "sample_max_new_tokens", "must be in [1, 4096]")
    need(
        cfg.sample_prompts is None or cfg.sample_max_new_tokens < cfg.max_length,
        "sample_max_new_tokens",
        "must be below --max-length (a prompt and its generation stay within it)",
    )
    need(
        cfg.sample_prompts is None or Path(cfg.sample_prompts).expanduser().is_file(),
        "sample_prompts",
        "no such file",
    )


def _check_processes(cfg: TrainConfig, need: Need) -> None:
    need(cfg.nproc_per_node >= 1, "nproc_per_node", "must be >= 1")
    need(cfg.threads_per_process >= 0, "threads_per_process", "must be >= 0")
    need(cfg.max_restarts >= 0, "max_restarts", "must be >= 0")
    need(cfg.node_rank is None or cfg.node_rank >= 0, "node_rank", "must be >= 0")
    nodes = parse_nnodes(cfg.nnodes)
    need(
        cfg.rdzv_endpoint is not None or nodes[1] == 1,
        "rdzv_endpoint",
        "is needed when --nnodes is more than 1",
    )
    need(cfg.hang_timeout >= 0, "hang_timeout", "must be >= 0 (0: no watchdog)")
    need(cfg.collective_timeout >= 10, "collective_timeout", "must be >= 10 seconds")


def _check_outputs(cfg: TrainConfig, need: Need) -> None:
    need(bool(cfg.output_dir.strip()), "output_dir", "must name a folder")
    need(cfg.save_every >= 0, "save_every", "must be >= 0")
    need(cfg.keep_last >= 0, "keep_last", "must be >= 0")
    need(cfg.log_every >= 1, "log_every", "must be >= 1")
    if cfg.resume not in ("auto", "never") and not Path(cfg.resume).is_dir():
        raise UserError(f"--resume: no such checkpoint folder: {cfg.resume}")


def _check_batch(cfg: TrainConfig, world_size: int) -> None:
    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    if cfg.micro_batch_size is None:
        if cfg.global_batch_size % world_size:
            raise UserError(
                f"--global-batch-size {cfg.global_batch_size} does not divide over {processes}; "
                f"use a multiple of {world_size}"
            )
    elif cfg.global_batch_size % (cfg.micro_batch_size * world_size):
        per_step = cfg.micro_batch_size * world_size
        raise UserError(
            f"--global-batch-size {cfg.global_batch_size} does not divide into "
            f"--micro-batch-size {cfg.micro_batch_size} x {processes}; use a multiple of {per_step}"
        )
