"""Packing: the same loss, target count and gradients as unpacked rows, and no cross-talk."""

from __future__ import annotations

import random

import torch

from lmtune.data.collate import Collator
from lmtune.data.packing import PackedCollator, pack_bins
from lmtune.model.modeling import build_preset
from lmtune.objectives.sft import SummedLoss
from tests.conftest import tokenized, uneven_texts


def test_bins_hold_every_example_once_and_fit() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(1, 64) for _ in range(500)]
    bins = pack_bins(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert bins == pack_bins(lengths, 64)
    assert len(bins) <= 1.1 * sum(lengths) / 64 + 1  # best-fit packs tightly


def _setup() -> tuple[SummedLoss, object, object]:
    loaded = build_preset("tiny", seed=0)
    data = tokenized([*uneven_texts(24, seed=8), "a longer example " * 3], loaded.tokenizer, max_length=64)
    return SummedLoss(loaded.model), data, loaded.tokenizer


def _grads(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def test_packed_and_unpacked_give_the_same_loss_tokens_and_gradients() -> None:
    module, data, tok = _setup()
    rows = pack_bins(data.lengths().tolist(), 64)  # type: ignore[attr-defined]
    assert len(rows) < len(data)  # type: ignore[arg-type]
    pbatch = PackedCollator(tok.pad_token_id)([[data[j] for j in row] for row in rows])  # type: ignore[index]
    ubatch = Collator(tok.pad_token_id)([data[i] for i in range(len(data))])  # type: ignore[index, arg-type]
    assert sorted(pbatch.example_ids) == ubatch.example_ids
    assert pbatch.target_tokens() == ubatch.target_tokens()

    tokens = ubatch.target_tokens()
    results = []
    for batch in (pbatch, ubatch):
        module.zero_grad()
        loss = module(*batch.model_inputs()).sum()
        (loss / tokens).backward()  # normalised as in training
        results.append((float(loss.detach()), _grads(module)))
    (loss_p, grads_p), (loss_u, grads_u) = results
    assert abs(loss_p - loss_u) <= 1e-5 * loss_u
    assert (grads_p - grads_u).abs().max() <= 1e-6


def test_no_position_attends_across_a_boundary() -> None:
    module, data, tok = _setup()
    bins = pack_bins(data.lengths().tolist(), 64)  # type: ignore[attr-defined]
    row = next(b for b in bins if len(b) >= 3)
    collate = PackedCollator(tok.pad_token_id)
    original = [data[i] for i in row]  # type: ignore[index]
    changed = list(original)
    ids, labels, eid = changed[0]
    changed[0] = type(changed[0])(ids[::-1].copy(), labels[::-1].copy(), eid)  # perturb the first example

    def logits(examples: list[object]) -> torch.Tensor:
        batch = collate([examples])  # type: ignore[list-item]
        from lmtune.model.masks import block_causal_mask

        with torch.no_grad():
            return module.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                attention_mask=block_causal_mask(batch.segment_ids),
            ).logits[0]

    before, after = logits(original), logits(changed)  # type: ignore[arg-type]
    first = len(original[0][0])
    assert not torch.allclose(before[:first], after[:first])  # the perturbed example did change
    assert torch.equal(before[first:], after[first:])  # and nothing after it moved


def test_auto_packs_only_steps_with_much_padding() -> None:
    from lmtune.data.collate import StepCollator

    loaded = build_preset("tiny", seed=0)
    collate = StepCollator(loaded.tokenizer.pad_token_id, micro_batch_size=8, mode="auto", max_length=256)
    even = tokenized(["abcd"] * 8, loaded.tokenizer)
    uneven = tokenized(["a", "b" * 60, "c", "d" * 3, "e" * 90, "f", "g" * 7, "h"], loaded.tokenizer)
    (even_batch,) = collate([even[i] for i in range(8)])
    assert even_batch.segment_ids is None  # equal lengths: nothing to gain, plain rows
    uneven_batches = collate([uneven[i] for i in range(8)])
    assert all(b.segment_ids is not None for b in uneven_batches)
    assert sum(len(b.example_ids) for b in uneven_batches) == 8
