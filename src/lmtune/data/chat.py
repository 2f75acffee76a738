"""Chat templates: the built-in ones, a template file read and checked, the template and its turn
markers given to a tokenizer, and the end-of-turn token a template trains after each reply."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtune.errors import UserError

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


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # Jinja, as tokenizers store it in ``chat_template``
    markers: tuple[str, ...]  # the special tokens it writes (added to a vocabulary that lacks them)


# Turn by turn, with no trimming, so a reply's text is found unchanged in the rendering. Each writes
# the tokenizer's BOS where its model family does (Llama 3, Gemma); ChatML (Qwen) writes none.
TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate(
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}",
        ("<|im_start|>", "<|im_end|>"),
    ),
    "llama3": ChatTemplate(
        "{%- if bos_token %}{{ bos_token }}{% endif -%}"
        "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor -%}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif -%}",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    ),
    # Gemma names the assistant "model"; a system turn is kept as its own turn rather than folded
    # into the first user turn, so that every turn renders the same wherever it stands.
    "gemma": ChatTemplate(
        "{%- if bos_token %}{{ bos_token }}{% endif -%}"
        "{%- for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ m['content'] }}<end_of_turn>\n{% endfor -%}"
        "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif -%}",
        ("<start_of_turn>", "<end_of_turn>"),
    ),
}
MAX_TEMPLATE_BYTES = 64 * 1024
# Marker-shaped literals of a template file: <|name|> (ChatML, Llama 3, Phi) or <word_word> (Gemma).
_MARKER = re.compile(r"<\|[A-Za-z0-9_.-]{1,64}\|>|<[a-z]+(?:_[a-z]+)+>")


def read_template(choice: str) -> ChatTemplate:
    """A built-in template by name, or a ``.jinja`` file (which transformers renders sandboxed)."""
    if choice in TEMPLATES:
        return TEMPLATES[choice]
    option = f"--chat-template {choice}"
    path = Path(choice).expanduser()
    if path.suffix != ".jinja":
        raise UserError(f"{option}: must be one of {', '.join(TEMPLATES)} or a .jinja file")
    if not path.is_file():
        raise UserError(f"{option}: no such file")
    if path.stat().st_size > MAX_TEMPLATE_BYTES:
        raise UserError(f"{option}: over {MAX_TEMPLATE_BYTES // 1024} KiB, not a chat template")
    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{option}: not UTF-8 text (byte {e.start})") from None
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment().parse(source)
    except TemplateSyntaxError as e:
        raise UserError(f"{option}: line {e.lineno}: {e.message}") from None
    if "messages" not in source:
        raise UserError(f"{option}: the template never reads 'messages', so it renders no conversation")
    return ChatTemplate(source, tuple(dict.fromkeys(_MARKER.findall(source))))


def use_chat_template(tokenizer: Any, choice: str) -> list[str]:
    """Give ``tokenizer`` the chosen template (saved with every model folder) and its turn markers
    as special tokens, so each is one token that decoding hides. Returns the markers that were not
    in the vocabulary: the model's embeddings must grow by that many rows."""
    from tokenizers import AddedToken

    template = read_template(choice)
    vocabulary = tokenizer.get_vocab()
    new = [m for m in template.markers if m not in vocabulary]
    tokenizer.add_tokens(
        [AddedToken(m, special=True, normalized=False) for m in template.markers], special_tokens=True
    )
    tokenizer.chat_template = template.source
    return new
