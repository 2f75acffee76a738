"""Which examples each rank reads, as pure functions plus a thin ``Sampler`` around them.

The global order of an epoch is the permutation ``DistributedSampler`` uses
(``torch.randperm(n)`` seeded with ``seed + epoch``, the same on every rank). It is cut to whole
global batches, so the examples of optimizer step ``s`` are ``order[s*G:(s+1)*G]`` whatever the
world size ``W``: N ranks train on exactly the batches one process would.

Within a step, the examples are dealt so that every rank gets ``G / W`` of them and nearly the same
number of tokens (given the lengths): a step lasts as long as its busiest rank, and the strided
split ``r, r + W, ...`` of ``DistributedSampler`` left one rank ~10% more tokens than the other on
data of uneven lengths. Without lengths, the strided split.

A mixture of weighted sources (lmtune.data.mixture) has its own epoch order, of the same length,
dealt out the same way.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

from lmtune.data.mixture import Mixture, mixture_order


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


def largest_global_batch(n: int, micro_batch_size: int | None, world_size: int) -> int:
    """The largest global batch ``n`` examples fill that the processes and their micro-batches
    divide (0: none)."""
    step = (micro_batch_size or 1) * world_size
    return n - n % step


def rank_indices(
    order: list[int],
    rank: int,
    world_size: int,
    global_batch_size: int,
    lengths: Sequence[int] | None = None,
) -> list[int]:
    """The part of the epoch order that ``rank`` reads, in the order it reads it."""
    used = steps_per_epoch(len(order), global_batch_size) * global_batch_size
    if lengths is None or world_size == 1:
        return order[:used][rank::world_size]
    mine: list[int] = []
    for start in range(0, used, global_batch_size):
        mine += balanced_share(order[start : start + global_batch_size], lengths, rank, world_size)
    return mine


def balanced_share(step: list[int], lengths: Sequence[int], rank: int, world_size: int) -> list[int]:
    """``rank``'s examples of one step: longest first, each to the rank with the fewest tokens so far
    among those with room left (ties to the lower rank), so every rank gets as many examples and
    the token counts differ by at most about one example. Kept in the step's order."""
    per_rank = len(step) // world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]  # positions in the step
    room = [(0, r) for r in range(world_size)]  # (tokens so far, rank) of the ranks with room left
    # By position: a mixture's step may hold an example twice.
    for k in sorted(range(len(step)), key=lambda k: (-int(lengths[step[k]]), k)):
        load, to = heapq.heappop(room)
        shares[to].append(k)
        if len(shares[to]) < per_rank:
            heapq.heappush(room, (load + int(lengths[step[k]]), to))
    return [step[k] for k in sorted(shares[rank])]


def eval_indices(n: int, rank: int, world_size: int) -> list[int]:
    """Every example exactly once across ranks, with no padding duplicates (shards may differ by one)."""
    return list(range(rank, n, world_size))


class TrainSampler(Sampler[int]):
    """This rank's indices for the current epoch; call :meth:`set_epoch` before each epoch."""

    def __init__(
        self,
        n: int,
        global_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        lengths: Sequence[int] | None = None,
        mixture: Mixture | None = None,
    ):
        self.n, self.global_batch_size = n, global_batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.lengths = lengths  # tokens per example: balance the ranks' shares of each step
        self.mixture = mixture  # weighted sources (lmtune.data.mixture); None: each example once
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

    def order(self) -> list[int]:
        """The global order of the current epoch, the same on every rank."""
        if self.mixture is not None:
            return mixture_order(self.mixture, self.seed, self.epoch)
        return epoch_order(self.n, self.seed, self.epoch)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        mine = rank_indices(order, self.rank, self.world_size, self.global_batch_size, self.lengths)
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


def eval_batches(sizes: Sequence[int], rank: int, world_size: int, batch_size: int) -> list[list[int]]:
    """``rank``'s evaluation batches of a set kept per source (each source's examples contiguous,
    ``sizes`` of them): every example exactly once across ranks, and no batch mixes sources."""
    batches: list[list[int]] = []
    start = 0
    for size in sizes:
        mine = list(range(start + rank, start + size, world_size))
        batches += [mine[k : k + batch_size] for k in range(0, len(mine), batch_size)]
        start += size
    return batches


class EvalBatches(Sampler[list[int]]):
    """A DataLoader's ``batch_sampler`` of :func:`eval_batches`."""

    def __init__(self, sizes: Sequence[int], rank: int, world_size: int, batch_size: int):
        self.batches = eval_batches(sizes, rank, world_size, batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)
