"""Checkpoints of the whole training state, exact resume, and export to Hugging Face format.

A checkpoint is ``checkpoints/step-NNNNNN/``: the model (safetensors; under ``--lora`` only the
adapter, in PEFT format), optimizer and LR-scheduler state (``torch.save``, loaded with
``weights_only=True`` so no pickled code runs) or, under FSDP, model and optimizer shards written
by every rank through ``torch.distributed.checkpoint`` (``sharded/``), every rank's RNG
streams (JSON), the position in the global sample order, and a manifest with every file's size and
SHA-256 written last. It is assembled in a hidden temporary folder and renamed into place when
complete, so a run killed while saving leaves the previous checkpoint as the newest valid one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmtune import faults
from lmtune.distributed import DistEnv, barrier
from lmtune.errors import UserError
from lmtune.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_state, load_adapter_state, save_adapter

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
SCALER_FILE = "scaler.pt"
SHARDED_DIR = "sharded"  # torch.distributed.checkpoint folder: one file per rank + .metadata
SHARDED_METADATA = f"{SHARDED_DIR}/.metadata"
MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE = (
    "model.safetensors",
    "optimizer.pt",
    "scheduler.pt",
    "trainer.json",
)


@dataclass(frozen=True)
class TrainerState:
    """Where training stands after ``step`` optimizer steps."""

    step: int
    epoch: int  # the epoch the next step belongs to
    step_in_epoch: int  # steps of that epoch already taken: the next samples are order[k*G:]
    global_batch_size: int
    world_size: int
    seed: int
    examples: int  # size of the training set: the sample order is only meaningful for the same data
    skipped_steps: int = 0  # updates dropped by --on-nan skip

    @property
    def samples_in_epoch(self) -> int:
        return self.step_in_epoch * self.global_batch_size


@dataclass(frozen=True)
class ModelParts:
    """The model as checkpoints see it."""

    model: nn.Module  # the Hugging Face model (a PeftModel under --lora), as the strategy left it
    root: nn.Module  # the module the strategy wrapped: the FSDP root under --strategy fsdp
    sharded: bool  # FSDP2: every rank holds a shard; state goes through torch.distributed.checkpoint
    lora: bool  # only the adapter trains; the frozen base is rebuilt from --model


def save_hf_folder(model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """Write config, ``model.safetensors`` and the tokenizer so ``from_pretrained`` loads it back."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
        tokenizer.save_pretrained(tmp)

    _replace_folder(folder, write)


def save_final(parts: ModelParts, tokenizer: Any, folder: Path, env: DistEnv) -> None:
    """``final/`` (collective): the whole model as a Hugging Face folder, or the LoRA adapter in
    PEFT format. FSDP gathers one decoder block at a time, so no rank ever holds the whole model."""
    if parts.lora:
        adapter = gathered_adapter(parts)
        if env.is_main:

            def write(tmp: Path) -> None:
                save_adapter(parts.model, tmp, adapter)
                tokenizer.save_pretrained(tmp)

            _replace_folder(folder, write)
    elif parts.sharded:
        _save_sharded_hf_folder(parts, tokenizer, folder, env)
    elif env.is_main:
        save_hf_folder(parts.model, tokenizer, folder)
    barrier(env)


def _replace_folder(folder: Path, write: Callable[[Path], None]) -> None:
    """Write beside the final name and rename when complete, so a crash never leaves a half-written
    folder where a finished one is expected."""
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)


def _save_sharded_hf_folder(parts: ModelParts, tokenizer: Any, folder: Path, env: DistEnv) -> None:
    """Hugging Face's sharded layout (``model-0000k-of-0000n.safetensors`` + index), one file per
    decoder block: each block's parameters are gathered, written by rank 0 and dropped."""
    import re

    from safetensors.torch import save_file

    prefix = _prefix_of(parts)
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
            _base_config(parts.model).save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

    if env.is_main:
        _replace_folder(folder, write)
    else:
        write(folder)  # joins the gathers; writes nothing


# --- RNG ------------------------------------------------------------------------------------------


