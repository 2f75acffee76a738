"""What train() is built from: data, loaders, the model with its memory savers, strategy and loss.

Each function takes the run's settings and returns one part; train.py composes them.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lmtune import __version__
from lmtune.attention import use_varlen
from lmtune.chat import fit_embeddings, use_chat_template
from lmtune.checkpoint import ModelParts
from lmtune.chunked_loss import LossChoice
from lmtune.chunked_loss import choose as choose_loss
from lmtune.config import SAMPLE_DATA, TrainConfig
from lmtune.data.dataset import TokenizedDataset, split_off
from lmtune.data.prepare import DataSettings, default_cache_dir, prepare
from lmtune.data.sources import SAMPLE_EVAL
from lmtune.data.tokenize import EncodeStats
from lmtune.distributed import DistEnv, all_gather_object
from lmtune.errors import UserError
from lmtune.lora import LoraSettings, add_lora
from lmtune.loss import SummedLoss
from lmtune.metrics import InfoLog, RunLog
from lmtune.parallel import wrap_model
from lmtune.perf import low_precision_dtype


def autocast_context(precision: str, device: torch.device) -> AbstractContextManager[object]:
    dtype = low_precision_dtype(precision)
    return nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def checkpoint_activations(model: torch.nn.Module, name: str) -> None:
    """Per-block activation checkpointing, non-reentrant: the reentrant variant runs backward
    hooks twice and DDP then sees parameters "marked ready twice"."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"--activation-checkpointing: {name} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def compile_model(model: torch.nn.Module, log: RunLog) -> None:
    """torch.compile in place (parameter names unchanged, so checkpoints stay the same)."""
    import torch._dynamo

    # A graph that fails to compile at its first call runs eagerly instead of ending the run.
    torch._dynamo.config.suppress_errors = True
    try:
        model.compile()
    except Exception as e:  # compile support differs by platform and model; eager always works
        log.info(f"--compile: torch.compile is not available here ({type(e).__name__}: {e}); running eagerly")


def _eval_spec(cfg: TrainConfig) -> str | None:
    if cfg.eval_data is None and cfg.data == SAMPLE_DATA and cfg.eval_split is None:
        return SAMPLE_EVAL
    return cfg.eval_data


def data_cache_dir(cfg: TrainConfig) -> Path:
    """--cache-dir, else lmtune's default cache of tokenized data."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def prepare_data(
    cfg: TrainConfig,
    tokenizer: Any,
    env: DistEnv,
    log: InfoLog,
    check_stop: Callable[[], None] = lambda: None,
) -> tuple[TokenizedDataset, TokenizedDataset | None, dict[str, Any]]:
    """Tokenize (or read from the cache) the training and evaluation data; report what was done."""
    settings = DataSettings(
        format=cfg.data_format,
        text_field=cfg.text_field,
        max_length=cfg.max_length,
        truncation=cfg.truncation,
        skip_bad_lines=cfg.skip_bad_lines,
        txt_mode=cfg.txt_mode,
        train_on_prompt=cfg.train_on_prompt,
    )
    cache_dir = data_cache_dir(cfg)
    info: dict[str, Any] = {}
    prepared: dict[str, TokenizedDataset] = {}
    for name, spec, option in (("train", cfg.data, "--data"), ("eval", _eval_spec(cfg), "--eval-data")):
        if spec is None:
            continue
        p = prepare(spec, tokenizer, settings, env, cache_dir, cfg.cache_per_node, option, check_stop)
        builders = [r for r, built in enumerate(all_gather_object(p.built, env)) if built]
        meta = p.dataset.meta
        info[name] = {
            "spec": spec,
            "cache": str(p.folder),
            "key": p.key,
            "built_by_ranks": builders,
            **{k: meta[k] for k in (*(f.name for f in fields(EncodeStats)), "bad_lines")},
        }
        how = f"tokenized in {meta['build_seconds']:.1f}s" if builders else "from the cache"
        log.info(
            f"{name} data {spec}: {meta['examples']:,} examples, {meta['tokens']:,} tokens ({how}); "
            f"{meta['truncated']} truncated, {meta['dropped_too_long']} dropped as too long, "
            f"{meta['dropped_no_targets']} dropped with no trainable tokens"
            + (f", {meta['bad_lines']} bad lines skipped" if meta["bad_lines"] else "")
        )
        for message in meta["bad_line_examples"][:5] if builders else []:
            log.info(f"  skipped: {message}")
        prepared[name] = p.dataset
    if cfg.eval_split is not None:
        try:
            prepared["train"], prepared["eval"] = split_off(prepared["train"], cfg.eval_split, cfg.seed)
        except ValueError as e:
            raise UserError(f"--eval-split {cfg.eval_split}: {e}") from None
        info["eval"] = {"spec": f"--eval-split {cfg.eval_split}", "examples": len(prepared["eval"])}
        log.info(f"eval data: {len(prepared['eval']):,} examples of --data held out (--eval-split)")
    return prepared["train"], prepared.get("eval"), info


BATCHING_NAMES = {
    "pack": "packed rows",
    "auto": "packed where it saves padding",
    "group": "grouped by length",
    "pad": "padded",
}


def batching_of(cfg: TrainConfig, formats: dict[str, int]) -> str:
    """pack | auto | group | pad: how a step's examples become micro-batches."""
    if cfg.packing == "on":
        return "pack"
    if cfg.packing == "auto" and set(formats) == {"text"}:
        return "auto"
    return "group" if cfg.group_by_length else "pad"


