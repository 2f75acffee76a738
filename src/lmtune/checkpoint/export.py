"""Models in Hugging Face format: final/ (whole, gathered block by block under FSDP, or a PEFT
adapter), the configs that make a folder loadable elsewhere (generation_config's stop tokens), and
`lmtune export` of a checkpoint."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmtune.checkpoint import sharded
from lmtune.checkpoint.checkpoint_files import check_files, loaded_or_named
from lmtune.checkpoint.export_folder import check_destination, write_export
from lmtune.checkpoint.layout import (
    GENERATION_CONFIG,
    MANIFEST,
    MODEL_FILE,
    SHARDED_DIR,
    begin_temporary,
    end_temporary,
    in_the_way,
    not_a_checkpoint,
    open_to_umask,
    temporary_of,
    verify,
)
from lmtune.checkpoint.owned import users_files_said
from lmtune.checkpoint.state import ModelParts
from lmtune.config.files import read_json_object
from lmtune.config.io import build_config
from lmtune.config.verbosity import no_progress_bars
from lmtune.errors import UserError, out_of_space, room, sizes
from lmtune.model.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_state, save_adapter
from lmtune.model.loss import WRAPPED_PREFIX
from lmtune.model.modeling import merge_device, merged_into_base
from lmtune.model.quantization import BASE_QUANTIZATION_FILE, quantization_of
from lmtune.parallel.distributed import DistEnv, barrier, refused_by_main


def save_hf_folder(model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """Write config, ``model.safetensors`` and the tokenizer so ``from_pretrained`` loads it back."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        tokenizer.save_pretrained(tmp)

    replace_folder(folder, write)


def save_final(parts: ModelParts, tokenizer: Any, folder: Path, env: DistEnv) -> None:
    """``final/`` (collective): the whole model as a Hugging Face folder, or the LoRA adapter in
    PEFT format. FSDP gathers one decoder block at a time, so no rank ever holds the whole model.

    Raises:
        UserError: on every rank when the disk has too little room for it (checked before writing).
    """
    tmp = temporary_of(folder)
    refused_by_main(
        lambda: _users_files_problem(folder) or in_the_way(tmp) or _space_problem(parts, folder), env
    )
    if parts.lora:
        adapter = gathered_adapter(parts)
        if env.is_main:

            def write(tmp: Path) -> None:
                save_adapter(parts.model, tmp, adapter, parts.quantization)
                save_configs(parts.model, tmp, architecture=False)
                tokenizer.save_pretrained(tmp)

            replace_folder(folder, write)
    elif parts.sharded:
        _save_sharded_hf_folder(parts, tokenizer, folder, env)
    elif env.is_main:
        save_hf_folder(parts.model, tokenizer, folder)
    barrier(env)


def _users_files_problem(folder: Path) -> str:
    """Why ``folder`` (final/) is not lmtune's to replace: files put or changed there during the run
    (the run's start refused those that were there before)."""
    theirs = users_files_said(folder) if folder.is_dir() else ""
    if not theirs:
        return ""
    return (
        f"{theirs}, put there during the run, so the model is not written there; the run's last "
        "checkpoint, if it saved one, holds it (lmtune export writes it to a folder outside the run)"
    )


def _space_problem(parts: ModelParts, folder: Path) -> str:
    """Why ``folder`` would not fit on its disk ("" when it fits with 5% to spare): the weights
    it holds (the adapter alone under LoRA), as they are stored."""
    needed = sum(
        p.numel() * p.element_size() for p in parts.root.parameters() if p.requires_grad or not parts.lora
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder.parent).free
    if free >= room(needed):
        return ""
    return (
        f"no space left on device for {folder}: {sizes(needed, free)} (free some space; the same command "
        "resumes from the last checkpoint)"
    )


def replace_folder(folder: Path, write: Callable[[Path], None]) -> None:
    """Write beside the final name and rename when complete, so a crash never leaves a half-written
    folder where a finished one is expected. Only for folders lmtune owns (``final/`` of a locked
    output folder); a full disk is a :class:`UserError` that leaves ``folder`` as it was."""
    tmp = temporary_of(folder)
    begin_temporary(tmp)
    try:
        with no_progress_bars():
            write(tmp)
        end_temporary(tmp)
        open_to_umask(tmp)
    except Exception as e:
        full = out_of_space(e, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise UserError(f"no space left on device while writing {folder}; free some space") from None
        raise
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)


