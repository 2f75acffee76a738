"""Special tokens on the model's side: the stop tokens a saved model carries in
``generation_config.json``, and embeddings grown for a template's new turn markers.

A model fine-tuned on ChatML data learns to write ``<|im_end|>`` after a reply, but a generation
config that lists only ``<|endoftext|>`` lets ``generate`` run past it into an invented next turn.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def stop_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """Every token that ends generation for ``model``: its generation config's and the EOS."""
    config = getattr(model, "generation_config", None)
    listed = getattr(config, "eos_token_id", None)
    ids = listed if isinstance(listed, list) else [listed]
    # Token ids only: a generation config is a file from disk and may hold anything.
    ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
    return list(dict.fromkeys([*ids, tokenizer.eos_token_id]))


def set_stop_tokens(model: nn.Module, tokenizer: Any, extra: list[int]) -> list[int]:
    """Add ``extra`` (end-of-turn tokens) to ``model``'s generation config, keeping the EOS; the
    config is saved with the model, so transformers' ``generate`` stops there too."""
    ids = list(dict.fromkeys([*stop_ids(model, tokenizer), *extra]))
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.eos_token_id = ids if len(ids) > 1 else ids[0]
    return ids


def fit_embeddings(model: nn.Module, tokenizer: Any) -> bool:
    """Grow the embeddings (and an untied head) to the tokenizer's size; new rows start at the mean
    of the others, as transformers does. True when they grew."""
    rows = model.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    if len(tokenizer) <= rows:  # many models ship spare rows beyond the tokenizer's ids
        return False
    model.resize_token_embeddings(len(tokenizer))  # type: ignore[operator]
    return True
