"""What train() is built from: data, loaders, the model with its memory savers, strategy, loss
and optimizer. :func:`build` makes them all for one run; train.py composes the run from them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lmtune.checkpoint.resume import Fingerprint, fingerprint
from lmtune.checkpoint.state import ModelParts
from lmtune.config.groups import DataSettings
from lmtune.config.settings import SAMPLE_DATA, SAMPLE_EVAL, TrainConfig, warmup_steps
from lmtune.data.chat import end_of_turn_ids, use_chat_template
from lmtune.data.dataset import TokenizedDataset, split_off
from lmtune.data.prepare import default_cache_dir, prepare
from lmtune.data.sampling import EvalSampler, TrainSampler
from lmtune.data.tokenize import EncodeStats
from lmtune.errors import UserError
from lmtune.model.attention import use_varlen
from lmtune.model.chunked_loss import LossChoice
from lmtune.model.chunked_loss import choose as choose_loss
from lmtune.model.lora import add_lora
from lmtune.model.modeling import LoadedModel, load_model
from lmtune.model.precision import grad_scaler, low_precision_dtype
from lmtune.model.products import Fp32Products
from lmtune.model.tokens import fit_embeddings, set_stop_tokens
from lmtune.objectives import objective_for
from lmtune.objectives.base import LossSetup, Objective
from lmtune.outputs.runlog import InfoLog, RunLog
from lmtune.parallel.distributed import DistEnv, all_gather_object, broadcast_object
from lmtune.parallel.wrap import wrap_model
from lmtune.training.batch_layout import BatchLayout, batch_layout
from lmtune.training.context import RunContext
from lmtune.training.loop import FitData
from lmtune.training.optim import build_schedule, optimizer_for
from lmtune.training.reference import (
    PolicyParts,
    model_digest,
    precompute_references,
    precomputes,
    with_live_reference,
)

# Adapters start at zero and need a larger step than full fine-tuning of pretrained weights.
LORA_MIN_DEFAULT_LR = 2e-4


@dataclass(frozen=True)
class Built:
    """The parts of a run, before resume."""

    loaded: LoadedModel  # the Hugging Face model as loaded, and its tokenizer
    train_data: TokenizedDataset
    eval_data: TokenizedDataset | None
    data_info: dict[str, Any]  # run.json's "data"
    layout: BatchLayout
    batching: str  # pack | auto | group | pad (see batching_of)
    lr: float
    model: torch.nn.Module  # the strategy's wrapper around the loss module
    parts: ModelParts
    loss: LossChoice
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    fingerprint: Fingerprint  # what a checkpoint of this run must match to be continued
    objective: Objective  # what the loss module computes, and what it is normalised by

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer


def build(run: RunContext, objective: Objective | None = None) -> Built:
    """Model, data, batch layout, the wrapped model with its loss, and the optimizer; the loss is
    ``objective``'s (default: the one ``--objective`` names)."""
    cfg, env, log = run.cfg, run.env, run.log
    run.heartbeat.beat("load")
    loaded = load_model(cfg.model.name, cfg.seed, cfg.model.trust_remote_code)
    tokenizer = loaded.tokenizer
    if cfg.examples.chat_template is not None:
        apply_chat_template_option(cfg, loaded.model, tokenizer, log)
    run.heartbeat.beat("data-prep")
    train_data, eval_data, data_info = prepare_data(cfg, tokenizer, env, log, run.stop.raise_if_requested)
    run.heartbeat.beat("load")
    objective = objective or objective_for(cfg.objective)
    check_data_kind(objective, train_data, eval_data)
    if {"messages", "preference_messages"} & set(data_info["train"]["formats"]):
        # The reply's end-of-turn token trains; saved models must also stop generating there.
        stops = set_stop_tokens(loaded.model, tokenizer, end_of_turn_ids(tokenizer))
        log.info(f"chat data: saved models stop at {tokenizer.convert_ids_to_tokens(stops)}")
    layout = batch_layout(cfg, env.world_size, len(train_data))
    default_lr = max(loaded.default_lr, LORA_MIN_DEFAULT_LR) if cfg.lora.enabled else loaded.default_lr
    lr = cfg.optim.lr if cfg.optim.lr is not None else default_lr
    # Hashed before wrapping: FSDP2 leaves each rank a shard, LoRA adds adapters.
    digest = (
        broadcast_object(model_digest(loaded.model) if env.is_main else None, env)
        if (precomputes(run, objective) and cfg.objective.reference_model is None)
        else None
    )
    model, parts, loss = build_model(run, loaded.model, objective)
    if precomputes(run, objective):
        policy = PolicyParts(model, digest, loss.chunk, bool(parts.root.varlen), parts.sharded)
        datasets = _distinct(train_data, eval_data, data_info)
        data_info["reference"] = precompute_references(
            run, policy, datasets, tokenizer.pad_token_id, data_cache_dir(cfg.data)
        )
    # After wrapping: FSDP2 replaces the parameters by their shards, which the optimizer must hold.
    optimizer = optimizer_for(cfg.optim, parts.root, lr)
    run_fingerprint = fingerprint(
        cfg,
        data_key=data_info["train"]["key"],
        examples=len(train_data),
        model_config=loaded.model.config,
        lr=lr,
        total_steps=layout.total_steps,
    )
    return Built(
        loaded=loaded,
        train_data=train_data,
        eval_data=eval_data,
        data_info=data_info,
        layout=layout,
        batching=batching_of(cfg, data_info["train"]["formats"]),
        lr=lr,
        model=model,
        parts=parts,
        loss=loss,
        optimizer=optimizer,
        scaler=grad_scaler(cfg.model.precision),
        fingerprint=run_fingerprint,
        objective=objective,
    )


