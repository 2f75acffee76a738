"""Resumable checkpoints of the whole training state: save (atomically, space checked first), prune,
and load for an exact resume.

A checkpoint is ``checkpoints/step-NNNNNN/``: the model (safetensors; under ``--lora`` only the
adapter, in PEFT format), optimizer state (``torch.save``, loaded with ``weights_only=True`` so no
pickled code runs) or, under FSDP, model and optimizer shards written by every rank through
``torch.distributed.checkpoint`` (``sharded/``, read back by :mod:`lmtune.checkpoint.sharded` without
unpickling anything), every rank's RNG streams (JSON), the position in the global sample order,
the run's fingerprint, and a manifest with every file's size and SHA-256 written last. It is
assembled in a hidden temporary folder and renamed into place when complete, so a run killed while
saving leaves the previous checkpoint as the newest valid one. The LR schedule is a function of the
step, so it is rebuilt from the settings rather than stored.

Everything read back is data, verified first (:func:`lmtune.checkpoint.layout.verify`).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lmtune.checkpoint import sharded
from lmtune.checkpoint.export import gathered_adapter, save_configs
from lmtune.checkpoint.layout import (
    CHECKPOINTS,
    JOB_KEY,
    MANIFEST,
    MANIFEST_BYTES,
    MODEL_FILE,
    OPTIMIZER_FILE,
    SAVED_AT_KEY,
    SCALER_FILE,
    SHARDED_DIR,
    SHARDED_METADATA,
    STATE_FILE,
    begin_temporary,
    end_temporary,
    fsync_write,
    list_checkpoints,
    remove_checkpoint,
    resume_instead,
    saved_checkpoints,
    step_folder,
    verify,
    write_manifest,
)
from lmtune.checkpoint.state import (
    ModelParts,
    TrainerState,
    checked_optimizer_state,
    rng_state,
    set_rng_state,
)
from lmtune.config.files import is_int, read_json_object
from lmtune.config.groups import MAX_STEPS
from lmtune.errors import UserError, one_line, out_of_space, room, sizes, why_it_failed
from lmtune.model.lora import ADAPTER_FILE, load_adapter_state, save_adapter
from lmtune.model.quantization import logical_sizes
from lmtune.parallel.distributed import DistEnv, barrier, decided_by_main, refused_by_main
from lmtune.parallel.launched import run_id


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
) -> Path:
    """Write a checkpoint of ``state`` (collective: every rank calls it), then keep the newest
    ``keep_last`` (0: all; :func:`prune` keeps a chosen one besides).

    ``records`` are JSON files written into it by name: the run's fingerprint, the best-model
    tracker, the fp16 gradient scaler (:data:`SCALER_FILE`).

    Raises:
        UserError: on every rank when the disk has too little room (checked before writing), and on
            the rank that ran out of space while writing; the temporary folder is removed and the
            previous checkpoint stays valid.
    """
    final = step_folder(output_dir, state.step)
    tmp = final.with_name(f".{final.name}.tmp")
    refused_by_main(lambda: _space_problem(output_dir, state.step, parts, optimizer, env), env)
    decided_by_main(lambda: begin_temporary(tmp), None, env)  # a user's folder in the way: refused
    barrier(env)
    try:
        _write_checkpoint(tmp, state, parts, tokenizer, optimizer, env, records)
    except Exception as e:
        if not out_of_space(e, tmp):
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
        prune(output_dir, keep_last)
    barrier(env)
    return final


def prune(output_dir: Path, keep_last: int, protect: Path | None = None) -> None:
    """Delete all but the newest ``keep_last`` checkpoints (0 keeps all), never ``protect``, nor a
    folder lmtune did not write (a user's step-N)."""
    saved = saved_checkpoints(output_dir)
    for old in saved[:-keep_last] if keep_last > 0 else []:
        if old != protect:
            remove_checkpoint(old)  # a user's files put into it are kept


def _write_checkpoint(
    tmp: Path,
    state: TrainerState,
    parts: ModelParts,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    records: dict[str, Any],
) -> None:
    tmp.mkdir(parents=True, exist_ok=True)  # on another node when --output-dir is not shared
    fsync_write(tmp / f"rng-rank-{env.rank}.json", json.dumps(rng_state()))
    if parts.sharded:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        dcp_save(_sharded_state(parts, optimizer), checkpoint_id=str(tmp / SHARDED_DIR))
    adapter = gathered_adapter(parts) if parts.lora else {}  # collective under FSDP
    if env.is_main:
        _save_model(parts, adapter, tmp)
        # Config and tokenizer make the checkpoint self-contained for `lmtune export`.
        save_configs(parts.model, tmp)
        tokenizer.save_pretrained(tmp)
        if not parts.sharded:
            # DDP keeps every replica identical, so rank 0's optimizer is the whole state.
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        for name, record in records.items():
            fsync_write(tmp / name, json.dumps(record, indent=2))
        # The launch that saved it (torchrun's run id), and when: a restart goes on only from its own
        # launch's (lmtune.checkpoint.resume.restart_settings).
        job = {JOB_KEY: run_id(), SAVED_AT_KEY: time.time()}
        fsync_write(tmp / STATE_FILE, json.dumps(asdict(state) | job, indent=2))
    barrier(env)
    if env.is_main:
        end_temporary(tmp)
        write_manifest(tmp)


def free_bytes(folder: Path) -> int:
    """Free bytes on the disk holding ``folder``."""
    return shutil.disk_usage(folder).free


def _estimate_bytes(parts: ModelParts, optimizer: torch.optim.Optimizer, env: DistEnv) -> int:
    """What a checkpoint of this run takes: the trained weights (whole) and the optimizer state."""
    from lmtune.checkpoint.state import optimizer_state_bytes

    shards = env.world_size if parts.sharded else 1
    return _saved_weight_bytes(parts) + optimizer_state_bytes(optimizer) * shards


def _saved_weight_bytes(parts: ModelParts) -> int:
    """The weights a checkpoint or final/ holds: all of them, or LoRA's adapter."""
    return sum(
        p.numel() * p.element_size() for p in parts.root.parameters() if p.requires_grad or not parts.lora
    )


def _merged_bytes(parts: ModelParts) -> int:
    """What --merge-lora's final/merged holds: the base with the adapter merged in, a quantized
    layer's weight dequantized (saved in fp32: lmtune.model.modeling.merged_into_base)."""
    logical = logical_sizes(parts.root)
    return sum(
        logical[id(p)] * 4 if id(p) in logical else p.numel() * p.element_size()
        for p in parts.root.parameters()
        if not p.requires_grad
    )


@dataclass(frozen=True)
class Saves:
    """What a run is about to save: ``copies`` checkpoints on the disk at once beside what is there
    (by ``optimizer``, --optimizer, whose state they hold) or, with none (--save-every 0), only
    final/ (and final/merged under --merge-lora: ``merged``)."""

    copies: int
    optimizer: str
    momentum: bool = True  # SGD's: without it, SGD holds no state
    keep_last: int = 0
    merged: bool = False


def check_room(
    output_dir: Path, parts: ModelParts, optimizer: torch.optim.Optimizer, env: DistEnv, saves: Saves
) -> None:
    """Before the first step, refused on every rank (rank 0 judges) where the disk cannot hold the
    checkpoints the run keeps at once and its final model, written beside them: otherwise found at
    a save (or at the end), after every step before it."""
    from lmtune.checkpoint.state import optimizer_state_estimate

    def problem() -> str:
        one = weights = _saved_weight_bytes(parts)
        final = weights + (_merged_bytes(parts) if saves.merged else 0)
        if saves.copies:
            trained = [p.numel() for p in parts.root.parameters() if p.requires_grad]
            state = optimizer_state_estimate(saves.optimizer, trained, saves.momentum)
            # A resumed optimizer's own state, where it holds more than the estimate.
            one = max(_estimate_bytes(parts, optimizer, env), weights + state)
        needed, free = saves.copies * one + final, free_bytes(output_dir)
        if free >= room(needed):
            return ""
        model = "final model (and the merged one --merge-lora writes)" if saves.merged else "final model"
        what = (
            f"the {model} of this run"
            if not saves.copies
            else f"one checkpoint and the {model} of this run"
            if saves.copies == 1
            else f"{saves.copies} checkpoints of this run at once (those --keep-last keeps, and each new one "
            f"written before the oldest goes) and its {model}"
        )
        fewer = (
            "; a smaller --keep-last needs fewer"
            if saves.copies > 1 and saves.keep_last != 1 and free >= room(2 * one + final)
            else f"; --save-every 0 saves only the {model}, which fits"
            if saves.copies and free >= room(final)
            else "; without --merge-lora the adapter alone fits (`lmtune export --merge-lora` merges later)"
            if saves.merged and free >= room(saves.copies * one + weights)
            else ""
        )
        return (
            f"--output-dir {output_dir}: too little room on its disk for {what} ({sizes(needed, free)}); "
            f"free some space or choose another --output-dir{fewer}"
        )

    refused_by_main(problem, env)


def _space_problem(
    output_dir: Path, step: int, parts: ModelParts, optimizer: torch.optim.Optimizer, env: DistEnv
) -> str:
    """Why a checkpoint of ``step`` would not fit on the disk ("" when it fits, with 5% to spare)."""
    folder = output_dir / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    needed = _estimate_bytes(parts, optimizer, env)
    free = free_bytes(folder)
    if free >= room(needed):
        return ""
    return _no_space(step, step_folder(output_dir, step), needed, free)


def _no_space(step: int, final: Path, needed: int, free: int) -> str:
    # Past the check before writing, the disk filled meanwhile (another job's files).
    meanwhile = "the disk filled while it was written, " if free >= room(needed) else ""
    return (
        f"no space left on device while saving step {step} to {final}: {meanwhile}{sizes(needed, free)}; "
        f"{resume_note(final.parent.parent, final)}"
    )


def resume_note(output_dir: Path, unfinished: Path | None = None) -> str:
    """What a run stopped by a full disk can resume from: its newest intact checkpoint (other than
    ``unfinished``, the one being written)."""
    earlier = [p for p in list_checkpoints(output_dir) if p != unfinished and verify(p) is None]
    if earlier:
        return (
            f"{earlier[-1].name}, the newest checkpoint, is intact (free some space; the same command "
            "resumes from it)"
        )
    return "no earlier checkpoint was saved, so the run starts afresh once there is space"


def _save_model(parts: ModelParts, adapter: dict[str, torch.Tensor], folder: Path) -> None:
    from safetensors.torch import save_model

    if parts.lora:
        save_adapter(parts.model, folder, adapter, parts.quantization)
    elif not parts.sharded:
        save_model(parts.model, str(folder / MODEL_FILE))


def _sharded_state(parts: ModelParts, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state keyed by parameter name, each rank holding its shards; the frozen
    base of a LoRA model is left out (it is rebuilt from --model)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(ignore_frozen_params=parts.lora)
    model_state, optimizer_state = get_state_dict(parts.root, optimizer, options=options)
    if parts.lora:
        # Only the adapter: a 4-bit base's quantization constants are state entries, not frozen
        # parameters, and exist only where the values are packed in bytes (not under FSDP2).
        trainable = {name for name, p in parts.root.named_parameters() if p.requires_grad}
        model_state = {k: v for k, v in model_state.items() if k in trainable}
    return {"model": model_state, "optimizer": optimizer_state}


def read_state(folder: Path) -> TrainerState:
    """The trainer state of a verified checkpoint, checked field by field: whole numbers in the
    ranges a run produces (an edited file with huge or negative counts is refused, not trained on)."""
    path = folder / STATE_FILE
    raw = read_json_object(path)
    try:
        kwargs = {f: raw[f] for f in TrainerState.__dataclass_fields__ if f in raw}
        state = TrainerState(**kwargs)
    except TypeError as e:
        raise UserError(f"{path}: not a trainer state lmtune wrote ({e})") from None
    counts = all(is_int(getattr(state, f), 0, MAX_STEPS) for f in kwargs if f != "train_seconds")
    seconds = state.train_seconds
    timed = type(seconds) in (int, float) and 0 <= seconds < 1e10  # NaN fails both
    sane = (
        counts
        and timed
        and state.global_batch_size >= 1
        and state.world_size >= 1
        and state.examples >= 1
        and max(state.epoch, state.step_in_epoch, state.skipped_steps) <= state.step
        and state.samples_in_epoch <= state.examples
    )
    if not sane:
        raise UserError(f"{path}: not a trainer state lmtune wrote (counts out of range)")
    return state


def check_layout(folder: Path, parts: ModelParts) -> dict[str, Any]:
    """The manifest of ``folder``, when this run's model (LoRA or not, sharded or not) can load it."""
    listed: dict[str, Any] = read_json_object(folder / MANIFEST, limit=MANIFEST_BYTES)
    saved_lora, saved_sharded = ADAPTER_FILE in listed, SHARDED_METADATA in listed
    if saved_lora != parts.lora or (parts.sharded and not saved_sharded):
        raise UserError(
            f"--resume {folder}: it was saved by {_describe(saved_lora, saved_sharded)}; this run "
            f"({_describe(parts.lora, parts.sharded)}) cannot load it; use the same --lora and "
            "--strategy, or start afresh in another --output-dir (or with --overwrite)"
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
        except (RuntimeError, ValueError, KeyError, OSError, SafetensorError) as e:
            raise _unloadable(folder, ADAPTER_FILE if parts.lora else MODEL_FILE, e) from None
        saved = checked_optimizer_state(
            _load_plain(folder / OPTIMIZER_FILE), optimizer, folder / OPTIMIZER_FILE
        )
        try:
            optimizer.load_state_dict(saved)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            raise _unloadable(folder, OPTIMIZER_FILE, e) from None
    if scaler is not None and SCALER_FILE in listed:
        scaler.load_state_dict(_scaler_state(folder / SCALER_FILE))
    rng = folder / f"rng-rank-{env.rank}.json"
    if state.world_size == env.world_size and rng.name in listed:
        try:
            set_rng_state(read_json_object(rng))
        except UserError as e:
            raise UserError(
                f"{rng}: not the RNG state lmtune wrote ({str(e).removeprefix(f'{rng}: ')})"
            ) from None
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, OverflowError, MemoryError) as e:
            why = one_line(str(e), 100)
            raise UserError(f"{rng}: not the RNG state lmtune wrote ({type(e).__name__}: {why})") from None
    return state


def _load_plain(path: Path) -> Any:
    """A ``torch.save`` file read as tensors and plain values only: pickled code is refused."""
    import pickle
    import warnings

    try:
        with warnings.catch_warnings():  # torch's advice on weights_only: the refusal below says it
            warnings.simplefilter("ignore")
            return torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        lines = [line for line in str(e).split("WeightsUnpickler error: ")[-1].splitlines() if line.strip()]
        why = one_line(lines[0], 160) if lines else type(e).__name__
        raise UserError(f"{path}: refused, not plain tensors and values ({why})") from None
    except (RuntimeError, OSError, ValueError, EOFError) as e:  # cut short, or not torch.save's
        raise _unloadable(path.parent, path.name, e) from None


def _unloadable(folder: Path, name: str, e: Exception) -> UserError:
    """The checkpoint ``folder``'s file ``name`` failed to load: said with its reason (torch's second
    line says what) and the checkpoint before it to continue from instead."""
    why = why_it_failed(e)
    fits = isinstance(e, RuntimeError) and name != OPTIMIZER_FILE  # names or shapes that differ
    saved = list_checkpoints(folder.parent.parent)
    older = (
        [p for p in saved[: saved.index(folder)] if verify(p, hashes=False) is None]
        if folder in saved
        else []
    )
    instead = resume_instead(older, "start afresh with another --output-dir")
    what = "does not fit this run's model" if fits else "does not load"
    return UserError(f"--resume {folder}: its {name} {what} ({why}), not as lmtune saved it; {instead}")


_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def _scaler_state(path: Path) -> dict[str, float]:
    """The gradient scaler's saved numbers, checked: a crafted file is an error, not a traceback."""
    state = read_json_object(path)
    numbers = all(
        type(state.get(k)) in (int, float) and math.isfinite(state[k]) and 0 <= state[k] <= 2.0**64
        for k in _SCALER_KEYS
    )
    if (
        not numbers
        or state["scale"] <= 0
        or state["growth_factor"] < 1
        or not 0 < state["backoff_factor"] <= 1
    ):
        raise UserError(f"{path}: not a gradient scaler state lmtune wrote (needs {', '.join(_SCALER_KEYS)})")
    if not (is_int(state["growth_interval"], 1) and is_int(state["_growth_tracker"])):
        raise UserError(f"{path}: not a gradient scaler state lmtune wrote (whole-number counts)")
    return {k: state[k] for k in _SCALER_KEYS}


def _describe(lora: bool, sharded: bool) -> str:
    what = "LoRA" if lora else "full fine-tuning"
    return f"{what} under {'--strategy fsdp' if sharded else 'single/ddp'}"
