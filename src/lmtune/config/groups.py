"""The settings groups of a training run: each a frozen dataclass whose fields carry their --help
text, their allowed values and, where it differs from the field's name, the flag that sets them.

A group is what a function takes (``build_optimizer`` takes :class:`OptimSettings`, the data cache
takes :class:`ExampleSettings`); :class:`lmtune.config.settings.TrainConfig` holds one of each. The
flags and YAML keys stay flat (``--lora-rank``, ``lora_rank:``) and are listed once, here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_EPOCHS = 3
SAMPLE_EPOCHS = 8
# Far past any run: a checkpoint's larger count is an edited file, a larger --max-steps a slip (1e30
# steps warmed up for 5e28 of them, training nothing at a learning rate of ~1e-29).
MAX_STEPS = 2**40
# Tokens in one example: far past any model's context (a 1e22 --max-length packed rows forever).
MAX_LENGTH = 2**24


def setting(default: Any, text: str, *, choices: tuple[str, ...] = (), flag: str | None = None) -> Any:
    """A settings field: its default, its --help text, its allowed values (the one place they are
    listed: --help shows them as {a,b,c}, validation checks them) and its flag's name (default: the
    field's own)."""
    return field(default=default, metadata={"help": text, "choices": choices, "flag": flag})


@dataclass(frozen=True)
class ModelSettings:
    """The model and how it runs: what to load, precision, device, and its memory savers."""

    name: str = setting(
        "tiny",
        "Local Hugging Face model folder, hub id, or built-in preset (tiny, small, medium) built offline.",
        flag="model",
    )
    trust_remote_code: bool = setting(
        False, "Allow a hub model to run its own Python code (off: only built-in classes)."
    )
    precision: str = setting(
        "fp32",
        (
            "fp32 | bf16 (autocast, CPU and GPU) | fp16 (autocast with a gradient scaler, GPU only); weights "
            "and optimizer state stay fp32."
        ),
        choices=("fp32", "bf16", "fp16"),
    )
    device: str = setting("auto", "auto (cuda when available) | cpu | cuda.", choices=("auto", "cpu", "cuda"))
    compile: bool = setting(False, "torch.compile the model; falls back to eager with a message if it fails.")
    activation_checkpointing: bool = setting(
        False,
        (
            "Recompute each decoder block's activations in the backward pass instead of keeping them "
            "(non-reentrant, so it works under DDP): less memory, about a third more compute."
        ),
    )
    loss_chunk_size: int | None = setting(
        None,
        (
            "Compute the output layer and the loss this many tokens at a time, so the logits of a "
            "micro-batch "
            "(tokens x vocabulary) never exist whole; 0 computes full logits. Default: sized from the "
            "vocabulary and the device (about 128 MiB of fp32 logits per chunk on a CPU, 1 GiB on a GPU). "
            "Models whose output is not a plain linear "
            "layer (a logit soft-cap) keep full logits."
        ),
    )
    load_in_4bit: bool = setting(
        False,
        (
            "QLoRA: load the frozen base with its linear layers in 4 bits (bitsandbytes; double "
            "quantization, computed in --precision's dtype); embeddings, norms and the output head stay "
            "fp32. Needs --lora."
        ),
    )
    load_in_8bit: bool = setting(
        False, "Load the frozen base with its linear layers in 8 bits (bitsandbytes LLM.int8). Needs --lora."
    )
    bnb_4bit_quant_type: str = setting(
        "nf4",
        "With --load-in-4bit: nf4 (4-bit NormalFloat, for normally distributed weights) | fp4.",
        choices=("nf4", "fp4"),
    )


@dataclass(frozen=True)
class DataSettings:
    """Where the examples come from, where their tokenized form is cached, and how they are read."""

    train: str = setting(
        "sample",
        (
            "Training data, comma-separated: .jsonl/.ndjson, .json (a list), .parquet, .csv, .tsv or .txt "
            "files, globs, folders, a saved Hugging Face data set folder, a hub data set NAME[:SPLIT], or "
            "'sample' for the built-in addition task."
        ),
        flag="data",
    )
    weights: str | None = setting(
        None,
        (
            "A mixture: one positive weight per --data source (comma-separated, normalised). An epoch keeps "
            "as many examples as the sources hold together, each source its weight's share: a source is "
            "repeated evenly or walked across epochs without repeats (README: Data mixtures). Name a source "
            "NAME=PATH in --data (default: its file stem)."
        ),
        flag="data_weights",
    )
    eval: str | None = setting(
        None,
        (
            "Evaluation data, given like --data. With --data sample it defaults to the sample's held-out "
            "split; otherwise no evaluation unless given. Several sources (NAME=PATH,...) are also "
            "evaluated one by one (eval_loss/NAME)."
        ),
        flag="eval_data",
    )
    eval_split: float | None = setting(
        None,
        (
            "Hold out this share of --data for evaluation (a fraction below 1, or a number of examples): the "
            "same examples whatever the number of processes and across resume, never trained on. Instead of "
            "--eval-data."
        ),
    )
    cache_dir: str | None = setting(
        None,
        (
            "Where tokenized data is cached (default: $LMTUNE_CACHE_DIR/data, else ~/.cache/lmtune/data). "
            "Must be shared by all nodes unless --cache-per-node."
        ),
    )
    cache_per_node: bool = setting(
        False, "Cache dir is node-local: one process per node tokenizes, instead of one in all."
    )
    num_workers: int = setting(0, "DataLoader worker processes per rank.")