def check_data_kind(
    objective: Objective, train_data: TokenizedDataset, eval_data: TokenizedDataset | None
) -> None:
    """Preference objectives train on pairs, the others on single examples."""
    pairs = objective.unit == "pairs"
    for data, option in ((train_data, "--data"), (eval_data, "--eval-data")):
        if data is None or data.is_pairs == pairs:
            continue
        if pairs:
            raise UserError(
                f"{option}: --objective {objective.name} tunes on preference pairs, records of "
                "'prompt', 'chosen' and 'rejected' (strings, or lists of messages); these are single examples"
            )
        raise UserError(
            f"{option}: holds preference pairs (prompt, chosen, rejected); tune on them with --objective "
            "dpo, ipo, simpo or orpo (--objective sft trains on single examples)"
        )


def _distinct(
    train: TokenizedDataset, held_out: TokenizedDataset | None, info: dict[str, Any]
) -> list[tuple[TokenizedDataset, str]]:
    """The data sets whose pairs need reference log-probs, with their cache keys: one for the
    training data and an --eval-split of it, two with --eval-data."""
    found = [(train.base(), info["train"]["key"])]
    if held_out is not None and held_out.base() is not train.base():
        found.append((held_out.base(), info["eval"]["key"]))
    return found


def checkpoint_activations(model: torch.nn.Module, name: str, fp32_products: bool = False) -> None:
    """Per-block activation checkpointing, non-reentrant: the reentrant variant runs backward
    hooks twice and DDP then sees parameters "marked ready twice"."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UserError(f"--activation-checkpointing: {name} does not support gradient checkpointing")
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if fp32_products:
        # The recomputation in backward runs outside the step's context: the checkpoint restores
        # autocast, not the products' mode, and a block recomputed with PyTorch's bf16 kernels
        # saves other tensors than its forward did (CheckpointError).
        kwargs["context_fn"] = _recompute_with_fp32_products
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def _recompute_with_fp32_products() -> tuple[AbstractContextManager[object], AbstractContextManager[object]]:
    """torch.utils.checkpoint's context_fn: (around the forward, around the recomputation)."""
    return nullcontext(), Fp32Products()


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
    if cfg.data.eval is None and cfg.data.train == SAMPLE_DATA and cfg.data.eval_split is None:
        return SAMPLE_EVAL
    return cfg.data.eval


