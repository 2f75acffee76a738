"""NEFTune: the noise an example gets follows from the seed, the step and the example alone, not
from the rows, packing or attention path it runs in; its scale is the Hugging Face Trainer's."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch

from lmtune.data.collate import Batch, Collator
from lmtune.data.packing import PackedCollator, pack_bins
from lmtune.model.attention import use_varlen
from lmtune.model.modeling import build_preset
from lmtune.model.neftune import NO_NOISE, embedding_noise, example_seed, token_seeds
from lmtune.objectives.sft import SummedLoss
from tests.conftest import tokenized, uneven_texts

ALPHA = 5.0


def _examples() -> tuple[torch.nn.Module, Any, list[Any]]:
    loaded = build_preset("tiny", seed=0)
    texts = [*uneven_texts(12, seed=3), "a longer example " * 6]
    data = tokenized(texts, loaded.tokenizer, max_length=120)
    return loaded.model, loaded.tokenizer, [data[i] for i in range(len(data))]


def _loss_and_grads(module: SummedLoss, batch: Batch, noise: bool = True) -> tuple[float, torch.Tensor]:
    module.zero_grad()
    extra = {"token_seeds": token_seeds(batch, seed=7, step=3)} if noise else {}
    loss = module(*batch.model_inputs(), **extra).sum()
    (loss / batch.target_tokens()).backward()
    grads = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
    return float(loss.detach()), grads


def test_every_layout_and_path_gives_each_example_the_same_noise() -> None:
    model, tok, examples = _examples()
    modules = [
        SummedLoss(copy.deepcopy(model), neftune_alpha=ALPHA),  # rows as they are, masked attention
        SummedLoss(copy.deepcopy(model), bucket_tokens=True, neftune_alpha=ALPHA),  # rows right-padded
    ]
    assert use_varlen(model)
    modules.append(SummedLoss(model, varlen=True, neftune_alpha=ALPHA))  # flattened, per-example attention
    rows = pack_bins([len(e.input_ids) for e in examples], 120)
    layouts = {
        "padded": Collator(tok.pad_token_id)(examples),
        "reversed": Collator(tok.pad_token_id)(examples[::-1]),
        "packed": PackedCollator(tok.pad_token_id)([[examples[j] for j in row] for row in rows]),
    }
    assert layouts["packed"].input_ids.size(0) < len(examples)  # several examples share rows
    reference, reference_grads = _loss_and_grads(modules[0], layouts["padded"])
    clean, _ = _loss_and_grads(modules[0], layouts["padded"], noise=False)
    assert abs(reference - clean) > 1e-3 * clean  # the noise is there
    for module in modules:
        for name, batch in layouts.items():
            loss, grads = _loss_and_grads(module, batch)
            assert abs(loss - reference) <= 1e-5 * reference, name
            assert (grads - reference_grads).abs().max() <= 1e-6, name


def test_each_token_gets_its_own_examples_seed() -> None:
    _, tok, examples = _examples()
    rows = pack_bins([len(e.input_ids) for e in examples], 120)
    for batch in (
        Collator(tok.pad_token_id)(examples[:5]),
        PackedCollator(tok.pad_token_id)([[examples[j] for j in row] for row in rows]),
    ):
        seeds = token_seeds(batch, seed=7, step=3)
        assert (seeds[batch.attention_mask == 0] == NO_NOISE).all()
        real = seeds[batch.attention_mask.bool()].tolist()  # row by row, examples in order
        expected = [example_seed(7, 3, e.example_id) for e in _in_row_order(batch, examples)]
        lengths = [len(examples[i].input_ids) for i in batch.example_ids]
        assert real == [s for s, n in zip(expected, lengths, strict=True) for _ in range(n)]
    # Another step or seed: other noise.
    assert (
        len({example_seed(7, 3, 1), example_seed(7, 4, 1), example_seed(8, 3, 1), example_seed(7, 3, 2)}) == 4
    )


def _in_row_order(batch: Batch, examples: list[Any]) -> list[Any]:
    by_id = {e.example_id: e for e in examples}
    return [by_id[i] for i in batch.example_ids]


def test_noise_is_zero_on_padding_bounded_by_its_scale_and_found_again_anywhere() -> None:
    a, b, width = example_seed(1, 1, 1), example_seed(1, 1, 2), 16
    seeds = torch.tensor([[a] * 5 + [b] * 3 + [NO_NOISE] * 2])
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]])
    noise = embedding_noise(seeds, positions, width, ALPHA)
    assert noise.shape == (1, 10, width)
    assert (noise[0, 8:] == 0).all()
    for part, length in ((noise[0, :5], 5), (noise[0, 5:8], 3)):
        assert part.abs().max() <= ALPHA / math.sqrt(length * width)
        assert part.abs().min() > 0
    # The same example elsewhere, after padding, in another row: the same noise.
    moved = embedding_noise(
        torch.tensor([[NO_NOISE] * 4 + [a] * 5, [b] * 3 + [NO_NOISE] * 6]), None, width, ALPHA
    )
    assert torch.equal(moved[0, 4:], noise[0, :5]) and torch.equal(moved[1, :3], noise[0, 5:8])
    # The same example twice in a row (positions start again): its noise twice, at its own length.
    twice = embedding_noise(torch.tensor([[a] * 10]), torch.tensor([[0, 1, 2, 3, 4] * 2]), width, ALPHA)
    assert torch.equal(twice[0, :5], noise[0, :5]) and torch.equal(twice[0, 5:], noise[0, :5])


def test_the_scale_is_the_hugging_face_trainers_on_an_unpadded_example() -> None:
    """On one unpadded example the Trainer's NEFTune hook (which TRL and Axolotl use) and lmtune
    draw from the same distribution: uniform in +-alpha / sqrt(length x width)."""
    from transformers.integrations.neftune import neftune_post_forward_hook

    length, width = 300, 256
    embedding = torch.nn.Embedding(4, width)
    embedding.neftune_noise_alpha = ALPHA  # type: ignore[assignment]
    embedding.train()
    torch.manual_seed(0)
    theirs = neftune_post_forward_hook(embedding, None, torch.zeros(1, length, width))
    ours = embedding_noise(torch.full((1, length), example_seed(0, 1, 0)), None, width, ALPHA)
    bound = ALPHA / math.sqrt(length * width)
    for noise in (theirs, ours):
        assert noise.abs().max() <= bound
        assert float(noise.abs().max()) > 0.99 * bound
        # Uniform in +-bound: a standard deviation of bound / sqrt(3) (76,800 draws: ~0.3% error).
        assert float(noise.std()) == pytest.approx(bound / math.sqrt(3), rel=0.01)
        assert abs(float(noise.mean())) < 0.01 * bound
