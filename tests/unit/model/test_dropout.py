"""Keyed dropout: the masks an example gets follow from the seed, the step and the example alone,
not from the rows, packing or attention path it runs in, so N ranks train as one process does."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lmtune.config.groups import LoraSettings
from lmtune.data.collate import Batch, Collator
from lmtune.data.packing import PackedCollator, pack_bins
from lmtune.model.attention import use_varlen
from lmtune.model.dropout import KeyedDropout, key_dropout, keyed_dropout
from lmtune.model.lora import add_lora
from lmtune.model.modeling import build_preset
from lmtune.model.neftune import token_seeds
from lmtune.objectives.sft import SummedLoss
from tests.conftest import tokenized, uneven_texts


def _gpt2(vocab: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    # Dropout on the embeddings, the residual branches and the MLP: token activations. Attention
    # probabilities' dropout is not keyed (it runs inside the attention kernel).
    config = GPT2Config(
        vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128, attn_pdrop=0.0, resid_pdrop=0.2
    )
    config.embd_pdrop = 0.2
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _model(kind: str) -> tuple[nn.Module, Any]:
    loaded = build_preset("tiny", seed=0)
    if kind == "gpt2":
        return _gpt2(len(loaded.tokenizer)), loaded.tokenizer
    torch.manual_seed(0)
    model = add_lora(loaded.model, LoraSettings(enabled=True, rank=8, dropout=0.2))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # zero at the start, which would hide what the adapter's input is
            nn.init.normal_(p, std=0.5)
    return model, loaded.tokenizer


def _layouts(tok: Any) -> dict[str, Batch]:
    texts = [*uneven_texts(12, seed=3), "a longer example " * 6]
    data = tokenized(texts, tok, max_length=120)
    examples = [data[i] for i in range(len(data))]
    rows = pack_bins([len(e.input_ids) for e in examples], 120)
    packed = PackedCollator(tok.pad_token_id)([[examples[j] for j in row] for row in rows])
    assert packed.input_ids.size(0) < len(examples)  # several examples share rows
    return {
        "padded": Collator(tok.pad_token_id)(examples),
        "reversed": Collator(tok.pad_token_id)(examples[::-1]),
        "packed": packed,
        "halves": Collator(tok.pad_token_id)(examples[:6]),  # a share of them: checked apart
    }


def _loss_and_grads(module: nn.Module, batch: Batch, step: int | None = 3) -> tuple[float, torch.Tensor]:
    module.zero_grad()
    extra = {} if step is None else {"token_seeds": token_seeds(batch, seed=7, step=step)}
    loss = module(*batch.model_inputs(), **extra).sum()
    (loss / batch.target_tokens()).backward()
    grads = torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])
    return float(loss.detach()), grads


@pytest.mark.parametrize("kind", ["gpt2", "lora"])
def test_every_layout_and_path_gives_each_example_the_same_masks(kind: str) -> None:
    model, tok = _model(kind)
    key_dropout(model)
    assert keyed_dropout(model)
    modules = [
        SummedLoss(copy.deepcopy(model)),  # rows as they are, masked attention
        SummedLoss(copy.deepcopy(model), bucket_tokens=True),  # rows right-padded
    ]
    assert use_varlen(model)
    modules.append(SummedLoss(model, varlen=True))  # flattened, per-example attention
    layouts = _layouts(tok)
    halves = layouts.pop("halves")
    reference, reference_grads = _loss_and_grads(modules[0], layouts["padded"])
    _, other_step = _loss_and_grads(modules[0], layouts["padded"], step=4)
    modules[0].eval()
    _, clean = _loss_and_grads(modules[0], layouts["padded"])
    modules[0].train()
    # The masks are there, and another step draws others: far beyond the tolerance below.
    assert (
        min((reference_grads - g).abs().max() for g in (clean, other_step))
        > 1e-2 * reference_grads.abs().max()
    )
    for module in modules:
        for name, batch in layouts.items():
            loss, grads = _loss_and_grads(module, batch)
            assert abs(loss - reference) <= 1e-5 * reference, name
            assert (grads - reference_grads).abs().max() <= 1e-5 * reference_grads.abs().max(), name
    # Six of the examples alone draw what they drew among all thirteen.
    alone, _ = _loss_and_grads(modules[0], halves)
    assert abs(alone - _loss_and_grads(modules[2], halves)[0]) <= 1e-5 * alone


def test_activation_checkpointing_recomputes_the_same_masks() -> None:
    model, tok = _model("gpt2")
    key_dropout(model)
    batch = _layouts(tok)["packed"]
    assert use_varlen(model)
    plain = SummedLoss(copy.deepcopy(model), varlen=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = SummedLoss(model, varlen=True)
    loss, grads = _loss_and_grads(plain, batch)
    torch.manual_seed(123)  # the process's stream is not what the masks come from
    loss_c, grads_c = _loss_and_grads(checkpointed, batch)
    assert abs(loss - loss_c) <= 1e-6 * loss and (grads - grads_c).abs().max() <= 1e-6 * grads.abs().max()


def test_the_models_dropout_modules_are_numbered_and_fall_back_without_seeds() -> None:
    model, tok = _model("lora")
    before = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    key_dropout(model)
    keyed = [(n, m) for n, m in model.named_modules() if isinstance(m, KeyedDropout)]
    assert [n for n, _ in keyed] == before and [m.salt for _, m in keyed] == list(range(1, len(before) + 1))
    module, batch = SummedLoss(model), _layouts(tok)["padded"]
    # Without the layout (no seeds given) masks come from the process's stream, as nn.Dropout's.
    torch.manual_seed(1)
    first, _ = _loss_and_grads(module, batch, step=None)
    torch.manual_seed(2)
    assert first != _loss_and_grads(module, batch, step=None)[0]
    torch.manual_seed(1)
    assert first == _loss_and_grads(module, batch, step=None)[0]
