"""The names users bring from Hugging Face Trainer, TRL and Axolotl, and what lmtune makes of them.

A name with the same meaning as an lmtune setting is an accepted alias (``--learning-rate``,
``learning_rate:``): it sets that setting, which run.json records under lmtune's name. A name whose
meaning differs, or that lmtune derives instead of taking, is refused with a hint that says what to
do (exit 2). Any other unknown name gets the closest names as suggestions. Flags and YAML keys go
through the same table.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from typing import Any

from lmtune.errors import UserError, one_line

# Foreign name -> the lmtune setting of the same meaning.
ALIASES: dict[str, str] = {
    "learning_rate": "lr",  # HF Trainer, TRL, Axolotl
    "num_train_epochs": "epochs",  # HF Trainer, TRL
    "num_epochs": "epochs",  # Axolotl
    "per_device_train_batch_size": "micro_batch_size",  # HF Trainer, TRL
    "max_seq_length": "max_length",  # TRL (before 0.20)
    "sequence_len": "max_length",  # Axolotl
    "save_steps": "save_every",  # HF Trainer
    "eval_steps": "eval_every",  # HF Trainer
    "logging_steps": "log_every",  # HF Trainer
    "save_total_limit": "keep_last",  # HF Trainer
    "load_best_model_at_end": "load_best_at_end",  # HF Trainer
    "metric_for_best_model": "metric_for_best",  # HF Trainer
    "overwrite_output_dir": "overwrite",  # HF Trainer
    "dataloader_num_workers": "num_workers",  # HF Trainer
    "adam_epsilon": "adam_eps",  # HF Trainer
    "gradient_checkpointing": "activation_checkpointing",  # HF Trainer, Axolotl
    "torch_compile": "compile",  # HF Trainer, Axolotl
    "model_name_or_path": "model",  # HF examples, TRL
    "base_model": "model",  # Axolotl
    "train_file": "data",  # HF examples
    "validation_file": "eval_data",  # HF examples
    "dataset_name": "data",  # TRL: a hub data set, which --data takes
    "dataset_text_field": "text_field",  # TRL
    "train_on_inputs": "train_on_prompt",  # Axolotl
    "val_set_size": "eval_split",  # Axolotl
    "lora_r": "lora_rank",  # TRL, Axolotl
    "use_peft": "lora",  # TRL
    "ddp_timeout": "collective_timeout",  # HF Trainer: seconds, as lmtune's
    "hub_private_repo": "hub_private",  # HF Trainer
    "neftune_noise_alpha": "neftune_alpha",  # HF Trainer, TRL, Axolotl
    "rl_beta": "beta",  # Axolotl
    "dpo_beta": "beta",  # Axolotl (before rl_beta)
    "orpo_alpha": "orpo_lambda",  # Axolotl: ORPO's weight, which it passes as TRL's ORPOConfig.beta
    "log_every_n_steps": "log_every",  # torchtune
    "enable_activation_checkpointing": "activation_checkpointing",  # torchtune
    "out_dir": "output_dir",  # litgpt
    "num_nodes": "nnodes",  # litgpt
}

# Foreign name -> what to do instead. ``{name}`` becomes a setting's name in the style of the place
# it was written: ``--global-batch-size`` on the command line, ``global_batch_size`` in YAML.
_MEET = "the job meets at {rdzv_endpoint} HOST:PORT (node 0's address), with {nnodes} and {node_rank}"
HINTS: dict[str, str] = {
    "gradient_accumulation_steps": (
        "lmtune derives gradient accumulation from {global_batch_size} (examples per optimizer step "
        "over all processes) = {micro_batch_size} x processes x accumulation"
    ),
    "per_device_eval_batch_size": "evaluation runs micro-batches of {micro_batch_size}",
    # Axolotl's: lmtune counts in optimizer steps (the start line says how many an epoch has).
    "evals_per_epoch": "{eval_every} N evaluates every N optimizer steps",
    "saves_per_epoch": "{save_every} N saves a checkpoint every N optimizer steps",
    "bf16": "set the precision with {precision} bf16",
    # QLoRA's other bitsandbytes settings (peft, TRL, Axolotl): lmtune decides them.
    "bnb_4bit_compute_dtype": "4-bit layers compute in {precision}'s dtype (bf16 with {precision} bf16)",
    "bnb_4bit_use_double_quant": "{load_in_4bit} always quantizes the quantization constants too",
    "fp16": "set the precision with {precision} fp16",
    "optim": "lmtune's optimizers: {optimizer} adamw | adamw8bit | paged_adamw8bit | sgd",
    "lr_scheduler_type": (
        "lmtune's schedules: {lr_schedule} cosine | linear | constant | wsd (its cosine decays to lr x "
        "{min_lr_ratio}, 0.1 by default; transformers' cosine decays to 0: add {min_lr_ratio} 0)"
    ),
    "lr_scheduler": "lmtune's schedules: {lr_schedule} cosine | linear | constant | wsd",
    "eval_strategy": "{eval_every} N evaluates every N optimizer steps (0: at the end only)",
    "evaluation_strategy": "{eval_every} N evaluates every N optimizer steps (0: at the end only)",
    "save_strategy": "{save_every} N saves a checkpoint every N optimizer steps",
    "logging_strategy": "{log_every} N writes a metrics line every N optimizer steps",
    "resume_from_checkpoint": (
        "{resume} auto (the default: continue from the newest checkpoint in {output_dir}) | never | PATH"
    ),
    "completion_only_loss": (
        "lmtune trains only completions and assistant turns by default; {train_on_prompt} trains every token"
    ),
    "assistant_only_loss": (
        "lmtune trains only assistant turns of chat data by default; {train_on_prompt} trains every token"
    ),
    # HF Trainer's repository, uploaded to only with push_to_hub (taken together as lmtune's).
    "hub_model_id": (
        "the HF Trainer uploads there only with push_to_hub; lmtune's {push_to_hub} NAME/REPO names the "
        "repository and uploads"
    ),
    "hub_token": (
        "lmtune reads the Hugging Face token as huggingface_hub does (HF_TOKEN, or `hf auth login`), "
        "never from an option, so it stays out of run.json and the process list"
    ),
    "rl": "preference tuning is {objective} dpo | ipo | simpo | orpo",  # Axolotl
    "stage": "supervised is {objective} sft; preference tuning {objective} dpo | ipo | simpo | orpo",
    "loss_type": (  # TRL's DPOConfig
        "the preference loss is {objective}: TRL's sigmoid is dpo, ipo is ipo (SimPO and ORPO are "
        "{objective} simpo | orpo)"
    ),
    "precompute_ref_log_probs": (
        "{reference} logprobs (the default) precomputes the reference's log-probs once, {reference} live "
        "runs it in every step"
    ),
    "ref_model": "name the reference with {reference_model} (default: the starting model)",
    "sync_ref_model": (
        "lmtune's reference stays the model it starts as (or {reference_model}); it has no TR-DPO syncing"
    ),
    "deepspeed": "lmtune shards parameters, gradients and optimizer state with {strategy} fsdp (FSDP2)",
    "fsdp": "use {strategy} fsdp (FSDP2)",
    "fsdp_config": "lmtune's {strategy} fsdp (FSDP2) takes no config: it shards each decoder block",
    # torchrun's and the HF Trainer's launch settings.
    "master_addr": _MEET,
    "master_port": _MEET,
    "ddp_backend": "lmtune uses NCCL between GPUs and gloo on CPUs; it takes no backend",
    "no_cuda": "{device} cpu trains on the CPU",
    "use_cpu": "{device} cpu trains on the CPU",
    "local_rank": (
        "lmtune reads the rank from the launcher's environment: start the processes with "
        "{nproc_per_node} N, or under torchrun"
    ),
    "adapter": (
        "LoRA is switched on by {lora} (with {lora_rank}, {lora_alpha}, {lora_target_modules}); QLoRA "
        "by {load_in_4bit} as well"
    ),
    # Axolotl's
    "lora_target_linear": "every linear layer is lmtune's default ({lora_target_modules} all-linear)",
    "sample_packing": "packing is {packing} on | off | auto",
    "datasets": (
        "give the files as lmtune's {data} (comma-separated; each record's format is detected from its "
        "fields) and rename fields with {field_map}"
    ),
    "dataset": "give the files as lmtune's {data}",
    "field_messages": "map field names with {field_map} messages=FIELD,role=FIELD,content=FIELD",
    "message_property_mappings": "map field names with {field_map} messages=FIELD,role=FIELD,content=FIELD",
    "formatting_func": "map field names with {field_map} (for example prompt=question,completion=answer)",
    "wandb_project": "set WANDB_PROJECT in the environment and give {report_to} wandb",
    "logging_dir": ("metrics go to OUTPUT/metrics.jsonl; {report_to} tensorboard writes OUTPUT/tensorboard"),
    "attn_implementation": (
        "lmtune chooses attention itself (per-example flash attention where the model allows); "
        "run.json's resolved.attention says which"
    ),
    "flash_attention": (
        "lmtune chooses attention itself (per-example flash attention where the model allows); "
        "run.json's resolved.attention says which"
    ),
    "num_processes": "start processes with {nproc_per_node} N",
    # HF Trainer's and TRL's names that lmtune has no setting for (what they do is lmtune's way, or
    # does not apply), so a config brought from there is answered line by line, not with a guess.
    "eval_accumulation_steps": (
        "evaluation runs micro-batches of {micro_batch_size} and keeps only sums: nothing to accumulate"
    ),
    "data_seed": "the data order follows {seed} (shuffled with seed + epoch, the same on every process)",
    "logging_first_step": "metrics.jsonl has every {log_every} steps and the last",
    "log_level": (
        "lmtune prints its own lines and warnings; `lmtune train -v` shows other packages' warnings too"
    ),
    "disable_tqdm": "turn the progress bar off with {progress} false",
    "hub_strategy": "{push_to_hub} uploads the final model once, when training ends",
    "tf32": (
        "lmtune leaves TF32 at PyTorch's default (off for matrix products); {precision} bf16 runs them "
        "in bf16"
    ),
    "torch_dtype": "trained weights are kept in fp32; {precision} bf16 | fp16 computes in half precision",
    "run_name": "a run is named by its {output_dir} (W&B and MLflow runs take that folder's name)",
    "use_liger_kernel": (
        "lmtune's chunked linear cross-entropy ({loss_chunk_size}, on by default) never holds the full "
        "logits, as Liger's fused loss does"
    ),
    "padding_free": "lmtune trains without padding by default: per-example attention on packed rows",
    "full_determinism": (
        "lmtune has no switch for PyTorch's deterministic GPU kernels; a run follows {seed}, and a "
        "resume repeats the uninterrupted run exactly"
    ),
    "gradient_checkpointing_kwargs": "{activation_checkpointing} true is non-reentrant already",
    "ddp_find_unused_parameters": "lmtune sets DDP up itself: remove it",
    "remove_unused_columns": "lmtune reads only the fields its data format uses: remove it",
    "dataset_num_proc": "lmtune tokenizes in its own worker processes: remove it",
    "do_train": "lmtune train trains: remove it",
    "do_eval": "evaluation runs when there is {eval_data} or {eval_split}: remove it",
    "save_safetensors": "lmtune saves safetensors always: remove it",
    "save_only_model": (
        "a checkpoint holds what an exact resume needs; the model alone is OUTPUT/final (and {keep_last} "
        "limits the checkpoints kept)"
    ),
    "eos_token": "lmtune uses the tokenizer's own end-of-sequence token; a chat template ends turns with it",
    "pad_token": (
        "lmtune pads with the tokenizer's padding token, or its end-of-sequence token when it has none "
        "(padding never trains)"
    ),
    # torchtune's and litgpt's
    "max_steps_per_epoch": "{max_steps} N ends the run after N optimizer steps; lmtune has no cap per epoch",
    "dtype": "trained weights are kept in fp32; {precision} bf16 | fp16 computes in half precision",
    "batch_size": (  # torchtune's is per device
        "{micro_batch_size} is the examples per process in one forward; {global_batch_size} the examples "
        "of an optimizer step over all processes"
    ),
    "shuffle": "the training data is shuffled every epoch, by {seed}, the same for any number of processes",
    "betas": "AdamW's betas are {adam_beta1} and {adam_beta2} (0.9 and 0.999 by default)",
    **dict.fromkeys(  # litgpt's
        [f"lora_{layer}" for layer in ("query", "key", "value", "projection", "mlp", "head")],
        "{lora} switches LoRA on; {lora_target_modules} names its layers as the model does (q_proj,v_proj)",
    ),
    "logger_name": "{report_to} tensorboard | wandb | mlflow (metrics.jsonl is always written)",
    "quantize": "{load_in_4bit} loads the base in 4 bits (NF4: litgpt's bnb.nf4), {load_in_8bit} in 8",
    "min_lr": "{min_lr_ratio} is where the schedule ends as a fraction of {lr} (min_lr / lr; 0.1 by default)",
    "clip_grad_norm": "{max_grad_norm} N clips the global gradient norm (1.0 by default; 0: no clipping)",
    "devices": "start processes with {nproc_per_node} N (and {nnodes} N for several machines)",
    "checkpoint_dir": (
        "{model} names the model to start from (a folder or a hub id); {output_dir} is where lmtune writes "
        "its checkpoints"
    ),
    "max_completion_length": (
        "a preference pair keeps prompt and answer within {max_length}: the prompt is cut from the left "
        "(keeping at least half of {max_length}), the answers from the right"
    ),
}

_SCHEDULES = {
    "cosine": (
        "{lr_schedule} cosine is lmtune's default; it decays to lr x {min_lr_ratio} (0.1 by default), "
        "transformers' and Axolotl's to 0: add {min_lr_ratio} 0 for theirs"
    ),
    "linear": "{lr_schedule} linear (warmup, then linear decay to 0)",
    "constant_with_warmup": "{lr_schedule} constant (constant after the warmup)",
    "warmup_stable_decay": "{lr_schedule} wsd",
}
# Foreign names whose answer depends on the value given (as text, lower case; "*": any other).
_BY_VALUE: dict[str, dict[str, str]] = {
    "bf16": {
        "false": "lmtune's default {precision} is fp32 already: remove it",
        # Axolotl's: bf16 where the GPU has it.
        "auto": "lmtune takes the precision as given: {precision} bf16 (GPUs, CPUs with bf16 units) or fp32",
    },
    "fp16": {"false": "lmtune's default {precision} is fp32 already: remove it"},
    # A --config file's TRL values that lmtune's settings say are taken (_VALUE_SWITCHES); flags
    # are answered.
    "loss_type": {
        "sigmoid": "TRL's sigmoid loss is {objective} dpo",
        "ipo": "TRL's ipo loss is {objective} ipo",
        "*": "lmtune's preference losses are {objective} dpo (TRL's sigmoid) | ipo | simpo | orpo; "
        "TRL's {value} is none of them",
    },
    "precompute_ref_log_probs": {
        "true": "lmtune precomputes the reference's log-probs by default ({reference} logprobs): remove it",
        "false": "{reference} live runs the reference in every step",
    },
    "eval_strategy": {"no": "lmtune evaluates only when given {eval_data} or {eval_split}: remove it"},
    "evaluation_strategy": {"no": "lmtune evaluates only when given {eval_data} or {eval_split}: remove it"},
    "save_strategy": {
        "no": "{save_every} 0 saves no checkpoint during training (final/ is saved at the end)"
    },
    "lr_scheduler": _SCHEDULES,
    "lr_scheduler_type": _SCHEDULES,
}

_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _styled(text: str, style: Callable[[str], str]) -> str:
    return _PLACEHOLDER.sub(lambda m: style(m.group(1)), text)


def yaml_hint(name: str) -> str:
    """The answer to another tool's ``name`` (in :data:`HINTS`), in a YAML file's names."""
    return _styled(HINTS[name], lambda setting: setting)


def canonical(name: str) -> str:
    """A flag or key as a setting-style name: ``--Learning-Rate`` -> ``learning_rate`` (at most 80
    characters of it: a message shows it, and a hostile file may hold a key of any length)."""
    return " ".join(name[:200].lstrip("-").split("=", 1)[0].replace("-", "_").lower().split())[:80]


def aliases_of(setting: str) -> list[str]:
    """The foreign names accepted for ``setting``."""
    return [foreign for foreign, ours in ALIASES.items() if ours == setting]


# What a short option means in other tools, by the names each command may have for it.
_SHORT = {"o": ("out", "output_dir", "json", "plot"), "m": ("model",), "c": ("config",), "d": ("data",)}


def as_arguments(option: str, parser: Any) -> str:
    """How ``parser``'s command takes ``option``'s values instead, as its arguments (data audit's
    files, report's output folders), or ""."""
    key = canonical(option.split("=", 1)[0])
    takes = {canonical(x.dest): x.metavar for x in parser._actions if not x.option_strings}
    return f" (give it as arguments: {parser.prog} {takes[key]} ...)" if key in takes else ""


def explain_unknown(
    name: str, known: Iterable[str], style: Callable[[str], str], where: str, value: Any = None
) -> str:
    """Why ``name`` is not accepted ``where`` (a command, or a YAML file), in one line.

    ``known``: the setting-style names accepted there; ``style`` writes a name as it is written
    there (``--lr`` on the command line, ``lr`` in YAML); ``value``: what it was given, if known.
    """
    key, accepted = canonical(name), set(known)
    written = one_line(name, 80).split("=", 1)[0]
    upper = written != written.lower()
    # A short option (-q) is shown as written: its long form (--q) is no one's spelling.
    shown = written if upper or (written.startswith("-") and not written.startswith("--")) else style(key)
    kind = "option" if style(key).startswith("-") else "setting"
    meant = ALIASES.get(key, key)
    if upper and meant in accepted:  # names are matched exactly, as argparse matches options
        return f"{written}: names are lower case; did you mean {style(meant)}?"
    if key in ALIASES and ALIASES[key] not in accepted:
        return f"{shown} is {style(ALIASES[key])} in lmtune, which {where} does not take"
    from lmtune.config.settings import config_fields  # it explains its own unknown names with this

    if key not in accepted and any(s.name == key for s in config_fields()):
        plural = [c for c in sorted(accepted) if c == f"{key}s"]  # bench's --precisions
        instead = f"; it takes {style(plural[0])}" if plural else ""
        return f"{shown} is a setting of lmtune train, which {where} does not take{instead}"
    # The closest names: this place's own, and the foreign names of the table (a typo of one).
    candidates = sorted(accepted | set(ALIASES) | set(HINTS))
    # An abbreviation (refused: a later option could make it ambiguous) names what it abbreviates.
    prefixed = [c for c in candidates if len(key) >= 3 and c.startswith(key) and not c.startswith("no_")]
    close = [key] if key in HINTS else difflib.get_close_matches(key, candidates, n=3, cutoff=0.75)
    # What the name extends (report's --out for --output), or what a short option means elsewhere.
    extends = [c for c in sorted(accepted) if len(c) >= 3 and key.startswith(c)]
    short = (
        [c for c in _SHORT.get(key, ()) if c in accepted] if written.startswith("-") and len(key) == 1 else []
    )
    close = list(dict.fromkeys([*close, *prefixed[:3], *extends, *short]))
    given = str(value).lower() if isinstance(value, (str, bool, int, float)) else None
    answers = _BY_VALUE.get(key, {})
    if given is not None and (answer := answers.get(given, answers.get("*"))):
        return f"{shown}: {_styled(answer, lambda n: one_line(given, 40) if n == 'value' else style(n))}"
    if close and close[0] in HINTS:
        hint = _styled(HINTS[close[0]], style)
        if close[0] == key:
            return f"{shown}: {hint}"
        # A near name's answer, not this one's: torchtune's max_steps_per_epoch is not saves_per_epoch.
        return f"unknown {kind} {shown}; did you mean {style(close[0])}? ({style(close[0])}: {hint})"
    suggestions = [ALIASES.get(c, c) for c in close if c not in HINTS]
    suggestions = [s for s in dict.fromkeys(suggestions) if s in accepted]
    if not suggestions:
        return f"unknown {kind} {shown}" + (f" (`{where} --help` lists them)" if kind == "option" else "")
    return f"unknown {kind} {shown}; did you mean {' or '.join(style(s) for s in suggestions)}?"


def accumulation_here(key: str, value: Any, values: dict[str, Any], style: Callable[[str], str]) -> str:
    """For gradient_accumulation_steps beside a micro-batch size (in ``values``): the global batch
    they make on one device, in this place's names."""
    if canonical(key) != "gradient_accumulation_steps":
        return ""

    def given(setting: str) -> Any:
        return next(
            (v for k, v in values.items() if ALIASES.get(canonical(k), canonical(k)) == setting), None
        )

    # Flags arrive as text, YAML values as numbers.
    value, micro, batch = (
        int(v) if isinstance(v, str) and v.isdigit() else v
        for v in (value, given("micro_batch_size") or given("batch_size"), given("global_batch_size"))
    )  # torchtune's batch_size is per device, as micro_batch_size
    if not (type(value) is int and value > 0):
        value = 4
    # A flag takes its value after a space, a YAML key after a colon.
    sep = " " if style("x").startswith("-") else ": "
    if type(batch) is int and batch > 0 and micro is None and batch % value == 0:
        return (  # the global batch given: what micro-batch it means with this accumulation
            f"; {style('global_batch_size')}{sep}{batch} with {value} accumulation on one device is "
            f"{style('micro_batch_size')}{sep}{batch // value}"
        )
    if not (type(micro) is int and micro > 0):
        micro = 8  # HF Trainer's default per_device_train_batch_size
    return (
        f"; {micro} per device x {value} accumulation on one device is {style('global_batch_size')}{sep}"
        f"{micro * value}, {style('micro_batch_size')}{sep}{micro}, and the same numbers train the same on "
        "any number of processes"
    )


def lmtune_name(key: str, accepted: set[str]) -> str:
    """The setting ``key`` names: itself, or the one it is an alias of. Matched as written, lower
    case (as the command line's options are): `Learning_Rate` is refused with its lower-case name,
    as `LR` is."""
    return key if key in accepted or key != key.lower() else ALIASES.get(canonical(key), key)


def resolve_names(
    values: dict[str, Any],
    known: Iterable[str],
    where: Callable[[str], str],
    style: Callable[[str], str] = lambda name: name,
) -> dict[str, Any]:
    """``values`` under lmtune's names: aliases renamed, anything else unknown refused.

    Raises:
        UserError: starting with ``where(key)`` (the file and line), for a name that has a hint or
            is unknown, or a setting given twice (under its name and an alias).
    """
    accepted = set(known)
    values = _value_switches(_hub_switch(values, where, style), where, style)
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    unknown: list[str] = []  # all of them at once: a config from another tool has several
    for key, value in values.items():
        name = lmtune_name(key, accepted)
        if name not in accepted and value is None:
            continue  # another tool's key left empty (unset, as Axolotl's configs leave many) asks nothing
        if name not in accepted:
            why = explain_unknown(key, accepted, style, "lmtune train", value)
            unknown.append(where(key) + why + accumulation_here(key, value, values, style))
            continue
        if name in out:
            both = f"as {one_line(given_as[name], 60)} and {one_line(key, 60)}"
            raise UserError(f"{where(key)}{style(name)} is set twice ({both})")
        out[name], given_as[name] = value, key
    if unknown:
        raise UserError("\n".join(unknown))
    return out


# Another tool's key whose value says what lmtune settings do: (its key, value as text) -> ours.
_VALUE_SWITCHES: dict[str, dict[str, dict[str, Any]]] = {
    "adapter": {"lora": {"lora": True}, "qlora": {"lora": True, "load_in_4bit": True}},  # Axolotl
    "rl": {  # Axolotl ("true": its first releases' DPO)
        **{name: {"objective": name} for name in ("dpo", "ipo", "simpo", "orpo")},
        "true": {"objective": "dpo"},
        "false": {},
    },
    "lora_target_linear": {"true": {"lora_target_modules": "all-linear"}, "false": {}},  # Axolotl
    "loss_type": {"sigmoid": {"objective": "dpo"}, "ipo": {"objective": "ipo"}},  # TRL
    "precompute_ref_log_probs": {"true": {"reference": "logprobs"}, "false": {"reference": "live"}},  # TRL
    # HF Trainer's, TRL's and Axolotl's half-precision switches (false: not that one, asks nothing).
    "bf16": {"true": {"precision": "bf16"}, "false": {}},
    "fp16": {"true": {"precision": "fp16"}, "false": {}},
}


def _value_switches(
    values: dict[str, Any], where: Callable[[str], str], style: Callable[[str], str]
) -> dict[str, Any]:
    """Another tool's key whose value lmtune's settings say (:data:`_VALUE_SWITCHES`: Axolotl's
    ``adapter: qlora`` is ``lora: true`` and ``load_in_4bit: true``, TRL's ``loss_type: sigmoid`` is
    ``objective: dpo``) becomes them; the same setting given by the file too is fine when it agrees
    (Axolotl's QLoRA configs give ``load_in_4bit: true`` beside ``adapter: qlora``). Another value
    is left to be refused with its hint.

    Raises:
        UserError: the file gives one of those settings another value.
    """
    out = dict(values)
    for key, value in values.items():
        switched = _VALUE_SWITCHES.get(canonical(key), {}).get(str(value).lower())
        if switched is None or isinstance(value, (list, dict)):
            continue
        given = {canonical(k): v for k, v in out.items()}
        del out[key]
        for name, ours in switched.items():
            if name not in given:
                out[name] = ours
            elif str(given[name]).lower() != str(ours).lower():
                written = str(value).lower() if isinstance(value, bool) else one_line(str(value), 40)
                raise UserError(
                    f"{where(key)}{key}: {written} is {style(name)} {str(ours).lower()} in "
                    f"lmtune, which the file sets to {one_line(str(given[name]), 40)}"
                )
    return out


def _hub_switch(
    values: dict[str, Any], where: Callable[[str], str], style: Callable[[str], str]
) -> dict[str, Any]:
    """HF Trainer's ``push_to_hub`` is yes/no, the repository in ``hub_model_id``; lmtune's names
    the repository. Yes with a repository becomes lmtune's, no drops both (as in HF, no upload).

    Raises:
        UserError: yes without a repository.
    """
    names = {canonical(k): k for k in values}
    switch, repo_key = values.get(names.get("push_to_hub", "")), names.get("hub_model_id")
    if not isinstance(switch, bool):
        return values
    out = {k: v for k, v in values.items() if k not in (names["push_to_hub"], repo_key)}
    if switch and repo_key is None:
        raise UserError(
            f"{where(names['push_to_hub'])}{style('push_to_hub')} takes the repository to upload to "
            "(NAME/REPO, HF Trainer's hub_model_id), not yes/no"
        )
    return {**out, "push_to_hub": values[repo_key]} if switch and repo_key else out
