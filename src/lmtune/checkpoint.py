"""Checkpoints of the whole training state, exact resume, and export to Hugging Face format.

A checkpoint is ``checkpoints/step-NNNNNN/``: the model (safetensors; under ``--lora`` only the
adapter, in PEFT format), optimizer state (``torch.save``, loaded with ``weights_only=True`` so no
pickled code runs) or, under FSDP, model and optimizer shards written by every rank through
``torch.distributed.checkpoint`` (``sharded/``, read back by :mod:`lmtune.sharded` without
unpickling anything), every rank's RNG streams (JSON), the position in the global sample order,
the run's fingerprint, and a manifest with every file's size and SHA-256 written last. It is
assembled in a hidden temporary folder and renamed into place when complete, so a run killed while
saving leaves the previous checkpoint as the newest valid one. The LR schedule is a function of the
step, so it is rebuilt from the settings rather than stored.

Everything read back is data: a manifest that names a path outside the folder, a link, or a file it
does not list makes the checkpoint invalid.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmtune import faults, sharded
from lmtune.distributed import DistEnv, barrier, broadcast_object
from lmtune.errors import UserError
from lmtune.lora import ADAPTER_CONFIG, ADAPTER_FILE, adapter_state, load_adapter_state, save_adapter

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
SCALER_FILE = "scaler.pt"
FINGERPRINT_FILE = "fingerprint.json"
GENERATION_CONFIG = "generation_config.json"
_STEP_NAME = re.compile(r"step-(\d+)")
SHARDED_DIR = "sharded"  # torch.distributed.checkpoint folder: one file per rank + .metadata
SHARDED_METADATA = f"{SHARDED_DIR}/.metadata"
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.pt", "trainer.json"


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

    @property
    def epochs_done(self) -> float:
        """Epochs completed, fractional (Hugging Face Trainer's ``epoch``): 0.5 halfway through the
        first, 1.0 at its end. metrics.jsonl, reports and dashboards use this one convention."""
        per_epoch = max(self.examples // self.global_batch_size, 1)
        return round(self.epoch + self.step_in_epoch / per_epoch, 6)


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
                _save_configs(parts.model, tmp, architecture=False)
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
            _save_configs(parts.model, tmp)
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
    env: DistEnv,
    *,
    keep_last: int,
    records: dict[str, Any],
    scaler: torch.amp.GradScaler | None = None,
    protect: Path | None = None,
) -> Path:
    """Write a checkpoint of ``state`` (collective: every rank calls it) and prune old ones.

    ``records`` are JSON files written into it by name (the run's fingerprint, the best-model
    tracker); ``protect`` is a checkpoint that pruning keeps (the best one).

    Raises:
        UserError: on every rank when the disk has too little room (checked before writing), and on
            the rank that ran out of space while writing; the temporary folder is removed and the
            previous checkpoint stays valid.
    """
    final = step_folder(output_dir, state.step)
    tmp = final.with_name(f".{final.name}.tmp")
    problem = _space_problem(output_dir, state.step, parts, optimizer, env) if env.is_main else ""
    problem = broadcast_object(problem, env)
    if problem:
        raise UserError(problem)
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    try:
        _write_checkpoint(tmp, state, parts, tokenizer, optimizer, env, records, scaler)
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        needed, free = _estimate_bytes(parts, optimizer, env), shutil.disk_usage(output_dir).free
        raise UserError(_no_space(state.step, final, needed, free)) from None
    if env.is_main:
        if final.exists():  # a checkpoint of this step from an earlier attempt: kept, not replaced
            aside = final.with_name(f"{final.name}.replaced-{int(time.time())}")
            final.rename(aside)
            print(f"lmtune: kept the earlier {final.name} as {aside}", flush=True)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            if old != protect:
                shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return final


def _write_checkpoint(
    tmp: Path,
    state: TrainerState,
    parts: ModelParts,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    records: dict[str, Any],
    scaler: torch.amp.GradScaler | None,
) -> None:
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
        _save_configs(parts.model, tmp)
        tokenizer.save_pretrained(tmp)
        if not parts.sharded:
            # DDP keeps every replica identical, so rank 0's optimizer is the whole state.
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / SCALER_FILE)
        for name, record in records.items():
            _fsync_write(tmp / name, json.dumps(record, indent=2))
        _fsync_write(tmp / STATE_FILE, json.dumps(asdict(state), indent=2))
    barrier(env)
    if env.is_main:
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        manifest = {
            p.relative_to(tmp).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files
        }
        _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=2))


def _estimate_bytes(parts: ModelParts, optimizer: torch.optim.Optimizer, env: DistEnv) -> int:
    """What a checkpoint of this run takes: the trained weights (whole) and the optimizer state."""
    from lmtune.optim import optimizer_state_bytes

    weights = sum(
        p.numel() * p.element_size() for p in parts.root.parameters() if p.requires_grad or not parts.lora
    )
    shards = env.world_size if parts.sharded else 1
    return weights + optimizer_state_bytes(optimizer) * shards


def _space_problem(
    output_dir: Path, step: int, parts: ModelParts, optimizer: torch.optim.Optimizer, env: DistEnv
) -> str:
    """Why a checkpoint of ``step`` would not fit on the disk ("" when it fits, with 5% to spare)."""
    folder = output_dir / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    needed = _estimate_bytes(parts, optimizer, env)
    free = faults.free_bytes_override() or shutil.disk_usage(folder).free
    if free >= needed * 1.05 + (1 << 20):
        return ""
    return _no_space(step, step_folder(output_dir, step), needed, free)


def _no_space(step: int, final: Path, needed: int, free: int) -> str:
    return (
        f"no space left on device while saving step {step} to {final}: about "
        f"{needed / 2**20:,.0f} MB needed, {free / 2**20:,.0f} MB free; the previous checkpoint is "
        "intact (free some space; the same command resumes from it)"
    )


def _save_configs(model: nn.Module, folder: Path, *, architecture: bool = True) -> None:
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
    """Checkpoint folders by step number, oldest first (hidden temporary folders, and folders kept
    aside, are not checkpoints)."""
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_NAME.fullmatch(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found, key=lambda item: item[0])]


def verify(folder: Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when its manifest checks out.

    The manifest must list every file of the folder, by plain relative names inside it; no entry
    may be a link.
    """
    if folder.is_symlink() or not folder.is_dir():
        return "not a folder"
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file() or manifest_path.is_symlink():
        return "no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return f"{MANIFEST} is unreadable"
    if not isinstance(manifest, dict) or not all(isinstance(e, dict) for e in manifest.values()):
        return f"{MANIFEST} is not a manifest"
    if STATE_FILE not in manifest:
        return f"manifest lists no {STATE_FILE}"
    layouts = ((MODEL_FILE, OPTIMIZER_FILE), (ADAPTER_FILE, OPTIMIZER_FILE), (SHARDED_METADATA,))
    if not any(all(name in manifest for name in layout) for layout in layouts):
        return "manifest lists no model and optimizer state"
    for path in folder.rglob("*"):
        name = path.relative_to(folder).as_posix()
        if path.is_symlink():
            return f"{name} is a symbolic link"
        if path.is_file() and name != MANIFEST and name not in manifest:
            return f"{name} is not in the manifest"
    root = folder.resolve()
    for name, entry in manifest.items():
        path = folder / name
        if name.startswith("/") or "\\" in name or ".." in Path(name).parts or not name:
            return f"manifest entry {name!r} is not a plain path inside the checkpoint"
        if not path.is_file():
            return f"{name} is missing"
        if root not in path.resolve().parents:
            return f"manifest entry {name!r} is not inside the checkpoint"
        size = path.stat().st_size
        if size != entry.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {entry.get('bytes')}"
        if _sha256(path) != entry.get("sha256"):
            return f"{name} does not match its checksum"
    return None


def read_state(folder: Path) -> TrainerState:
    """The trainer state of a verified checkpoint, checked field by field."""
    path = folder / STATE_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        kwargs = {f: raw[f] for f in TrainerState.__dataclass_fields__ if f in raw}
        state = TrainerState(**kwargs)
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path}: not a trainer state lmtune wrote ({e})") from None
    if not all(type(getattr(state, f)) is int and getattr(state, f) >= 0 for f in kwargs):
        raise UserError(f"{path}: not a trainer state lmtune wrote (fields must be counts)")
    return state


