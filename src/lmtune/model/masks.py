"""Attention masks the model is given for packed rows: block-diagonal causal, with the model's
sliding window where it has one."""

from __future__ import annotations

import torch

from lmtune.errors import UserError


def block_causal_mask(segment_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[batch, 1, L, L]`` bool: position q may attend to k when both are in one segment and k <= q
    (and q - window < k for a model with a sliding window)."""
    length = segment_ids.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    if window is not None:
        causal = causal.triu(1 - window)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


def sliding_window(config: object) -> int | None:
    """The sliding window all attention layers of a model share (None: full attention).

    A 4D mask passed to the model replaces every layer's own; a model that mixes sliding and full
    layers cannot take one, and needs per-example attention for packed rows.
    """
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    if window is None or kinds <= {"sliding_attention"}:
        return window
    if "sliding_attention" not in kinds:
        return None
    raise UserError(
        "--packing: this model mixes sliding-window and full attention layers, so packed rows need "
        "per-example attention, which this model's attention code does not take; use --packing off"
    )


def mask_obstacle(model: object) -> str | None:
    """Why ``model`` cannot be given lmtune's masks (block-diagonal for packed rows, a pair's),
    or None; a model that runs per-example attention (lmtune.model.attention) needs none."""
    from lmtune.model.attention import supports_varlen

    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", "")
    if config is None or supports_varlen(model):  # type: ignore[arg-type]
        return None
    if kind == "bloom" or (kind == "falcon" and getattr(config, "alibi", False)):
        return f"{kind}'s ALiBi attention builds its position bias from a padding mask and takes no other"
    if kind == "mpt":  # its attention fills where the mask is True: transformers' masks say the opposite
        return "mpt's attention reads a mask the other way round from the masks transformers builds"
    window, kinds = getattr(config, "sliding_window", None), set(getattr(config, "layer_types", None) or [])
    if window is not None and "sliding_attention" in kinds and kinds != {"sliding_attention"}:
        return (
            "this model mixes sliding-window and full attention layers, whose own masks a mask given replaces"
        )
    return None


def pair_causal_mask(
    segment_ids: torch.Tensor, position_ids: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """``[batch, 1, L, L]`` bool for rows of preference pairs (lmtune.data.pair_collate): a token
    sees the earlier tokens of its own pair, except that a rejected token never sees a chosen one
    (segment ids ``3 k`` prompt, ``3 k + 1`` chosen, ``3 k + 2`` rejected; -1 padding). A sliding
    window counts positions, which restart after the prompt for the rejected answer."""
    length = segment_ids.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    pair, part = torch.div(segment_ids, 3, rounding_mode="floor"), segment_ids % 3
    same = pair[:, :, None] == pair[:, None, :]
    apart = (part[:, :, None] == 2) & (part[:, None, :] == 1) & (segment_ids[:, :, None] >= 0)
    mask = same & causal & ~apart
    if window is not None:
        mask &= (position_ids[:, :, None] - position_ids[:, None, :]) < window
    return mask[:, None]
