"""What lmtune answers to the names users bring from other tools (Hugging Face Trainer, TRL,
Axolotl, torchtune, litgpt) that have no lmtune setting of the same meaning: what to do instead.
The names that do mean an lmtune setting are aliases (lmtune.config.aliases, which reads these)."""

from __future__ import annotations

# Foreign name -> what to do instead. ``{name}`` becomes a setting's name in the style of the place
# it was written: ``--global-batch-size`` on the command line, ``global_batch_size`` in YAML.
_MEET = "the job meets at {rdzv_endpoint} HOST:PORT (node 0's address), with {nnodes} and {node_rank}"
_OWN_TOKENIZER = (
    "lmtune loads the tokenizer saved with the model ({model}); for another one, save the model and "
    "that tokenizer into one folder (their save_pretrained(DIR)) and give DIR as {model}"
)
HINTS: dict[str, str] = {
    "gradient_accumulation_steps": (
        "lmtune derives gradient accumulation from {global_batch_size} (examples per optimizer step "
        "over all processes) = {micro_batch_size} x processes x accumulation"
    ),
    "per_device_eval_batch_size": "evaluation runs micro-batches of {micro_batch_size}: set that one",
    # Axolotl's: lmtune counts in optimizer steps (the start line says how many an epoch has).
    "evals_per_epoch": "{eval_every} N evaluates every N optimizer steps",
    "saves_per_epoch": "{save_every} N saves a checkpoint every N optimizer steps",
    "bf16": "set the precision with {precision} bf16",
    # transformers' generate() knobs, given to lmtune generate (or to train's samples).
    "do_sample": "a temperature above 0 samples (lmtune generate's temperature, train's "
    "{sample_temperature}); 0 decodes greedily",
    "num_beams": "lmtune decodes greedily or samples (a temperature above 0): it has no beam search",
    "repetition_penalty": "lmtune's decoding has no repetition penalty",
    "min_new_tokens": "lmtune's decoding stops at the end of a turn or sequence; it has no minimum",
    # QLoRA's other bitsandbytes settings (peft, TRL, Axolotl): lmtune decides them.
    "bnb_4bit_compute_dtype": "4-bit layers compute in {precision}'s dtype (bf16 with {precision} bf16)",
    "bnb_4bit_use_double_quant": "{load_in_4bit} always quantizes the quantization constants too",
    "quantization_config": (
        "lmtune's {load_in_4bit} (with {bnb_4bit_quant_type} nf4 | fp4) or {load_in_8bit} quantize the "
        "base; give them as settings of their own"
    ),
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
        "{objective} simpo | orpo); one loss: TRL's list of several, weighted together, is not lmtune's"
    ),
    "precompute_ref_log_probs": (
        "{reference} logprobs (the default) precomputes the reference's log-probs once, {reference} live "
        "runs it in every step"
    ),
    "ref_model": "name the reference with {reference_model} (default: the starting model)",
    # TRL's DPOConfig and CPOConfig settings that lmtune has no setting for.
    "disable_dropout": (
        "a preference objective turns all dropout off (LoRA's too), as TRL's default true does; "
        "supervised training keeps the model's: remove it"
    ),
    "reference_free": (
        "{objective} dpo | ipo compare with a reference ({reference_model}, default the starting model); "
        "{objective} simpo | orpo use none"
    ),
    "rpo_alpha": "lmtune's DPO adds no NLL term on the chosen answers; {objective} orpo has one",
    "cpo_alpha": (
        "{objective} simpo is SimPO without the NLL term (TRL's cpo_alpha 0, which is taken); lmtune has "
        "no CPO"
    ),
    "use_weighting": "lmtune's DPO does not weight pairs (no WPO): remove it",
    "generate_during_eval": "{sample_prompts} FILE generates from those prompts every {sample_every} steps",
    "truncation_mode": (
        "{truncation} right | left | drop | error; for pairs right and left both cut the prompt from "
        "the left (TRL's keep_end) and the answers from the right"
    ),
    "lora_modules_to_save": "lmtune's LoRA trains and saves the adapters only: no module is trained whole",
    "lora_fan_in_fan_out": "peft sets it from the layer's kind (GPT-2's Conv1D layers take it)",
    "lora_task_type": "lmtune's LoRA is for causal language modelling (peft's CAUSAL_LM) always",
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
    "strict": "lmtune checks every key of a config file and refuses unknown ones: remove it",
    "special_tokens": (
        "lmtune keeps the tokenizer's special tokens; a {chat_template} preset adds the ones it needs"
    ),
    "datasets": (
        "give the files as lmtune's {data} (comma-separated; each record's format is detected from its "
        "fields) and rename fields with {field_map}"
    ),
    "dataset": "give the files as lmtune's {data}",
    # TRL's trainers' arguments, as a script passes them on to TrainConfig
    "train_dataset": "give the files as lmtune's {data}",
    "eval_dataset": "give the evaluation files as lmtune's {eval_data}",
    "peft_config": (
        "LoRA is lmtune's {lora} with {lora_rank} (peft's r), {lora_alpha}, {lora_dropout} and "
        "{lora_target_modules}"
    ),
    "test_datasets": "give the evaluation files as lmtune's {eval_data}",
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
    "padding_free": (
        "lmtune trains without padding by default where the model allows it (per-example attention on "
        "packed rows; the log says why a model pads): remove it"
    ),
    # Axolotl's.
    "pad_to_sequence_len": "lmtune computes on no padding (per-example attention on packed rows): remove it",
    "model_type": "lmtune loads every model as a causal LM (transformers' AutoModelForCausalLM): remove it",
    "tokenizer_type": "lmtune loads the tokenizer saved with the model ({model}): remove it",
    "tokenizer_config": "lmtune loads the tokenizer saved with the model ({model})",
    # HF's run_clm.py, and a Trainer user's tokenizer= / TRL's processing_class=.
    "tokenizer_name": _OWN_TOKENIZER,
    "tokenizer": _OWN_TOKENIZER,
    "processing_class": _OWN_TOKENIZER,
    "dataset_prepared_path": (
        "lmtune caches the tokenized data where {cache_dir} says (else LMTUNE_CACHE_DIR), keyed by the data, "
        "the tokenizer and the settings that shape it"
    ),
    "full_determinism": (
        "lmtune has no switch for PyTorch's deterministic GPU kernels; a run follows {seed}, and a "
        "resume repeats the uninterrupted run exactly"
    ),
    "gradient_checkpointing_kwargs": (
        "{activation_checkpointing} true checkpoints non-reentrant (use_reentrant false), always: drop it "
        "(a reentrant checkpoint runs DDP's gradient hooks twice)"
    ),
    "ddp_find_unused_parameters": "lmtune sets DDP up itself: remove it",
    "remove_unused_columns": "lmtune reads only the fields its data format uses: remove it",
    # The HF Trainer's and TRL's settings that name what lmtune always does, or has not.
    "packing_strategy": (
        "lmtune packs by its own rule ({packing} on | off | auto), exact: a packed step trains what the "
        "same examples unpacked would, each example attending to itself alone (TRL's bfd with position "
        "ids, which is taken; its wrapped, which cuts examples across rows, lmtune has not)"
    ),
    "lr_scheduler_kwargs": (
        "lmtune's schedules take their settings by name: {min_lr_ratio} (transformers' min_lr_rate), "
        "{decay_ratio} (wsd's decay share), {warmup_steps} | {warmup_ratio}"
    ),
    "dataloader_drop_last": (
        "lmtune always trains whole global batches, as dataloader_drop_last: true (the examples left past "
        "an epoch's last whole batch sit that epoch out; the log says how many)"
    ),
    "average_tokens_across_devices": (
        "lmtune always normalises a step's loss by the target tokens of every process and micro-step: "
        "remove it"
    ),
    "shuffle_dataset": "lmtune shuffles the examples every epoch, by {seed}: remove it",
    "label_smoothing_factor": (
        "lmtune's supervised loss has no label smoothing; {label_smoothing} is the preference "
        "objectives' (DPO's robust loss)"
    ),
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