def _save_sharded_hf_folder(parts: ModelParts, tokenizer: Any, folder: Path, env: DistEnv) -> None:
    """Hugging Face's sharded layout (``model-0000k-of-0000n.safetensors`` + index), one file per
    decoder block: each block's parameters are gathered, written by rank 0 and dropped."""
    import re

    from safetensors.torch import save_file

    prefix = prefix_of(parts)
    every = {n for n, _ in parts.root.named_parameters(remove_duplicate=False)}
    aliases = every - {n for n, _ in parts.root.named_parameters()}  # tied weights: saved once
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, value in parts.root.state_dict().items():
        if name in aliases or not name.startswith(prefix):
            continue
        block = re.search(r"\.layers\.(\d+)\.", name)
        groups.setdefault(block.group(1) if block else "rest", []).append((name.removeprefix(prefix), value))
    weight_map: dict[str, str] = {}
    total = 0

    def write(tmp: Path) -> None:
        nonlocal total
        for i, (_, items) in enumerate(groups.items()):
            file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            # Every rank joins each gather (full_tensor is a collective); only rank 0 keeps the result.
            tensors = {
                n: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for n, v in items
            }
            if env.is_main:
                save_file(
                    {n: t.contiguous() for n, t in tensors.items()},
                    str(tmp / file),
                    metadata={"format": "pt"},
                )
                weight_map.update(dict.fromkeys(tensors, file))
                total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors
        if env.is_main:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
            save_configs(parts.model, tmp)
            tokenizer.save_pretrained(tmp)

    if env.is_main:
        replace_folder(folder, write)
    else:
        write(folder)  # joins the gathers; writes nothing


def save_configs(model: nn.Module, folder: Path, *, architecture: bool = True) -> None:
    """The base model's config.json (unless ``architecture`` is False: a PEFT adapter folder must
    not look like a model folder) and generation_config.json, whose stop tokens (a chat model's
    end of turn) every tool that generates with the folder reads."""
    get_base = getattr(model, "get_base_model", None)
    base: Any = get_base() if callable(get_base) else model
    if architecture:
        base.config.save_pretrained(folder)
    generation = getattr(base, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)


def gathered_adapter(parts: ModelParts) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors, whole, under PEFT's names (collective under FSDP; adapters are
    small, so gathering them on every rank costs little)."""
    if not parts.sharded:
        return adapter_state(parts.model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, broadcast_from_rank0=False)
    full = get_model_state_dict(parts.root, options=options)
    prefix = prefix_of(parts)
    return adapter_state(parts.model, {k.removeprefix(prefix): v for k, v in full.items()})


def prefix_of(parts: ModelParts) -> str:
    """The name prefix of ``parts.model`` inside ``parts.root`` (``model.`` under SummedLoss)."""
    for name, module in parts.root.named_modules():
        if module is parts.model:
            return f"{name}." if name else ""
    raise ValueError("the model is not inside the wrapped module")


def export(
    checkpoint: Path,
    out: Path,
    trust_remote_code: bool = False,
    overwrite: bool = False,
    merge_lora: bool = False,
) -> str | None:
    """Write a Hugging Face model folder (config, safetensors, tokenizer) from a checkpoint; a LoRA
    checkpoint gives a PEFT adapter folder, or with ``merge_lora`` its base with the adapter
    merged in. ``out`` is written beside its name and renamed into place; it may be new, empty, or
    (with ``overwrite``) an earlier export, nothing else. Returns a note for the user, or None."""
    from transformers import AutoTokenizer

    if checkpoint.is_symlink():  # a link of the user's ("latest") is read where it points, as train reads it
        checkpoint = checkpoint.resolve()
    if not checkpoint.is_dir():
        if checkpoint.exists():
            raise UserError(f"{checkpoint}: not a folder; export takes a checkpoint, RUN/checkpoints/step-N")
        raise UserError(f"{checkpoint}: no such checkpoint folder")
    reason = verify(checkpoint)
    if reason is not None and (instead := not_a_checkpoint(checkpoint)):
        raise UserError(f"{checkpoint}: {instead}; export takes a checkpoint, RUN/checkpoints/step-N")
    if reason is not None:
        raise UserError(f"{checkpoint}: not a valid checkpoint: {reason}")
    check_destination(checkpoint, out, overwrite)
    listed = read_json_object(checkpoint / MANIFEST)
    check_files(checkpoint, listed)
    tokenizer = loaded_or_named(
        checkpoint, "its tokenizer", lambda: AutoTokenizer.from_pretrained(checkpoint)
    )
    if merge_lora and ADAPTER_FILE not in listed:
        raise UserError(f"{checkpoint}: holds the whole model, no LoRA adapter to merge (--merge-lora)")
    if ADAPTER_FILE in listed and not merge_lora:

        def write_adapter(tmp: Path) -> None:
            for name in (ADAPTER_FILE, ADAPTER_CONFIG, GENERATION_CONFIG, BASE_QUANTIZATION_FILE):
                if name in listed:
                    shutil.copy2(checkpoint / name, tmp / name)
            tokenizer.save_pretrained(tmp)
            _write_card(checkpoint, tmp, out)

        write_export(out, write_adapter, checkpoint)
        if read_json_object(checkpoint / ADAPTER_CONFIG).get("base_model_name_or_path"):
            return None
        return (
            f"note: {out} is a LoRA adapter of a built-in preset, which only lmtune builds (from the "
            "run's seed), so it names no base model and loads nowhere else; `lmtune export "
            f"{checkpoint} DIR --merge-lora` writes a model that loads anywhere"
        )
    model: Any = (
        loaded_or_named(
            checkpoint, f"its {ADAPTER_CONFIG}", lambda: _merged_checkpoint(checkpoint, trust_remote_code)
        )
        if merge_lora
        else _checkpoint_model(checkpoint, listed, trust_remote_code)
    )

    def write_model(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _write_card(checkpoint, tmp, out)

    write_export(out, write_model, checkpoint)
    return None


def _checkpoint_model(checkpoint: Path, listed: dict[str, Any], trust_remote_code: bool) -> nn.Module:
    """The whole model a (full fine-tuning) checkpoint holds, with its stop tokens."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM

    def rebuilt() -> Any:
        config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
        return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)

    model = loaded_or_named(checkpoint, "its config.json", rebuilt)
    if GENERATION_CONFIG in listed:  # the stop tokens training set (a chat model's end of turn)
        from transformers import GenerationConfig

        generation = loaded_or_named(
            checkpoint, GENERATION_CONFIG, lambda: GenerationConfig.from_pretrained(checkpoint)
        )
        model.generation_config = generation
    if MODEL_FILE in listed:
        loaded_or_named(checkpoint, MODEL_FILE, lambda: load_model(model, str(checkpoint / MODEL_FILE)))
    else:
        _load_sharded_model(model, checkpoint / SHARDED_DIR)
    loaded: nn.Module = model
    return loaded


