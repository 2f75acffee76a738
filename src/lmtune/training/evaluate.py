"""Token-exact evaluation loss and perplexity across ranks."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from lmtune.data.batch import Batch, idle_batch
from lmtune.parallel.distributed import DistEnv, all_reduce_max, all_reduce_sum


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    target_tokens: int
    examples: int


@torch.no_grad()
def evaluate(
    loss_module: nn.Module,
    batches: Sequence[Batch] | DataLoader[Batch],
    env: DistEnv,
    autocast: AbstractContextManager[object],
    lockstep: bool = False,
    on_batch: Callable[[], None] = lambda: None,
) -> EvalResult:
    """Mean loss over every target token of the eval set, each example counted once.

    ``loss_module`` is the unwrapped module: a DDP forward may run collectives, and ranks may hold
    different numbers of eval batches. Under FSDP (``lockstep``) every forward gathers parameters
    from all ranks, so ranks with fewer batches run extra forwards that count for nothing.
    """
    was_training = loss_module.training
    loss_module.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=env.device)
    rounds = len(batches)
    if lockstep:
        rounds = int(all_reduce_max(torch.tensor([rounds], device=env.device), env).item())
    idle = itertools.repeat(None, rounds - len(batches))
    for item in itertools.chain(batches, idle):
        on_batch()  # progress, for the hang watchdog: an evaluation may take long, a batch does not
        batch = (item or idle_batch()).to(env.device)
        with autocast:
            loss_sum = loss_module(*batch.model_inputs()).sum()
        if item is not None:
            sums[0] += loss_sum.double()
            sums[1] += batch.target_tokens()
            sums[2] += batch.input_ids.size(0)
    loss_module.train(was_training)
    total_loss, tokens, examples = all_reduce_sum(sums, env).tolist()
    loss = total_loss / max(tokens, 1.0)
    return EvalResult(
        loss=loss, perplexity=math.exp(min(loss, 700.0)), target_tokens=int(tokens), examples=int(examples)
    )