# Names another command than train means otherwise, by command: what to do there. Checked before
# the answers above, which are train's (export's --dtype is no --precision: export takes none).
_CAST = (
    "lmtune export writes the checkpoint's weights as saved (fp32); to cast them, load the export with "
    "transformers (from_pretrained(DIR, dtype=torch.bfloat16)) and save_pretrained it"
)
_PUSH_EXPORT = "upload the export afterwards with lmtune push DIR REPO_ID"
_PROMPT_FILE = (
    "a file's text comes on standard input: lmtune generate --model M < FILE (the whole file is one "
    "prompt; with --chat, each line a turn of one conversation)"
)
IN_COMMAND: dict[str, dict[str, str]] = {
    "export": {
        "precision": _CAST,
        "dtype": _CAST,
        "torch_dtype": _CAST,
        "output_dir": "the folder is lmtune export's second argument: lmtune export CHECKPOINT DIR",
        "push_to_hub": _PUSH_EXPORT,
        "hub_model_id": _PUSH_EXPORT,
    },
    "generate": {
        "max_length": "--max-new-tokens N caps the reply's tokens (the prompt's are not counted)",
        "do_sample": "--temperature T above 0 samples; 0, the default, decodes greedily",
        "prompt_file": _PROMPT_FILE,
        "prompts": _PROMPT_FILE,
    },
    "eval": {
        "eval_split": (
            "lmtune eval scores DATA whole; to score the examples a run's --eval-split held out, give "
            "a --config file with the run's data and eval_split (and its example settings) instead of "
            "DATA: it holds out the same ones"
        ),
    },
}

