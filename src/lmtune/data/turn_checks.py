"""A chat turn's own checks: whether its flags let it train (Axolotl's weight, training), and its
content as text (a string, or a list of text parts); and a completion's own label (TRL's KTO)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lmtune.data.sources import Record
from lmtune.errors import UserError, brief


def turn_trains(record: Record, turn: Mapping[str, Any], where: str, role: str, every_turn: bool) -> bool:
    """Whether a turn's own flag lets it train (Axolotl's ``weight`` 0 or 1 of ShareGPT turns, and
    ``training``): unless it says 0 (false). Only the assistant's turns train, every turn under
    ``every_turn`` (--train-on-prompt).

    Raises:
        UserError: a flag of another value, or one that asks to train a turn that is not the assistant's.
    """
    flags = {k: turn[k] for k in ("weight", "training") if k in turn}
    for key, value in flags.items():
        if value not in (0, 1) or (key == "training" and not isinstance(value, bool)):
            raise UserError(
                f"{record.where}: {where} has {key} {brief(value)}; a turn's {key} is "
                f"{'0 or 1' if key == 'weight' else 'true or false'}: whether the turn trains"
            )
    if role != "assistant" and any(flags.values()) and not every_turn:
        asked = ", ".join(f"{k} {str(v).lower() if isinstance(v, bool) else v}" for k, v in flags.items())
        raise UserError(
            f"{record.where}: {where} ({role}) asks to train ({asked}); lmtune trains the assistant's "
            "turns (every turn with --train-on-prompt)"
        )
    return all(flags.values())


def text_content(record: Record, content: Any, what: str) -> str | None:
    """A message's content as text: a string, or a list of text parts (``{"type": "text", "text":
    ...}``, as multimodal chat data and TRL's conversational data write it) joined, as transformers'
    chat templates render them one after another; None when it is neither."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content or not all(isinstance(p, Mapping) for p in content):
        return None
    other = next((p for p in content if p.get("type") != "text" or not isinstance(p.get("text"), str)), None)
    if other is not None and other.get("type") == "text":  # {"type": "text", "content": ...}: said "not text"
        raise UserError(
            f"{record.where}: {what} has a text part without a 'text' string (its fields: "
            f'{", ".join(map(repr, other))}); a text part is {{"type": "text", "text": ...}}'
        )
    if other is not None:
        kind = other.get("type")
        raise UserError(
            f"{record.where}: {what} has a content part that is not text "
            f"({'type ' + brief(kind) if kind is not None else 'no type'}); lmtune trains on text: "
            'give only {"type": "text", "text": ...} parts, or a string'
        )
    return "".join(p["text"] for p in content)


def refuse_undesired(record: Record, fmt: str) -> None:
    """A prompt/completion record (``fmt``) labelled false (TRL's KTO data: an answer not to give)
    would train as one to give: the audit said "clean"."""
    label = record.fields.get("label")
    if fmt == "prompt_completion" and (label is False or label == 0 or str(label).lower() == "false"):
        raise UserError(
            f"{record.where}: a completion labelled false (KTO's unpaired data: an answer not to give) "
            "would train as one to give; lmtune has no KTO: leave such records out (--skip-bad-lines "
            "skips them), or pair a prompt's answers as chosen and rejected for --objective dpo"
        )
