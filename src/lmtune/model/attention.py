"""Variable-length attention: every example attends to itself only, and padding costs nothing.

A micro-batch of rows (padded or packed) is flattened into one sequence of its real tokens, and
attention runs per example with a causal kernel: no FLOPs on padding, none on the masked-out
blocks of a packed row, and no ``L x L`` mask. The other layers (projections, MLP, norms) see the
same tokens as before, only without padding, so the loss is that of the rows, to rounding.

Models opt in through transformers' attention interface: a model whose layers dispatch attention
through it (``_supports_attention_backend``) and that runs ``sdpa`` is switched to ``VARLEN``, which
is ``sdpa`` itself whenever a call carries no segments (evaluation with a cache, generation).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmtune.config import environment
from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.errors import UserError

VARLEN = "lmtune_varlen"
# The same on the CPU under bf16 autocast, with attention in bf16 over bucketed shapes.
VARLEN_BUCKETED = "lmtune_varlen_bucketed"
BUCKET = 64  # example lengths round up to a multiple of this in bucketed attention
CPU_ATTENTION_ENV = environment.CPU_ATTENTION
SEGMENTS = "lmtune_segments"  # the keyword that carries a flattened batch's Segments to attention


@dataclass(frozen=True)
class Segments:
    """Where each example starts in a flattened micro-batch: ``offsets[i]:offsets[i + 1]``."""

    offsets: tuple[int, ...]
    cumulative: torch.Tensor  # the same offsets, int32 on the device, for fused varlen kernels
    # Preference pairs (lmtune.data.pair_collate): per example, its prompt's and chosen answer's
    # lengths; the rest of it is the rejected answer, which sees the prompt and itself only. None:
    # every example is one causal sequence.
    pairs: tuple[tuple[int, int], ...] | None = None

    def lengths(self) -> list[int]:
        return [end - start for start, end in zip(self.offsets[:-1], self.offsets[1:], strict=True)]

    @property
    def longest(self) -> int:
        return max(self.lengths(), default=0)


@dataclass(frozen=True)
class Flat:
    """A micro-batch as one row of its real tokens (batch dimension 1)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    segments: Segments


def flatten(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    round_to: Callable[[int], int] | None = None,
) -> Flat:
    """Drop the padding of right-padded or packed rows and concatenate what is left.

    An example starts where a row starts or its segment changes. Its first token gets no target:
    in a row of its own, position 0 is never predicted, and flattened it would otherwise be the
    target of the previous example's last token.

    ``round_to`` ends the sequence with a filler segment (no targets, attends only to itself, so no
    real token's loss or gradient depends on it) up to the length it gives: :func:`round_up` on the
    CPU, lmtune.model.products' ``token_bucket`` where oneDNN's bf16 kernels run the products (they
    keep a compiled kernel for every matrix shape they meet).
    """
    keep = attention_mask.bool()
    if position_ids is None:  # right padding: the model's own positions are 0..n-1 on every row
        position_ids = torch.cumsum(keep, dim=1) - 1
    rows = torch.arange(keep.size(0), device=keep.device)[:, None].expand_as(keep)
    segment = rows if segment_ids is None else rows * (int(segment_ids.max()) + 2) + segment_ids + 1
    segment = segment[keep]
    starts = torch.ones_like(segment, dtype=torch.bool)
    starts[1:] = segment[1:] != segment[:-1]
    tokens = int(segment.numel())
    offsets = [*torch.nonzero(starts).flatten().tolist(), tokens]
    ids, positions = input_ids[keep], position_ids[keep]
    flat_labels = labels[keep].masked_fill(starts, IGNORE_INDEX)
    filler = round_to(tokens) - tokens if round_to is not None else 0
    if filler:
        ids = torch.cat([ids, ids.new_zeros(filler)])
        positions = torch.cat([positions, torch.arange(filler, device=keep.device)])
        flat_labels = torch.cat([flat_labels, flat_labels.new_full((filler,), IGNORE_INDEX)])
        offsets.append(tokens + filler)
    cumulative = torch.tensor(offsets, dtype=torch.int32, device=keep.device)
    return Flat(
        input_ids=ids[None],
        position_ids=positions[None],
        labels=flat_labels[None],
        segments=Segments(tuple(offsets), cumulative),
    )