_SCHEDULES = {
    "cosine": (
        "{lr_schedule} cosine is lmtune's default; it decays to lr x {min_lr_ratio} (0.1 by default), "
        "transformers' and Axolotl's to 0: add {min_lr_ratio} 0 for theirs (and {warmup_steps} 0 where "
        "you give no warmup: lmtune warms up over 5% of the steps unless told)"
    ),
    "linear": (
        "{lr_schedule} linear (warmup, then linear decay to 0; lmtune warms up over 5% of the steps "
        "unless told, transformers not at all: add {warmup_steps} 0 for theirs)"
    ),
    "constant": (
        "{lr_schedule} constant with {warmup_steps} 0 (lmtune warms up over 5% of the steps unless "
        "told; transformers' constant has no warmup)"
    ),
    "constant_with_warmup": "{lr_schedule} constant (constant after the warmup)",
    "cosine_with_min_lr": (
        "{lr_schedule} cosine, with its min_lr_rate as {min_lr_ratio} (and {warmup_steps} 0 where you give "
        "no warmup: lmtune warms up over 5% of the steps unless told)"
    ),
    "warmup_stable_decay": "{lr_schedule} wsd",
}
# Foreign names whose answer depends on the value given (as text, lower case; "*": any other).
_OURS = ("adamw", "adamw8bit", "paged_adamw8bit", "sgd")
# transformers' optimizer names (TrainingArguments.optim, which Axolotl and TRL take) as lmtune's.
TRANSFORMERS_OPTIMIZERS = {
    **dict.fromkeys(("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused"), "adamw"),
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "bnb_adamw_8bit"), "adamw8bit"),
    "paged_adamw_8bit": "paged_adamw8bit",
    "paged_adamw_32bit": "adamw",  # 32-bit state, not paged
}

