"""The chunked linear cross-entropy gives the loss and gradients of the full-logits path."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch

from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.chunked_loss import default_chunk_size, head_is_exact, split_head
from lmtune.model.products import Fp32Products
from lmtune.objectives.sft import SummedLoss

VOCAB = 301


def _config(kind: str) -> Any:
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    small = {"vocab_size": VOCAB, "hidden_size": 48, "num_attention_heads": 4, "num_hidden_layers": 2}
    if kind == "gpt2":
        return GPT2Config(vocab_size=VOCAB, n_embd=48, n_head=4, n_layer=2, bos_token_id=1, eos_token_id=2)
    if kind == "llama-tied":
        return LlamaConfig(**small, intermediate_size=96, tie_word_embeddings=True)
    if kind == "llama-untied":
        return LlamaConfig(**small, intermediate_size=96, tie_word_embeddings=False)
    return Qwen2Config(**small, intermediate_size=96, num_key_value_heads=2, tie_word_embeddings=False)


def _model(kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model: torch.nn.Module = AutoModelForCausalLM.from_config(_config(kind))
    return model.eval()  # no dropout: both paths must see the same network


def _batch(pad_from: int = 15) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, 21), generator=g)
    mask = torch.ones_like(ids)
    mask[1, pad_from:] = 0  # a padded row
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    labels[0, :6] = IGNORE_INDEX  # a prompt
    return ids, mask, labels


def _loss_and_grads(
    model: torch.nn.Module,
    chunk: int,
    dtype: torch.dtype | None,
    varlen: bool = False,
    fp32_products: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    # Over 10% padding sends per-example attention down its flattened path.
    ids, mask, labels = _batch(pad_from=8 if varlen else 15)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype is not None else nullcontext()
    with autocast, Fp32Products() if fp32_products else nullcontext():
        wrapped = SummedLoss(model, varlen=varlen, loss_chunk=chunk, fp32_products=fp32_products)
        loss = wrapped(ids, mask, labels).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = float(b[name].abs().max()) + 1e-12
        assert float((a[name] - b[name]).abs().max()) <= rel * scale, name


@pytest.mark.parametrize("kind", ["gpt2", "llama-tied", "llama-untied", "qwen2"])
def test_chunked_equals_full_logits_in_fp32(kind: str) -> None:
    model = _model(kind)
    assert split_head(model) is not None and head_is_exact(model, split_head(model))  # type: ignore[arg-type]
    full_loss, full = _loss_and_grads(model, 0, None)
    for chunk in (7, 16, 4096):  # many chunks, a few, one
        loss, grads = _loss_and_grads(model, chunk, None)
        assert float(loss) == pytest.approx(float(full_loss), rel=1e-6)
        _close(grads, full, 1e-5)


@pytest.mark.parametrize("fp32_products", [False, True], ids=["bf16-products", "fp32-products"])
@pytest.mark.parametrize("kind", ["llama-tied", "qwen2"])
def test_chunked_equals_full_logits_under_bf16_autocast(kind: str, fp32_products: bool) -> None:
    """The products take bf16 operands both ways and the loss runs in fp32; only the order in which
    bf16 gradient pieces are summed differs (chunk by chunk here), so they agree to bf16 rounding.
    fp32-products: a CPU bf16 run's (lmtune.model.products)."""
    model = _model(kind)
    full_loss, full = _loss_and_grads(model, 0, torch.bfloat16, fp32_products=fp32_products)
    loss, grads = _loss_and_grads(model, 16, torch.bfloat16, fp32_products=fp32_products)
    assert float(loss) == pytest.approx(float(full_loss), rel=1e-4)
    _close(grads, full, 2e-2)