@dataclass(frozen=True)
class ExampleSettings:
    """How records become training examples: format, chat template, what trains, length and truncation.

    Every field is part of the tokenized-data cache key."""

    format: str = setting(
        "auto",
        (
            "auto (from each record's fields) | text (train on all of it) | prompt_completion "
            "(prompt+completion or instruction/input/output; train on the completion) | messages "
            "(chat: a list of role/content turns; train on assistant turns) | sharegpt (chat as "
            "conversations of from/value turns, roles human/gpt/system) | preference (prompt + chosen + "
            "rejected, as strings or as messages, for the preference objectives)."
        ),
        choices=("auto", "text", "prompt_completion", "messages", "sharegpt", "preference"),
        flag="data_format",
    )
    text_field: str = setting("text", "Name of the field holding plain text.")
    field_map: str | None = setting(
        None,
        (
            "The data set's names for lmtune's fields, as OURS=THEIRS pairs, comma-separated: fields "
            "(messages=dialog,role=speaker,content=text; prompt=question,completion=answer; text=body) "
            "and role values (assistant=bot,user=human). In YAML also a mapping."
        ),
    )
    train_on_prompt: bool = setting(
        False,
        (
            "Train on every token: the prompt of prompt_completion records and chat's system and user turns "
            "too (by default only completions and assistant replies train)."
        ),
    )
    chat_template: str | None = setting(
        None,
        (
            "Chat template for messages data: chatml | llama3 | gemma | a FILE.jinja. Its turn "
            "markers become "
            "special tokens (the embeddings grow when the vocabulary lacks them) and it is saved with the "
            "model. Default: the tokenizer's own template, else a built-in one."
        ),
    )
    max_length: int = setting(512, "Truncate examples to this many tokens (the appended EOS included).")
    truncation: str = setting(
        "right",
        (
            "Examples longer than --max-length: right (cut the end) | left (cut the start) | drop | error | "
            "split (a document, a text record, trains as consecutive pieces of --max-length tokens, as HF's "
            "run_clm chunks texts; other examples are cut as right). Pairs (prompt + longer answer): right, "
            "left and split cut the prompt left, the answers right. Counts go to the log and run.json."
        ),
        choices=("right", "left", "drop", "error", "split"),
    )
    max_prompt_length: int | None = setting(
        None,
        "Preference pairs: a prompt longer than this many tokens is cut from the left first (TRL's "
        "max_prompt_length); prompt and answers then fit --max-length together as --truncation says.",
    )
    skip_bad_lines: bool = setting(
        False, "Skip unreadable lines (bad JSON, bad UTF-8) with a warning and a count, instead of stopping."
    )
    txt_mode: str = setting(
        "line",
        ".txt files: one example per line | per blank-line-separated block.",
        choices=("line", "block"),
    )


@dataclass(frozen=True)
class ObjectiveSettings:
    """What training optimises (lmtune.objectives)."""

    name: str = setting(
        "sft",
        "sft: supervised fine-tuning, next-token loss on the trained tokens, normalised by the global number "
        "of target tokens | dpo | ipo | simpo | orpo: preference tuning on {prompt, chosen, rejected} "
        "pairs, normalised by the global number of pairs (losses as TRL names them).",
        choices=("sft", "dpo", "ipo", "simpo", "orpo"),
        flag="objective",
    )
    beta: float = setting(
        0.1,
        "dpo, ipo, simpo: the implicit reward's scale (DPO's beta, IPO's tau, SimPO's beta). Higher keeps "
        "the policy closer to the reference. ORPO's (TRL's ORPOConfig.beta) is --orpo-lambda.",
    )
    label_smoothing: float = setting(
        0.0, "dpo and simpo: the assumed share of flipped preference labels (conservative DPO), in [0, 0.5)."
    )
    simpo_gamma: float = setting(0.5, "--objective simpo: the target reward margin gamma.")
    orpo_lambda: float = setting(
        0.1,
        "--objective orpo: the weight lambda of the odds-ratio term, which also scales the logged rewards "
        "(TRL's ORPOConfig.beta).",
    )
    neftune_alpha: float = setting(
        0.0,
        "sft: NEFTune, noise on the input embeddings while training (TRL's neftune_noise_alpha; the paper "
        "used 5 to 15): uniform in +-alpha / sqrt(length x width) of each example, drawn for each example "
        "and step from --seed, so the same whatever the processes or packing, and on resume. 0: none.",
    )
    reference: str = setting(
        "logprobs",
        "dpo and ipo: logprobs (the reference's log-probs of every pair computed once before training, "
        "cached beside the token cache) | live (a reference runs in every step: with --lora the base with "
        "the adapter disabled, no second copy; else a frozen copy).",
        choices=("logprobs", "live"),
    )
    reference_model: str | None = setting(
        None, "dpo and ipo: the reference model (folder, hub id or preset); default: the starting model."
    )