BY_VALUE: dict[str, dict[str, str]] = {
    # The HF Trainer's optim key (a group of settings here): its value answered by name.
    "optim": {
        **{
            theirs: f"transformers' {theirs} is {{optimizer}} {ours}"
            for theirs, ours in TRANSFORMERS_OPTIMIZERS.items()
        },
        **{ours: f"the optimizer is {{optimizer}} {ours} (optim groups its settings)" for ours in _OURS},
        "*": "lmtune's optimizers: {optimizer} adamw | adamw8bit | paged_adamw8bit | sgd; {value} is none",
    },
    "bf16": {
        "false": "lmtune's default {precision} is fp32 already: remove it",
        # Axolotl's: bf16 where the GPU has it.
        "auto": "lmtune takes the precision as given: {precision} bf16 (GPUs, CPUs with bf16 units) or fp32",
    },
    "fp16": {"false": "lmtune's default {precision} is fp32 already: remove it"},
    # Axolotl's adapter: lora and qlora are taken (switches.VALUE_SWITCHES); any other is none of lmtune's.
    "adapter": {
        "lora": "Axolotl's adapter lora is {lora}",
        "qlora": "Axolotl's adapter qlora is {lora} with {load_in_4bit}",
        "*": "Axolotl's adapters are lora and qlora (here {lora}, and {load_in_4bit} for qlora); "
        "{value} is neither",
    },
    # A --config file's TRL values that lmtune's settings say are taken (switches.VALUE_SWITCHES); flags
    # are answered.
    "loss_type": {
        "sigmoid": "TRL's sigmoid loss is {objective} dpo",
        "ipo": "TRL's ipo loss is {objective} ipo",
        "simpo": "TRL's simpo loss (CPOConfig) is {objective} simpo",
        "nll": "TRL's nll loss (SFTConfig's) is {objective} sft, lmtune's default: remove it",
        "*": "lmtune's losses are {objective} sft (TRL's nll) | dpo (TRL's sigmoid) | ipo | simpo | orpo; "
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


# Other tools' names of lmtune's choices.
_TRANSFORMERS, _LIGHTNING = "transformers'", "Lightning's (litgpt's)"
FOREIGN_CHOICES: dict[str, dict[str, tuple[str, str]]] = {
    "optimizer": {
        theirs: (_TRANSFORMERS, f"{ours} here" + (" (32-bit state, not paged)" if "32bit" in theirs else ""))
        for theirs, ours in TRANSFORMERS_OPTIMIZERS.items()
        if theirs != ours
    },
    # lmtune's half precisions are Lightning's mixed ones: fp32 weights and optimizer state.
    "precision": {
        "bf16-mixed": (_LIGHTNING, "bf16 here"),
        "16-mixed": (_LIGHTNING, "fp16 here"),
        **dict.fromkeys(("32-true", "32"), (_LIGHTNING, "fp32 here")),
        "bf16-true": (_LIGHTNING, "bf16 here, which keeps the weights in fp32"),
        "16-true": (_LIGHTNING, "fp16 here, which keeps the weights in fp32"),
        "no": ("accelerate's", "fp32 here"),
        **dict.fromkeys(("float32", "torch.float32"), ("PyTorch's dtype", "fp32 here")),
        **dict.fromkeys(("bfloat16", "torch.bfloat16"), ("PyTorch's dtype", "bf16 here")),
        **dict.fromkeys(("float16", "half", "torch.float16"), ("PyTorch's dtype", "fp16 here")),
    },
    "device": {
        **dict.fromkeys(("gpu", "cuda:0"), ("", "cuda here (a process per GPU: --nproc-per-node N)")),
        "mps": ("", "not here: lmtune trains on cpu or cuda"),
    },
    # TRL's trainers and loss types by name: "cpo" was answered "the closest is ipo".
    "objective": {
        "cpo": (
            "TRL's",
            "not here: it adds an NLL term to its loss (orpo has one; simpo is TRL's CPO with loss_type "
            "simpo and cpo_alpha 0)",
        ),
        "kto": ("TRL's", "not here: it trains on unpaired examples, and lmtune's objectives on pairs"),
        "sigmoid": ("TRL's loss_type", "dpo here"),
    },
}