def _rng_state() -> dict[str, Any]:
    """Every RNG stream of this process as plain JSON (no pickle)."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))

    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


# --- writing --------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_write(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def step_folder(output_dir: Path, step: int) -> Path:
    return output_dir / CHECKPOINTS / f"step-{step:06d}"


def save_checkpoint(
    output_dir: Path,
    state: TrainerState,
    parts: ModelParts,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    env: DistEnv,
    keep_last: int,
    scaler: torch.amp.GradScaler | None = None,
) -> Path:
    """Write a checkpoint of ``state`` (collective: every rank calls it) and prune old ones."""
    final = step_folder(output_dir, state.step)
    tmp = final.with_name(f".{final.name}.tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    tmp.mkdir(parents=True, exist_ok=True)  # on another node when --output-dir is not shared
    _fsync_write(tmp / f"rng-rank-{env.rank}.json", json.dumps(_rng_state()))
    if parts.sharded:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        dcp_save(_sharded_state(parts, optimizer), checkpoint_id=str(tmp / SHARDED_DIR))
    adapter = gathered_adapter(parts) if parts.lora else {}  # collective under FSDP
    if env.is_main:
        _save_model(parts, adapter, tmp)
        faults.maybe_kill_in_save(state.step)
        # Config and tokenizer make the checkpoint self-contained for `lmtune export`.
        _base_config(parts.model).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not parts.sharded:
            # DDP keeps every replica identical, so rank 0's optimizer is the whole state.
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / SCALER_FILE)
        _fsync_write(tmp / STATE_FILE, json.dumps(asdict(state), indent=2))
    barrier(env)
    if env.is_main:
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files
        }
        _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return final


def _base_config(model: nn.Module) -> Any:
    get_base = getattr(model, "get_base_model", None)
    return (get_base() if callable(get_base) else model).config


def _save_model(parts: ModelParts, adapter: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_model

    if parts.lora:
        save_adapter(parts.model, folder, adapter)
    elif not parts.sharded:
        save_model(parts.model, str(folder / MODEL_FILE))


def _sharded_state(parts: ModelParts, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name, each rank holding its shards; the frozen
    base of a LoRA model is left out (it is rebuilt from --model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=parts.lora)
    model_state, optimizer_state = get_state_dict(parts.root, optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state}


def gathered_adapter(parts: ModelParts) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors, whole, under PEFT's names (collective under FSDP; adapters are
    small, so gathering them on every rank costs little)."""
    if not parts.sharded:
        return adapter_state(parts.model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True, broadcast_from_rank0=False)
    full = get_model_state_dict(parts.root, options=options)
    prefix = _prefix_of(parts)
    return adapter_state(parts.model, {k.removeprefix(prefix): v for k, v in full.items()})


def _prefix_of(parts: ModelParts) -> str:
    """The name prefix of ``parts.model`` inside ``parts.root`` (``model.`` under SummedLoss)."""
    for name, module in parts.root.named_modules():
        if module is parts.model:
            return f"{name}." if name else ""
    raise ValueError("the model is not inside the wrapped module")


# --- reading --------------------------------------------------------------------------------------


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint folders by step, oldest first (hidden temporary folders are not checkpoints)."""
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]
    return sorted(found, key=lambda p: p.name)


def verify(folder: Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when its manifest checks out."""
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return "unreadable manifest"
    for required in (SCHEDULER_FILE, STATE_FILE):
        if required not in manifest:
            return f"manifest lists no {required}"
    layouts = ((MODEL_FILE, OPTIMIZER_FILE), (ADAPTER_FILE, OPTIMIZER_FILE), (SHARDED_METADATA,))
    if not any(all(name in manifest for name in layout) for layout in layouts):
        return "manifest lists no model and optimizer state"
    for name, entry in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
        if _sha256(path) != entry["sha256"]:
            return f"{name} does not match its checksum"
    return None


def newest_valid(output_dir: Path, warn: Any) -> Path | None:
    """The newest checkpoint whose manifest checks out; broken ones are reported through ``warn``."""
    for folder in reversed(list_checkpoints(output_dir)):
        reason = verify(folder)
        if reason is None:
            return folder
        warn(f"ignoring checkpoint {folder}: {reason}")
    return None


def read_state(folder: Path) -> TrainerState:
    return TrainerState(**json.loads((folder / STATE_FILE).read_text()))


