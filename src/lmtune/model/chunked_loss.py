"""Cross-entropy through the output layer, a chunk of tokens at a time: the logits of a whole
micro-batch (tokens x vocabulary, and their fp32 copy, and their gradient) never exist at once.

Each chunk's gradients (for the hidden states, the head's weight and bias) are computed in the
forward, right after its loss, and the backward only scales them by the incoming gradient. That
costs no second product with the head, which for a model with a large vocabulary is a big share
of the step, against holding one fp32 weight-sized gradient from forward to backward.
Only positions with a target are projected: prompt tokens and padding cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.products import token_bucket

# Default chunk: about this many bytes of fp32 logits (big enough for efficient products). A GPU
# takes larger ones: each chunk adds weight-sized passes (its part of the head's gradient). On an
# H200 at Qwen2.5-0.5B's shape (4 x 2048 tokens, bf16) the head and loss alone took 2.3x the full
# logits' time in chunks of 256 tokens, 1.41x in 1024, 1.31x in 1664 (this default there), 1.2x in
# 4096; whole steps (24 blocks) 1.13x in 1664, with a peak 10.5 GiB under the full logits' 32.7.
CHUNK_BYTES = {"cpu": 128 * 2**20, "cuda": 2**30}
MIN_CHUNK, MAX_CHUNK = 256, 16384


def default_chunk_size(vocab: int, device_type: str = "cpu") -> int:
    """Tokens per chunk for a vocabulary on a device: a multiple of 128, within [MIN_CHUNK, MAX_CHUNK]."""
    size = CHUNK_BYTES.get(device_type, CHUNK_BYTES["cpu"])
    return max(MIN_CHUNK, min(MAX_CHUNK, size // (4 * vocab) // 128 * 128))


@dataclass(frozen=True)
class _HeadPlan:
    """How the chunked head runs: tokens per chunk, the autocast dtype the products round to, the
    dtype they run in (fp32: lmtune.model.products), and the rows' bucketing (None: as they are)."""

    chunk: int
    dtype: torch.dtype
    product_dtype: torch.dtype
    bucket: Callable[[int], int] | None


