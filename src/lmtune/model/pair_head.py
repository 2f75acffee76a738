"""Preference losses through the output layer, without the logits of a micro-batch.

A preference loss is a sum over pairs of a function of each pair's summed answer log-probs (and
its token counts and reference log-probs): the gradient of a token's log-prob is that function's
derivative for its sequence. The answer tokens of a micro-batch come pair by pair (lmtune.data.
pair_collate), so chunks of whole pairs are projected through the head, their log-probs summed
per sequence, the pairs' losses and derivatives computed, and each chunk's gradients for the
hidden states, the head's weight and bias accumulated right away, as the chunked cross-entropy
does (lmtune.model.chunked_loss): one product for the logits, two for the gradients, and the
backward only scales them. A pair with more answer tokens than a chunk is projected twice
(its log-probs first, then its gradients), so no chunk holds more than ``chunk`` rows of logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.chunked_loss import (
    ChunkGrads,
    Products,
    chunk_logits,
    exponentiate,
    operand,
    scaled_grads,
)

# (summed log-probs [pairs, 2], answer tokens [pairs, 2], reference log-probs [pairs, 2]), float64,
# chosen then rejected -> each pair's loss [pairs].
PairLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Answers:
    """The answer tokens of a micro-batch of pairs (lmtune.data.pair_collate), in position order:
    each pair's targets are consecutive, chosen before rejected."""

    source: torch.Tensor  # per target, the position whose hidden state predicts it
    targets: torch.Tensor  # the target tokens
    seq: torch.Tensor  # their answers: 2 * pair for the chosen one, 2 * pair + 1 the rejected one
    pairs: int
    # Read from the device here, before the model runs (a count is data): read after its forward,
    # a GPU's CPU would wait for the whole forward (see chunked_loss.targets_of).
    counts: torch.Tensor  # target tokens per answer, [pairs, 2] float64
    bounds: list[int]  # where each pair's targets start in seq, and the end

    @classmethod
    def of(cls, labels: torch.Tensor, part: torch.Tensor, pair: torch.Tensor, pairs: int) -> Answers:
        """From the positions as the model runs them (flattened): their labels (an answer token's
        own id, else IGNORE_INDEX), part (0 prompt, 1 chosen, 2 rejected, -1 none) and pair.

        A token is predicted by the position before it, but for a rejected answer's first token,
        which the prompt's last position predicts (the chosen answer lies between them)."""
        labels, part, pair = labels.reshape(-1), part.reshape(-1), pair.reshape(-1)
        index = torch.arange(labels.numel(), device=labels.device)
        before = torch.roll(index, 1)
        first_rejected = (part == 2) & ((part[before] != 2) | (pair[before] != pair) | (index == 0))
        prompt_end = torch.full((max(pairs, 1),), -1, dtype=torch.long, device=labels.device)
        in_prompt = part == 0
        prompt_end = prompt_end.scatter_reduce(0, pair[in_prompt], index[in_prompt], reduce="amax")
        source = torch.where(first_rejected, prompt_end[pair.clamp(min=0)], index - 1)
        keep = labels != IGNORE_INDEX
        seq = 2 * pair + (part == 2).long()
        seq = seq[keep]
        n = 2 * pairs
        return cls(
            source=source[keep],
            targets=labels[keep],
            seq=seq,
            pairs=pairs,
            counts=torch.bincount(seq, minlength=n)[:n].reshape(pairs, 2).double(),
            bounds=_pair_bounds(seq, pairs),
        )

    def rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states (or logits) that predict the targets."""
        return hidden.reshape(-1, hidden.size(-1))[self.source]


def logps_from_logits(logits: torch.Tensor, answers: Answers) -> torch.Tensor:
    """Summed answer log-probs ``[pairs, 2]`` (float64, differentiable) from full logits."""
    token = answers.rows(logits).float().log_softmax(-1).gather(1, answers.targets[:, None]).squeeze(1)
    sums = torch.zeros(2 * answers.pairs, dtype=torch.float64, device=logits.device)
    return sums.index_add(0, answers.seq, token.double()).reshape(answers.pairs, 2)


def _pair_bounds(seq: torch.Tensor, pairs: int) -> list[int]:
    """Where each pair's targets start in ``seq`` (sorted), and the end: ``pairs + 1`` offsets."""
    edges = torch.arange(0, 2 * pairs + 1, 2, device=seq.device)
    return [int(x) for x in torch.searchsorted(seq, edges).tolist()]


def _groups(bounds: list[int], chunk: int) -> list[tuple[int, int]]:
    """Consecutive pairs into groups of at most ``chunk`` targets (a longer pair alone): (first
    pair, end pair)."""
    groups, first = [], 0
    for end in range(1, len(bounds)):
        if bounds[end] - bounds[first] > chunk and end - 1 > first:
            groups.append((first, end - 1))
            first = end - 1
    if len(bounds) > 1:
        groups.append((first, len(bounds) - 1))
    return groups


