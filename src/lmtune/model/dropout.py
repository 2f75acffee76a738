"""Dropout whose masks follow from the run's seed, the optimizer step and the example alone.

``nn.Dropout`` draws from its process's random stream, so N ranks (each on its own stream and
its own share of the examples) draw other masks than one process does, and a packed row other
masks than the same examples padded. Here every ``nn.Dropout`` of the trained model on token
activations (LoRA's ``lora_dropout``; GPT-2's embedding, residual and MLP dropout) becomes a
:class:`KeyedDropout`: an example's mask, ``[its length, width]``, is drawn from a generator
seeded by (the example's seed at this step, as NEFTune's: :func:`lmtune.model.neftune.example_seed`,
and the module's place in the model). What an example gets does not depend on the rank,
micro-batch, row, padding or packing it lands in, and a resumed run draws what the uninterrupted
one did. Activation checkpointing's recomputation draws the same masks again by construction.

The loss module tells the modules where each example's tokens are (:func:`set_token_runs`) before
each training forward. Dropout on other shapes (attention probabilities in an eager attention),
a forward without that layout, and a model's functional dropout (OPT's ``F.dropout``, SDPA's
``dropout_p``) draw from the process's stream, which is seeded at every optimizer step by
(the run's seed, the rank, the step): :func:`step_stream_seed`, so that these too are drawn alike
by a resumed run, whatever its start-up drew (a data loader's first iterator draws its seed).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TokenRuns:
    """Where the examples of a forward's rows are: ``(seed, start, end)`` over the rows' tokens
    flattened, for the rows' ``shape`` (rows, length); tokens outside every run (padding) keep all."""

    shape: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...]


def module_seed(example: int, salt: int) -> int:
    """The seed of one example's mask in the dropout module ``salt`` (below 2**63)."""
    digest = hashlib.blake2b(f"dropout:{example}:{salt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def step_stream_seed(seed: int, rank: int, step: int) -> int:
    """The seed of ``rank``'s own random stream for optimizer step ``step`` (below 2**63)."""
    digest = hashlib.blake2b(f"stream:{seed}:{rank}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class KeyedDropout(nn.Dropout):
    """``nn.Dropout`` with masks keyed by example (see the module docstring); ``salt`` tells the
    model's dropout modules apart."""

    def __init__(self, p: float, salt: int) -> None:
        super().__init__(p)
        self.salt = salt
        # Set by the loss module before each training forward and kept until the next, so that
        # activation checkpointing's recomputation in the backward finds it.
        self.token_runs: TokenRuns | None = None

    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        runs = self.token_runs
        if not self.training or self.p == 0:
            return x
        if runs is None or x.dim() < 2 or tuple(x.shape[:-1]) != runs.shape:
            return F.dropout(x, self.p, True, self.inplace)
        width = x.size(-1)
        # Uniform draws, filled example by example; tokens of no example (padding) draw 1: kept.
        drawn = torch.ones(x.numel() // width, width, device=x.device)
        for seed, start, end in runs.runs:
            generator = torch.Generator(device=x.device)
            generator.manual_seed(module_seed(seed, self.salt))
            drawn[start:end].uniform_(generator=generator)
        keep = (drawn >= self.p).to(x.dtype).mul_(1.0 / (1.0 - self.p))
        return x * keep.view_as(x)

    def extra_repr(self) -> str:
        return f"p={self.p}, keyed by example"


def key_dropout(model: nn.Module) -> None:
    """Every ``nn.Dropout`` of ``model`` with ``p > 0`` as a :class:`KeyedDropout`, numbered in
    the model's module order (the same on every rank)."""
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Dropout) and not isinstance(m, KeyedDropout) and m.p > 0
    ]
    for salt, (name, module) in enumerate(found, start=1):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, KeyedDropout(module.p, salt))


def keyed_dropout(model: nn.Module) -> bool:
    """Whether ``model`` has keyed dropout that draws (``p > 0``)."""
    return any(isinstance(m, KeyedDropout) and m.p > 0 for m in model.modules())


def set_token_runs(model: nn.Module, runs: TokenRuns | None) -> None:
    """Tell ``model``'s keyed dropout modules where the examples of the next forward are (None:
    nowhere known; they draw as ``nn.Dropout`` does)."""
    for module in model.modules():
        if isinstance(module, KeyedDropout):
            module.token_runs = runs
