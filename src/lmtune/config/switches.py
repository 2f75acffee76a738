"""Another tool's settings whose value says what lmtune's settings do (Axolotl's ``adapter:
qlora``, TRL's ``loss_type: sigmoid``, the HF Trainer's dumps at their defaults): taken as lmtune's
(:func:`lmtune.config.aliases.value_switched`), where other values of the same keys are answered."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Another tool's key whose null means a value of lmtune's setting: the HF Trainer's (and Axolotl's)
# save_total_limit null, its default, keeps every checkpoint (TrainingArguments.to_dict() writes it).
PEER_NULLS: dict[str, Any] = {"save_total_limit": 0}


def metric_as_read(metric: Any) -> Any:
    """A metric's name as the HF Trainer reads metric_for_best_model: ``loss`` is ``eval_loss``."""
    if isinstance(metric, str) and metric and not metric.startswith("eval_"):
        return f"eval_{metric}"
    return metric


def steps_left_unset(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (lmtune's names) less a ``warmup_steps`` of 0 beside a ratio that warms up:
    transformers 4's dumps write both, and its Trainer takes the ratio where the steps are 0."""
    if values.get("warmup_steps") == 0 and values.get("warmup_ratio") not in (None, 0):
        return {k: v for k, v in values.items() if k != "warmup_steps"}
    return values


# lmtune's settings whose values are read otherwise than written: two names of one of them agree
# where they read the same.
READ_AS: dict[str, Callable[[Any], Any]] = {"metric_for_best": metric_as_read}


# The dtypes' names in bitsandbytes' and transformers' configs, by lmtune's precision.
DTYPES = {
    "fp32": ("float32", "fp32", "torch.float32"),
    "bf16": ("bfloat16", "bf16", "torch.bfloat16"),
    "fp16": ("float16", "fp16", "torch.float16"),
}
# Another tool's key whose value says what lmtune settings do: (its key, value as text) -> ours.
VALUE_SWITCHES: dict[str, dict[str, dict[str, Any]]] = {
    "adapter": {"lora": {"lora": True}, "qlora": {"lora": True, "load_in_4bit": True}},  # Axolotl
    "rl": {  # Axolotl ("true": its first releases' DPO)
        **{name: {"objective": name} for name in ("dpo", "ipo", "simpo", "orpo")},
        "true": {"objective": "dpo"},
        "false": {},
    },
    "lora_target_linear": {"true": {"lora_target_modules": "all-linear"}, "false": {}},  # Axolotl
    "loss_type": {  # TRL's DPOConfig (sigmoid, ipo), CPOConfig (simpo) and SFTConfig (nll, its default)
        "nll": {"objective": "sft"},
        "sigmoid": {"objective": "dpo"},
        "ipo": {"objective": "ipo"},
        "simpo": {"objective": "simpo"},
    },
    "sample_packing": {"true": {"packing": "on"}, "false": {"packing": "off"}},  # Axolotl
    "precompute_ref_log_probs": {"true": {"reference": "logprobs"}, "false": {"reference": "live"}},  # TRL
    # HF Trainer's, TRL's and Axolotl's half-precision switches (false: not that one, asks nothing).
    "bf16": {"true": {"precision": "bf16"}, "false": {}},
    "fp16": {"true": {"precision": "fp16"}, "false": {}},
    # bitsandbytes' (peft, TRL, Axolotl): a 4-bit layer computes in the run's precision, and its
    # constants are always quantized too; values that say so are taken.
    "bnb_4bit_compute_dtype": {
        **{name: {"precision": ours} for ours, names in DTYPES.items() for name in names},
    },
    "bnb_4bit_use_double_quant": {"true": {}},
    "cpo_alpha": {"0": {}, "0.0": {}},  # TRL's CPOConfig: SimPO is cpo_alpha 0, lmtune's simpo
    # TRL's SFTConfig: lmtune trains completions and assistant turns only (false is answered:
    # TRL's two settings are one in lmtune, --train-on-prompt, which is not what either says).
    "completion_only_loss": {"true": {}},
    "assistant_only_loss": {"true": {}},
    "tf32": {"false": {}},  # the HF Trainer's: PyTorch's default, which lmtune keeps
    # The HF Trainer's and TRL's, saying what lmtune always does (other values are answered), as
    # their dumps (to_dict()) write them at their defaults.
    "dataloader_drop_last": {"true": {}},
    "average_tokens_across_devices": {"true": {}},
    # TRL's shuffles once before training; every epoch's sampler shuffles anyway, as lmtune does.
    "shuffle_dataset": {"true": {}, "false": {}},
    "label_smoothing_factor": {"0": {}, "0.0": {}},
    "use_cpu": {"false": {}},
    "no_cuda": {"false": {}},
    "disable_tqdm": {"false": {}},
    # (YAML reads an unquoted no as false.)
    "eval_strategy": {"no": {}, "false": {}},
    "evaluation_strategy": {"no": {}, "false": {}},
    # TRL's packing strategy: lmtune's packing is exact, each example its own attention, as bfd's.
    "packing_strategy": {"bfd": {}},
    # The HF Trainer's, as its docs advise it: lmtune's checkpointing is non-reentrant.
    "gradient_checkpointing_kwargs": {"use_reentrant=false": {}},
    # Axolotl's loader classes: the ones lmtune uses for every model.
    "model_type": {"automodelforcausallm": {}},
    "tokenizer_type": {"autotokenizer": {}},
}


def peer_unset(name: str, value: Any) -> Any:
    """``value``, or lmtune's for how Hugging Face configs write "not set": ``max_steps: -1`` (the
    epochs decide) and ``neftune_noise_alpha: null`` (off), as configs written from
    TrainingArguments or SFTConfig hold them, and ``val_set_size: 0`` (none held out), as Axolotl's."""
    # Not str(value): an int of more than 4,300 digits has no str (TrainConfig(max_steps=10**5000)).
    written = value.strip() if isinstance(value, str) else value
    if isinstance(written, bool):
        return value
    if name == "max_steps" and written in ("-1", -1) and not isinstance(written, float):
        return None
    if name == "neftune_alpha" and value is None:
        return 0.0
    if name == "eval_split" and written in ("0", "0.0", 0):
        return None  # Axolotl's val_set_size: 0, its default: no evaluation split
    return value