def data_cache_dir(data: DataSettings) -> Path:
    """--cache-dir, else lmtune's default cache of tokenized data."""
    return Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()


def prepare_data(
    cfg: TrainConfig,
    tokenizer: Any,
    env: DistEnv,
    log: InfoLog,
    check_stop: Callable[[], None] = lambda: None,
) -> tuple[TokenizedDataset, TokenizedDataset | None, dict[str, Any]]:
    """Tokenize (or read from the cache) the training and evaluation data; report what was done."""
    settings = cfg.examples
    cache_dir = data_cache_dir(cfg.data)
    info: dict[str, Any] = {}
    prepared: dict[str, TokenizedDataset] = {}
    for name, spec, option in (("train", cfg.data.train, "--data"), ("eval", _eval_spec(cfg), "--eval-data")):
        if spec is None:
            continue
        p = prepare(spec, tokenizer, settings, env, cache_dir, cfg.data.cache_per_node, option, check_stop)
        builders = [r for r, built in enumerate(all_gather_object(p.built, env)) if built]
        meta = p.dataset.meta
        info[name] = {
            "spec": spec,
            "cache": str(p.folder),
            "key": p.key,
            "built_by_ranks": builders,
            # .get: a cache built before a count existed lacks it
            **{k: meta.get(k, 0) for k in (*(f.name for f in fields(EncodeStats)), "bad_lines")},
        }
        how = f"tokenized in {meta['build_seconds']:.1f}s" if builders else "from the cache"
        log.info(
            f"{name} data {spec}: {meta['examples']:,} examples, {meta['tokens']:,} tokens ({how}); "
            f"{meta['truncated']} truncated, {meta['dropped_too_long']} dropped as too long, "
            f"{meta['dropped_no_targets']} dropped with no trainable tokens"
            + (f", {meta['bad_lines']} bad lines skipped" if meta["bad_lines"] else "")
            + _pair_counts(meta)
        )
        for message in meta["bad_line_examples"][:5] if builders else []:
            log.info(f"  skipped: {message}")
        prepared[name] = p.dataset
    if cfg.data.eval_split is not None:
        try:
            prepared["train"], prepared["eval"] = split_off(prepared["train"], cfg.data.eval_split, cfg.seed)
        except ValueError as e:
            raise UserError(f"--eval-split {cfg.data.eval_split}: {e}") from None
        info["eval"] = {"spec": f"--eval-split {cfg.data.eval_split}", "examples": len(prepared["eval"])}
        log.info(f"eval data: {len(prepared['eval']):,} examples of --data held out (--eval-split)")
    return prepared["train"], prepared.get("eval"), info


def _pair_counts(meta: dict[str, Any]) -> str:
    """What truncation did to preference pairs, for the data line of the log."""
    if not meta.get("truncated") or not {"preference", "preference_messages"} & set(meta["formats"]):
        return ""
    return (
        f" (pairs: {meta.get('prompts_truncated', 0)} prompts cut from the left, "
        f"{meta.get('answers_truncated', 0)} with answers cut from the right)"
    )


BATCHING_NAMES = {
    "pack": "packed rows",
    "auto": "packed where it saves padding",
    "group": "grouped by length",
    "pad": "padded",
}


def batching_of(cfg: TrainConfig, formats: dict[str, int]) -> str:
    """pack | auto | group | pad: how a step's examples become micro-batches."""
    if cfg.batch.packing == "on":
        return "pack"
    if cfg.batch.packing == "auto" and set(formats) == {"text"}:
        return "auto"
    return "group" if cfg.batch.group_by_length else "pad"


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


