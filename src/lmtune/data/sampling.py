"""Which examples each rank reads, as pure functions plus a thin ``Sampler`` around them.

The global order of an epoch is the permutation ``DistributedSampler`` uses
(``torch.randperm(n)`` seeded with ``seed + epoch``, the same on every rank). It is cut to whole
global batches, and rank ``r`` reads positions ``r, r + W, r + 2W, ...`` of it, so the examples of
optimizer step ``s`` are ``order[s*G:(s+1)*G]`` whatever the world size ``W``: N ranks train on
exactly the batches one process would.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The global order of the examples for one epoch, identical on every rank."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def steps_per_epoch(n: int, global_batch_size: int) -> int:
    """Whole optimizer steps in an epoch; the remainder is left out of that epoch."""
    return n // global_batch_size


def rank_indices(order: list[int], rank: int, world_size: int, global_batch_size: int) -> list[int]:
    """The part of the epoch order that ``rank`` reads, in the order it reads it."""
    used = steps_per_epoch(len(order), global_batch_size) * global_batch_size
    return order[:used][rank::world_size]


def eval_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Every example exactly once across ranks, with no padding duplicates (shards may differ by one)."""
    return list(range(rank, n, world_size))


class TrainSampler(Sampler[int]):
    """This rank's indices for the current epoch; call :meth:`set_epoch` before each epoch."""

    def __init__(self, n: int, global_batch_size: int, rank: int, world_size: int, seed: int):
        self.n, self.global_batch_size = n, global_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch = 0
        self.start_step = 0

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Read epoch ``epoch`` from its optimizer step ``start_step`` on (a resumed run).

        The skipped samples are never read: the rest of the global order is dealt out again among
        the ranks there are now, so a resume may change the world size.
        """
        self.epoch, self.start_step = epoch, start_step

    def _per_rank_step(self) -> int:
        return self.global_batch_size // self.world_size

    def __iter__(self) -> Iterator[int]:
        order = epoch_order(self.n, self.seed, self.epoch)
        mine = rank_indices(order, self.rank, self.world_size, self.global_batch_size)
        return iter(mine[self.start_step * self._per_rank_step() :])

    def __len__(self) -> int:
        steps = steps_per_epoch(self.n, self.global_batch_size) - self.start_step
        return max(0, steps) * self._per_rank_step()


class EvalSampler(Sampler[int]):
    def __init__(self, n: int, rank: int, world_size: int):
        self.indices = eval_indices(n, rank, world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
