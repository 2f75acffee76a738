"""Special tokens on the model's side: the stop tokens a saved model carries in
``generation_config.json``, and embeddings grown for a template's new turn markers.

A model fine-tuned on ChatML data learns to write ``<|im_end|>`` after a reply, but a generation
config that lists only ``<|endoftext|>`` lets ``generate`` run past it into an invented next turn.
"""

from __future__ import annotations

from collections.abc import Callable
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


# What a model whose tokenizer outgrew its embeddings needs, where it is only used (eval, generate).
UNEMBEDDED = (
    "save the model with its embeddings grown to its tokenizer (transformers' resize_token_embeddings, "
    "or an lmtune run without --lora, which grows them), or give it the tokenizer it was trained with"
)


def embedding_rows(model: nn.Module) -> int:
    return int(model.get_input_embeddings().weight.shape[0])  # type: ignore[operator]


def tokens_without_embeddings(model: nn.Module, tokenizer: Any, name: str) -> str:
    """Where the tokenizer's ids reach past the model's embeddings (tokens added to a tokenizer
    saved without the model's embeddings grown, or another model's tokenizer), what it says of
    them ("" when every id has a row): such an id fails in the model as an index error."""
    rows = embedding_rows(model)
    if len(tokenizer) <= rows:
        return ""
    added = sorted((i, t) for t, i in tokenizer.get_added_vocab().items() if i >= rows)
    some = (
        f" ({', '.join(f'{t} = {i}' for i, t in added[:3])}{', ...' if len(added) > 3 else ''})"
        if added
        else ""
    )
    return (
        f"{name}: its tokenizer has {len(tokenizer):,} tokens and its embeddings {rows:,} rows, so ids from "
        f"{rows:,} on{some} have no embedding"
    )


def fit_vocabulary(
    model: nn.Module, tokenizer: Any, name: str, *, lora: bool, say: Callable[[str], None]
) -> None:
    """For training: a tokenizer with more tokens than the model has embeddings grows them, said.

    Raises:
        UserError: under LoRA (``lora``), which would leave the new rows untrained.
    """
    from lmtune.errors import UserError

    problem = tokens_without_embeddings(model, tokenizer, name)
    if not problem:
        return
    if lora:
        raise UserError(
            f"{problem}; under --lora new embedding rows would stay untrained: fine-tune without --lora "
            "(the embeddings grow to the tokenizer), or give the model the tokenizer it was trained with"
        )
    fit_embeddings(model, tokenizer)
    say(f"{problem}: grown to {len(tokenizer):,} rows (new rows start at the mean of the others)")


def fit_embeddings(model: nn.Module, tokenizer: Any) -> bool:
    """Grow the embeddings (and an untied head) to the tokenizer's size; new rows start at the mean
    of the others. True when they grew.

    Exactly the mean: transformers' mean resizing draws them around it from the unseeded global
    generator (1e-9 of the rows' covariance), so two identical runs started from other weights, 2
    ranks did not train as 1 process, and a resume found its starting weights changed."""
    import torch

    rows = embedding_rows(model)
    if len(tokenizer) <= rows:  # many models ship spare rows beyond the tokenizer's ids
        return False
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)  # type: ignore[operator]
    layers = [getattr(model, f"get_{side}_embeddings", lambda: None)() for side in ("input", "output")]
    weights = {id(w): w for w in (getattr(m, "weight", None) for m in layers) if isinstance(w, torch.Tensor)}
    with torch.no_grad():
        for weight in weights.values():
            if weight.shape[0] > rows:
                weight[rows:] = weight[:rows].double().mean(dim=0).to(weight.dtype)
    return True


def position_limit(model: nn.Module) -> tuple[int | None, bool]:
    """The positions the model was trained with (``n_positions``/``max_position_embeddings``), and
    whether they are a learned table (GPT-2, OPT: a longer sequence indexes past it and fails)
    rather than rotary or ALiBi positions (which run on, but beyond what the model has seen)."""
    config = getattr(model, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int):
        return None, False
    get_inputs = getattr(model, "get_input_embeddings", None)
    inputs = get_inputs() if callable(get_inputs) else None
    learned = any(
        isinstance(m, nn.Embedding) and m is not inputs and limit <= m.num_embeddings <= limit + 2
        for m in model.modules()
    )  # OPT's table holds 2 more rows than its limit
    return limit, learned


def check_positions(model: nn.Module, longest: int, warn: Any) -> None:
    """Refuse sequences longer than a learned position table, warn past rotary positions.

    Raises:
        UserError: naming --max-length.
    """
    from lmtune.errors import UserError

    limit, learned = position_limit(model)
    if limit is None or longest <= limit:
        return
    if learned:
        raise UserError(
            f"--max-length: examples of up to {longest} tokens, but the model has {limit} positions "
            f"(a learned table: longer sequences cannot run); give --max-length {limit} or less"
        )
    warn(
        f"warning: examples of up to {longest} tokens, past the model's {limit} positions "
        "(max_position_embeddings): it never saw positions that far; --max-length caps examples"
    )


def prompt_ids(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt to continue, as token ids: less the EOS a tokenizer that appends one itself
    (``add_eos_token``) writes after it, which would ask the model to go on past its own end."""
    ids: list[int] = tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
    return ids[:-1] if add_special_tokens and ids and appends_eos(tokenizer) else ids


def appends_eos(tokenizer: Any) -> bool:
    """Whether the tokenizer's own special tokens end every text with EOS (a Llama tokenizer saved
    with ``add_eos_token``)."""
    eos = tokenizer.eos_token_id
    with_specials = tokenizer("a")["input_ids"]
    return (
        eos is not None
        and with_specials[-1:] == [eos]
        and tokenizer("a", add_special_tokens=False)["input_ids"][-1:] != [eos]
    )