@dataclass
class ChunkGrads:
    """The gradients a chunked head computes in its forward, for the hidden states, the head's
    weight and its bias (None where no gradient is wanted); the weight's summed in fp32."""

    h: torch.Tensor | None
    w: torch.Tensor | None
    b: torch.Tensor | None

    @classmethod
    def wanted(
        cls, ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> ChunkGrads:
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        return cls(
            h=torch.empty_like(hidden) if want_h else None,
            w=torch.zeros_like(weight, dtype=torch.float32) if want_w else None,
            b=torch.zeros_like(bias, dtype=torch.float32) if want_b and bias is not None else None,
        )

    @property
    def any(self) -> bool:
        return self.h is not None or self.w is not None or self.b is not None

    def add(self, g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, start: int, dtypes: Products) -> None:
        """Add a chunk's part: ``g`` is d(loss)/d(logits) of the rows from ``start`` (fp32; fp32
        products round it in place), ``h`` and ``w`` the operands as the products took them."""
        dtype, product_dtype = dtypes
        if self.b is not None:
            self.b += g.sum(0)
        if product_dtype == dtype:
            g = g.to(dtype)
        else:  # rounded in place: a rounded fp32 copy would be a second chunk of fp32 at the peak
            g.copy_(g.to(dtype))
        if self.h is not None:
            # A bucketed last chunk has zero rows past the hidden states' end: not written back.
            rows = min(g.size(0), self.h.size(0) - start)
            self.h[start : start + rows] = (g @ w)[:rows].to(dtype)
        if self.w is None:
            return
        if product_dtype == torch.float32:
            self.w.addmm_(g.t(), h)  # summed in fp32 over the chunks, in place
        else:  # the low-precision product added as it is, without an fp32 copy of a weight's size
            self.w.add_(g.t() @ h)

    def finish(self, dtypes: Products) -> None:
        dtype, product_dtype = dtypes
        if self.w is not None and product_dtype != dtype:
            # Rounded once, as the full-logits path's one product over all rows is: per chunk,
            # the rounding also cost three passes over a weight-sized tensor each time.
            self.w = self.w.to(dtype).float()

    def save(self, ctx: Any, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        ctx.save_for_backward(self.h, self.w, self.b)
        ctx.dtypes = (hidden.dtype, weight.dtype)


# (autocast dtype, product dtype): the products take operands rounded to the autocast dtype and
# give results rounded to it, as the full-logits path's would; product dtype fp32: see
# lmtune.model.products.
Products = tuple[torch.dtype, torch.dtype]


def operand(t: torch.Tensor | None, dtypes: Products) -> torch.Tensor | None:
    """A product's operand as the full-logits path would take it."""
    return None if t is None else t.to(dtypes[0]).to(dtypes[1])


def chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtypes: Products) -> torch.Tensor:
    """A chunk's logits in fp32, rounded as the autocast products would give them."""
    return F.linear(h, w, b).to(dtypes[0]).float()


def exponentiate(
    logits: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the logits of ``targets``, the targets of the first rows; each row's log-sum-exp; each row's
    sum of exponentials), turning ``logits`` into exp(logits - the row's max) in place, so that
    ``logits / sums`` is the softmax. The log-sum-exp is torch.logsumexp's to the bit, without its
    temporary of the chunk's size (fp32), and the softmax costs no second exp over the chunk."""
    picked = logits[: targets.numel()].gather(1, targets[:, None]).squeeze(1)
    top = logits.amax(dim=-1, keepdim=True)
    top.masked_fill_(top.isinf(), 0.0)  # as logsumexp: a row of -inf gives -inf, not nan
    sums = logits.sub_(top).exp_().sum(dim=-1)
    return picked, sums.log() + top.squeeze(1), sums


def scaled_grads(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """A chunked head's backward: the forward's gradients times the incoming one."""
    grad_h, grad_w, grad_b = ctx.saved_tensors
    h_dtype, w_dtype = ctx.dtypes
    scale = grad_out.float()
    return (
        None if grad_h is None else (grad_h * scale).to(h_dtype),
        None if grad_w is None else (grad_w * scale).to(w_dtype),
        None if grad_b is None else (grad_b * scale).to(w_dtype),
    )


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        plan: _HeadPlan,
    ) -> torch.Tensor:
        chunk, bucket, dtypes = plan.chunk, plan.bucket, (plan.dtype, plan.product_dtype)
        grads = ChunkGrads.wanted(ctx, hidden, weight, bias)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # Softmax and log-sum-exp in fp32. Autocast is off inside so each cast is the one written here.
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = operand(weight, dtypes), operand(bias, dtypes)
            assert w is not None
            for start in range(0, hidden.size(0), chunk):
                t = targets[start : start + chunk]
                real = t.numel()
                rows = min(bucket(real), chunk) if bucket else real
                h = operand(_rows(hidden[start : start + chunk], rows), dtypes)
                assert h is not None
                logits = chunk_logits(h, w, b, dtypes)
                picked, lse, sums = exponentiate(logits, t)
                total += (lse[:real] - picked).sum()
                if grads.any:
                    logits.div_(sums[:, None])  # the softmax; minus one_hot(target): d(loss)/d(logits)
                    logits[torch.arange(real, device=t.device), t] -= 1.0
                    logits[real:] = 0.0  # bucketing's zero rows: no loss, no gradient
                    grads.add(logits, h, w, start, dtypes)
                # Kept bound, a chunk's logits would live on while the next chunk's are made: a
                # second chunk of fp32 logits at the peak (1 GiB at a GPU's default chunk).
                del logits
            grads.finish(dtypes)
        grads.save(ctx, hidden, weight)
        return total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*scaled_grads(ctx, grad_out), None, None)  # targets, plan


def _rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows``."""
    return t if t.size(0) == rows else torch.cat([t, t.new_zeros(rows - t.size(0), *t.shape[1:])])


@dataclass(frozen=True)
class Targets:
    """The positions of a micro-batch that have a target (flattened), and those targets."""

    index: torch.Tensor
    tokens: torch.Tensor
    positions: int  # of the micro-batch: its hidden states must have as many


def targets_of(labels: torch.Tensor) -> Targets:
    """The next-token targets of ``labels`` (shifted here) and where they are. Their number is
    data, so the device is waited for: take them before the decoder runs, while it holds little
    work. Picked after the forward, on a GPU the CPU waited for the whole forward and stopped
    launching the backward ahead of the GPU (a step 1.3x as long at Qwen2.5-0.5B's shape)."""
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)
    index = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    return Targets(index=index, tokens=targets[index], positions=targets.numel())


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    head: nn.Linear,
    targets: Targets,
    chunk: int,
    fp32_products: bool = False,
    bucketed: bool = False,
) -> torch.Tensor:
    """The summed next-token loss of ``head(hidden)`` against ``targets`` (:func:`targets_of` the
    labels), as :func:`lmtune.model.loss.token_loss_sum` computes it from full logits, without them.
    Only the positions with a target are projected: prompts and padding cost nothing.
    ``fp32_products``: a CPU bf16 run's products in fp32 (lmtune.model.products); ``bucketed``: the
    rows of each chunk's products padded to a bucketed count (``token_bucket``), where the number
    of targets would otherwise give the head's products a new shape at every step."""
    flat = hidden.reshape(-1, hidden.size(-1))
    if flat.size(0) != targets.positions:
        raise ValueError(f"{flat.size(0)} hidden states for the targets of {targets.positions} positions")
    rows = flat.index_select(0, targets.index)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    product_dtype = torch.float32 if fp32_products else dtype
    loss: torch.Tensor = _LinearCrossEntropy.apply(  # type: ignore[no-untyped-call]
        rows,
        head.weight,
        head.bias,
        targets.tokens,
        _HeadPlan(
            chunk=chunk, dtype=dtype, product_dtype=product_dtype, bucket=token_bucket if bucketed else None
        ),
    )
    return loss


