"""Example formats, and how each renders to text with the character spans that are trained.

Masking is decided here, on the rendered text: a token later trains exactly when it starts inside
one of the trainable spans. No token ids are searched for, so the mask does not depend on how a
tokenizer happens to encode a role marker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from lmtune.data.sources import Record
from lmtune.errors import UserError

ROLES = ("system", "user", "assistant", "tool")

# The template for tokenizers that have none (and for the presets). Assistant turns end with EOS so
# the model learns to stop; the newline comes before a turn, so nothing trainable follows the EOS.
BUILTIN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if not loop.first %}\n{% endif -%}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' %}{{ eos_token }}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{% if messages %}\n{% endif %}<|assistant|>\n{% endif -%}"
)


@dataclass(frozen=True)
class Rendered:
    """An example as text, the ``[start, end)`` character spans that train, and special tokens."""

    text: str
    spans: tuple[tuple[int, int], ...]
    add_special_tokens: bool  # the tokenizer's BOS and the like (chat templates write their own)
    append_eos: bool  # train an EOS after the text (chat templates end their own turns)
    format: str


def detect_format(fields: Mapping[str, Any], text_field: str) -> str | None:
    """The format a record's fields say it has, or None."""
    if "chosen" in fields or "rejected" in fields:  # one without the other: a broken pair
        return "preference"
    if "messages" in fields:
        return "messages"
    if ("prompt" in fields and "completion" in fields) or ("instruction" in fields and "output" in fields):
        return "prompt_completion"
    if text_field in fields:
        return "text"
    return None


def _expected(text_field: str) -> str:
    return (
        f"'{text_field}' (text), 'prompt' + 'completion', 'instruction' + 'output' (+ 'input'), 'messages', "
        "or 'prompt' + 'chosen' + 'rejected'"
    )


def _string(record: Record, name: str, allow_missing: bool = False) -> str:
    value = record.fields.get(name)
    if value is None and allow_missing:
        return ""
    if not isinstance(value, str):
        found = ", ".join(repr(k) for k in record.fields) or "none"
        problem = "no" if value is None else f"a non-string ({type(value).__name__})"
        raise UserError(f"{record.where}: record has {problem} '{name}' field (fields found: {found})")
    return value


def render(
    record: Record, fmt: str, text_field: str, tokenizer: Any, *, train_on_prompt: bool = False
) -> Rendered:
    """Render one record in format ``fmt`` (``auto`` detects it from the fields); with
    ``train_on_prompt`` all of it trains (the prompt, and chat's system and user turns too)."""
    chosen = detect_format(record.fields, text_field) if fmt == "auto" else fmt
    if chosen is None:
        found = ", ".join(repr(k) for k in record.fields) or "none"
        raise UserError(
            f"{record.where}: cannot tell the format (fields found: {found}; expected: "
            f"{_expected(text_field)}; set another text field with --text-field)"
        )
    if chosen == "preference":
        raise UserError(
            f"{record.where}: a preference pair (prompt, chosen, rejected) is not a single example; "
            "tune on pairs with --objective dpo, ipo, simpo or orpo"
        )
    if chosen == "text":
        text = _string(record, text_field)
        return Rendered(
            text=text, spans=((0, len(text)),), add_special_tokens=True, append_eos=True, format="text"
        )
    if chosen == "prompt_completion":
        if "prompt" in record.fields or "instruction" not in record.fields:
            prompt, completion = _string(record, "prompt"), _string(record, "completion")
        else:
            instruction, extra = _string(record, "instruction"), _string(record, "input", allow_missing=True)
            prompt = instruction + (f"\n\n{extra}" if extra else "") + "\n\n"
            completion = _string(record, "output")
        text = prompt + completion
        start = 0 if train_on_prompt else len(prompt)
        return Rendered(
            text=text,
            spans=((start, len(text)),),
            add_special_tokens=True,
            append_eos=True,
            format="prompt_completion",
        )
    rendered = _render_messages(record, tokenizer)
    return replace(rendered, spans=((0, len(rendered.text)),)) if train_on_prompt else rendered


def messages_field(record: Record, name: str = "messages") -> list[dict[str, str]]:
    """The record's list of ``{role, content}`` messages in field ``name``, checked."""
    raw = record.fields.get(name)
    if not isinstance(raw, list) or not raw:
        raise UserError(f"{record.where}: '{name}' must be a non-empty list of {{role, content}} objects")
    out = []
    label = "message" if name == "messages" else f"'{name}' message"
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping) or not isinstance(m.get("content"), str) or "role" not in m:
            raise UserError(
                f"{record.where}: {label} {i + 1} must be an object with a 'role' and a string 'content'"
            )
        if m["role"] not in ROLES:
            raise UserError(
                f"{record.where}: {label} {i + 1} has unknown role {m['role']!r} (roles: {', '.join(ROLES)})"
            )
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    return out


def chat_text(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    """The messages rendered by the tokenizer's chat template."""
    return str(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    )


def _render_messages(record: Record, tokenizer: Any) -> Rendered:
    """Render with the tokenizer's chat template; each assistant turn's own text is trainable.

    A turn's span is what rendering up to and including it adds to the rendering of the
    conversation before it with the generation prompt: the reply and its end-of-turn marker.
    """
    messages = messages_field(record)
    text = chat_text(tokenizer, messages, generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = chat_text(tokenizer, messages[:i], generation_prompt=True) if i else _empty_prompt(tokenizer)
        upto = chat_text(tokenizer, messages[: i + 1], generation_prompt=False)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise UserError(
                f"{record.where}: the chat template does not render the conversation turn by turn, so "
                "the assistant replies cannot be located; use a template that appends turns"
            )
        spans.append((len(before), len(upto)))
    return Rendered(
        text=text, spans=tuple(spans), add_special_tokens=False, append_eos=False, format="messages"
    )


def chat_prompt(record: Record, tokenizer: Any) -> tuple[str, str]:
    """A conversation's last turn, and the conversation rendered up to the assistant's reply."""
    ensure_chat_template(tokenizer)
    messages = messages_field(record)
    return messages[-1]["content"], chat_text(tokenizer, messages, generation_prompt=True)


def _empty_prompt(tokenizer: Any) -> str:
    """What precedes a reply that opens the conversation."""
    try:
        return chat_text(tokenizer, [], generation_prompt=True)
    except Exception:  # many templates index messages[0]; then nothing precedes it
        return ""


def ensure_chat_template(tokenizer: Any) -> None:
    """Give a tokenizer without a chat template the built-in one (saved with the model)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = BUILTIN_CHAT_TEMPLATE
