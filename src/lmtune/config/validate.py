"""check_settings(cfg, world_size): every setting's range and the combinations of settings, each
error naming its option. Nothing is read from disk here: lmtune.training.preflight checks the
files and folders the settings name.

Allowed values come from the settings' metadata (groups.py lists them once); the checks here are
the ranges, one function per group, then the combinations across groups.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable

from lmtune.config.groups import (
    MAX_LENGTH,
    MAX_STEPS,
    BatchSettings,
    LoraSettings,
    ObjectiveSettings,
    OptimSettings,
    ScheduleSettings,
)
from lmtune.config.hints import FOREIGN_CHOICES
from lmtune.config.mixture import named_items, parse_weights, source_names
from lmtune.config.python_values import typed_as
from lmtune.config.run_groups import (
    BEST_METRICS,
    CheckpointSettings,
    EvalSettings,
    HealthSettings,
    LaunchSettings,
    SampleSettings,
)
from lmtune.config.settings import (
    SAMPLE_DATA,
    Setting,
    TrainConfig,
    config_fields,
    given_names,
    option_name,
    parse_nnodes,
    setting_named,
    value_of,
)
from lmtune.errors import SettingError, brief, too_long_to_show

Need = Callable[[bool, str, str], None]


def check_settings(cfg: TrainConfig, world_size: int, given: frozenset[str] | None = None) -> None:
    """Reject settings that cannot work, naming the option; ``world_size`` is the process count;
    ``given``: the settings the user gave by flag or file (a TrainConfig knows those given to it by
    name)."""

    def need(ok: bool, name: str, why: str) -> None:
        if not ok:
            setting = setting_named(name)
            value = value_of(cfg, setting)
            if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
                value = int(value)  # a float setting given as 16 is shown so, not "16.0"
            # A switch's value is the option itself ("--merge-lora: needs --lora", not "(got True)"); an
            # unset one has none to show.
            got = (
                "" if (setting.type is bool and value is True) or value is None else f" (got {brief(value)})"
            )
            raise SettingError(name, option_name(name), f"{why}{got}")

    for s in config_fields():
        problem = value_problem(s, value_of(cfg, s))
        need(problem is None, s.name, problem or "")
    need(0 <= cfg.seed < 2**32, "seed", "must be in [0, 2**32)")
    _check_optim(cfg.optim, need)
    _check_schedule(cfg.schedule, need)
    _check_lora(cfg.lora, need)
    _check_quantization(cfg, need)
    _check_eval(cfg.eval, need)
    _check_objective(cfg, need)
    _check_samples(cfg.samples, need)
    _check_launch(cfg.launch, cfg.health, need)
    _check_outputs(cfg.checkpoint, cfg.logging.log_every, need)
    _check_data(cfg, need)
    _check_evaluation_data(cfg, need)
    _check_batch(cfg.batch, world_size, need)
    _check_applicable(cfg, need, (given or frozenset()) | given_names(cfg))  # Python's by name


def value_problem(s: Setting, value: object) -> str | None:
    """What is wrong with ``value`` for setting ``s`` by itself (its type, finiteness, choices),
    or None; the checks across settings follow in :func:`check_settings`."""
    if not typed_as(value, s.type, s.optional):
        return f"expected {s.type.__name__}"
    # As the CLI and YAML refuse them (the Python API converts nothing): inf and nan pass some
    # range checks below, and fail later as a non-finite loss.
    if s.type is float and value is not None and not _finite(value):
        return "must be a finite number"
    if too_long_to_show(value):  # past what the range checks can show
        return "is too large"
    if s.choices and value is not None and value not in s.choices:
        # Another tool's name for one of them: named, else the closest (a typo).
        whose, theirs = FOREIGN_CHOICES.get(s.name, {}).get(str(value).lower(), ("", ""))
        close = difflib.get_close_matches(str(value), [str(c) for c in s.choices], n=1, cutoff=0.6)
        hint = f"; {whose + ' ' if whose else ''}{value} is {theirs}" if theirs else ""
        if str(value).lower() in s.choices:  # BF16: the choices are lower case
            hint = f"; in lower case: {str(value).lower()}"
        hint = hint or (f"; the closest is {close[0]}" if close else "")
        return f"must be one of {', '.join(s.choices)}{hint}"
    return None


def split_written_as_decimal(name: str, value: object) -> str | None:
    """For --eval-split, a whole number of at least 1 written as a decimal (YAML's 1.0, a flag's
    "2.0", Python's 1.0): 1.0 reads as all of the data, and as a count it held out one example,
    in silence."""
    if name != "eval_split" or isinstance(value, bool) or not isinstance(value, (str, float)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    if (isinstance(value, str) and "." not in value) or not (number >= 1 and number.is_integer()):
        return None
    return f"must be a fraction below 1 or a number of examples without a decimal point ({int(number)})"


def _finite(value: object) -> bool:
    try:
        return math.isfinite(value)  # type: ignore[arg-type]
    except OverflowError:  # an int past float's range: TrainConfig(lr=10**400)
        return False


def _check_optim(o: OptimSettings, need: Need) -> None:
    need(o.lr is None or o.lr > 0, "lr", "must be > 0")
    need(0 <= o.momentum < 1, "momentum", "must be in [0, 1)")
    need(o.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(0 <= o.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)")
    need(0 <= o.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)")
    need(o.adam_eps > 0, "adam_eps", "must be > 0")
    need(o.max_grad_norm >= 0, "max_grad_norm", "must be >= 0")


def _check_schedule(s: ScheduleSettings, need: Need) -> None:
    need(s.epochs is None or s.epochs >= 1, "epochs", "must be >= 1")
    need(s.max_steps is None or s.max_steps >= 1, "max_steps", "must be >= 1")
    for name, count in (("epochs", s.epochs), ("max_steps", s.max_steps)):
        need(count is None or count <= MAX_STEPS, name, f"must be at most 2**40 ({MAX_STEPS:,})")
    need(0 <= s.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)")
    need(s.warmup_steps is None or s.warmup_steps >= 0, "warmup_steps", "must be >= 0")
    need(0 < s.decay_ratio <= 1, "decay_ratio", "must be in (0, 1]")
    need(0 <= s.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")


def _check_lora(lora: LoraSettings, need: Need) -> None:
    need(lora.rank >= 1, "lora_rank", "must be >= 1")
    need(lora.alpha > 0, "lora_alpha", "must be > 0")
    need(0 <= lora.dropout < 1, "lora_dropout", "must be in [0, 1)")
    need(bool(lora.target_modules.strip(" ,")), "lora_target_modules", "must name modules or all-linear")


def _check_quantization(cfg: TrainConfig, need: Need) -> None:
    m, strategy = cfg.model, cfg.launch.strategy
    need(not (m.load_in_4bit and m.load_in_8bit), "load_in_8bit", "is instead of --load-in-4bit: give one")
    for name, on in (("load_in_4bit", m.load_in_4bit), ("load_in_8bit", m.load_in_8bit)):
        if not on:
            continue
        need(
            cfg.lora.enabled,
            name,
            "needs --lora: a quantized base cannot be trained itself, only LoRA adapters on it (QLoRA)",
        )
        need(
            strategy != "dp",
            name,
            "is not supported under --strategy dp (nn.DataParallel replicates parameters as plain "
            "tensors, leaving their quantization constants on the first GPU); use --strategy ddp",
        )
    need(
        not (cfg.optim.name in ("adamw8bit", "paged_adamw8bit") and strategy == "fsdp"),
        "optimizer",
        "does not work with --strategy fsdp (bitsandbytes' 8-bit update takes whole tensors, not "
        "FSDP2's shards); use --strategy ddp, or --optimizer adamw",
    )
    need(
        not (m.load_in_8bit and strategy == "fsdp"),
        "load_in_8bit",
        "does not work with --strategy fsdp (FSDP2 gathers int8 weights without the scales "
        "bitsandbytes keeps beside them); use --load-in-4bit, which FSDP2 shards, or --strategy ddp",
    )


def _check_eval(e: EvalSettings, need: Need) -> None:
    need(e.every >= 0, "eval_every", "must be >= 0")
    need(e.early_stopping_patience >= 0, "early_stopping_patience", "must be >= 0")
    need(
        not e.early_stopping_patience or (e.metric_for_best is not None and e.every > 0),
        "early_stopping_patience",
        "needs --metric-for-best and --eval-every",
    )
    need(e.early_stopping_threshold >= 0, "early_stopping_threshold", "must be >= 0")
    need(
        not e.greater_is_better or e.metric_for_best is not None,
        "greater_is_better",
        "needs --metric-for-best",
    )
    need(
        not e.early_stopping_threshold or e.early_stopping_patience > 0,
        "early_stopping_threshold",
        "needs --early-stopping-patience",
    )


# The objectives that tune on preference pairs, and those of them that compare with a reference.
PREFERENCE = ("dpo", "ipo", "simpo", "orpo")
WITH_BETA = ("dpo", "ipo", "simpo")  # ORPO's one weight is --orpo-lambda
WITH_REFERENCE = ("dpo", "ipo")


def _check_objective(cfg: TrainConfig, need: Need) -> None:
    o: ObjectiveSettings = cfg.objective
    preference = o.name in PREFERENCE
    need(o.beta > 0, "beta", "must be > 0")
    need(0 <= o.label_smoothing < 0.5, "label_smoothing", "must be in [0, 0.5)")
    need(o.simpo_gamma >= 0, "simpo_gamma", "must be >= 0")
    need(o.orpo_lambda >= 0, "orpo_lambda", "must be >= 0")
    need(o.neftune_alpha >= 0, "neftune_alpha", "must be >= 0")
    need(o.reference_model is None or bool(o.reference_model.strip()), "reference_model", "must name a model")
    single = cfg.examples.format not in ("auto", "preference")
    need(  # each preference record was refused as having no such field
        not (preference and single),
        "data_format",
        f"reads single examples, and --objective {o.name} trains on pairs: give --data-format preference "
        "or auto (answers as messages are read as conversations)",
    )
    metric = cfg.eval.metric_for_best or ""
    need(
        preference or not metric.startswith("eval_rewards/"),
        "metric_for_best",
        "reward metrics need a preference objective (--objective dpo, ipo, simpo or orpo)",
    )
    need(
        not preference or not metric.startswith("eval_perplexity"),
        "metric_for_best",
        f"--objective {o.name} reports no perplexity; use eval_loss or eval_rewards/accuracies",
    )
    need(
        not preference or cfg.launch.strategy != "dp",
        "strategy",
        f"--objective {o.name} keeps both answers of a pair in one replica; use ddp or fsdp",
    )


# Given at all, even at its default, one of these asks for what the run would not do: an Axolotl
# config's `lora_r: 16` without `adapter: lora` trained every weight, TRL's `beta: 0.1` under
# --objective sft trained no preference.
_ASKS_FOR_ITS_FEATURE = frozenset(
    {
        "lora_rank",
        "lora_alpha",
        "lora_target_modules",
        "bnb_4bit_quant_type",
        "beta",
        "simpo_gamma",
        "orpo_lambda",
    }
)


def _check_applicable(cfg: TrainConfig, need: Need, given: frozenset[str]) -> None:
    """A setting changed from its default where it has no effect is refused (one table for all of
    them, LoRA's, quantization's and the objectives' knobs), and one of
    :data:`_ASKS_FOR_ITS_FEATURE` given at all: a run that quietly
    ignored ``lora_r: 8`` (LoRA not switched on: all weights trained) or ``--simpo-gamma`` (under
    --objective dpo) is not the run its user asked for."""
    o, lora = cfg.objective, cfg.lora
    sgd, adam = cfg.optim.name == "sgd", ("adam_beta1", "adam_beta2", "adam_eps")
    referenced = f"applies to --objective {' and '.join(WITH_REFERENCE)} only (the others need no reference)"
    lora_only = "applies with --lora only (LoRA is off: every weight would train)"
    applies = {
        "lora_rank": (lora.enabled, lora_only),
        "lora_alpha": (lora.enabled, lora_only),
        "lora_dropout": (
            lora.enabled and (o.name not in PREFERENCE or lora.dropout == 0),
            lora_only
            if not lora.enabled
            else f"has no effect under --objective {o.name}, which turns all dropout off (as TRL's "
            "disable_dropout)",
        ),
        "lora_target_modules": (lora.enabled, lora_only),
        "merge_lora": (lora.enabled, "needs --lora"),
        "bnb_4bit_quant_type": (cfg.model.load_in_4bit, "needs --load-in-4bit"),
        "beta": (
            o.name in WITH_BETA,
            "under --objective orpo: ORPO's weight (TRL's ORPOConfig.beta) is --orpo-lambda"
            if o.name == "orpo"
            else f"applies to --objective {', '.join(WITH_BETA)} only",
        ),
        "label_smoothing": (o.name in ("dpo", "simpo"), "applies to --objective dpo and simpo only"),
        "simpo_gamma": (o.name == "simpo", "applies to --objective simpo only"),
        "orpo_lambda": (o.name == "orpo", "applies to --objective orpo only"),
        "neftune_alpha": (o.name == "sft", "applies to --objective sft only"),
        # Preference objectives score the answers alone (TRL's DPO and ORPO mask the prompt too).
        "train_on_prompt": (
            o.name == "sft",
            "applies to --objective sft only: a preference pair scores its answers",
        ),
        "reference": (o.name in WITH_REFERENCE, referenced),
        "reference_model": (o.name in WITH_REFERENCE, referenced),
        # HF Trainer lets warmup_steps win silently; one of them is what the user meant. A ratio of 0
        # beside them (transformers 4's dumps write both) asks nothing: the steps are taken, as there
        # (steps of 0 beside a ratio were left unset as the names were read: the ratio is taken).
        "warmup_ratio": (
            cfg.schedule.warmup_steps is None or cfg.schedule.warmup_ratio == 0,
            "is instead of --warmup-steps: give one",
        ),
        "decay_ratio": (cfg.schedule.name == "wsd", "applies to --lr-schedule wsd only"),
        "min_lr_ratio": (
            cfg.schedule.name in ("cosine", "wsd"),
            "applies to --lr-schedule cosine and wsd only (where the decay ends)",
        ),
        "hub_private": (cfg.checkpoint.push_to_hub is not None, "applies with --push-to-hub only"),
        "momentum": (sgd, "applies to --optimizer sgd only (AdamW's is --adam-beta1)"),
        **{name: (not sgd, "applies to the AdamW optimizers only (not --optimizer sgd)") for name in adam},
        "sample_temperature": (cfg.samples.prompts is not None, "applies with --sample-prompts only"),
        "sample_max_new_tokens": (cfg.samples.prompts is not None, "applies with --sample-prompts only"),
    }
    for name, (ok, why) in applies.items():
        s = setting_named(name)
        # LoRA's dropout given for a LoRA run the objective keeps dropout-free is as TRL runs it: not refused.
        feature = name in _ASKS_FOR_ITS_FEATURE or (name == "lora_dropout" and not lora.enabled)
        asked = value_of(cfg, s) != s.default or (name in given and feature)
        need(ok or not asked, name, why)


def _check_samples(s: SampleSettings, need: Need) -> None:
    need(s.every >= 0, "sample_every", "must be >= 0")
    need(not s.every or s.prompts is not None, "sample_every", "needs --sample-prompts")
    need(s.temperature >= 0, "sample_temperature", "must be >= 0")
    need(1 <= s.max_new_tokens <= 4096, "sample_max_new_tokens", "must be in [1, 4096]")


def _check_launch(launch: LaunchSettings, health: HealthSettings, need: Need) -> None:
    need(launch.nproc_per_node >= 1, "nproc_per_node", "must be >= 1")
    need(launch.threads_per_process >= 0, "threads_per_process", "must be >= 0")
    need(launch.max_restarts >= 0, "max_restarts", "must be >= 0")
    need(launch.node_rank is None or launch.node_rank >= 0, "node_rank", "must be >= 0")
    nodes = parse_nnodes(launch.nnodes)[1]
    need(
        launch.node_rank is None or launch.node_rank < nodes,
        "node_rank",
        f"must be below --nnodes {launch.nnodes} (nodes count from 0)",
    )
    need(
        launch.rdzv_endpoint is not None or nodes == 1,
        "rdzv_endpoint",
        "is needed when --nnodes is more than 1",
    )
    if launch.rdzv_endpoint is not None:
        why = "must be HOST:PORT (node 0's address) with a port from 1 to 65535"
        need(_is_endpoint(launch.rdzv_endpoint), "rdzv_endpoint", why)
    need(health.hang_timeout >= 0, "hang_timeout", "must be >= 0 (0: no watchdog)")
    need(health.collective_timeout >= 10, "collective_timeout", "must be >= 10 seconds")


def _is_endpoint(endpoint: str) -> bool:
    """HOST or HOST:PORT as torchrun reads it (an IPv6 host in brackets, or before the last colon;
    no port: 29400), checked before the launcher's rendezvous raises a ValueError with a traceback."""
    text = endpoint.strip()
    host, colon, port = text.rpartition(":")
    if not colon or (text.startswith("[") and text.endswith("]")):
        host, port = text, "29400"
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return bool(re.fullmatch(r"[\w.:-]+", host)) and port.isdigit() and 1 <= int(port) <= 65535


def _check_outputs(c: CheckpointSettings, log_every: int, need: Need) -> None:
    need(bool(c.output_dir.strip()), "output_dir", "must name a folder")
    need(c.save_every >= 0, "save_every", "must be >= 0")
    need(c.keep_last >= 0, "keep_last", "must be >= 0")
    need(log_every >= 1, "log_every", "must be >= 1")


def _check_data(cfg: TrainConfig, need: Need) -> None:
    need(bool(cfg.model.name.strip()), "model", "must name a model")
    need(
        cfg.model.loss_chunk_size is None or cfg.model.loss_chunk_size >= 0, "loss_chunk_size", "must be >= 0"
    )
    need(bool(cfg.data.train.strip()), "data", "must name data")
    if cfg.data.weights is not None:
        sources = len(source_names(cfg.data.train, "--data"))
        parse_weights(cfg.data.weights, sources)
        # One source's weight changes nothing: refused, as other settings without effect are.
        need(sources > 1, "data_weights", "applies to a mixture of two or more --data sources only")
    need(cfg.examples.max_length >= 2, "max_length", "must be >= 2")
    need(cfg.examples.max_length <= MAX_LENGTH, "max_length", f"must be at most 2**24 ({MAX_LENGTH:,})")
    m = cfg.examples.max_prompt_length
    limit = cfg.examples.max_length
    need(m is None or 1 <= m < limit, "max_prompt_length", f"must be in [1, --max-length), here [1, {limit})")
    need(bool(cfg.examples.text_field), "text_field", "must not be empty")
    need(cfg.data.num_workers >= 0, "num_workers", "must be >= 0")
    need(
        cfg.samples.prompts is None or cfg.samples.max_new_tokens < cfg.examples.max_length,
        "sample_max_new_tokens",
        "must be below --max-length (a prompt and its generation stay within it)",
    )


def _check_evaluation_data(cfg: TrainConfig, need: Need) -> None:
    split, eval_data = cfg.data.eval_split, cfg.data.eval
    need(split is None or eval_data is None, "eval_split", "is instead of --eval-data: give one")
    need(  # it would hold out pieces of documents whose other pieces train (HF splits before chunking)
        split is None or cfg.examples.truncation != "split",
        "eval_split",
        "holds out examples, and --truncation split makes several of each document: their neighbours "
        "would train; give held-out documents as --eval-data",
    )
    need(
        split is None or 0 < split < 1 or (split >= 1 and float(split).is_integer()),
        "eval_split",
        "must be a fraction in (0, 1) or a whole number of examples",
    )
    names = eval_source_names(cfg)
    metric = cfg.eval.metric_for_best
    if metric is not None and metric not in BEST_METRICS:
        base, _, name = metric.rpartition("/")
        per_source = (
            f", or one of them of a source: METRIC/{'|'.join(names)}"
            if names
            else (
                "; a per-source metric (METRIC/NAME) needs several --eval-data sources, or --eval-split "
                "of a weighted --data mixture"
                if base in BEST_METRICS  # eval_loss/NAME; eval_rewards/chosen is no such thing
                else ""
            )
        )
        need(
            base in BEST_METRICS and name in names,
            "metric_for_best",
            f"must be {' | '.join(BEST_METRICS)}{per_source}",
        )
    evaluates = eval_data is not None or split is not None or cfg.data.train == SAMPLE_DATA
    for name, given in (
        # --load-best-at-end's metric is eval_loss when none is given: named by what the user gave.
        ("load_best_at_end", cfg.eval.load_best_at_end),
        ("metric_for_best", cfg.eval.metric_for_best is not None),
        ("eval_every", cfg.eval.every),
        ("eval_on_start", cfg.eval.on_start),
    ):
        need(not given or evaluates, name, "needs --eval-data or --eval-split (nothing to evaluate)")


def eval_source_names(cfg: TrainConfig) -> list[str]:
    """The sources evaluated apart: several --eval-data sources, or --eval-split of a mixture."""
    if cfg.data.eval is not None and len(named_items(cfg.data.eval)) > 1:
        return source_names(cfg.data.eval, "--eval-data")
    if cfg.data.eval_split is not None and cfg.data.weights is not None:
        return source_names(cfg.data.train, "--data")
    return []


def _check_batch(batch: BatchSettings, world_size: int, need: Need) -> None:
    need(batch.global_batch_size >= 1, "global_batch_size", "must be >= 1")
    need(batch.micro_batch_size is None or batch.micro_batch_size >= 1, "micro_batch_size", "must be >= 1")
    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    size = batch.global_batch_size
    # SettingErrors: a --config file's value is named by its line (the micro batch's when set).
    if batch.micro_batch_size is None:
        if size % world_size:
            below = size - size % world_size
            near = sorted({max(world_size, below), below + world_size})  # one where the batch is below
            raise SettingError(
                "global_batch_size",
                f"--global-batch-size {size}",
                f"does not divide over {processes}; give a multiple of {world_size} (such as "
                f"{' or '.join(map(str, near))}), or "
                f"run on a number of processes that divides {size} (as a resumed run must: it keeps its "
                "global batch)",
            )
    elif size % (batch.micro_batch_size * world_size):
        per_step = batch.micro_batch_size * world_size
        raise SettingError(
            "micro_batch_size",
            f"--micro-batch-size {batch.micro_batch_size}",
            f"--global-batch-size {size} does not divide into {batch.micro_batch_size} x {processes}; "
            f"use a global batch that is a multiple of {per_step}",
        )
