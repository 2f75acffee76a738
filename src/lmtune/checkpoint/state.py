"""The trainer's state between steps (step, epoch, position in the sample order), the model as
checkpoints see it, and every RNG stream of a process as plain JSON."""

from __future__ import annotations

import base64
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lmtune.errors import UserError, brief, one_line
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


_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "state1", "state2")
_BNB_STATE = "__bnb_optimizer_quant_state__"  # bitsandbytes' 8-bit state, nested in each entry


def checked_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
    """``saved`` (read from ``path``) where every entry fits the parameter it belongs to in
    ``optimizer``: a moment of another shape reaches the fused AdamW kernel, which then writes
    past the end of its buffers (a crash, or memory corrupted without a word).

    Raises:
        UserError: naming the file and the first entry that does not fit.
    """

    def refused(why: str) -> UserError:
        return UserError(f"{path}: not an optimizer state of this run's model ({why})")

    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)) or not isinstance(
        saved.get("param_groups"), list
    ):
        raise refused("it holds no state and param_groups")
    groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(groups) or any(
        not isinstance(g, dict)
        or not isinstance(g.get("params"), list)
        or len(g["params"]) != len(h["params"])
        or not all(type(i) is int for i in g["params"])
        for g, h in zip(saved["param_groups"], groups, strict=True)
    ):
        raise refused("its parameter groups are not this run's")
    params = {
        i: p
        for g, h in zip(saved["param_groups"], groups, strict=True)
        for i, p in zip(g["params"], h["params"], strict=True)
    }
    for i, entry in saved["state"].items():
        nested = entry.get(_BNB_STATE, {}) if isinstance(entry, dict) else None
        if i not in params or not isinstance(nested, dict):
            raise refused(f"an entry for parameter {brief(i)}, which this run's optimizer has not")
        missing = _REQUIRED.get(type(optimizer).__name__, set()) - set(entry)
        if missing:
            raise refused(f"parameter {brief(i)}'s entry lacks {', '.join(sorted(missing))}")
        for name, value in {**entry, **nested}.items():
            problem = "" if name == _BNB_STATE else _entry_problem(name, value, params[i])
            if problem:
                raise refused(f"parameter {brief(i)}'s {one_line(str(name), 60)} {problem}")
    return saved


def _entry_problem(name: str, value: Any, param: torch.Tensor) -> str:
    """Why ``value`` is not the optimizer state entry ``name`` of ``param`` ("" when it is)."""
    if name == "step":
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        scalar = isinstance(value, torch.Tensor) and value.numel() == 1 and value.layout == torch.strided
        count = float(value) if number or scalar else -1.0
        return "" if math.isfinite(count) and count >= 0 else "is not a step count"
    shapes: dict[str, tuple[int, ...]] = {
        **dict.fromkeys(_MOMENTS, tuple(param.shape)),
        **dict.fromkeys(("qmap1", "qmap2"), (256,)),  # 8-bit quantisation maps
        **dict.fromkeys(("absmax1", "absmax2"), (math.ceil(param.numel() / 256),)),  # one per block
    }
    if name not in shapes:
        return "is not an entry of lmtune's optimizers"
    if value is None and name == "momentum_buffer":  # SGD before its first step with momentum
        return ""
    if not isinstance(value, torch.Tensor):
        return "is not a tensor"
    if not (value.is_floating_point() or (value.dtype == torch.uint8 and name in ("state1", "state2"))):
        return f"holds {str(value.dtype).removeprefix('torch.')} values"
    if tuple(value.shape) != shapes[name]:
        return f"has shape {list(value.shape)}, the parameter's needs {list(shapes[name])}"
    # Fused kernels index a tensor as dense memory of its shape: a sparse one, or an expanded view
    # (strides of 0 over a smaller storage), is read and written past its end.
    if value.layout != torch.strided or not value.is_contiguous():
        return "is not a dense tensor"
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        return "holds values that are not finite"
    if name in ("exp_avg_sq", "max_exp_avg_sq") and bool((value < 0).any()):
        return "holds negative values (a mean of squares)"
    return ""


# The entries every state of these optimizers holds (a missing one failed at the first step).
_REQUIRED = {"AdamW": {"step", "exp_avg", "exp_avg_sq"}, "Adam": {"step", "exp_avg", "exp_avg_sq"}}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (moments, quantisation maps, ...)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