def round_up(tokens: int) -> int:
    """The next multiple of 1/32 of the length's power of two: at most ~3% more tokens, and a few
    dozen distinct lengths over a run instead of one per step."""
    step = max(8, 1 << max(tokens.bit_length() - 6, 0))
    return -(-tokens // step) * step


def supports_varlen(model: nn.Module) -> bool:
    """Whether ``model`` dispatches attention through transformers' attention interface and runs
    ``sdpa``, and mixes tokens through attention only, so that :func:`use_varlen` can switch it to
    per-example attention."""
    from lmtune.model.masks import unmasked_layers

    config = getattr(model, "config", None)
    if not getattr(model, "_supports_attention_backend", False) or config is None:
        return False
    # Flattened examples would reach each other through the other layers (or kinds of attention).
    return getattr(config, "_attn_implementation", None) == "sdpa" and unmasked_layers(model) is None


def use_varlen(model: nn.Module, bucketed: bool = False) -> bool:
    """Switch ``model`` to per-example attention when it :func:`supports_varlen`; returns whether it
    did. Other implementations (eager, flash-attention chosen by the user, models with their own
    attention code) are left as they are and get packed rows through a block-diagonal mask instead.

    ``bucketed`` (a CPU bf16 run whose attention lmtune.model.paths decided to run in bf16): bf16
    over bucketed shapes (:func:`bucketed_attention`) instead of fp32."""
    if not supports_varlen(model):
        return False
    _register()
    name = VARLEN_BUCKETED if bucketed else VARLEN
    model.set_attn_implementation(name)  # type: ignore[operator]
    return bool(model.config._attn_implementation == name)  # type: ignore[union-attr]  # may decline


def attention_description(model: nn.Module) -> str:
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if name == VARLEN_BUCKETED:
        return f"per example, bf16 in lengths rounded to {BUCKET}"
    return "per example" if name == VARLEN else "masked"


def _register() -> None:
    """Make our attention known to transformers (idempotent), with sdpa's masks for the calls
    that carry no segments."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    # Outside torch.compile's graphs (--compile compiles the decoder blocks around them): traced, the
    # per-example loop would specialise the graph on every batch's example lengths and recompile.
    AttentionInterface.register(VARLEN, torch.compiler.disable(varlen_attention))  # type: ignore[no-untyped-call]
    AttentionMaskInterface.register(VARLEN, sdpa_mask)
    AttentionInterface.register(VARLEN_BUCKETED, torch.compiler.disable(bucketed_attention))  # type: ignore[no-untyped-call]
    AttentionMaskInterface.register(VARLEN_BUCKETED, sdpa_mask)


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``[batch, heads, length, dim]`` in,
    ``[batch, length, heads, dim]`` out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments: Segments | None = kwargs.pop(SEGMENTS, None)
    if segments is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    window = kwargs.get("sliding_window")
    bias = kwargs.get("position_bias")
    if segments.pairs is None and _fused_available(query, dropout, bias):
        return _fused(module, query, key, value, segments, scaling, window), None
    dtype = query.dtype
    # On the CPU attention runs in fp32, outside autocast (which would cast it back to bf16):
    # PyTorch's CPU flash kernel was 2-3x slower in bf16 here (head sizes 32 and 64), and kept
    # memory for every distinct example length it met (+1 GB within 8 steps of varied examples).
    on_cpu = query.device.type == "cpu"
    if on_cpu:
        query, key, value = (t.float() for t in (query, key, value))
    lengths = segments.lengths()
    attend = _Attend(module=module, dropout=dropout, scaling=scaling, window=window)
    with torch.autocast("cpu", enabled=False) if on_cpu else nullcontext():
        if segments.pairs is not None:
            out = _pairs(attend, query, key, value, segments, bias)
        elif bias is None and _pad_together(lengths):
            out = _padded(attend, query, key, value, segments)
        else:
            out = _one_by_one(attend, query, key, value, segments, bias)
    return out.to(dtype), None


def bucketed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Per-example attention in the inputs' (low) precision on the CPU, with every call's shape
    drawn from a small set: example lengths round up to a multiple of ``BUCKET`` and the examples
    of one length run together, their count rounded up to a power of two. PyTorch's CPU bf16
    kernels keep memory for every shape they meet, so unbounded shapes would grow the process
    without end; bounded ones level off."""
    segments: Segments | None = kwargs.get(SEGMENTS)
    plain = segments is not None and segments.pairs is None  # pairs keep their own attention
    if segments is None or not plain or kwargs.get("position_bias") is not None or query.device.type != "cpu":
        return varlen_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    attend = _Attend(module=module, dropout=dropout, scaling=scaling, window=kwargs.get("sliding_window"))
    return _bucketed(attend, query, key, value, segments), None


def _bucketed(
    attend: _Attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments
) -> torch.Tensor:
    """``[1, heads, T, dim]`` in, ``[1, T, heads, dim]`` out; padding queries and keys come after
    every real one of their example, so causal attention never lets a real query see them."""
    device, tokens = query.device, query.size(2)
    lengths = segments.lengths()
    widths = [-(-n // BUCKET) * BUCKET for n in lengths]
    padded = [torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.size(3))], dim=2)[0] for t in (query, key, value)]
    outputs, places = [], []
    for width in sorted(set(widths)):
        members = [i for i, w in enumerate(widths) if w == width]
        count = 1 << (len(members) - 1).bit_length()  # spare rows are all padding
        spare = [0] * (count - len(members))
        starts = torch.tensor([segments.offsets[i] for i in members] + spare, device=device)
        sizes = torch.tensor([lengths[i] for i in members] + spare, device=device)
        positions = torch.arange(width, device=device)
        real = positions[None] < sizes[:, None]  # [count, width]
        index = torch.where(real, starts[:, None] + positions[None], tokens)
        q, k, v = (t[:, index].transpose(0, 1) for t in padded)  # [count, heads, width, dim]
        outputs.append(attend(q, k, v)[real])
        places.append(index[real])
    out = torch.cat(outputs)
    return out.new_zeros(tokens, *out.shape[1:]).index_copy(0, torch.cat(places), out)[None]


