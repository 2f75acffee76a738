"""Where a chat model's reply ends: the end-of-turn token its template trains, and the stop tokens a
saved model carries in ``generation_config.json`` so that every tool generating with it stops there.

A model fine-tuned on ChatML data learns to write ``<|im_end|>`` after a reply, but a generation
config that lists only ``<|endoftext|>`` lets ``generate`` run past it into an invented next turn.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_PROBE = "lmtune-end-of-turn-probe"


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The special token the chat template writes right after an assistant reply ([] when none).

    Found by rendering a one-exchange conversation and tokenizing what follows the reply's text,
    so it works for any template (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's
    ``<end_of_turn>``, or EOS in lmtune's built-in template).
    """
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    text = str(tokenizer.apply_chat_template(messages, tokenize=False))
    after = text[text.rfind(_PROBE) + len(_PROBE) :]
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
    }
    for token in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if token in special:
            return [int(token)]
    return []


def stop_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """Every token that ends generation for ``model``: its generation config's and the EOS."""
    config = getattr(model, "generation_config", None)
    listed = getattr(config, "eos_token_id", None)
    ids = [listed] if isinstance(listed, int) else list(listed or [])
    return list(dict.fromkeys([*ids, tokenizer.eos_token_id]))


def set_stop_tokens(model: nn.Module, tokenizer: Any, extra: list[int]) -> list[int]:
    """Add ``extra`` (end-of-turn tokens) to ``model``'s generation config, keeping the EOS; the
    config is saved with the model, so transformers' ``generate`` stops there too."""
    ids = list(dict.fromkeys([*stop_ids(model, tokenizer), *extra]))
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.eos_token_id = ids if len(ids) > 1 else ids[0]
    return ids
