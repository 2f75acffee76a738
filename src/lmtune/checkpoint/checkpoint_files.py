"""A checkpoint's files read as data from disk, before `lmtune export` builds a model from them: a
manifest recomputed after an edit passes :func:`lmtune.checkpoint.layout.verify`, so the files are
checked as ``--model`` checks a model folder, and one that fails to load is named, not a traceback
from transformers, peft or safetensors."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmtune.config.files import is_int, read_json_object
from lmtune.errors import UserError, brief, why_it_failed
from lmtune.model.configs import check_config, check_folder
from lmtune.model.lora import ADAPTER_CONFIG, ADAPTER_FILE, is_target


def check_files(checkpoint: Path, listed: dict[str, Any]) -> None:
    """The configs of ``checkpoint`` (whose manifest lists ``listed``): sizes in config.json, token
    ids in generation_config.json, a LoRA adapter's rank against its weights."""
    check_folder(checkpoint, "lmtune export")
    if ADAPTER_FILE in listed:
        _check_adapter(checkpoint)
    else:
        config = checkpoint / "config.json"
        check_config(read_json_object(config, follow_links=True), str(config), fits_memory=True)


def loaded_or_named(checkpoint: Path, what: str, load: Callable[[], Any]) -> Any:
    """``load()``, where a file of ``checkpoint`` that does not load (truncated, edited) is a
    UserError naming it rather than a traceback from transformers or safetensors."""
    try:
        return load()
    except UserError:
        raise
    except Exception as e:
        why = why_it_failed(e)
        raise UserError(
            f"{checkpoint}: {what} does not load ({why}); not a checkpoint lmtune wrote"
        ) from None


def _check_adapter(checkpoint: Path) -> None:
    """A LoRA checkpoint's adapter: its config names a positive rank, its weights load."""
    from safetensors.torch import load_file

    path = checkpoint / ADAPTER_CONFIG
    config = read_json_object(path, follow_links=True)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    number = isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha)
    if config.get("peft_type", "LORA") != "LORA" or not is_int(rank, 1, 1 << 16) or not number:
        raise UserError(
            f"{path}: a LoRA adapter's, with r a whole number >= 1 and lora_alpha a finite number (got "
            f"peft_type {brief(config.get('peft_type'))}, r {brief(rank)}, lora_alpha {brief(alpha)}); not a "
            "checkpoint lmtune wrote"
        )
    tensors = loaded_or_named(checkpoint, ADAPTER_FILE, lambda: load_file(checkpoint / ADAPTER_FILE))
    ranks = {t.shape[0] for k, t in tensors.items() if "lora_A" in k} | {
        t.shape[1] for k, t in tensors.items() if "lora_B" in k and t.dim() == 2
    }
    if not config.get("rank_pattern") and ranks - {rank}:
        raise UserError(
            f"{path}: r {rank}, but {ADAPTER_FILE} holds rank {', '.join(map(str, sorted(ranks)))}; not a "
            "checkpoint lmtune wrote"
        )
    targets = config.get("target_modules")
    adapted = {k.split(".lora_")[0] for k in tensors if ".lora_" in k}
    # peft matches a listed name against a module's name or its last part (a string is a pattern);
    # target_parameters adapt weights of modules (fused MoE experts), by the weight's name.
    owners = [str(p).rpartition(".")[0] for p in config.get("target_parameters") or []]
    unlisted = sorted(
        m
        for m in adapted
        if isinstance(targets, list)
        and not any(is_target(m, t) for t in targets)
        and not any(o == "" or is_target(m.removesuffix(".base_layer"), o) for o in owners)
    )
    if unlisted:
        raise UserError(
            f"{path}: target_modules {brief(targets)} does not name {unlisted[0]}, whose weights "
            f"{ADAPTER_FILE} holds; not a checkpoint lmtune wrote"
        )
