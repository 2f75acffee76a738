"""Typed settings for `lmtune train`: every setting once, with its default, help and allowed values.

Every setting is a dataclass field whose metadata holds its help text and, where there is a fixed
set, its allowed values: the CLI (and its --help), the YAML file, validation (validate.py), the
flags given to subprocesses (config_io.to_argv) and ``run.json`` can never disagree about names,
defaults or choices.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from lmtune.errors import UserError

# --data sample: the built-in addition task, and its held-out split (the default evaluation data).
SAMPLE_DATA = "sample"
SAMPLE_EVAL = "sample:eval"
# The settings `lmtune plan` reads (the model, the data's shape, the setup): its --help lists these.
_PLAN = (
    "model data data_format text_field train_on_prompt chat_template packing truncation "
    "skip_bad_lines txt_mode cache_dir max_length global_batch_size micro_batch_size seed strategy "
    "precision optimizer activation_checkpointing lora lora_rank lora_alpha lora_dropout "
    "lora_target_modules loss_chunk_size compile device nproc_per_node nnodes trust_remote_code"
)
PLAN_SETTINGS = tuple(_PLAN.split())
DEFAULT_EPOCHS = 3
SAMPLE_EPOCHS = 8


def _help(text: str, choices: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field metadata: the --help text, and the allowed values where there is a fixed set (the one
    place they are listed: --help shows them as {a,b,c}, validate() checks them)."""
    return {"help": text, "choices": choices}


