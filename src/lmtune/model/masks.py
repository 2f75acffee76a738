"""Attention masks the model is given for packed rows: block-diagonal causal, with the model's
sliding window where it has one."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch
from torch import nn


def block_causal_mask(segment_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[batch, 1, L, L]`` bool: position q may attend to k when both are in one segment and k <= q
    (and q - window < k for a model with a sliding window)."""
    length = segment_ids.size(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    if window is not None:
        causal = causal.triu(1 - window)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (same & causal)[:, None]


MaskOfWindow = Callable[[int | None], torch.Tensor]
# transformers' decoders that take a mask per layer kind test for the mapping in their forward.
MASK_MAPPING = re.compile(r"isinstance\((causal_mask_mapping\s*:=\s*)?attention_mask,\s*dict\)")


def given_mask(model: nn.Module, mask_of: MaskOfWindow) -> torch.Tensor | dict[str, torch.Tensor]:
    """What ``model`` is given as its attention mask for lmtune's rows: ``mask_of(window)``, the
    bool mask with a sliding window (None: without), for the window its layers share; for a model
    that mixes sliding and full layers, a mask per layer kind (transformers' models take such a
    mapping: :func:`takes_masks_per_layer_kind`). Additive where attention is eager, which adds the
    mask it is given to its scores (transformers' own masks are additive there, in the model's
    dtype)."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or [])
    eager = getattr(config, "_attn_implementation", None) == "eager"
    dtype = model.get_input_embeddings().weight.dtype if eager else torch.bool  # type: ignore[operator]

    def given(window: int | None) -> torch.Tensor:
        mask = mask_of(window)
        if dtype == torch.bool:
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )

    if window is None or kinds == {"full_attention"}:
        return given(None)
    if "full_attention" in kinds:
        return {"full_attention": given(None), "sliding_attention": given(window)}
    return given(window)  # every layer slides (no layer kinds: a window is every layer's)


def takes_masks_per_layer_kind(model: nn.Module) -> bool:
    """Whether the model's decoder takes a mapping from layer kind to mask, as transformers' models
    that mix sliding and full layers do."""
    decoder = getattr(model, "get_decoder", lambda: model)()
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    return MASK_MAPPING.search(source) is not None


ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
LAYERS_WITHOUT_MIXING = frozenset({"mlp", "moe", "dense"})  # kinds some configs list beside their mixers
CARRY = "carry each token into the next outside attention, where no mask reaches"
# Recurrent models whose time mixing holds no convolution module to find.
RECURRENT_MODELS = frozenset({"rwkv", "xlstm"})


def unmasked_layers(model: object) -> str | None:
    """Why some layers of ``model`` are out of reach of lmtune's masks and per-example attention,
    or None: they carry one token's state to the next other than by attention (linear attention,
    convolutions, state-space and recurrent layers), reading the example before them in a packed
    or flattened row and a pair's chosen answer from its rejected one; or they attend in a way the
    masks do not describe (Llama 4's chunked attention)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", "") or "this model"
    kinds = set(getattr(config, "layer_types", None) or []) - ATTENTION_LAYERS - LAYERS_WITHOUT_MIXING
    attending = sorted(k for k in kinds if k.endswith("attention") and k != "linear_attention")
    mixing = sorted(kinds - set(attending))
    if mixing:
        return f"{kind}'s {' and '.join(mixing)} layers (as its config names them) {CARRY}"
    if attending:
        return f"{kind}'s {' and '.join(attending)} layers attend in a way lmtune's masks do not describe"
    if kind in RECURRENT_MODELS:
        return f"{kind}'s recurrent layers {CARRY}"
    # The text decoder's own: a vision or audio tower's convolutions see no text tokens.
    decoder = getattr(model, "get_decoder", lambda: model)()
    modules = decoder.modules() if isinstance(decoder, torch.nn.Module) else ()
    for module in modules:
        if isinstance(module, nn.Conv1d):
            return f"{kind}'s convolution layers {CARRY}"
        if isinstance(module, nn.RNNBase):  # an LSTM or GRU of a model's own code
            return f"{kind}'s recurrent layers ({type(module).__name__}) {CARRY}"
    return None


def own_code(model: object) -> bool:
    """Whether ``model``'s modeling code came with it (``--trust-remote-code``), not transformers'."""
    base = getattr(model, "get_base_model", lambda: model)()  # under LoRA, peft's wrapper
    return type(base).__module__.startswith("transformers_modules.")


def mask_obstacle(model: object) -> str | None:
    """Why ``model`` cannot be given lmtune's masks (block-diagonal for packed rows, a pair's),
    or None; a model that runs per-example attention (lmtune.model.attention) needs none."""
    from lmtune.model.attention import supports_varlen

    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", "")
    unmasked = unmasked_layers(model)
    if unmasked is not None:
        return unmasked
    if config is None or supports_varlen(model):  # type: ignore[arg-type]
        return None
    if kind == "bloom" or (kind == "falcon" and getattr(config, "alibi", False)):
        return f"{kind}'s ALiBi attention builds its position bias from a padding mask and takes no other"
    if kind == "mpt":  # its attention fills where the mask is True: transformers' masks say the opposite
        return "mpt's attention reads a mask the other way round from the masks transformers builds"
    if own_code(model):  # a GRU of its own packed took each example's end into the next one's start
        return (
            f"{kind or 'this model'}'s modeling code came with it (--trust-remote-code), and lmtune cannot "
            "tell whether its layers keep examples apart"
        )
    window, kinds = getattr(config, "sliding_window", None), set(getattr(config, "layer_types", None) or [])
    mixed = window is not None and kinds == ATTENTION_LAYERS
    if mixed and not takes_masks_per_layer_kind(model):  # type: ignore[arg-type]
        return "this model mixes sliding-window and full attention layers and takes one mask for both"
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