@dataclass(frozen=True)
class BatchSettings:
    """How examples form a step: the global batch (the invariant), micro-batches, packing."""

    global_batch_size: int = setting(
        32,
        (
            "Examples per optimizer step across all processes; gradient accumulation is derived from it, so "
            "changing the number of processes does not change the optimisation."
        ),
    )
    micro_batch_size: int | None = setting(
        None,
        (
            "Examples per forward pass on one process. Default: the global batch divided by the number of "
            "processes (no accumulation); lower it when a batch does not fit in memory."
        ),
    )
    packing: str = setting(
        "auto",
        (
            "Pack several examples of a step into rows of --max-length, with no attention across them: on | "
            "off | auto (text-format data: packs the steps where grouping by length would still leave"
            " over 10%"
            " padding)."
        ),
        choices=("auto", "on", "off"),
    )
    group_by_length: bool = setting(
        True, "Without packing, sort a step's examples by length before cutting micro-batches."
    )


@dataclass(frozen=True)
class OptimSettings:
    """The optimizer and its hyperparameters."""

    name: str = setting(
        "adamw",
        (
            "adamw | adamw8bit (bitsandbytes: 8-bit optimizer state, about a quarter of the memory) | "
            "paged_adamw8bit (8-bit, state paged to CPU memory under GPU memory pressure; on a CPU, "
            "adamw8bit) | sgd (with "
            "--momentum). Weights stay fp32 with every choice."
        ),
        choices=("adamw", "adamw8bit", "paged_adamw8bit", "sgd"),
        flag="optimizer",
    )
    lr: float | None = setting(
        None,
        (
            "Peak learning rate. Default: 1e-3 for a preset trained from scratch; for a pretrained model "
            "2e-5 (2e-4 with --lora), and under a preference objective TRL's 1e-6 (1e-5 with --lora)."
        ),
    )
    weight_decay: float = setting(
        0.01, "AdamW weight decay on matrices; biases, norms and other 1-d tensors get none."
    )
    momentum: float = setting(0.9, "SGD momentum (--optimizer sgd).")
    adam_beta1: float = setting(0.9, "AdamW beta1.")
    adam_beta2: float = setting(0.999, "AdamW beta2.")
    adam_eps: float = setting(1e-08, "AdamW epsilon.")
    max_grad_norm: float = setting(1.0, "Clip the global gradient norm to this value; 0 disables clipping.")


@dataclass(frozen=True)
class ScheduleSettings:
    """How long the run is, and the learning rate over it."""

    epochs: int | None = setting(
        None,
        (
            f"Passes over the training data. Default: {DEFAULT_EPOCHS}, or {SAMPLE_EPOCHS} for --data "
            f"sample (a"
            f" small set that needs more passes)."
        ),
    )
    max_steps: int | None = setting(
        None, "Stop after this many optimizer steps (overrides --epochs; -1, HF's unset, means none)."
    )
    name: str = setting(
        "cosine",
        (
            "cosine (warmup, then cosine decay to lr x --min-lr-ratio) | linear (warmup, then linear "
            "decay to "
            "0) | constant (after warmup) | wsd (warmup, stable, then the last --decay-ratio of the steps "
            "decaying to lr x --min-lr-ratio)."
        ),
        choices=("cosine", "linear", "constant", "wsd"),
        flag="lr_schedule",
    )
    warmup_ratio: float = setting(0.05, "Fraction of the optimizer steps spent in linear warmup.")
    warmup_steps: int | None = setting(None, "Warmup steps, instead of --warmup-ratio.")
    min_lr_ratio: float = setting(0.1, "cosine and wsd decay end at lr x this ratio.")
    decay_ratio: float = setting(0.1, "wsd: fraction of the optimizer steps spent decaying at the end.")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (peft) instead of full fine-tuning."""

    enabled: bool = setting(
        False,
        (
            "Train LoRA adapters (peft) instead of all weights: only the adapters have gradients, optimizer "
            "state and all-reduce; checkpoints and final/ hold the adapter (PEFT format)."
        ),
        flag="lora",
    )
    rank: int = setting(16, "LoRA rank r.", flag="lora_rank")
    alpha: float = setting(32.0, "LoRA alpha (the update is scaled by alpha / r).", flag="lora_alpha")
    dropout: float = setting(0.05, "Dropout on the LoRA input.", flag="lora_dropout")
    target_modules: str = setting(
        "all-linear",
        (
            "Comma-separated module names to adapt (q_proj,v_proj,...), or all-linear: every linear layer of "
            "the decoder blocks, found per architecture (the output head excluded)."
        ),
        flag="lora_target_modules",
    )
    merge: bool = setting(
        False,
        "With --lora, also write the base model with the adapter merged to final/merged/.",
        flag="merge_lora",
    )
