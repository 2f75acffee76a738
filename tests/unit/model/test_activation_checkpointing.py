"""Activation checkpointing recomputes each decoder block in backward, and changes no gradient."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.llama import modeling_llama

from lmtune.model.checkpointing import checkpoint_activations
from lmtune.model.modeling import build_preset


def _run(checkpointed: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[int, torch.Tensor]:
    # Counted on the class: module hooks do not run again when the checkpoint recomputes a block.
    original = modeling_llama.LlamaMLP.forward
    calls = 0

    def counting(self: Any, x: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return original(self, x)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", counting)
    model = build_preset("tiny", seed=0).model.train()
    if checkpointed:
        checkpoint_activations(model, "tiny")
    x = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    model(input_ids=x, labels=x).loss.backward()
    return calls, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_blocks_run_twice_and_gradients_do_not_change(monkeypatch: pytest.MonkeyPatch) -> None:
    plain_calls, plain = _run(False, monkeypatch)
    ckpt_calls, ckpt = _run(True, monkeypatch)
    layers = 4
    assert (plain_calls, ckpt_calls) == (layers, 2 * layers)  # forward, then recomputed in backward
    assert torch.equal(plain, ckpt)


def test_fp32_products_recompute_as_their_forward_did() -> None:
    """A CPU bf16 run with fp32 products (lmtune.model.products): the backward's recomputation
    multiplies as the forward did (it raised CheckpointError), every product in fp32, and the
    gradients are those without checkpointing."""
    from lmtune.model.precision import autocast_context
    from tests.unit.model.test_products import _ProductDtypes

    def grads(checkpointed: bool) -> tuple[torch.Tensor, set[torch.dtype]]:
        model = build_preset("tiny", seed=0).model.train()
        if checkpointed:
            checkpoint_activations(model, "tiny", fp32_products=True)
        x = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
        seen = _ProductDtypes()
        with seen:
            with autocast_context("bf16", torch.device("cpu"), fp32_products=True):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
        flat = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return flat, set(seen.dtypes)

    plain, plain_dtypes = grads(False)
    ckpt, ckpt_dtypes = grads(True)
    assert plain_dtypes == ckpt_dtypes == {torch.float32}
    assert torch.equal(plain, ckpt)
