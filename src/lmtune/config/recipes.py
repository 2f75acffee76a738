"""torchtune's recipes in a ``--config`` file: groups built from a ``_component_`` (a Python path
torchtune instantiates). lmtune builds the model, data, optimizer and loss from its own settings and
runs nothing a file names, so each such group is answered with lmtune's settings, all at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmtune.errors import UserError, brief

COMPONENT = "_component_"

# By the group's name (torchtune's recipes name them so), what lmtune takes instead.
_GROUPS = {
    "model": "model: a Hugging Face model folder or hub id (torchtune's checkpointer.checkpoint_dir is one)",
    "checkpointer": "model: the Hugging Face folder of checkpoint_dir; lmtune reads its safetensors files",
    "tokenizer": "the model folder's own tokenizer is used (max_seq_len is max_length)",
    "dataset": "data: a JSONL file (text, prompt/completion or chat messages) or a hub data set name",
    "optimizer": "optimizer: adamw (the default) | adamw8bit | paged_adamw8bit | sgd",
    "lr_scheduler": "lr_schedule: cosine (the default) | linear | constant | wsd, with warmup_steps",
    "loss": "lmtune's loss is a chunked linear cross-entropy by default: remove it",
    "metric_logger": "report_to: tensorboard | wandb | mlflow (metrics.jsonl is always written)",
    "profiler": "profile: true times each step's phases",
}
_LORA_ON = "LoRA is switched on by lora: true; lora_target_modules names the layers by the model's names"
_OTHER = "lmtune takes settings by name (lmtune train --help), not components"


def component_answer(group: str) -> str:
    """What lmtune takes instead of a torchtune recipe's ``group`` (model, optimizer, ...)."""
    return _GROUPS.get(group, _OTHER)


def refuse_components(
    loaded: dict[Any, Any], where: Callable[[str], str], known: set[str], rest: Callable[[], object]
) -> None:
    """Refuse a file with ``_component_`` groups, answering each group and, in the same message,
    what ``rest`` (reading the file's other keys) refuses. ``where(key)``: the file and line."""
    groups = [str(k) for k, v in loaded.items() if isinstance(v, dict) and COMPONENT in v]
    if not groups:
        return
    from lmtune.config.aliases import lmtune_name

    answers = []
    for key in groups:
        group = loaded[key]
        said = f"{key}: {brief(group[COMPONENT])} is a torchtune component; {component_answer(key)}"
        ours = {name: lmtune_name(str(name), known) for name in group if name != COMPONENT}
        settings = [f"{name} ({ours[name]})" if ours[name] != name else str(name) for name in ours]
        settings = [s for name, s in zip(ours, settings, strict=True) if ours[name] in known]
        if settings:
            said += f"; {', '.join(settings)}: lmtune's settings, given at the top level"
        if any(str(name).startswith("lora_") for name in group):  # torchtune's lora_* models
            said += f" ({_LORA_ON})"
        answers.append(where(key) + said)
    try:
        rest()
    except UserError as e:
        answers.append(str(e))
    raise UserError("\n".join(answers))