def loaders(run: RunContext, built: Built) -> tuple[FitData, DataLoader[Any] | None]:
    """The training data as fit walks it, and the evaluation loader (None without eval data)."""
    cfg, env, layout, pad = run.cfg, run.env, built.layout, built.tokenizer.pad_token_id
    step_collate = built.objective.step_collator(
        pad, layout.micro_batch_size, built.batching, cfg.examples.max_length
    )
    lengths = built.train_data.lengths().tolist()
    sampler = TrainSampler(
        len(built.train_data), cfg.batch.global_batch_size, env.rank, env.world_size, cfg.seed, lengths
    )
    # One loader item is one rank's share of one optimizer step, already cut into micro-batches.
    loader = make_loader(built.train_data, sampler, layout.per_rank, step_collate, env, cfg.data.num_workers)
    eval_loader = None
    if built.eval_data is not None:
        eval_sampler = EvalSampler(len(built.eval_data), env.rank, env.world_size)
        collate = built.objective.eval_collator(pad)
        eval_loader = make_loader(built.eval_data, eval_sampler, layout.micro_batch_size, collate, env, 0)
    return FitData(loader, sampler, layout), eval_loader


def build_model(
    run: RunContext, base: torch.nn.Module, objective: Objective
) -> tuple[torch.nn.Module, ModelParts, LossChoice]:
    """Memory savers, LoRA, compile, the loss wrapper and the strategy's wrapper, in that order."""
    cfg, strategy, env, log = run.cfg, run.strategy, run.env, run.log
    if cfg.model.activation_checkpointing:
        checkpoint_activations(base, cfg.model.name, run.products.fp32)
    # Per-example attention computes nothing on padding or across packed examples. Its per-example
    # loop would make torch.compile recompile for every batch, so compiled runs keep the masks.
    cpu_bf16 = env.device.type == "cpu" and cfg.model.precision == "bf16"
    varlen = not cfg.model.compile and use_varlen(base, cpu_bf16)
    trained = base
    if cfg.lora.enabled:
        # The same adapter init on every rank: FSDP keeps each rank's own shard of it (DDP would
        # broadcast rank 0's).
        torch.manual_seed(cfg.seed)
        trained = add_lora(base, cfg.lora)
    # A rank-specific stream from here on, so dropout differs across the ranks' examples.
    torch.manual_seed(cfg.seed + env.rank)
    loss = choose_loss(trained, cfg.model.loss_chunk_size, cfg.model.compile)
    if cfg.model.loss_chunk_size and not loss.chunk:
        log.info(f"--loss-chunk-size {cfg.model.loss_chunk_size}: not used; {loss.description}")
    if cfg.model.compile:
        compile_model(trained, log)
    objective = with_live_reference(run, base, objective, varlen)  # a copy of the unwrapped start
    loss_module = objective.loss_module(trained, LossSetup(varlen, loss.chunk, run.products.fp32))
    model = wrap_model(loss_module, strategy, env, low_precision_dtype(cfg.model.precision))
    return model, ModelParts(trained, loss_module, sharded=strategy == "fsdp", lora=cfg.lora.enabled), loss


def apply_chat_template_option(cfg: TrainConfig, model: torch.nn.Module, tokenizer: Any, log: RunLog) -> None:
    assert cfg.examples.chat_template is not None
    added = use_chat_template(tokenizer, cfg.examples.chat_template)
    if added and cfg.lora.enabled:
        raise UserError(
            f"--chat-template {cfg.examples.chat_template}: its turn markers {', '.join(added)} are new to "
            f"{cfg.model.name}'s vocabulary, and LoRA leaves new token embeddings untrained, so the model "
            "could never learn to end a turn. Fine-tune without --lora, or use a template whose "
            "markers the tokenizer has (its own, when it has one)"
        )
    grew = fit_embeddings(model, tokenizer)
    log.info(
        f"chat template {cfg.examples.chat_template}"
        + (f": new special tokens {', '.join(added)}" if added else "")
        + (f" (embeddings grown to {len(tokenizer):,} rows)" if grew else "")
    )


def schedule(cfg: TrainConfig, built: Built, start_step: int) -> torch.optim.lr_scheduler.LRScheduler:
    total = built.layout.total_steps
    return build_schedule(
        built.optimizer,
        name=cfg.schedule.name,
        total_steps=total,
        warmup_steps=warmup_steps(cfg.schedule, total),
        min_ratio=cfg.schedule.min_lr_ratio,
        decay_ratio=cfg.schedule.decay_ratio,
        lr=built.lr,
        start_step=start_step,
    )