@dataclass(frozen=True)
class HeadSplit:
    """A causal LM as its decoder (to the final hidden states) and its output layer."""

    decoder: nn.Module
    head: nn.Linear


def split_head(model: nn.Module) -> HeadSplit | None:
    """The decoder and a plain linear output layer of ``model`` (a PEFT wrapper looked through),
    or None when it has no such pair."""
    unwrap = getattr(model, "get_base_model", None)
    base: nn.Module = unwrap() if callable(unwrap) else model
    get_decoder, get_head = getattr(base, "get_decoder", None), getattr(base, "get_output_embeddings", None)
    if not callable(get_decoder) or not callable(get_head):
        return None
    head, decoder = get_head(), get_decoder()
    if type(head) is not nn.Linear or decoder is base:  # a LoRA-adapted head is not plain
        return None
    return HeadSplit(decoder, head)


@torch.no_grad()
def head_is_exact(model: nn.Module, split: HeadSplit) -> bool:
    """Whether the model's logits are exactly its head applied to its decoder's output: not so
    for models that scale or soft-cap the logits (Gemma 2's final soft-cap, Cohere's scale, ...).
    Checked on a few tokens rather than by a list of model types that would age."""
    was_training = model.training
    model.eval()
    try:
        device = split.head.weight.device
        ids = torch.arange(1, 5, device=device)[None] % split.head.out_features
        full = model(input_ids=ids, use_cache=False).logits.float()
        parts = split.head(split.decoder(input_ids=ids, use_cache=False).last_hidden_state).float()
    except Exception:  # a decoder that needs other inputs: keep the full-logits path
        return False
    finally:
        model.train(was_training)
    return full.shape == parts.shape and bool(torch.allclose(full, parts, rtol=1e-4, atol=1e-5))


@dataclass(frozen=True)
class LossChoice:
    chunk: int  # tokens per chunk; 0: full logits
    description: str  # for the log and run.json's resolved.loss


def choose(model: nn.Module, requested: int | None, compiled: bool, *, device_type: str) -> LossChoice:
    """The chunked loss where its math is exactly the model's, else full logits and why; its
    default chunk is the one for the device the model will run on (it may not be there yet)."""
    if requested == 0:
        return LossChoice(0, "full logits (--loss-chunk-size 0)")
    if compiled:  # the compiled graph is the model's whole forward, logits included
        return LossChoice(0, "full logits (--compile compiles the model's whole forward: it lists no blocks)")
    split = split_head(model)
    if split is None or not head_is_exact(model, split):
        return LossChoice(
            0, "full logits (the model's output is not a plain linear layer over its decoder's output)"
        )
    chunk = requested or default_chunk_size(split.head.out_features, device_type)
    return LossChoice(chunk, f"chunked linear cross-entropy ({chunk} tokens per chunk)")
