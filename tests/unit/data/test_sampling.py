from __future__ import annotations

import random

import torch
from torch.utils.data.distributed import DistributedSampler

from lmtune.data.sampling import TrainSampler, balanced_share, epoch_order, eval_indices, rank_indices


def test_order_changes_per_epoch_and_is_shared_by_ranks() -> None:
    a = list(TrainSampler(40, 8, rank=0, world_size=2, seed=3))
    s = TrainSampler(40, 8, rank=0, world_size=2, seed=3)
    s.set_epoch(1)
    assert list(s) != a
    s.set_epoch(0)
    assert list(s) == a


def test_shards_are_disjoint_and_cover_every_used_example() -> None:
    n, g, w = 43, 8, 2
    for epoch in range(3):
        shards = []
        for r in range(w):
            s = TrainSampler(n, g, r, w, seed=0)
            s.set_epoch(epoch)
            shards.append(list(s))
            assert len(shards[-1]) == len(s)
        assert not set(shards[0]) & set(shards[1])
        assert len(set(shards[0]) | set(shards[1])) == (n // g) * g


def test_same_permutation_as_distributed_sampler() -> None:
    n, w = 64, 2
    for r in range(w):
        ours = TrainSampler(n, 8, r, w, seed=5)
        theirs = DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=True, seed=5)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)


def test_each_step_sees_the_same_examples_whatever_the_world_size() -> None:
    n, g = 50, 8
    order = epoch_order(n, seed=1, epoch=0)
    for world in (1, 2, 4):
        per_rank_step = g // world
        for step in range(n // g):
            union = []
            for r in range(world):
                mine = rank_indices(order, r, world, g)
                union += mine[step * per_rank_step : (step + 1) * per_rank_step]
            assert sorted(union) == sorted(order[step * g : (step + 1) * g])


def test_eval_counts_each_example_once() -> None:
    for n in (1, 7, 8):
        got = sorted(i for r in range(2) for i in eval_indices(n, r, 2))
        assert got == list(range(n))


def test_epoch_order_matches_torch_randperm() -> None:
    g = torch.Generator()
    g.manual_seed(9 + 2)
    assert epoch_order(10, seed=9, epoch=2) == torch.randperm(10, generator=g).tolist()


def test_balanced_shares_hold_the_step_with_equal_counts_and_nearly_equal_tokens() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(5, 700) for _ in range(4000)]
    order = epoch_order(len(lengths), seed=2, epoch=0)
    g = 32
    for world in (2, 4, 8):
        shards = [rank_indices(order, r, world, g, lengths) for r in range(world)]
        strided = [rank_indices(order, r, world, g) for r in range(world)]
        worst = worst_strided = 0.0
        for step in range(len(order) // g):
            part = slice(step * (g // world), (step + 1) * (g // world))
            shares = [shard[part] for shard in shards]
            assert sorted(i for share in shares for i in share) == sorted(order[step * g : (step + 1) * g])
            tokens = [sum(lengths[i] for i in share) for share in shares]
            assert max(tokens) - min(tokens) <= max(lengths[i] for i in order[step * g : (step + 1) * g])
            worst = max(worst, max(tokens) / (sum(tokens) / world))
            plain = [sum(lengths[i] for i in shard[part]) for shard in strided]
            worst_strided = max(worst_strided, max(plain) / (sum(plain) / world))
        assert worst < 1.1 < worst_strided  # the strided split of the same steps is far worse


def test_balanced_share_keeps_the_step_order_and_is_deterministic() -> None:
    step = [9, 3, 7, 1, 5, 0]
    lengths = [10, 60, 1, 40, 1, 30, 1, 20, 1, 50]
    shares = [balanced_share(step, lengths, r, 2) for r in range(2)]
    assert shares == [balanced_share(step, lengths, r, 2) for r in range(2)]
    for share in shares:
        assert share == sorted(share, key=step.index)
    # Longest first to the lighter rank: 60, 50, 40 (r1), 30 (r0), 20 (tie: r0), 10. 110/100 is the
    # best split of three each here (all lengths are multiples of 10, the total is 210).
    assert shares == [[7, 1, 5], [9, 3, 0]]