def make_loader(
    data: TokenizedDataset,
    sampler: Any,
    batch_size: int,
    collate: Callable[[Any], Any],
    env: DistEnv,
    workers: int,
) -> DataLoader[Any]:
    return DataLoader(
        data,  # type: ignore[arg-type]
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate,
        num_workers=workers,
        pin_memory=env.device.type == "cuda",
        persistent_workers=workers > 0,
    )


def environment_info(env: DistEnv, threads: int) -> dict[str, Any]:
    import transformers

    return {
        "lmtune": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "world_size": env.world_size,
        "device": str(env.device),
        "backend": env.backend,
        "threads_per_process": threads,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }


def build_model(
    cfg: TrainConfig, base: torch.nn.Module, strategy: str, env: DistEnv, log: RunLog
) -> tuple[torch.nn.Module, ModelParts, LossChoice]:
    """Memory savers, LoRA, compile, the loss wrapper and the strategy's wrapper, in that order."""
    if cfg.activation_checkpointing:
        checkpoint_activations(base, cfg.model)
    # Per-example attention computes nothing on padding or across packed examples. Its per-example
    # loop would make torch.compile recompile for every batch, so compiled runs keep the masks.
    cpu_bf16 = env.device.type == "cpu" and cfg.precision == "bf16"
    varlen = not cfg.compile and use_varlen(base, cpu_bf16)
    trained = base
    if cfg.lora:
        # The same adapter init on every rank: FSDP keeps each rank's own shard of it (DDP would
        # broadcast rank 0's).
        torch.manual_seed(cfg.seed)
        lora = LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
        trained = add_lora(base, lora)
    # A rank-specific stream from here on, so dropout differs across the ranks' examples.
    torch.manual_seed(cfg.seed + env.rank)
    loss = choose_loss(trained, cfg.loss_chunk_size, cfg.compile)
    if cfg.loss_chunk_size and not loss.chunk:
        log.info(f"--loss-chunk-size {cfg.loss_chunk_size}: not used; {loss.description}")
    if cfg.compile:
        compile_model(trained, log)
    loss_module = SummedLoss(trained, varlen, loss.chunk)
    model = wrap_model(loss_module, strategy, env, cfg.precision)
    return model, ModelParts(trained, loss_module, sharded=strategy == "fsdp", lora=cfg.lora), loss


def apply_chat_template_option(cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any, log: RunLog) -> None:
    assert cfg.chat_template is not None
    added = use_chat_template(tokenizer, cfg.chat_template)
    if added and cfg.lora:
        raise UserError(
            f"--chat-template {cfg.chat_template}: its turn markers {', '.join(added)} are new to "
            f"{cfg.model}'s vocabulary, and LoRA leaves new token embeddings untrained, so the model "
            "could never learn to end a turn. Fine-tune without --lora, or use a template whose "
            "markers the tokenizer has (its own, when it has one)"
        )
    grew = fit_embeddings(model, tokenizer)
    log.info(
        f"chat template {cfg.chat_template}"
        + (f": new special tokens {', '.join(added)}" if added else "")
        + (f" (embeddings grown to {len(tokenizer):,} rows)" if grew else "")
    )