@dataclass(frozen=True)
class _Pass:
    """One pass of a micro-batch's answer rows through the head, chunks of whole pairs at a time."""

    hidden: torch.Tensor  # the rows with a target
    targets: torch.Tensor
    seq: torch.Tensor
    pairs: int
    counts: torch.Tensor
    bounds: list[int]
    chunk: int
    dtypes: Products

    def run(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        grads: ChunkGrads,
        loss: tuple[PairLossFn, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss of the pairs under ``loss`` = (function, reference), 0 without; their
        summed log-probs ``[2 * pairs]``), adding the loss's gradients to ``grads``. The log-probs
        are the same with or without a loss: the chunks are the same."""
        seq, targets, chunk, dtypes, counts = self.seq, self.targets, self.chunk, self.dtypes, self.counts
        logps = torch.zeros(2 * self.pairs, dtype=torch.float64, device=self.hidden.device)
        total = torch.zeros((), dtype=torch.float64, device=self.hidden.device)
        bounds = self.bounds
        w, b = operand(weight, dtypes), operand(bias, dtypes)
        assert w is not None
        for first, end in _groups(bounds, chunk):
            lo, hi = bounds[first], bounds[end]
            spans = [(s, min(s + chunk, hi)) for s in range(lo, hi, chunk)]
            kept = None
            for s, e in spans:
                part = _recompute(self.hidden[s:e], targets[s:e], w, b, dtypes)
                logps.index_add_(0, seq[s:e], (part.picked - part.lse).double())
                # One span's chunk is kept for its gradient; of several, each is dropped before
                # the next is made (two chunks of fp32 logits would be live at once).
                kept = part if len(spans) == 1 else None
                del part
            if loss is None:
                continue
            loss_fn, reference = loss
            with torch.enable_grad():
                mine = logps[2 * first : 2 * end].reshape(-1, 2).detach().requires_grad_(grads.any)
                losses = loss_fn(mine, counts[first:end], reference[first:end]).sum()
                total += losses.detach()
                if not grads.any:
                    continue
                (d_logps,) = torch.autograd.grad(losses, mine)
            d_seq = d_logps.reshape(-1).float()
            for s, e in spans:
                part = kept or _recompute(self.hidden[s:e], targets[s:e], w, b, dtypes)
                kept = None
                # d(token log-prob)/d(logits) = one_hot - softmax, times its sequence's derivative.
                g = part.logits.div_(part.sums[:, None])
                g[torch.arange(e - s, device=g.device), targets[s:e]] -= 1.0
                g.mul_(-d_seq[seq[s:e] - 2 * first][:, None])
                grads.add(g, part.h, w, s, dtypes)
                del part, g
        grads.finish(dtypes)
        return total, logps


class _PairHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        head_pass: _Pass,
        loss_fn: PairLossFn,
        reference: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        grads = ChunkGrads.wanted(ctx, hidden, weight, bias)
        with torch.autocast(hidden.device.type, enabled=False):
            total, logps = head_pass.run(weight, bias, grads, (loss_fn, reference))
        grads.save(ctx, hidden, weight)
        ctx.mark_non_differentiable(logps)
        return total, logps.reshape(-1, 2)

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor, _: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*scaled_grads(ctx, grad_total), None, None, None)


@dataclass(frozen=True)
class _Chunk:
    """A chunk of answer rows through the head: ``logits`` exponentiated in place (see
    chunked_loss.exponentiate), their row sums, log-sum-exps and target logits, and the rows as
    the product took them."""

    logits: torch.Tensor
    sums: torch.Tensor
    lse: torch.Tensor
    picked: torch.Tensor
    h: torch.Tensor


def _recompute(
    hidden: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtypes: Products
) -> _Chunk:
    h = operand(hidden, dtypes)
    assert h is not None
    logits = chunk_logits(h, w, b, dtypes)
    picked, lse, sums = exponentiate(logits, targets)
    return _Chunk(logits=logits, sums=sums, lse=lse, picked=picked, h=h)


def _dtypes(hidden: torch.Tensor, head: nn.Linear, fp32_products: bool) -> Products:
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    return dtype, torch.float32 if fp32_products else dtype


def _head_pass(
    hidden: torch.Tensor, head: nn.Linear, answers: Answers, chunk: int, fp32_products: bool
) -> _Pass:
    return _Pass(
        hidden=answers.rows(hidden),
        targets=answers.targets,
        seq=answers.seq,
        pairs=answers.pairs,
        counts=answers.counts,
        bounds=answers.bounds,
        chunk=chunk,
        dtypes=_dtypes(hidden, head, fp32_products),
    )


def pair_loss_chunked(
    hidden: torch.Tensor,
    head: nn.Linear,
    answers: Answers,
    reference: torch.Tensor,
    loss_fn: PairLossFn,
    chunk: int,
    fp32_products: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the summed loss of the pairs, differentiable; their summed answer log-probs ``[pairs, 2]``,
    detached) of ``head(hidden)``, ``chunk`` answer tokens at a time (``fp32_products``: a CPU bf16
    run's products in fp32, lmtune.model.products)."""
    head_pass = _head_pass(hidden, head, answers, chunk, fp32_products)
    out: tuple[torch.Tensor, torch.Tensor] = _PairHead.apply(  # type: ignore[no-untyped-call]
        head_pass.hidden, head.weight, head.bias, head_pass, loss_fn, reference.double()
    )
    return out


@torch.no_grad()
def pair_logps_chunked(
    hidden: torch.Tensor, head: nn.Linear, answers: Answers, chunk: int, fp32_products: bool = False
) -> torch.Tensor:
    """Summed answer log-probs ``[pairs, 2]`` (float64, no gradient) in the chunks
    :func:`pair_loss_chunked` takes: a reference pass on the policy's batch gives its log-probs
    bit for bit."""
    head_pass = _head_pass(hidden, head, answers, chunk, fp32_products)
    with torch.autocast(hidden.device.type, enabled=False):
        _, logps = head_pass.run(head.weight, head.bias, ChunkGrads(None, None, None))
    return logps.reshape(-1, 2)