def _merged_checkpoint(checkpoint: Path, trust_remote_code: bool) -> nn.Module:
    """A LoRA checkpoint's adapter merged into the base it was trained on, rebuilt from the run's
    record beside it (a preset's weights come from its seed; a quantized base is dequantized)."""
    from lmtune.checkpoint.fingerprint import read_fingerprint  # resume -> store -> this module

    saved = read_fingerprint(checkpoint)
    record = checkpoint.parent.parent / "run.json"
    run = read_json_object(record) if record.is_file() else {}
    config, resolved = run.get("config"), run.get("resolved")
    # --model as typed (relative to where training ran), and a local folder as loaded (absolute),
    # as the fingerprint records it.
    models = {config.get("model") if isinstance(config, dict) else None}
    models.add(resolved.get("model_source") if isinstance(resolved, dict) else None)
    same = (
        saved is not None
        and isinstance(config, dict)
        and saved.fixed.get("--model") in models - {None}
        and config.get("seed") == saved.fixed.get("--seed")
    )
    if not same:
        from lmtune.model.modeling import PRESETS

        found = (
            f"{record} is not that run's record"
            if record.is_file()
            else "it is not in a run's folder (RUN/checkpoints/step-N, with RUN/run.json)"
        )
        fix = "export it from its run's folder"
        if saved is None or saved.fixed.get("--model") not in PRESETS:  # a preset is built by lmtune alone
            fix += (
                ", or export the adapter without --merge-lora and merge it with peft "
                "(PeftModel.from_pretrained(base, DIR).merge_and_unload())"
            )
        raise UserError(
            f"{checkpoint}: --merge-lora rebuilds the base from the run that saved the checkpoint, and "
            f"{found}; {fix}"
        )
    assert isinstance(config, dict)
    model = build_config(config, str(record)).model
    # The adapter names a local base by its absolute path (--model may have been relative to the
    # directory training ran in); a preset's adapter names none.
    named = read_json_object(checkpoint / ADAPTER_CONFIG).get("base_model_name_or_path")
    try:
        merged, _ = merged_into_base(
            named if isinstance(named, str) and named else model.name,
            int(config["seed"]),
            checkpoint,
            trust_remote_code=trust_remote_code,
            quantization=quantization_of(model, "single"),
            device=merge_device(),
        )
    except UserError as e:  # export has no --model: the base is the adapter's
        said = str(e)
        if not said.startswith("--model "):
            raise
        raise UserError(f"{checkpoint}: its adapter's base model {said.removeprefix('--model ')}") from None
    return merged


def _write_card(checkpoint: Path, folder: Path, out: Path) -> None:
    """An exported folder's model card: its run's record (OUTPUT/run.json, when the checkpoint is
    still in its run's folder), with the results of the checkpoint's own step."""
    from lmtune.checkpoint.card import checkpoint_record, write_model_card
    from lmtune.checkpoint.store import read_state

    step = read_state(checkpoint).step
    run = checkpoint_record(checkpoint, step)
    note = f"Exported from the checkpoint of step {step} ({checkpoint.name})."
    write_model_card(folder, run, note=note, final=out)


def _load_sharded_model(model: nn.Module, folder: Path) -> None:
    """Read the model part of an FSDP checkpoint into one process (no process group needed)."""
    # Keys as the training wrapper named them (its prefix + the model's names), under "model".
    saved = set(sharded.read_index(folder).state_dict_metadata)
    missing = [n for n, _ in model.named_parameters() if f"model.{WRAPPED_PREFIX}{n}" not in saved]
    if missing:
        raise UserError(f"{folder}: the sharded checkpoint has no {missing[0]} (not a full model)")
    state = {"model": {f"{WRAPPED_PREFIX}{k}": v for k, v in model.state_dict().items()}}
    # Partial: a tied weight (the output head) may be stored once under the embedding's name.
    sharded.load(state, folder, no_dist=True, allow_partial=True)
    model.load_state_dict({k.removeprefix(WRAPPED_PREFIX): v for k, v in state["model"].items()})
