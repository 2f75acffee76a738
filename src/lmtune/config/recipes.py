"""Other tools' recipes in a ``--config`` file: torchtune's groups built from a ``_component_`` and
litgpt's from a ``class_path`` (Python paths those tools instantiate), and litgpt's ``train:`` and
``eval:`` groups. lmtune builds the model, data, optimizer and loss from its own settings, given at
the top level, and runs nothing a file names: each such group is answered with lmtune's settings,
all at once, with what the file's other keys need."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmtune.errors import UserError, brief

COMPONENT = "_component_"  # torchtune's
CLASS_PATH, INIT_ARGS = "class_path", "init_args"  # litgpt's (jsonargparse)
_BUILT = (COMPONENT, CLASS_PATH)

_DATA = "data: a JSONL file (text, prompt/completion or chat messages) or a hub data set name"
_EVALUATES = "lmtune evaluates every eval_every steps and at the end"
# By the group's name (torchtune's and litgpt's recipes name them so), what lmtune takes instead.
_GROUPS = {
    "model": "model: a Hugging Face model folder or hub id (torchtune's checkpointer.checkpoint_dir is one)",
    "checkpointer": "model: the Hugging Face folder of checkpoint_dir; lmtune reads its safetensors files",
    "tokenizer": "the model folder's own tokenizer is used (max_seq_len is max_length)",
    "dataset": _DATA,
    "data": _DATA,
    "optimizer": "optimizer: adamw (the default) | adamw8bit | paged_adamw8bit | sgd",
    "lr_scheduler": "lr_schedule: cosine (the default) | linear | constant | wsd, with warmup_steps",
    "loss": "lmtune's loss is a chunked linear cross-entropy by default: remove it",
    "metric_logger": "report_to: tensorboard | wandb | mlflow (metrics.jsonl is always written)",
    "profiler": "profile: true times each step's phases",
}
# litgpt's plain groups, and its names in them that are lmtune's settings under another name.
_LITGPT_GROUPS = {
    "train": {
        "save_interval": "save_every",
        "log_interval": "log_every",
        "lr_warmup_steps": "warmup_steps",
        "max_norm": "max_grad_norm",
    },
    "eval": {"interval": "eval_every", "initial_validation": "eval_on_start"},
}
# Names inside other tools' groups that lmtune answers (it has no setting of that name).
_IN_GROUP_ANSWERS = {
    ("eval", "max_iters"): "lmtune evaluates on all of eval_data (or eval_split)",
    ("eval", "max_new_tokens"): "sample_max_new_tokens, with sample_prompts, generates during training",
    ("eval", "final_validation"): _EVALUATES,
    ("data", "mask_prompt"): "prompts are out of the loss by default (train_on_prompt: true trains them)",
    ("data", "prompt_style"): "records are trained as written; chat messages take the model's chat template",
    ("model", "lora_attn_modules"): "lora_target_modules, by the model's names (q_proj,k_proj,v_proj,o_proj)",
    ("model", "apply_lora_to_mlp"): "lora_target_modules: all-linear adapts the MLP's layers too",
}
_LORA_ON = "LoRA is switched on by lora: true; lora_target_modules names the layers by the model's names"
_OTHER = "lmtune takes settings by name (lmtune train --help), not components"


def in_group(group: str, name: str) -> str | None:
    """lmtune's name of litgpt's ``name`` in its ``group`` (train's save_interval: save_every)."""
    return _LITGPT_GROUPS.get(group, {}).get(name)


def group_entry_answer(group: str, name: str) -> str | None:
    """What lmtune does instead of ``name`` in another tool's ``group`` (eval's max_iters), or None."""
    return _IN_GROUP_ANSWERS.get((group, name))


def component_answer(group: str) -> str:
    """What lmtune takes instead of a recipe's ``group`` (model, optimizer, ...)."""
    return _GROUPS.get(group, _OTHER)


def recipe_groups(loaded: dict[Any, Any]) -> list[Any]:
    """The keys of ``loaded`` (a YAML file's top level) that are another tool's groups."""
    groups = {k: v for k, v in loaded.items() if isinstance(v, dict)}
    built = [k for k, v in groups.items() if any(b in v for b in _BUILT)]
    litgpt = any(CLASS_PATH in groups[k] for k in built) or "train" in groups
    return [k for k in groups if k in built or (litgpt and k in _LITGPT_GROUPS)]


def refuse_recipe(
    loaded: dict[Any, Any], where: Callable[[str], str], known: set[str], rest: Callable[[], object]
) -> None:
    """Refuse a file with another tool's groups (:func:`recipe_groups`), answering each group and,
    in the same message, what ``rest`` (reading the file's other keys) refuses. ``where(key)``:
    the file and line."""
    groups = recipe_groups(loaded)
    if not groups:
        return
    answers = [where(str(key)) + _group_answer(str(key), loaded[key], known) for key in groups]
    try:
        rest()
    except UserError as e:
        answers.append(str(e))
    raise UserError("\n".join(answers))


def _group_answer(key: str, group: dict[Any, Any], known: set[str]) -> str:
    from lmtune.config.aliases import lmtune_name, yaml_hint
    from lmtune.config.hints import HINTS

    built = group.get(COMPONENT, group.get(CLASS_PATH))
    inner: Any = group.get(INIT_ARGS) if CLASS_PATH in group else group
    if built is None:
        said = f"{key}: litgpt's group of settings"
    else:
        tool = "torchtune" if COMPONENT in group else "litgpt"
        said = f"{key}: {brief(built)} is a {tool} component; {component_answer(key)}"
    entries = [str(n) for n in (inner if isinstance(inner, dict) else {}) if n not in (*_BUILT, INIT_ARGS)]
    ours = {n: in_group(key, n) or lmtune_name(n, known) for n in entries}
    settings = [f"{n} ({ours[n]})" if ours[n] != n else n for n in entries if ours[n] in known]
    if settings:
        said += f"; {', '.join(settings)}: lmtune's settings, given at the top level"
    said += "".join(f"; {n}: {yaml_hint(n)}" for n in entries if n in HINTS)
    said += "".join(f"; {n}: {_IN_GROUP_ANSWERS[key, n]}" for n in entries if (key, n) in _IN_GROUP_ANSWERS)
    if any(n.startswith("lora_") for n in entries):  # torchtune's lora_* models
        said += f" ({_LORA_ON})"
    return said
