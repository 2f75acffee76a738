"""Completion from a trained model folder: `lmtune generate` and the demo's answers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmtune.errors import UserError, one_line
from lmtune.model.masks import own_code
from lmtune.model.tokens import appends_eos, prompt_ids, stop_ids


@dataclass(frozen=True)
class Sampling:
    """How :func:`complete` picks each token: greedy at temperature 0, else sampled, reproducibly
    by ``seed``."""

    temperature: float = 0.0
    # None: the model's generation config's (transformers' defaults: top-p 1.0, top-k 50).
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0


@torch.no_grad()
def complete(
    model: nn.Module,
    tokenizer: Any,
    prompt: str,
    max_new_tokens: int = 32,
    sampling: Sampling = Sampling(),
    add_special_tokens: bool = True,
) -> str:
    """Continue ``prompt`` until a stop token (EOS, or a chat model's end of turn, as its generation
    config lists them) or ``max_new_tokens``."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids(tokenizer, prompt, add_special_tokens)], dtype=torch.long, device=device)
    encoded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    sampled = sampling.temperature > 0
    options: dict[str, Any] = {"do_sample": sampled}
    if sampled:
        cuts = {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
        options.update({k: v for k, v in cuts.items() if v is not None})
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), _its_own(model):
        torch.manual_seed(sampling.seed)
        out = model.generate(  # type: ignore[operator]
            **encoded,
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids(model, tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            **options,
        )
    model.train(was_training)
    new_tokens = out[0, encoded["input_ids"].size(1) :]
    return str(tokenizer.decode(new_tokens, skip_special_tokens=True))


@torch.no_grad()
def complete_greedy(
    model: nn.Module, tokenizer: Any, prompts: list[str], max_new_tokens: int = 32
) -> list[str]:
    """Greedy continuations of several prompts in one batch (padded on the left, so every prompt
    ends where generation starts): the demo's 50 answers in one call rather than 50."""
    device = next(model.parameters()).device
    encoded = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt").to(device)
    if appends_eos(tokenizer):  # padded on the left: every prompt's own EOS is the last column
        encoded = {name: values[:, :-1] for name, values in encoded.items()}
    was_training = model.training
    model.eval()
    with _its_own(model):
        out = model.generate(  # type: ignore[operator]
            **encoded,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stop_ids(model, tokenizer),
            pad_token_id=tokenizer.pad_token_id,
        )
    model.train(was_training)
    new_tokens = out[:, encoded["input_ids"].size(1) :]
    return [str(text) for text in tokenizer.batch_decode(new_tokens, skip_special_tokens=True)]


def chat_reply(model: nn.Module, tokenizer: Any, messages: list[dict[str, str]], **options: Any) -> str:
    """The assistant's next reply to ``messages``, rendered with the tokenizer's chat template (which
    writes its own special tokens) and ended by the end-of-turn token the model was trained with;
    as generated (a reply of whitespace alone is one)."""
    from lmtune.data.chat import render_chat

    prompt = render_chat(tokenizer, messages, generation_prompt=True)
    return complete(model, tokenizer, prompt, add_special_tokens=False, **options)


@contextmanager
def _its_own(model: nn.Module) -> Iterator[None]:
    """A model whose code came with it (--trust-remote-code) may not take transformers' generate
    (a config without num_hidden_layers, kwargs its forward does not take): its failure is named
    as the model's, not shown as lmtune's traceback."""
    try:
        yield
    except (AttributeError, TypeError, ValueError, NotImplementedError) as e:
        if not own_code(model):
            raise
        raise UserError(
            f"the model's own code (--trust-remote-code) could not generate with transformers' generate: "
            f"{type(e).__name__}: {one_line(str(e))}"
        ) from None
