"""Checkpoints of the whole training state, exact resume, and export to Hugging Face format.

A checkpoint is ``checkpoints/step-NNNNNN/``: the model (safetensors), optimizer and LR-scheduler
state (``torch.save``, loaded with ``weights_only=True`` so no pickled code runs), every rank's RNG
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmtune import faults
from lmtune.distributed import DistEnv, barrier
from lmtune.errors import UserError

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
SCALER_FILE = "scaler.pt"
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


def save_hf_folder(model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """Write config, ``model.safetensors`` and the tokenizer so ``from_pretrained`` loads it back.

    The folder is written beside its final name and renamed when complete, so a crash never leaves
    a half-written model where a finished one is expected.
    """
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)


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
    model: nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    env: DistEnv,
    keep_last: int,
    scaler: torch.amp.GradScaler | None = None,
) -> Path:
    """Write a checkpoint of ``state`` (collective: every rank calls it) and prune old ones."""
    from safetensors.torch import save_model

    final = step_folder(output_dir, state.step)
    tmp = final.with_name(f".{final.name}.tmp")
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier(env)
    tmp.mkdir(parents=True, exist_ok=True)  # on another node when --output-dir is not shared
    _fsync_write(tmp / f"rng-rank-{env.rank}.json", json.dumps(_rng_state()))
    if env.is_main:
        # DDP keeps every replica identical, so rank 0's model and optimizer are the whole state.
        save_model(model, str(tmp / MODEL_FILE))
        faults.maybe_kill_in_save(state.step)
        # Config and tokenizer make the checkpoint self-contained for `lmtune export`.
        model.config.save_pretrained(tmp)  # type: ignore[operator, union-attr]
        tokenizer.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
        if scaler is not None:
            torch.save(scaler.state_dict(), tmp / SCALER_FILE)
        _fsync_write(tmp / STATE_FILE, json.dumps(asdict(state), indent=2))
    barrier(env)
    if env.is_main:
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        manifest = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
        _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(env)
    return final


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
    for required in (MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE):
        if required not in manifest:
            return f"manifest lists no {required}"
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
    model: nn.Module,
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
    state = read_state(folder)
    load_model(model, str(folder / MODEL_FILE), device=str(next(model.parameters()).device))
    optimizer.load_state_dict(torch.load(folder / OPTIMIZER_FILE, weights_only=True, map_location="cpu"))
    scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, weights_only=True))
    if scaler is not None and (folder / SCALER_FILE).is_file():
        scaler.load_state_dict(torch.load(folder / SCALER_FILE, weights_only=True))
    rng = folder / f"rng-rank-{env.rank}.json"
    if state.world_size == env.world_size and rng.is_file():
        _set_rng_state(json.loads(rng.read_text()))
    return state


def export(checkpoint: Path, out: Path, trust_remote_code: bool = False) -> None:
    """Write a Hugging Face model folder (config, safetensors, tokenizer) from a checkpoint."""
    from safetensors.torch import load_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not checkpoint.is_dir():
        raise UserError(f"{checkpoint}: no such checkpoint folder")
    reason = verify(checkpoint)
    if reason is not None:
        raise UserError(f"{checkpoint}: not a valid checkpoint: {reason}")
    config = AutoConfig.from_pretrained(checkpoint, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    load_model(model, str(checkpoint / MODEL_FILE))
    save_hf_folder(model, AutoTokenizer.from_pretrained(checkpoint), out)