def load_checkpoint(
    folder: Path,
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    env: DistEnv,
    scaler: torch.amp.GradScaler | None = None,
) -> TrainerState:
    """Restore model, optimizer, schedule, gradient scaler and (same world size) this rank's RNG."""
    from safetensors.torch import load_model

    reason = verify(folder)
    if reason is not None:
        raise UserError(f"--resume {folder}: not a valid checkpoint: {reason}")
    listed = json.loads((folder / MANIFEST).read_text())
    saved_lora, saved_sharded = ADAPTER_FILE in listed, SHARDED_METADATA in listed
    if saved_lora != parts.lora or (parts.sharded and not saved_sharded):
        raise UserError(
            f"--resume {folder}: it was saved by {_describe(saved_lora, saved_sharded)}; this run "
            f"({_describe(parts.lora, parts.sharded)}) cannot load it; use the same --lora and "
            "--strategy, or --resume never with a new --output-dir"
        )
    state = read_state(folder)
    if (folder / SHARDED_DIR).is_dir():
        # Sharded state loads into any world size and into an unsharded model too: DCP reshards.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        saved = _sharded_state(parts, optimizer)
        dcp_load(saved, checkpoint_id=str(folder / SHARDED_DIR), no_dist=not env.distributed)
        set_state_dict(
            parts.root,
            optimizer,
            model_state_dict=saved["model"],
            optim_state_dict=saved["optimizer"],
            options=StateDictOptions(ignore_frozen_params=parts.lora, strict=not parts.lora),
        )
    else:
        if parts.lora:
            load_adapter_state(parts.model, folder)
        else:
            device = str(next(parts.model.parameters()).device)
            load_model(parts.model, str(folder / MODEL_FILE), device=device)
        optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location="cpu"))
    scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=True))
    if scaler is not None and (folder / SCALER_FILE).is_file():
        scaler.load_state_dict(torch.load(folder / SCALER_FILE, weights_only=True))
    rng = folder / f"rng-rank-{env.rank}.json"
    if state.world_size == env.world_size and rng.is_file():
        _set_rng_state(json.loads(rng.read_text()))
    return state


def _describe(lora: bool, sharded: bool) -> str:
    what = "LoRA" if lora else "full fine-tuning"
    return f"{what} under {'--strategy fsdp' if sharded else 'single/ddp'}"


def export(checkpoint: Path, out: Path, trust_remote_code: bool = False) -> None:
    """Write a Hugging Face model folder (config, safetensors, tokenizer) from a checkpoint; a LoRA
    checkpoint gives a PEFT adapter folder."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not checkpoint.is_dir():
        raise UserError(f"{checkpoint}: no such checkpoint folder")
    reason = verify(checkpoint)
    if reason is not None:
        raise UserError(f"{checkpoint}: not a valid checkpoint: {reason}")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if (checkpoint / ADAPTER_FILE).is_file():

        def write(tmp: Path) -> None:
            for name in (ADAPTER_FILE, ADAPTER_CONFIG):
                shutil.copy2(checkpoint / name, tmp / name)
            tokenizer.save_pretrained(tmp)

        _replace_folder(out, write)
        return
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    if (checkpoint / MODEL_FILE).is_file():
        load_model(model, str(checkpoint / MODEL_FILE))
    else:
        _load_sharded_model(model, checkpoint / SHARDED_DIR)
    save_hf_folder(model, tokenizer, out)


def _load_sharded_model(model: nn.Module, folder: Path) -> None:
    """Read the model part of an FSDP checkpoint into one process (no process group needed)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    # Keys as the training wrapper named them ("model." + the model's names), under "model".
    saved = set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)
    missing = [n for n, _ in model.named_parameters() if f"model.model.{n}" not in saved]
    if missing:
        raise UserError(f"{folder}: the sharded checkpoint has no {missing[0]} (not a full model)")
    state = {"model": {f"model.{k}": v for k, v in model.state_dict().items()}}
    # Partial: a tied weight (the output head) may be stored once under the embedding's name.
    planner = DefaultLoadPlanner(allow_partial_load=True)
    dcp_load(state, checkpoint_id=str(folder), planner=planner, no_dist=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state["model"].items()})