@dataclass(frozen=True)
class _Attend:
    """Causal sdpa over one or more equally long examples, with the layer's settings."""

    module: nn.Module
    dropout: float
    scaling: float | None
    window: int | None

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        bias: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[examples, heads, length, dim]`` in, ``[examples, length, heads, dim]`` out; causal,
        or as ``mask`` (``[queries, keys]`` bool) says."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if mask is None:
            mask = _window_mask(query.size(2), self.window, query.device)
            causal = mask is None
        else:
            mask, causal = mask[None, None], False
        return sdpa_attention_forward(
            self.module,
            query,
            key,
            value,
            mask,
            dropout=self.dropout,
            scaling=self.scaling,
            is_causal=causal,
            position_bias=bias,
        )[0]


def _pad_together(lengths: list[int]) -> bool:
    """One call over the examples padded to the longest, rather than a call per example, when
    that wastes little (nearly equal lengths) or the examples are short: a call costs ~0.1 ms
    forward and backward on the CPU however few its tokens."""
    longest = max(lengths)
    return longest <= 64 or len(lengths) * longest**2 <= 1.25 * sum(n * n for n in lengths)


def _padded(
    attend: _Attend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments
) -> torch.Tensor:
    """Every example padded at its end to the longest, in one causal call: no real query sees a
    padding key (they all come after it), and padding queries are dropped from the output."""
    device, tokens = query.device, query.size(2)
    lengths = torch.tensor(segments.lengths(), device=device)
    positions = torch.arange(segments.longest, device=device)
    real = positions[None] < lengths[:, None]  # [examples, longest]
    index = torch.where(real, segments.cumulative[:-1, None].long() + positions[None], tokens)

    def examples_first(t: torch.Tensor) -> torch.Tensor:  # [1, heads, T, dim] -> [n, heads, L, dim]
        padded = torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.size(3))], dim=2)
        return padded[0][:, index].transpose(0, 1)

    out = attend(examples_first(query), examples_first(key), examples_first(value))
    return out[real][None]


