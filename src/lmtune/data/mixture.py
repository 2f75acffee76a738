"""Data mixtures: which examples of each weighted source an epoch holds, as pure functions.

An epoch holds as many examples as the sources together (``N``); source ``i`` gets its weight's
share of them, ``N * w_i / sum(w)`` rounded by largest remainder so the shares sum to ``N``.
A source of ``n`` examples drawn ``c`` times holds every example ``c // n`` times, plus
``c % n`` more from a fixed permutation of the source walked across epochs: epoch ``e`` takes the
``c % n`` positions after those epoch ``e - 1`` took (wrapping around). So an upsampled source
repeats evenly (every example ``k`` or ``k + 1`` times), a downsampled one holds distinct
examples and reaches the rest in the next epochs, and nothing depends on earlier epochs: epoch
``e`` is computed on its own, the same on every rank and after a resume.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lmtune.config.groups import DataSettings
from lmtune.config.mixture import named_items, parse_weights, source_names
from lmtune.errors import UserError

if TYPE_CHECKING:
    from lmtune.data.dataset import TokenizedDataset

COMPONENTS_META = "component_examples"  # a cache entry's examples per source, in order


@dataclass(frozen=True)
class Mixture:
    """The sources of a training set: names, where each starts among the set's positions, how
    many examples each holds, and how many of an epoch each gets."""

    names: tuple[str, ...]
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    draws: tuple[int, ...]  # per epoch; sums to sum(sizes)

    @property
    def epoch_size(self) -> int:
        return sum(self.draws)

    def describe(self) -> list[dict[str, Any]]:
        """Per source: name, examples, draws per epoch, share of the epoch, repetitions."""
        return [
            {
                "name": name,
                "examples": size,
                "per_epoch": draws,
                "share": draws / max(self.epoch_size, 1),
                "repeats": draws / size,
            }
            for name, size, draws in zip(self.names, self.sizes, self.draws, strict=True)
        ]


def shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder, ties to the earlier source):
    whole numbers that sum to ``total`` exactly."""
    exact = [Fraction(w) for w in weights]
    quotas = [total * w / sum(exact) for w in exact]
    counts = [int(q) for q in quotas]  # floor: quotas are not negative
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def mixture_of(names: list[str], sizes: list[int], weights: list[float]) -> Mixture:
    """The mixture of sources of ``sizes`` examples (contiguous, in order) with ``weights``.

    Raises:
        UserError: naming --data-weights, for a source left with no example in an epoch.
    """
    draws = shares(sum(sizes), weights)
    for name, size, count in zip(names, sizes, draws, strict=True):
        if size == 0:
            raise UserError(f"--data: source {name!r} has no examples left after tokenizing")
        if count == 0:
            raise UserError(
                f"--data-weights: source {name!r} gets no example of an epoch of {sum(sizes):,}; "
                "raise its weight"
            )
    starts = [0, *np.cumsum(sizes).tolist()][:-1]
    return Mixture(tuple(names), tuple(int(s) for s in starts), tuple(sizes), tuple(draws))


def source_draws(size: int, draws: int, seed: int, source: int, epoch: int) -> list[int]:
    """The examples (0..size-1) source ``source`` contributes to epoch ``epoch``: each ``draws //
    size`` times, then ``draws % size`` distinct ones walked along the source's own permutation."""
    full, extra = divmod(draws, size)
    picked = list(range(size)) * full
    if extra:
        walk = np.random.default_rng([seed, source]).permutation(size)
        first = epoch * extra % size
        picked += walk[(first + np.arange(extra)) % size].tolist()
    return picked


def mixture_order(mixture: Mixture, seed: int, epoch: int) -> list[int]:
    """The global order of one epoch of a mixture (positions in the training set; an upsampled
    source's examples appear more than once): every source's draws, shuffled together with the
    permutation an unmixed epoch uses."""
    drawn: list[int] = []
    for i, (start, size, draws) in enumerate(zip(mixture.starts, mixture.sizes, mixture.draws, strict=True)):
        drawn += [start + j for j in source_draws(size, draws, seed, i, epoch)]
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return [drawn[p] for p in torch.randperm(len(drawn), generator=g).tolist()]


@dataclass(frozen=True)
class SourceIndex:
    """Which source an example id (its position in the whole data set) comes from."""

    names: tuple[str, ...]
    bounds: tuple[int, ...]  # the first id of each source, then the end

    def of(self, example_id: int) -> int:
        return bisect.bisect_right(self.bounds, example_id) - 1

    def name(self, example_id: int) -> str:
        return self.names[self.of(example_id)]

    def sizes_in(self, ids: np.ndarray) -> list[int]:
        """How many of the sorted ``ids`` each source holds."""
        cuts = np.searchsorted(ids, np.asarray(self.bounds), side="left")
        return [int(c) for c in np.diff(cuts)]


def source_index(spec: str, meta: dict[str, Any], option: str) -> SourceIndex:
    """The sources of a cache entry built per source (``meta`` has their example counts)."""
    counts = meta.get(COMPONENTS_META)
    names = source_names(spec, option)
    if not isinstance(counts, list) or len(counts) != len(names):
        raise UserError(f"{option}: the data cache entry does not record its sources; delete it")
    return SourceIndex(tuple(names), tuple([0, *np.cumsum(counts, dtype=np.int64).tolist()]))


def check_sources_kept(data: TokenizedDataset, option: str) -> None:
    """Refuse sources kept apart (a mixture, an --eval-data of several) of which no example is
    left: a source with nothing to train on or to score (its loss read 0.0, a perfect score)."""
    assert data.sources is not None
    empty = [name for name, n in zip(data.sources.names, data.source_sizes(), strict=True) if n == 0]
    if empty:
        raise UserError(
            f"{option}: no example of {', '.join(empty)} is left: each was longer than --max-length under "
            "--truncation drop, or had nothing to train; fix or leave out the source"
        )


def per_source(data: DataSettings, spec: str, option: str) -> bool:
    """Whether ``spec``'s sources are kept apart: a weighted --data, an --eval-data of several."""
    if option == "--data":
        return data.weights is not None
    return len(named_items(spec)) > 1


def training_mixture(data: DataSettings, train: TokenizedDataset) -> Mixture | None:
    """The mixture --data-weights makes of the training set's sources (None: no weights)."""
    if data.weights is None or train.sources is None:
        return None
    names = list(train.sources.names)
    return mixture_of(names, train.source_sizes(), parse_weights(data.weights, len(names)))


def mixture_line(mixture: Mixture) -> str:
    """Per source: examples, draws per epoch with their share, and repetitions (for the log)."""
    return "; ".join(
        f"{d['name']} {d['examples']:,} examples -> {d['per_epoch']:,} "
        f"({d['share']:.1%}, x{d['repeats']:.2f})"
        for d in mixture.describe()
    )
