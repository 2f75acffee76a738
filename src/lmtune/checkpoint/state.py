"""The trainer's state between steps (step, epoch, position in the sample order), the model as
checkpoints see it, and every RNG stream of a process as plain JSON."""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from lmtune.model.quantization import Quantization


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
    # Seconds of training through ``step``, over every attempt (a resumed run goes on counting).
    # Not part of where training stands: two runs at the same step are the same state.
    train_seconds: float = field(default=0.0, compare=False)

    @classmethod
    def fresh(cls, global_batch_size: int, world_size: int, seed: int, examples: int) -> TrainerState:
        """The state of a run that has not taken a step."""
        return cls(
            step=0,
            epoch=0,
            step_in_epoch=0,
            global_batch_size=global_batch_size,
            world_size=world_size,
            seed=seed,
            examples=examples,
        )

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
    quantization: Quantization | None = None  # the frozen base's (QLoRA), recorded beside the adapter


def rng_state() -> dict[str, Any]:
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


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))

    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensor(s) for s in state["cuda"]])


def optimizer_state_estimate(name: str, sizes: Sequence[int], momentum: bool = True) -> int:
    """State bytes of optimizer ``name`` (--optimizer) for trainable tensors of these element counts,
    before it holds any: AdamW two fp32 moments and a step counter each; bitsandbytes 8-bit one byte
    per moment plus an fp32 absmax per 256-element block and two 256-entry quantisation maps (fp32
    moments under 4096 elements); SGD one momentum buffer (none without ``momentum``)."""
    if name == "sgd":
        return 4 * sum(sizes) if momentum else 0
    if name in ("adamw8bit", "paged_adamw8bit"):
        return sum(8 * n if n < 4096 else 2 * n + 8 * math.ceil(n / 256) + 2 * 256 * 4 for n in sizes)
    return sum(8 * n + 4 for n in sizes)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (moments, quantisation maps, ...)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
