"""`lmtune eval`: a model's loss and perplexity on data, as a training run's evaluation computes
them (the same rendering, truncation and loss per target token over the whole set), without
training: the base model against the tuned one on held-out data, or a checkpoint's export."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmtune.checkpoint.card import run_record_near
from lmtune.config.mixture import item_name, named_items, source_names
from lmtune.config.settings import TrainConfig
from lmtune.data.chat import use_chat_template
from lmtune.data.dataset import split_off
from lmtune.data.mixture import check_sources_kept, per_source, source_index
from lmtune.data.pairs import counted_as
from lmtune.data.prepare import Wanted, data_cache_dir, prepare
from lmtune.errors import SettingError, UserError
from lmtune.model.attention import use_varlen
from lmtune.model.chunked_loss import choose as choose_loss
from lmtune.model.modeling import load_model
from lmtune.model.paths import BF16, Paths, products_of, sample_micro_batches
from lmtune.model.precision import autocast_context, check_device
from lmtune.model.tokens import UNEMBEDDED, check_positions, tokens_without_embeddings
from lmtune.objectives.base import LossSetup
from lmtune.objectives.sft import SupervisedObjective
from lmtune.parallel.distributed import cpu_threads_per_process, read_dist_env
from lmtune.training.build import choose_paths, make_eval_loader
from lmtune.training.evaluate import EvalResult, evaluate


@dataclass(frozen=True)
class Evaluation:
    result: EvalResult
    data: dict[str, Any]  # the tokenized data's counts (examples, truncated, dropped, ...)
    model: str  # what was loaded, as the start line of a run says it
    paths: Paths  # the CPU bf16 kernels it ran with, chosen as a run chooses its own
    # Where the data scored is the model's run's --data (same content, tokenizer and settings), its
    # loss is on examples it trained on: that --data, and how the run says what it evaluated on.
    trained_on: tuple[str, str] | None = None


def evaluate_model(cfg: TrainConfig, batch_size: int, held_out: float | None = None) -> Evaluation:
    """``cfg.model``'s figures on ``cfg.data.train`` (the DATA of `lmtune eval`), read with its
    example settings, ``batch_size`` examples a forward; with ``held_out`` (a run's --eval-split),
    on the examples a run of ``cfg`` holds out of it.

    Raises:
        UserError: under several processes, on preference pairs, for a chat template whose markers
            the model never learned, and for what loading the model or the data refuses.
    """
    env = read_dist_env(cfg.model.device)
    if env.world_size > 1:
        raise UserError("lmtune eval runs in one process: start it without torchrun")
    check_device(cfg.model.precision, env.device, training=False)
    threads = cpu_threads_per_process(env)
    if env.device.type == "cpu":
        torch.set_num_threads(threads)  # as a run does: a timed paths decision is kept per thread count
    # A LoRA adapter stays beside its base, as the run evaluated it (merged, bf16 figures differ).
    loaded = load_model(
        cfg.model.name, seed=cfg.seed, trust_remote_code=cfg.model.trust_remote_code, merge_adapter=False
    )
    tokenizer = loaded.tokenizer
    if problem := tokens_without_embeddings(loaded.model, tokenizer, cfg.model.name):
        raise UserError(f"{problem}: {UNEMBEDDED}")
    if cfg.examples.chat_template is not None and (
        added := use_chat_template(tokenizer, cfg.examples.chat_template)
    ):
        raise SettingError(
            "chat_template",
            "--chat-template",
            f"its turn markers {', '.join(added)} are new to {cfg.model.name}'s vocabulary: the model "
            "never learned them, so its loss on them says nothing (give the template it was tuned with)",
        )
    cache = data_cache_dir(cfg.data)
    # Held out as the run holds it out: of each source apart for a mixture (--data-weights); DATA of
    # several sources is scored per source as well, as a run's --eval-data of several is.
    if held_out is not None:
        apart = per_source(cfg.data, cfg.data.train, "--data")
    else:
        apart = _named_apart(cfg.data.train)
    wanted = Wanted(cfg.data.train, "lmtune eval", per_source=apart)
    prepared = prepare(wanted, tokenizer, cfg.examples, env, cache)
    data = prepared.dataset
    if apart:
        data.sources = source_index(cfg.data.train, data.meta, "--data")
        check_sources_kept(data, "lmtune eval")
    if held_out is not None:
        try:
            data = split_off(data, held_out, cfg.seed)[1]
        except ValueError as e:
            raise SettingError("eval_split", f"--eval-split {held_out:g}", str(e)) from None
    if counted_as(data.meta) == "pairs":
        raise UserError(
            f"{cfg.data.train}: preference pairs; lmtune eval scores supervised examples (a preference "
            "objective's rewards need its reference: lmtune train --objective NAME --eval-data reports them)"
        )
    # Past a learned position table (GPT-2's, OPT's) the forward fails: said as train says it.
    check_positions(loaded.model, int(data.lengths().max(initial=0)), lambda m: print(m, file=sys.stderr))
    model = loaded.model.to(env.device)
    adapted = getattr(model, "get_base_model", None)  # a PeftModel: attention is its base's
    base: torch.nn.Module = adapted() if callable(adapted) else model
    # A CPU bf16 evaluation takes the products and attention a run would (by rule, or the timing
    # cached for this machine and model): autocast's own bf16 products are reference loops on a
    # CPU without bf16 units, ~30x slower, and would not give a run's figures.
    micro_batches = sample_micro_batches(data.lengths().tolist(), batch_size, None)
    paths = choose_paths(cfg, env, threads, base, micro_batches)
    products = products_of(paths, cfg.model.precision)
    varlen = use_varlen(base, bucketed=paths.attention is not None and paths.attention.choice == BF16)
    objective = SupervisedObjective()
    loss = choose_loss(model, cfg.model.loss_chunk_size, False, device_type=env.device.type)
    setup = LossSetup(varlen, loss.chunk, products.fp32, products.bucketed)
    loss_module = objective.loss_module(model, setup)
    collate = objective.eval_collator(tokenizer.pad_token_id)
    loader = make_eval_loader(data, collate, batch_size, env)
    autocast = autocast_context(cfg.model.precision, env.device, products.fp32)
    result = evaluate(loss_module, loader, env, autocast, sources=data.sources)
    trained_on = _run_trained_on(cfg.model.name, prepared.key) if held_out is None else None
    return Evaluation(result, data.meta, loaded.source, paths, trained_on)


def _run_trained_on(model: str, key: str) -> tuple[str, str] | None:
    """The --data of the run whose folder holds ``model`` (OUTPUT/final, a checkpoint), and what it
    evaluated on, where that data's key is ``key``: the examples scored are the ones it trained on."""
    run = run_record_near(Path(model)) if Path(model).is_dir() else None
    data = (run or {}).get("data")
    train, held = (data.get(k) if isinstance(data, dict) else None for k in ("train", "eval"))
    if not (isinstance(train, dict) and train.get("key") == key and isinstance(train.get("spec"), str)):
        return None
    if not isinstance(held, dict) or not isinstance(spec := held.get("spec"), str):
        return str(train["spec"]), ""
    if spec.startswith("--eval-split"):  # held out of these very examples
        return str(train["spec"]), f", less the {held.get('examples', 'few')} examples its {spec} held out"
    return str(train["spec"]), f"; it evaluated on {spec}"


def _named_apart(spec: str) -> bool:
    """Whether DATA holds several sources, each with a name of its own (its file's stem, or as
    NAME=PATH): scored one by one besides the whole. Sources whose stems do not tell them apart are
    scored whole, as before; names given that collide are refused."""
    items = named_items(spec)
    if len(items) < 2:
        return False
    try:
        source_names(spec, "lmtune eval")
    except UserError:
        # Names given as NAME=PATH that collide are the user's to fix, as train refuses them.
        if any(name != item_name(item) for name, item in items):
            raise
        return False
    return True
