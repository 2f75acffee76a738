"""The loss normalisation that makes N ranks train the same model as one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmtune.data.collate import Collator
from lmtune.model.loss import token_loss_sum
from lmtune.model.modeling import build_preset
from lmtune.objectives.sft import SummedLoss
from tests.conftest import tokenized, uneven_texts


def test_summed_loss_matches_mean_cross_entropy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    labels = torch.tensor([[1, 2, 3, -100, -100], [4, 5, 6, 7, 8]])
    loss_sum, count = token_loss_sum(logits, labels)
    assert int(count) == 2 + 4  # the first position of a row is never a target
    mean = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert torch.allclose(loss_sum / count, mean)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def _simulate(split: list[list[list[int]]], data, collate, module, mean_of_means: bool) -> torch.Tensor:
    """Gradient of one optimizer step; ``split[rank][micro]`` lists example indices.

    Reproduces what DDP does: each rank's gradient is averaged over ranks.
    """
    world = len(split)
    batches = [[collate([data[i] for i in micro]) for micro in rank] for rank in split]
    global_tokens = sum(b.target_tokens() for rank in batches for b in rank)
    total = torch.zeros(())
    for rank in batches:
        module.zero_grad()
        for b in rank:
            loss_sum = module(b.input_ids, b.attention_mask, b.labels).sum()
            if mean_of_means:
                loss = loss_sum / b.target_tokens() / len(rank)  # the tutorial's per-batch mean
            else:
                loss = loss_sum * world / global_tokens
            loss.backward()
        total = total + _grads(module) / world
    return total


def test_global_token_normalisation_is_world_size_invariant_and_mean_of_means_is_not() -> None:
    loaded = build_preset("tiny", seed=0)
    module = SummedLoss(loaded.model)
    data = tokenized(uneven_texts(8, seed=4), loaded.tokenizer, max_length=64)
    collate = Collator(loaded.tokenizer.pad_token_id)
    one_process = [[[0, 1], [2, 3], [4, 5], [6, 7]]]  # 1 rank x 4 micro-steps
    two_ranks = [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]  # 2 ranks x 2 micro-steps, same global batch

    exact_1 = _simulate(one_process, data, collate, module, mean_of_means=False)
    exact_2 = _simulate(two_ranks, data, collate, module, mean_of_means=False)
    assert (exact_1 - exact_2).abs().max() <= 1e-6

    naive_1 = _simulate(one_process, data, collate, module, mean_of_means=True)
    naive_2 = _simulate(two_ranks, data, collate, module, mean_of_means=True)
    # The same comparison fails for the mean of means: the test of equivalence has teeth.
    assert (naive_1 - naive_2).abs().max() > 1e-4
    assert (naive_1 - exact_1).abs().max() > 1e-4
