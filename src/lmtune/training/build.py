"""What train() is built from: data, loaders, the model with its memory savers, strategy, loss
and optimizer. :func:`build` makes them all for one run; train.py composes the run from them."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader

from lmtune.checkpoint.fingerprint import Fingerprint, fingerprint
from lmtune.checkpoint.state import ModelParts
from lmtune.config.mixture import shown_spec
from lmtune.config.settings import SAMPLE_DATA, SAMPLE_EVAL, TrainConfig, warmup_steps
from lmtune.data.chat import drop_unlearned_template, end_of_turn_ids, use_chat_template
from lmtune.data.dataset import TokenizedDataset, split_off
from lmtune.data.formats import CHAT_FORMATS, builtin_template_note
from lmtune.data.mixture import check_sources_kept, mixture_line, per_source, source_index, training_mixture
from lmtune.data.pair_audit import kind_refused
from lmtune.data.pairs import counted, data_line
from lmtune.data.prepare import Wanted, cache_root, data_cache_dir, prepare
from lmtune.data.sampling import EvalBatches, EvalSampler, TrainSampler
from lmtune.data.tokenize import EncodeStats
from lmtune.errors import SettingError, UserError
from lmtune.model.attention import supports_varlen, use_varlen
from lmtune.model.checkpointing import checkpoint_activations
from lmtune.model.chunked_loss import LossChoice
from lmtune.model.chunked_loss import choose as choose_loss
from lmtune.model.compiled import compile_blocks, compiles_whole
from lmtune.model.dropout import key_dropout, keyed_dropout
from lmtune.model.lora import add_lora
from lmtune.model.masks import mask_obstacle
from lmtune.model.modeling import LoadedModel, load_model
from lmtune.model.paths import (
    BF16,
    PATHS_FILE,
    Paths,
    Question,
    Workload,
    decide_paths,
    products_of,
    sample_micro_batches,
)
from lmtune.model.precision import autocast_context, grad_scaler, low_precision_dtype
from lmtune.model.products import Products
from lmtune.model.quantization import base_summary, quantization_of, return_freed_buffers
from lmtune.model.tokens import check_positions, fit_embeddings, fit_vocabulary, set_stop_tokens
from lmtune.objectives import objective_for
from lmtune.objectives.base import LossSetup, Objective
from lmtune.outputs.runlog import InfoLog, RunLog
from lmtune.parallel.distributed import DistEnv, all_gather_object
from lmtune.parallel.wrap import wrap_model
from lmtune.training.batch_layout import (
    BatchLayout,
    batch_layout,
    batching_of,
    check_model_layout,
    unpacked_note,
)
from lmtune.training.context import RunContext
from lmtune.training.loop import FitData
from lmtune.training.optim import build_schedule, default_lr, optimizer_for
from lmtune.training.preflight import check_same_data, warn_of_lost_stops, warn_unused_names
from lmtune.training.reference import attach_references, main_digest, needs_reference, with_live_reference


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
    paths: Paths  # the CPU bf16 paths decided for this run (recorded in its checkpoints)
    products: Products  # how matrices are multiplied (a CPU bf16 run's may be fp32)
    # A fresh autocast context of --precision on this device (none under fp32), with the products'.
    autocast: Callable[[], AbstractContextManager[object]]
    starting_digest: str | None  # the starting weights' hash, where the run depends on them (below)
    # What NEFTune's noise and keyed dropout's masks are drawn from (lmtune.model.neftune); None: neither
    token_seed: int | None

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer


def build(
    run: RunContext, objective: Objective | None = None, recorded_paths: dict[str, Any] | None = None
) -> Built:
    """:func:`build_parts`, with the reference log-probs a preference objective trains against."""
    built = build_parts(run, objective, recorded_paths)
    attach_references(run, built, data_cache_dir(run.cfg.data))
    return built


def build_parts(
    run: RunContext, objective: Objective | None = None, recorded_paths: dict[str, Any] | None = None
) -> Built:
    """Model, data, batch layout, the CPU bf16 paths (``recorded_paths``: those of the checkpoint
    the run resumes), the wrapped model with its loss, and the optimizer; the loss is
    ``objective``'s (default: the one ``--objective`` names). No reference log-probs yet
    (:func:`attach_references`): a finished run run again needs none."""
    cfg, env, log = run.cfg, run.env, run.log
    loaded = _load(run)
    objective = objective or objective_for(cfg.objective)
    obstacle = mask_obstacle(loaded.model)
    check_model_layout(cfg, obstacle, objective.unit == "pairs", log.info)
    tokenizer = loaded.tokenizer
    loaded_template = getattr(tokenizer, "chat_template", None)
    run.heartbeat.beat("data-prep")
    train_data, eval_data, data_info = prepare_data(cfg, tokenizer, env, log, run.stop.raise_if_requested)
    # The eval examples that are training's too: rank 0 says it, so the other ranks hash no tokens.
    warn_unused_names(cfg, data_info, log.info, (train_data, eval_data) if env.is_main else None)
    longest = max(int(d.lengths().max(initial=0)) for d in (train_data, eval_data) if d is not None)
    check_positions(loaded.model, min(longest, cfg.examples.max_length), log.info)
    run.heartbeat.beat("load")
    check_data_kind(objective, train_data, eval_data)
    formats = sorted(data_info["train"]["formats"])
    if cfg.examples.chat_template is not None and not set(CHAT_FORMATS) & set(formats):
        raise UserError(  # it would only save a template, and grown embeddings, that nothing trained
            f"--chat-template: applies to conversations (messages records), and the training data holds "
            f"{', '.join(formats) or 'no examples'}"
        )
    chat = bool(set(CHAT_FORMATS) & set(formats))
    if chat:
        # The reply's end-of-turn token trains; saved models must also stop generating there.
        stops = set_stop_tokens(loaded.model, tokenizer, end_of_turn_ids(tokenizer))
        log.info(f"chat data: saved models stop at {tokenizer.convert_ids_to_tokens(stops)}")
        if (note := builtin_template_note(tokenizer, loaded_template)) is not None:
            log.info(note)
    warn_of_lost_stops(data_info["train"], chat, objective.unit, cfg.examples, log.info)
    layout = batch_layout(cfg, env.world_size, len(train_data))
    lr = cfg.optim.lr if cfg.optim.lr is not None else default_lr(cfg, loaded, objective.unit)[0]
    batching = batching_of(cfg, data_info["train"]["formats"], obstacle)
    if (unpacked := unpacked_note(cfg, data_info["train"]["formats"], obstacle)) is not None:
        log.info(unpacked)
    micro_batches = _shapes(cfg, train_data, layout, batching)
    paths = choose_paths(cfg, env, run.threads, loaded.model, micro_batches, recorded_paths)
    products = products_of(paths, cfg.model.precision)
    autocast = partial(autocast_context, cfg.model.precision, env.device, products.fp32)
    digest = _starting_digest(run, loaded.model, objective)  # before wrapping: FSDP2 shards it
    model, parts, loss = build_model(run, loaded.model, objective, paths)
    # After wrapping: FSDP2 replaces the parameters by their shards, which the optimizer must hold.
    optimizer = optimizer_for(cfg.optim, parts.root, lr)
    run_fingerprint = fingerprint(
        cfg,
        data_key=data_info["train"]["key"],
        examples=len(train_data),
        model_config=loaded.model.config,
        lr=lr,
        total_steps=layout.total_steps,
        starting_weights=digest,
    )
    return Built(
        loaded=loaded,
        train_data=train_data,
        eval_data=eval_data,
        data_info=data_info,
        layout=layout,
        batching=batching,
        lr=lr,
        model=model,
        parts=parts,
        loss=loss,
        optimizer=optimizer,
        scaler=grad_scaler(cfg.model.precision),
        fingerprint=run_fingerprint,
        objective=objective,
        paths=paths,
        products=products,
        autocast=autocast,
        starting_digest=digest,
        token_seed=cfg.seed if cfg.objective.neftune_alpha or keyed_dropout(parts.model) else None,
    )


def _load(run: RunContext) -> LoadedModel:
    """The model and tokenizer; a quantized base straight onto its device (bitsandbytes quantizes
    there); the --chat-template applied."""
    cfg, env, log = run.cfg, run.env, run.log
    run.heartbeat.beat("load")
    quantization = quantization_of(cfg.model, run.strategy)
    device = env.device if quantization is not None else None
    if quantization is not None:
        return_freed_buffers(env.device)
    loaded = load_model(cfg.model.name, cfg.seed, cfg.model.trust_remote_code, quantization, device)
    if quantization is not None:
        log.info(base_summary(loaded.model, quantization))
    fit_vocabulary(loaded.model, loaded.tokenizer, cfg.model.name, lora=cfg.lora.enabled, say=log.info)
    if cfg.examples.chat_template is not None:
        apply_chat_template_option(cfg, loaded.model, loaded.tokenizer, log)
    return loaded


def _starting_digest(run: RunContext, model: torch.nn.Module, objective: Objective) -> str | None:
    """The starting weights' hash (rank 0's, on every rank), where the run depends on them beyond
    what its checkpoints hold: a LoRA run's frozen base, and a reference that is the starting model
    (it keys its log-probs' cache). A resume checks it: the --model folder retrained in place, or a
    hub model updated, would continue another run. Before wrapping: FSDP2 leaves each rank a shard,
    LoRA adds adapters."""
    own_reference = needs_reference(objective) and run.cfg.objective.reference_model is None
    if not (run.cfg.lora.enabled or own_reference):
        return None
    return main_digest(model, run.env)


def _shapes(cfg: TrainConfig, data: TokenizedDataset, layout: BatchLayout, batching: str) -> list[list[int]]:
    """A few of the run's micro-batches, as their examples' token counts (for a paths timing)."""
    packed = cfg.examples.max_length if batching in ("pack", "auto") else None
    return sample_micro_batches(data.lengths().tolist(), layout.micro_batch_size, packed)


def choose_paths(
    cfg: TrainConfig,
    env: DistEnv,
    threads: int,
    model: torch.nn.Module,
    micro_batches: list[list[int]],
    recorded: dict[str, Any] | None = None,
) -> Paths:
    """The run's CPU bf16 paths (lmtune.model.paths), timed where needed on its own micro-batches
    (each as its examples' token counts) for ``threads`` threads; `lmtune eval` takes them too, so
    it scores a model with the kernels a run's evaluation uses."""
    question = Question(
        cpu_bf16=env.device.type == "cpu" and cfg.model.precision == "bf16" and not cfg.model.compile,
        attention=not cfg.model.compile and supports_varlen(model),
        recorded=recorded,
        cache=cache_root() / PATHS_FILE if env.is_main else None,
        threads=threads,
    )
    return decide_paths(question, Workload(getattr(model, "config", None), micro_batches), env)


def check_data_kind(
    objective: Objective, train_data: TokenizedDataset, eval_data: TokenizedDataset | None
) -> None:
    """Preference objectives train on pairs, the others on single examples."""
    for data, option in ((train_data, "--data"), (eval_data, "--eval-data")):
        if data is not None and (
            refused := kind_refused(data.is_pairs, objective.name, objective.unit == "pairs")
        ):
            raise UserError(f"{option}: {refused}")


def _eval_spec(cfg: TrainConfig) -> str | None:
    if cfg.data.eval is None and cfg.data.train == SAMPLE_DATA and cfg.data.eval_split is None:
        return SAMPLE_EVAL
    return cfg.data.eval


def prepare_data(
    cfg: TrainConfig,
    tokenizer: Any,
    env: DistEnv,
    log: InfoLog,
    check_stop: Callable[[], None] = lambda: None,
) -> tuple[TokenizedDataset, TokenizedDataset | None, dict[str, Any]]:
    """Tokenize (or read from the cache) the training and evaluation data; report what was done."""
    cache_dir = data_cache_dir(cfg.data)
    had_template = bool(getattr(tokenizer, "chat_template", None))
    info: dict[str, Any] = {}
    prepared: dict[str, TokenizedDataset] = {}
    specs = (("train", cfg.data.train, "--data"), ("eval", _eval_spec(cfg), "--eval-data"))
    for name, spec, option in ((n, s, o) for n, s, o in specs if s is not None):
        wanted = Wanted(spec, option, per_source=per_source(cfg.data, spec, option))
        p = prepare(
            wanted, tokenizer, cfg.examples, env, cache_dir, cfg.data.cache_per_node, check_stop=check_stop
        )
        if wanted.per_source:
            p.dataset.sources = source_index(spec, p.dataset.meta, option)
            check_sources_kept(p.dataset, option)
        gathered = all_gather_object((p.built, p.key, len(p.dataset)), env)
        check_same_data(name, spec, option, gathered)
        builders = [r for r, (built, _, _) in enumerate(gathered) if built]
        meta = p.dataset.meta
        info[name] = {
            "spec": spec,
            "cache": str(p.folder),
            "key": p.key,
            "built_by_ranks": builders,
            # .get: a cache built before a count existed lacks it
            **{
                k: meta.get(k, {} if k == "where" else 0)
                for k in (*(f.name for f in fields(EncodeStats)), "bad_lines")
            },
        }
        how = f"tokenized in {meta['build_seconds']:.1f}s" if builders else "from the cache"
        shown = {SAMPLE_DATA: "the built-in sample", SAMPLE_EVAL: "the built-in sample's held-out split"}
        if p.files:  # a folder's or a glob's, as this run resolved them
            info[name]["files"] = list(p.files)
        log.info(
            data_line(f"{name} data {shown.get(spec, shown_spec(spec))}", meta, how, info[name].get("files"))
        )
        if (
            name == "train"
            and meta["examples"] == meta.get("identical_pairs", 0) > 0
            and cfg.objective.name != "orpo"
        ):
            raise UserError(
                f"--data {spec}: every pair has the same chosen and rejected answer: nothing to prefer"
            )
        for message in meta["bad_line_examples"][:5] if builders else []:
            log.info(f"  skipped: {message}")
        prepared[name] = p.dataset
    if cfg.data.eval_split is not None:
        try:
            prepared["train"], prepared["eval"] = split_off(prepared["train"], cfg.data.eval_split, cfg.seed)
        except ValueError as e:
            raise SettingError("eval_split", f"--eval-split {cfg.data.eval_split:g}", str(e)) from None
        info["eval"] = {"spec": f"--eval-split {cfg.data.eval_split:g}", "examples": len(prepared["eval"])}
        # ``examples`` stays the data's count (its cache entry's); this is what trains.
        info["train"]["held_out"] = len(prepared["eval"])
        info["train"]["training_examples"] = len(prepared["train"])
        log.info(
            f"eval data: {counted(len(prepared['eval']), prepared['train'].meta)} of --data held out "
            f"(--eval-split); {len(prepared['train']):,} left to train on"
        )
    for name, data in prepared.items():
        if data.sources is not None:
            info[name]["source_examples"] = dict(zip(data.sources.names, data.source_sizes(), strict=True))
    mixture = training_mixture(cfg.data, prepared["train"])
    if mixture is not None:
        info["train"]["mixture"] = mixture.describe()
        log.info(f"mixture (an epoch of {mixture.epoch_size:,}): {mixture_line(mixture)}")
    drop_unlearned_template(tokenizer, had_template, info)
    return prepared["train"], prepared.get("eval"), info


def make_loader(
    data: TokenizedDataset,
    sampler: Any,
    batch_size: int | None,
    collate: Callable[[Any], Any],
    env: DistEnv,
    workers: int,
) -> DataLoader[Any]:
    """A loader of ``sampler``'s examples in batches of ``batch_size`` (None: ``sampler`` yields
    the batches)."""
    batching: dict[str, Any] = {"batch_size": batch_size, "sampler": sampler}
    if batch_size is None:
        batching = {"batch_sampler": sampler}
    return DataLoader(
        data,  # type: ignore[arg-type]
        **batching,
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
        len(built.train_data),
        cfg.batch.global_batch_size,
        env.rank,
        env.world_size,
        cfg.seed,
        lengths,
        training_mixture(cfg.data, built.train_data),
    )
    # One loader item is one rank's share of one optimizer step, already cut into micro-batches.
    loader = make_loader(built.train_data, sampler, layout.per_rank, step_collate, env, cfg.data.num_workers)
    eval_loader = None
    if built.eval_data is not None:
        collate = built.objective.eval_collator(pad)
        eval_loader = make_eval_loader(built.eval_data, collate, layout.micro_batch_size, env)
    return FitData(loader, sampler, layout), eval_loader


def make_eval_loader(
    data: TokenizedDataset, collate: Callable[[Any], Any], batch_size: int, env: DistEnv
) -> DataLoader[Any]:
    """This rank's share of ``data``, each example once across ranks, ``batch_size`` a batch."""
    if data.sources is not None:  # evaluated per source: a batch holds one source's
        batches = EvalBatches(data.source_sizes(), env.rank, env.world_size, batch_size)
        return make_loader(data, batches, None, collate, env, 0)
    return make_loader(data, EvalSampler(len(data), env.rank, env.world_size), batch_size, collate, env, 0)


def build_model(
    run: RunContext, base: torch.nn.Module, objective: Objective, paths: Paths
) -> tuple[torch.nn.Module, ModelParts, LossChoice]:
    """Memory savers, LoRA, compile, the loss wrapper and the strategy's wrapper, in that order."""
    cfg, strategy, env, log = run.cfg, run.strategy, run.env, run.log
    products = products_of(paths, cfg.model.precision)
    if cfg.model.activation_checkpointing:
        checkpoint_activations(base, cfg.model.name, products.fp32)
    # Per-example attention computes nothing on padding or across packed examples (compiled runs
    # too: it stays out of their graphs).
    bf16_attention = paths.attention is not None and paths.attention.choice == BF16
    varlen = use_varlen(base, bucketed=bf16_attention)
    trained = base
    if cfg.lora.enabled:
        # The same adapter init on every rank: FSDP keeps each rank's own shard of it (DDP would
        # broadcast rank 0's).
        torch.manual_seed(cfg.seed)
        trained = add_lora(
            base, cfg.lora, log.info, None if run.given is None else "lora_dropout" in run.given
        )
    # Supervised runs key dropout by example (N ranks draw one process's masks); a preference
    # objective turns the model's off and its loss module lays out no examples for LoRA's.
    if objective.name == "sft":
        key_dropout(trained)
    if not any(p.requires_grad for p in trained.parameters()):
        raise UserError(f"--model {cfg.model.name}: every weight of it is frozen; nothing would train")
    # A rank-specific stream from here on: for what draws from it (dropout outside token activations).
    torch.manual_seed(cfg.seed + env.rank)
    loss = choose_loss(
        trained,
        cfg.model.loss_chunk_size,
        cfg.model.compile and compiles_whole(trained),
        device_type=env.device.type,
    )
    if cfg.model.loss_chunk_size and not loss.chunk:
        log.info(f"--loss-chunk-size {cfg.model.loss_chunk_size}: not used; {loss.description}")
    if cfg.model.compile and (failure := compile_blocks(trained)):
        log.info(f"--compile: not compiled ({failure}); running eagerly")
    objective = with_live_reference(run, base, objective, varlen, products)  # a copy of the unwrapped start
    setup = LossSetup(varlen, loss.chunk, products.fp32, products.bucketed, cfg.objective.neftune_alpha)
    loss_module = objective.loss_module(trained, setup)
    model = wrap_model(loss_module, strategy, env, low_precision_dtype(cfg.model.precision))
    sharded, quantized = strategy == "fsdp", quantization_of(cfg.model, strategy)
    return model, ModelParts(trained, loss_module, sharded, cfg.lora.enabled, quantized), loss


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