def test_chunked_with_per_example_attention_and_lora() -> None:
    from lmtune.config.groups import LoraSettings
    from lmtune.model.attention import use_varlen
    from lmtune.model.lora import add_lora

    model = _model("llama-untied")
    assert use_varlen(model)
    flattened = []
    model.model.register_forward_pre_hook(
        lambda m, a, k: flattened.append(k["input_ids"].shape[0] == 1), with_kwargs=True
    )
    full_loss, full = _loss_and_grads(model, 0, None, varlen=True)
    loss, grads = _loss_and_grads(model, 16, None, varlen=True)
    assert flattened == [True, True]  # both paths ran on the flattened rows
    assert float(loss) == pytest.approx(float(full_loss), rel=1e-6)
    _close(grads, full, 1e-5)
    torch.manual_seed(0)
    settings = LoraSettings(rank=4, alpha=8, dropout=0.0, target_modules="all-linear")
    lora = add_lora(_model("llama-tied"), settings)
    for p in lora.parameters():  # LoRA's B starts at zero; move it so its gradients mean something
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    assert split_head(lora) is not None  # the frozen head of the wrapped model
    full_loss, full = _loss_and_grads(lora, 0, None)
    loss, grads = _loss_and_grads(lora, 16, None)
    assert full and all("lora" in n for n in full)
    assert float(loss) == pytest.approx(float(full_loss), rel=1e-6)
    _close(grads, full, 1e-5)


def test_evaluation_without_gradients_computes_only_the_loss() -> None:
    model = _model("qwen2")
    ids, mask, labels = _batch()
    with torch.no_grad():
        full = SummedLoss(model, loss_chunk=0)(ids, mask, labels)
        chunked = SummedLoss(model, loss_chunk=8)(ids, mask, labels)
    assert float(chunked) == pytest.approx(float(full), rel=1e-6)


def test_a_soft_capped_head_is_not_exact_so_the_full_path_stays() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=1,
        final_logit_softcapping=5.0,
    )
    model = Gemma2ForCausalLM(config).eval()
    split = split_head(model)
    assert split is not None and not head_is_exact(model, split)
    model.config.final_logit_softcapping = None
    assert head_is_exact(model, split)


def test_default_chunk_sizes() -> None:
    assert default_chunk_size(151_936) == 256  # Qwen2.5: 148 MiB of fp32 logits per chunk
    assert default_chunk_size(32_000) == 1024
    assert default_chunk_size(300) == 16384
    assert default_chunk_size(151_936, "cuda") == 1664  # a GPU: 1 GiB of fp32 logits per chunk
    assert default_chunk_size(32_000, "cuda") == 8320


def test_targets_are_the_shifted_labels_with_a_target() -> None:
    from lmtune.model.chunked_loss import linear_cross_entropy_sum, targets_of

    _, _, labels = _batch()
    targets = targets_of(labels)
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    assert targets.positions == labels.numel()
    assert targets.index.tolist() == [i for i, t in enumerate(shifted.tolist()) if t != IGNORE_INDEX]
    assert torch.equal(targets.tokens, shifted[targets.index])
    head = torch.nn.Linear(8, VOCAB)
    with pytest.raises(ValueError, match="hidden states"):  # rows of another layout than the labels
        linear_cross_entropy_sum(torch.zeros(1, labels.numel() - 3, 8), head, targets, 16)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_plan_sizes_the_chunk_train_takes(device_type: str) -> None:
    """lmtune plan's chunk (from the config) is the one training chooses on the real model, for
    the device it will run on (a GPU's is larger), here at Qwen2.5's vocabulary."""
    from transformers import AutoModelForCausalLM

    from lmtune.config.settings import TrainConfig
    from lmtune.model.chunked_loss import choose
    from lmtune.tools.memory import loss_chunk

    config = _config("qwen2")
    config.vocab_size = 151_936
    model = AutoModelForCausalLM.from_config(config).eval()
    chosen = choose(model, None, False, device_type=device_type).chunk
    assert (
        chosen == loss_chunk(TrainConfig(), config, device_type) == default_chunk_size(151_936, device_type)
    )
    assert chosen == (1664 if device_type == "cuda" else 256)