def _one_by_one(
    attend: _Attend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """A causal call per example (with its block of an additive bias, if the model has one)."""
    lengths = segments.lengths()
    # One split per tensor, not a slice per example: a slice's backward writes a full-size zero
    # gradient per example, split's backward is one concatenation.
    queries, keys, values = (torch.split_with_sizes(t, lengths, dim=2) for t in (query, key, value))
    outputs = []
    for i in range(len(lengths)):
        part = slice(segments.offsets[i], segments.offsets[i + 1])
        block = None if bias is None else bias[..., part, part]
        outputs.append(attend(queries[i], keys[i], values[i], block))
    return torch.cat(outputs, dim=1)


def _pairs(
    attend: _Attend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Preference pairs, each one example of prompt, chosen and rejected tokens: the prompt and the
    chosen answer as one causal sequence, the rejected answer's queries over the prompt's keys and
    its own (causal among them). ``[1, heads, T, dim]`` in, ``[1, T, heads, dim]`` out."""
    if bias is not None:
        raise UserError(
            "preference objectives: this model's attention takes a position bias, which pairs do not"
        )
    assert segments.pairs is not None
    lengths = segments.lengths()
    queries, keys, values = (torch.split_with_sizes(t, lengths, dim=2) for t in (query, key, value))
    outputs = []
    for i, (p, c) in enumerate(segments.pairs):
        q, k, v = queries[i], keys[i], values[i]
        outputs.append(attend(q[:, :, : p + c], k[:, :, : p + c], v[:, :, : p + c]))
        r = lengths[i] - p - c
        if r:
            seen = (
                torch.cat([k[:, :, :p], k[:, :, p + c :]], dim=2),
                torch.cat([v[:, :, :p], v[:, :, p + c :]], dim=2),
            )
            outputs.append(attend(q[:, :, p + c :], *seen, mask=_after_prompt(p, r, attend.window, q.device)))
    return torch.cat(outputs, dim=1)


def _after_prompt(prompt: int, length: int, window: int | None, device: torch.device) -> torch.Tensor:
    """``[length, prompt + length]``: query i (at position prompt + i) sees the prompt and the
    answer up to itself (within the sliding window, where the model has one)."""
    q = prompt + torch.arange(length, device=device)[:, None]
    k = torch.cat([torch.arange(prompt, device=device), prompt + torch.arange(length, device=device)])[
        None, :
    ]
    seen = k <= q
    return seen & (k > q - window) if window is not None else seen


def _window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """A sliding-window causal mask where the window is shorter than the example, else None
    (plain causal). Same rule as transformers: key k is seen from query q when q - W < k <= q."""
    if window is None or length <= window:
        return None
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return ((k <= q) & (k > q - window))[None, None]


def _fused_available(query: torch.Tensor, dropout: float, bias: torch.Tensor | None) -> bool:
    """PyTorch's varlen flash kernel: CUDA, half precision, no dropout, no additive bias."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or dropout or bias is not None:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _fused(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    scaling: float | None,
    window: int | None,
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    def tokens_first(t: torch.Tensor) -> torch.Tensor:  # [1, heads, T, dim] -> [T, heads, dim]
        return t[0].transpose(0, 1)

    out = varlen_attn(
        tokens_first(query),
        tokens_first(key),
        tokens_first(value),
        segments.cumulative,
        segments.cumulative,
        segments.longest,
        segments.longest,
        scale=scaling,
        window_size=(-1 if window is None else window - 1, 0),
        enable_gqa=getattr(module, "num_key_value_groups", 1) > 1,
    )
    assert isinstance(out, torch.Tensor)
    return out[None]