def check_layout(folder: Path, parts: ModelParts) -> dict[str, Any]:
    """The manifest of ``folder``, when this run's model (LoRA or not, sharded or not) can load it."""
    listed: dict[str, Any] = json.loads((folder / MANIFEST).read_text())
    saved_lora, saved_sharded = ADAPTER_FILE in listed, SHARDED_METADATA in listed
    if saved_lora != parts.lora or (parts.sharded and not saved_sharded):
        raise UserError(
            f"--resume {folder}: it was saved by {_describe(saved_lora, saved_sharded)}; this run "
            f"({_describe(parts.lora, parts.sharded)}) cannot load it; use the same --lora and "
            "--strategy, or --resume never with a new --output-dir"
        )
    return listed


def load_checkpoint(
    folder: Path,
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    scaler: torch.amp.GradScaler | None = None,
) -> TrainerState:
    """Restore model, optimizer, gradient scaler and (same world size) this rank's RNG.

    What is loaded follows what the manifest lists, never what else lies in the folder.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    reason = verify(folder)
    if reason is not None:
        raise UserError(f"--resume {folder}: not a valid checkpoint: {reason}")
    listed = check_layout(folder, parts)
    saved_sharded = SHARDED_METADATA in listed
    state = read_state(folder)
    if saved_sharded:
        # Sharded state loads into any world size and into an unsharded model too: DCP reshards.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        saved = _sharded_state(parts, optimizer)
        sharded.load(saved, folder / SHARDED_DIR, no_dist=not env.distributed)
        set_state_dict(
            parts.root,
            optimizer,
            model_state_dict=saved["model"],
            optim_state_dict=saved["optimizer"],
            options=StateDictOptions(ignore_frozen_params=parts.lora, strict=not parts.lora),
        )
    else:
        try:
            if parts.lora:
                load_adapter_state(parts.model, folder)
            else:
                device = str(next(parts.model.parameters()).device)
                load_model(parts.model, str(folder / MODEL_FILE), device=device)
            optimizer.load_state_dict(_load_plain(folder / OPTIMIZER_FILE))
        except (RuntimeError, ValueError, KeyError, OSError, SafetensorError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"--resume {folder}: its state does not fit this run's model ({first})") from None
    if scaler is not None and SCALER_FILE in listed:
        scaler.load_state_dict(_load_plain(folder / SCALER_FILE))
    rng = f"rng-rank-{env.rank}.json"
    if state.world_size == env.world_size and rng in listed:
        _set_rng_state(json.loads((folder / rng).read_text()))
    return state


def _load_plain(path: Path) -> Any:
    """A ``torch.save`` file read as tensors and plain values only: pickled code is refused."""
    import pickle

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        why = str(e).split("WeightsUnpickler error: ")[-1].splitlines()[0]
        raise UserError(f"{path}: refused, not plain tensors and values ({why})") from None


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
    listed = json.loads((checkpoint / MANIFEST).read_text())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    if ADAPTER_FILE in listed:

        def write(tmp: Path) -> None:
            for name in (ADAPTER_FILE, ADAPTER_CONFIG, GENERATION_CONFIG):
                if name in listed:
                    shutil.copy2(checkpoint / name, tmp / name)
            tokenizer.save_pretrained(tmp)

        _replace_folder(out, write)
        return
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    if GENERATION_CONFIG in listed:  # the stop tokens training set (a chat model's end of turn)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(checkpoint)
    if MODEL_FILE in listed:
        load_model(model, str(checkpoint / MODEL_FILE))
    else:
        _load_sharded_model(model, checkpoint / SHARDED_DIR)
    save_hf_folder(model, tokenizer, out)


def _load_sharded_model(model: nn.Module, folder: Path) -> None:
    """Read the model part of an FSDP checkpoint into one process (no process group needed)."""
    # Keys as the training wrapper named them ("model." + the model's names), under "model".
    saved = set(sharded.read_index(folder).state_dict_metadata)
    missing = [n for n, _ in model.named_parameters() if f"model.model.{n}" not in saved]
    if missing:
        raise UserError(f"{folder}: the sharded checkpoint has no {missing[0]} (not a full model)")
    state = {"model": {f"model.{k}": v for k, v in model.state_dict().items()}}
    # Partial: a tied weight (the output head) may be stored once under the embedding's name.
    sharded.load(state, folder, no_dist=True, allow_partial=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state["model"].items()})