@dataclass
class TrainConfig:
    """Everything one training run needs; a YAML file may set any field, flags override it."""

    model: str = field(
        default="tiny",
        metadata=_help(
            "Local Hugging Face model folder, hub id, or built-in preset (tiny, small) built offline."
        ),
    )
    data: str = field(
        default=SAMPLE_DATA,
        metadata=_help(
            "Training data, comma-separated: .jsonl/.ndjson, .json (a list), .parquet, .csv or .txt "
            "files, globs, folders, a saved Hugging Face data set folder, a hub data set NAME[:SPLIT], "
            "or 'sample' for the built-in addition task."
        ),
    )
    eval_data: str | None = field(
        default=None,
        metadata=_help(
            "Evaluation data, given like --data. With --data sample it defaults to the sample's "
            "held-out split; otherwise no evaluation unless given."
        ),
    )
    eval_split: float | None = field(
        default=None,
        metadata=_help(
            "Hold out this share of --data for evaluation (a fraction below 1, or a number of "
            "examples): the same examples whatever the number of processes and across resume, never "
            "trained on. Instead of --eval-data."
        ),
    )
    data_format: str = field(
        default="auto",
        metadata=_help(
            "auto (from each record's fields) | text (train on all of it) | prompt_completion "
            "(prompt+completion or instruction/input/output; train on the completion) | messages "
            "(chat; train on assistant turns).",
            ("auto", "text", "prompt_completion", "messages"),
        ),
    )
    text_field: str = field(default="text", metadata=_help("Name of the field holding plain text."))
    train_on_prompt: bool = field(
        default=False,
        metadata=_help(
            "Train on every token: the prompt of prompt_completion records and chat's system and user "
            "turns too (by default only completions and assistant replies train)."
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_help(
            "Chat template for messages data: chatml | llama3 | gemma | a FILE.jinja. Its turn markers "
            "become special tokens (the embeddings grow when the vocabulary lacks them) and it is saved "
            "with the model. Default: the tokenizer's own template, else a built-in one."
        ),
    )
    packing: str = field(
        default="auto",
        metadata=_help(
            "Pack several examples of a step into rows of --max-length, with no attention across "
            "them: on | off | auto (text-format data: packs the steps where grouping by length "
            "would still leave over 10% padding).",
            ("auto", "on", "off"),
        ),
    )
    group_by_length: bool = field(
        default=True,
        metadata=_help("Without packing, sort a step's examples by length before cutting micro-batches."),
    )
    truncation: str = field(
        default="right",
        metadata=_help(
            "Examples longer than --max-length: right (cut the end) | left (cut the start) | drop | "
            "error. Counts go to the log and run.json.",
            ("right", "left", "drop", "error"),
        ),
    )
    skip_bad_lines: bool = field(
        default=False,
        metadata=_help(
            "Skip unreadable lines (bad JSON, bad UTF-8) with a warning and a count, instead of stopping."
        ),
    )
    txt_mode: str = field(
        default="line",
        metadata=_help(
            ".txt files: one example per line | per blank-line-separated block.", ("line", "block")
        ),
    )
    cache_dir: str | None = field(
        default=None,
        metadata=_help(
            "Where tokenized data is cached (default: $LMTUNE_CACHE_DIR, else ~/.cache/lmtune/data). "
            "Must be shared by all nodes unless --cache-per-node."
        ),
    )
    cache_per_node: bool = field(
        default=False,
        metadata=_help("Cache dir is node-local: one process per node tokenizes, instead of one in all."),
    )
    output_dir: str = field(
        default="lmtune-output",
        metadata=_help("Folder for final/, metrics.jsonl and run.json."),
    )
    epochs: int | None = field(
        default=None,
        metadata=_help(
            f"Passes over the training data. Default: {DEFAULT_EPOCHS}, or {SAMPLE_EPOCHS} for --data "
            "sample (a small set that needs more passes)."
        ),
    )
    max_steps: int | None = field(
        default=None,
        metadata=_help("Stop after this many optimizer steps (overrides --epochs)."),
    )
    global_batch_size: int = field(
        default=32,
        metadata=_help(
            "Examples per optimizer step across all processes; gradient accumulation is derived "
            "from it, so changing the number of processes does not change the optimisation."
        ),
    )
    micro_batch_size: int | None = field(
        default=None,
        metadata=_help(
            "Examples per forward pass on one process. Default: the global batch divided by the "
            "number of processes (no accumulation); lower it when a batch does not fit in memory."
        ),
    )
    lr: float | None = field(
        default=None,
        metadata=_help(
            "Peak learning rate. Default: 1e-3 for a preset trained from scratch, 2e-5 for a "
            "pretrained model."
        ),
    )
    lr_schedule: str = field(
        default="cosine",
        metadata=_help(
            "cosine (warmup, then cosine decay to lr x --min-lr-ratio) | linear (warmup, then linear "
            "decay to 0) | constant (after warmup) | wsd (warmup, stable, then the last --decay-ratio "
            "of the steps decaying to lr x --min-lr-ratio).",
            ("cosine", "linear", "constant", "wsd"),
        ),
    )
    min_lr_ratio: float = field(default=0.1, metadata=_help("cosine and wsd decay end at lr x this ratio."))
    warmup_ratio: float = field(
        default=0.05, metadata=_help("Fraction of the optimizer steps spent in linear warmup.")
    )
    warmup_steps: int | None = field(default=None, metadata=_help("Warmup steps, instead of --warmup-ratio."))
    decay_ratio: float = field(
        default=0.1, metadata=_help("wsd: fraction of the optimizer steps spent decaying at the end.")
    )
    weight_decay: float = field(
        default=0.01,
        metadata=_help("AdamW weight decay on matrices; biases, norms and other 1-d tensors get none."),
    )
    optimizer: str = field(
        default="adamw",
        metadata=_help(
            "adamw | adamw8bit (bitsandbytes: 8-bit optimizer state, about a quarter of the memory) | "
            "paged_adamw8bit (8-bit, state paged to CPU memory under GPU memory pressure) | sgd "
            "(with --momentum). Weights stay fp32 with every choice.",
            ("adamw", "adamw8bit", "paged_adamw8bit", "sgd"),
        ),
    )
    momentum: float = field(default=0.9, metadata=_help("SGD momentum (--optimizer sgd)."))
    adam_beta1: float = field(default=0.9, metadata=_help("AdamW beta1."))
    adam_beta2: float = field(default=0.999, metadata=_help("AdamW beta2."))
    adam_eps: float = field(default=1e-8, metadata=_help("AdamW epsilon."))
    max_grad_norm: float = field(
        default=1.0, metadata=_help("Clip the global gradient norm to this value; 0 disables clipping.")
    )
    max_length: int = field(
        default=512,
        metadata=_help("Truncate examples to this many tokens (the appended EOS included)."),
    )
    seed: int = field(
        default=42, metadata=_help("Seed for model init, data order and dropout; shared by all ranks.")
    )
    strategy: str = field(
        default="auto",
        metadata=_help(
            "auto (ddp when launched with several processes, else single) | single | "
            "dp (nn.DataParallel over the visible GPUs) | ddp | fsdp (FSDP2: parameters, gradients "
            "and optimizer state sharded over the processes; sharded checkpoints).",
            ("auto", "single", "dp", "ddp", "fsdp"),
        ),
    )
    precision: str = field(
        default="fp32",
        metadata=_help(
            "fp32 | bf16 (autocast, CPU and GPU) | fp16 (autocast with a gradient scaler, GPU only); "
            "weights and optimizer state stay fp32.",
            ("fp32", "bf16", "fp16"),
        ),
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata=_help(
            "Recompute each decoder block's activations in the backward pass instead of keeping them "
            "(non-reentrant, so it works under DDP): less memory, about a third more compute."
        ),
    )
    lora: bool = field(
        default=False,
        metadata=_help(
            "Train LoRA adapters (peft) instead of all weights: only the adapters have gradients, "
            "optimizer state and all-reduce; checkpoints and final/ hold the adapter (PEFT format)."
        ),
    )
    lora_rank: int = field(default=16, metadata=_help("LoRA rank r."))
    lora_alpha: float = field(default=32.0, metadata=_help("LoRA alpha (the update is scaled by alpha / r)."))
    lora_dropout: float = field(default=0.05, metadata=_help("Dropout on the LoRA input."))
    lora_target_modules: str = field(
        default="all-linear",
        metadata=_help(
            "Comma-separated module names to adapt (q_proj,v_proj,...), or all-linear: every linear "
            "layer of the decoder blocks, found per architecture (the output head excluded)."
        ),
    )
    merge_lora: bool = field(
        default=False,
        metadata=_help("With --lora, also write the base model with the adapter merged to final/merged/."),
    )
    loss_chunk_size: int | None = field(
        default=None,
        metadata=_help(
            "Compute the output layer and the loss this many tokens at a time, so the logits of a "
            "micro-batch (tokens x vocabulary) never exist whole; 0 computes full logits. Default: "
            "sized from the vocabulary (about 128 MiB of fp32 logits per chunk). Models whose "
            "output is not a plain linear layer (a logit soft-cap) keep full logits."
        ),
    )
    compile: bool = field(
        default=False,
        metadata=_help("torch.compile the model; falls back to eager with a message if it fails."),
    )
    device: str = field(
        default="auto", metadata=_help("auto (cuda when available) | cpu | cuda.", ("auto", "cpu", "cuda"))
    )
    nproc_per_node: int = field(
        default=1,
        metadata=_help(
            "Start this many processes on this machine through torch.distributed.run "
            "(ignored under torchrun, which has already started them)."
        ),
    )
    threads_per_process: int = field(
        default=0,
        metadata=_help("CPU threads per process; 0 shares this machine's cores evenly among its processes."),
    )
    eval_every: int = field(
        default=0, metadata=_help("Evaluate every N optimizer steps; 0 evaluates only at the end.")
    )
    metric_for_best: str | None = field(
        default=None,
        metadata=_help(
            "Keep the best checkpoint by this eval metric (eval_loss | eval_perplexity; lower is "
            "better unless --greater-is-better): it is saved when it improves and never pruned.",
            ("eval_loss", "eval_perplexity"),
        ),
    )
    greater_is_better: bool = field(
        default=False, metadata=_help("With --metric-for-best: higher is better.")
    )
    load_best_at_end: bool = field(
        default=False, metadata=_help("With --metric-for-best: final/ is the best model, not the last one.")
    )
    early_stopping_patience: int = field(
        default=0,
        metadata=_help(
            "With --metric-for-best: stop (saved, exit 0) after this many evaluations without "
            "improvement; 0 never stops early."
        ),
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata=_help("How much better an evaluation must be to count as an improvement.")
    )
    sample_prompts: str | None = field(
        default=None,
        metadata=_help(
            'JSONL file of prompts to generate from during training: each line a string, {"prompt": '
            '...} or {"messages": [...]} (rendered with the chat template). The generations go to '
            'metrics.jsonl ("kind": "sample") and the log.'
        ),
    )
    sample_every: int = field(
        default=0,
        metadata=_help("With --sample-prompts: generate every N optimizer steps; 0 only at the end."),
    )
    sample_temperature: float = field(
        default=0.0, metadata=_help("With --sample-prompts: 0 decodes greedily, above 0 samples (seeded).")
    )
    sample_max_new_tokens: int = field(
        default=48, metadata=_help("With --sample-prompts: the most tokens generated per prompt.")
    )
    log_every: int = field(default=1, metadata=_help("Write a metrics.jsonl line every N optimizer steps."))
    doctor: bool = field(
        default=False,
        metadata=_help(
            "Before training, run lmtune doctor's checks on every rank (versions, devices, all-reduce, "
            "the output and cache folders shared and writable, free disk, data, clocks); stop on a failure."
        ),
    )
    hang_timeout: float = field(
        default=30.0,
        metadata=_help(
            "Under lmtune's launcher, end the job (exit code 3, or a restart under --max-restarts) when "
            "a rank has not advanced for this long, or 10x its slowest step if longer (evaluation, "
            "saving and the first step get 10 minutes); OUTPUT/hang-report.txt says which rank, where. "
            "0 turns the watchdog off."
        ),
    )
    collective_timeout: float = field(
        default=300.0,
        metadata=_help(
            "After the first step, a collective that waits this long for another rank fails (before: "
            "30 minutes, for loading and warm-up; evaluation and saving keep 30 minutes)."
        ),
    )
    report_to: str = field(
        default="none",
        metadata=_help(
            "Also send the metrics to: none | tensorboard | wandb | mlflow, or a comma list "
            "(TensorBoard under OUTPUT/tensorboard; W&B offline under OUTPUT/wandb unless "
            "WANDB_API_KEY or WANDB_MODE is set; MLflow to MLFLOW_TRACKING_URI, else OUTPUT/mlruns)."
        ),
    )
    num_workers: int = field(default=0, metadata=_help("DataLoader worker processes per rank."))
    progress: bool = field(default=True, metadata=_help("Show a progress bar on rank 0."))
    profile: bool = field(
        default=False,
        metadata=_help("Time each step's data wait, forward, backward and optimizer into metrics.jsonl."),
    )
    save_every: int = field(
        default=0,
        metadata=_help(
            "Save a resumable checkpoint every N optimizer steps and at the end; 0 saves only when "
            "stopped by SIGTERM/SIGINT."
        ),
    )
    keep_last: int = field(default=3, metadata=_help("Keep the newest K checkpoints; 0 keeps all."))
    resume: str = field(
        default="auto",
        metadata=_help(
            "auto (continue from the newest valid checkpoint in --output-dir, if any) | never | "
            "PATH of a checkpoint folder."
        ),
    )
    on_nan: str = field(
        default="stop",
        metadata=_help(
            "A non-finite loss or gradient norm: stop (keep the last checkpoint) | skip the update.",
            ("stop", "skip"),
        ),
    )
    record_samples: bool = field(
        default=False,
        metadata=_help("Write the example ids of every step to samples/rank-R.jsonl (to audit data order)."),
    )
    max_restarts: int = field(
        default=0,
        metadata=_help(
            "Restart all workers this many times when one dies; they resume from the newest checkpoint."
        ),
    )
    nnodes: str = field(
        default="1",
        metadata=_help("Machines in the job: N, or MIN:MAX for an elastic job (c10d rendezvous)."),
    )
    node_rank: int | None = field(
        default=None,
        metadata=_help("This machine's rank; node 0 hosts the rendezvous store at --rdzv-endpoint."),
    )
    rdzv_endpoint: str | None = field(
        default=None, metadata=_help("HOST:PORT of the rendezvous, the same on every node (multi-node).")
    )
    rdzv_id: str = field(default="lmtune", metadata=_help("Job id shared by the nodes of one run."))
    trust_remote_code: bool = field(
        default=False,
        metadata=_help("Allow a hub model to run its own Python code (off: only built-in classes)."),
    )
    overwrite: bool = field(
        default=False,
        metadata=_help(
            "Start afresh in an --output-dir that holds an earlier run: its checkpoints, final/, "
            "metrics and records are deleted first (without it, such a folder is refused)."
        ),
    )


def config_fields() -> list[dataclasses.Field[Any]]:
    """The settings of :class:`TrainConfig`, in declaration order."""
    return list(dataclasses.fields(TrainConfig))


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def field_type(f: dataclasses.Field[Any]) -> type:
    """The scalar type of a field (``int | None`` gives ``int``)."""
    hints = typing.get_type_hints(TrainConfig)
    hint = hints[f.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    assert isinstance(hint, type)
    return hint


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def choices(name: str) -> tuple[str, ...]:
    """The allowed values of a setting (empty: any value of its type)."""
    found: tuple[str, ...] = _FIELDS[name].metadata.get("choices", ())
    return found


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    lo, _, hi = value.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"--nnodes: expected N or MIN:MAX, got {value!r}") from None
    if not 1 <= low <= high:
        raise UserError(f"--nnodes: expected 1 <= MIN <= MAX, got {value!r}")
    return low, high


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """Warmup in optimizer steps: as set, or --warmup-ratio of the run."""
    return cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_ratio * total_steps)
