"""Example formats, and how each renders to text with the character spans that are trained.

Masking is decided here, on the rendered text: a token later trains exactly when it starts inside
one of the trainable spans. No token ids are searched for, so the mask does not depend on how a
tokenizer happens to encode a role marker.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from lmtune.config.groups import ExampleSettings
from lmtune.data.chat import check_chat_template, render_chat
from lmtune.data.chat_spans import conversation_spans
from lmtune.data.field_hints import suggested_roles, unknown_format
from lmtune.data.sources import Record
from lmtune.data.turn_checks import refuse_undesired, text_content, turn_trains
from lmtune.errors import SettingError, UserError, brief

ROLES = ("system", "user", "assistant", "tool")
# The chat formats: rendered with the chat template, trained on the assistant turns.
CHAT_FORMATS = ("messages", "sharegpt", "preference_messages")
# lmtune's names for a record's fields, which --field-map may call otherwise in a data set.
FIELDS = (
    "text",
    "prompt",
    "completion",
    "instruction",
    "input",
    "output",
    "messages",
    "chosen",
    "rejected",
    "role",
    "content",
)
# The fields inside each turn of a chat (the others are the record's own).
TURN_FIELDS = ("role", "content")
# ShareGPT: the turns are "conversations" of {"from", "value"}, with roles human, gpt and system.
SHAREGPT_TURNS = {"messages": "conversations", "role": "from", "content": "value"}
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}
# ShareGPT's field names for lmtune's (its roles map by SHAREGPT_ROLES).
SHAREGPT_NAMES = {theirs: ours for ours, theirs in SHAREGPT_TURNS.items()} | SHAREGPT_ROLES


@dataclass(frozen=True)
class FieldMap:
    """A data set's names for lmtune's fields and roles (``--field-map``, ``--text-field``)."""

    fields: Mapping[str, str]  # lmtune's name -> the data set's: {"messages": "dialog"}
    roles: Mapping[str, str]  # the data set's role -> lmtune's: {"bot": "assistant"}

    @staticmethod
    def of(settings: ExampleSettings) -> FieldMap:
        """The mapping the settings give.

        Raises:
            UserError: naming --field-map, for a pair that is not OURS=THEIRS or names no field or role.
        """
        fields = {"text": settings.text_field} if settings.text_field != "text" else {}
        roles: dict[str, str] = {}
        for pair in (settings.field_map or "").split(","):
            if not pair.strip():
                continue
            ours, sep, theirs = (part.strip() for part in pair.partition("="))
            if not sep or not ours or not theirs:
                raise SettingError(
                    "field_map", "--field-map", f"expected OURS=THEIRS pairs, got {pair.strip()!r}"
                )
            if ours in ROLES:
                roles[theirs] = ours
            elif ours in SHAREGPT_NAMES:
                raise SettingError(
                    "field_map",
                    "--field-map",
                    f"lmtune's names go on the left; {ours!r} is ShareGPT's name for lmtune's "
                    f"{SHAREGPT_NAMES[ours]!r}: give {SHAREGPT_NAMES[ours]}={theirs}",
                )
            elif ours not in FIELDS:
                close = difflib.get_close_matches(ours.lower(), [*FIELDS, *ROLES], n=1, cutoff=0.75)
                raise SettingError(
                    "field_map",
                    "--field-map",
                    f"{ours!r} is none of lmtune's fields ({', '.join(FIELDS)}) or roles "
                    f"({', '.join(ROLES)})" + (f"; did you mean {close[0]}={theirs}?" if close else ""),
                )
            elif ours == "text" and fields.get("text", theirs) != theirs:
                raise UserError(f"--field-map text={theirs} and --text-field {settings.text_field} differ")
            else:
                fields[ours] = theirs
        return FieldMap(fields=fields, roles=roles)

    def name(self, ours: str) -> str:
        """The data set's name for lmtune's field ``ours``."""
        return self.fields.get(ours, ours)

    def found(self, fields: Mapping[str, Any]) -> str:
        """A record's fields (under lmtune's names) as its data set names them, for a message."""
        return ", ".join(repr(self.name(k)) for k in fields) or "none"

    def record(self, record: Record) -> Record:
        """``record`` with its fields under lmtune's names."""
        return replace(record, fields=self.apply(record.fields))

    def apply(self, found: Mapping[str, Any]) -> dict[str, Any]:
        """A record's fields under lmtune's names (a renamed field leaves its old name)."""
        top = {ours: theirs for ours, theirs in self.fields.items() if ours not in TURN_FIELDS}
        renamed = {k: v for k, v in found.items() if k not in top.values()}
        renamed.update({ours: found[theirs] for ours, theirs in top.items() if theirs in found})
        return renamed


PLAIN_FIELDS = FieldMap(fields={}, roles={})

# The formats that read each of lmtune's fields.
_READ_BY: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "prompt": ("prompt_completion", "preference", "preference_messages"),
    "messages": ("messages", "sharegpt"),  # ShareGPT's turns are read through a mapped messages too
    "chosen": ("preference", "preference_messages"),
    "rejected": ("preference", "preference_messages"),
    **{name: ("prompt_completion",) for name in ("completion", "instruction", "input", "output")},
    **{name: CHAT_FORMATS for name in TURN_FIELDS},
}


def unused_names(settings: ExampleSettings, formats: Collection[str]) -> list[str]:
    """The ``--text-field`` and ``--field-map`` entries that no record of ``formats`` was read
    through, as the user gave them."""
    names = FieldMap.of(settings)
    unused = [
        f"--text-field {theirs}"
        if ours == "text" and theirs == settings.text_field
        else f"--field-map {ours}={theirs}"
        for ours, theirs in names.fields.items()
        if not set(_READ_BY[ours]) & set(formats)
    ]
    if names.roles and not set(CHAT_FORMATS) & set(formats):
        unused += [f"--field-map {ours}={theirs}" for theirs, ours in names.roles.items()]
    return unused


# The template for tokenizers that have none (and for the presets). Assistant turns end with EOS so
# the model learns to stop; the newline comes before a turn, so nothing trainable follows the EOS.
# The newline between turns is an expression: transformers renders with trim_blocks, which drops
# a newline written right after a block tag.
BUILTIN_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if not loop.first %}{{ '\\n' }}{% endif -%}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{%- if m['role'] == 'assistant' %}{{ eos_token }}{% endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{% if messages %}{{ '\\n' }}{% endif %}<|assistant|>\n{% endif -%}"
)


@dataclass(frozen=True)
class Rendered:
    """An example as text, the ``[start, end)`` character spans that train, and special tokens."""

    text: str
    spans: tuple[tuple[int, int], ...]
    add_special_tokens: bool  # the tokenizer's BOS and the like (chat templates write their own)
    append_eos: bool  # train an EOS after the text (chat templates end their own turns)
    format: str
    # A conversation's system prompt that its chat template does not write (Mistral v0.3's writes it
    # only into a conversation that ends with a user turn): it trains without it, to be said.
    system_left_out: bool = False


def detect_format(fields: Mapping[str, Any]) -> str | None:
    """The format a record's fields (under lmtune's names) say it has, or None."""
    if "chosen" in fields or "rejected" in fields:  # one without the other: a broken pair
        return "preference"
    if "messages" in fields:
        return "messages"
    if "conversations" in fields:
        return "sharegpt"
    if ("prompt" in fields and "completion" in fields) or ("instruction" in fields and "output" in fields):
        return "prompt_completion"
    if "text" in fields:
        return "text"
    return None


def _expected(names: FieldMap) -> str:
    return (
        f"'{names.name('text')}' (text), '{names.name('prompt')}' + '{names.name('completion')}', "
        f"'instruction' + 'output' (+ 'input'), '{names.name('messages')}' (chat), 'conversations' "
        "(ShareGPT) or 'prompt' + 'chosen' + 'rejected' (preference)"
    )


def field_kind(record: Record, name: str) -> str:
    """What a field that should hold text holds instead, as "record has ... field" says it."""
    if name not in record.fields:
        return "no"
    value = record.fields[name]
    return "a null" if value is None else f"a non-string ({type(value).__name__})"


def _string(record: Record, name: str, names: FieldMap, allow_missing: bool = False) -> str:
    value = record.fields.get(name)
    if value is None and allow_missing:
        return ""
    if not isinstance(value, str):
        problem = field_kind(record, name)
        called = f" (--field-map {name}={names.fields[name]})" if name in names.fields else ""
        raise UserError(
            f"{record.where}: record has {problem} '{names.name(name)}' field{called} "
            f"(fields found: {names.found(record.fields)})"
        )
    return value


def render(
    record: Record, fmt: str, names: FieldMap, tokenizer: Any, *, train_on_prompt: bool = False
) -> Rendered:
    """Render one record in format ``fmt`` (``auto`` detects it from the fields, under the names
    ``names`` maps them to); with ``train_on_prompt`` all of it trains (the prompt, and chat's
    system and user turns too)."""
    record = names.record(record)
    chosen = detect_format(record.fields) if fmt == "auto" else fmt
    if chosen is None:
        raise unknown_format(record, names.found(record.fields), _expected(names))
    try:
        return _render_as(record, chosen, names, tokenizer, train_on_prompt)
    except UserError as e:  # a forced format's field missing, where the record is of another format
        detected = detect_format(record.fields) if fmt != "auto" else None
        if detected in (None, chosen, "preference"):
            raise
        raise UserError(f"{e}; it is a {detected} record, which --data-format auto reads as one") from None


def _render_as(
    record: Record, chosen: str, names: FieldMap, tokenizer: Any, train_on_prompt: bool
) -> Rendered:
    """:func:`render` of a record (its fields under lmtune's names) in format ``chosen``."""
    if chosen == "preference":
        raise UserError(
            f"{record.where}: a preference pair (prompt, chosen, rejected) is not a single example; "
            "tune on pairs with --objective dpo, ipo, simpo or orpo"
        )
    if chosen == "text":
        text = _string(record, "text", names)
        return Rendered(
            text=text, spans=((0, len(text)),), add_special_tokens=True, append_eos=True, format="text"
        )
    refuse_undesired(record, chosen)
    if chosen == "prompt_completion" and _conversational(record):
        turns, untrained = _prompt_and_answer(record, names, every_turn=train_on_prompt)
        return _render_messages(record, tokenizer, turns, "messages", untrained, every_turn=train_on_prompt)
    if chosen == "prompt_completion":
        if "prompt" in record.fields or "instruction" not in record.fields:
            prompt, completion = _string(record, "prompt", names), _string(record, "completion", names)
        else:
            instruction = _string(record, "instruction", names)
            extra = _string(record, "input", names, allow_missing=True)
            prompt = instruction + (f"\n\n{extra}" if extra else "") + "\n\n"
            completion = _string(record, "output", names)
        text = prompt + completion
        start = 0 if train_on_prompt else len(prompt)
        return Rendered(
            text=text,
            spans=((start, len(text)),),
            add_special_tokens=True,
            append_eos=True,
            format="prompt_completion",
        )
    turns, untrained = _conversation(record, chosen, names, every_turn=train_on_prompt)
    return _render_messages(record, tokenizer, turns, chosen, untrained, every_turn=train_on_prompt)


def _conversational(record: Record) -> bool:
    """A prompt/completion record of messages (TRL's conversational prompt-completion: a prompt of
    turns, a completion of the assistant's)."""
    return all(isinstance(record.fields.get(name), list) for name in ("prompt", "completion"))


def _prompt_and_answer(
    record: Record, names: FieldMap, every_turn: bool = False
) -> tuple[list[dict[str, str]], frozenset[int]]:
    """A conversational prompt/completion record's turns, the prompt's first, and those that do not
    train: the prompt's (as TRL's completion-only loss; every turn trains under ``every_turn``) and
    any its own flag keeps out."""
    prompt, kept = _conversation(record, "messages", names, "prompt", every_turn)
    answer, flagged = _conversation(record, "messages", names, "completion", every_turn)
    untrained = kept if every_turn else frozenset(range(len(prompt)))
    return prompt + answer, untrained | {len(prompt) + i for i in flagged}


def trained_content(record: Record, names: FieldMap) -> Any | None:
    """What a record's example trains on, comparable between records: its text and the spans that
    train, a chat's turns and which train, a pair's prompt and answers; not its other fields (an
    id). None for a record of no format (a bad line: it trains nothing)."""
    mapped = names.record(record)
    fmt = detect_format(mapped.fields)
    if fmt == "preference":  # its chat turns are checked where pairs are read
        return [mapped.fields.get(name) for name in ("prompt", "chosen", "rejected")]
    try:
        if fmt in ("messages", "sharegpt"):
            turns, untrained = _conversation(mapped, fmt, names)
            return [turns, sorted(untrained)]
        if fmt == "prompt_completion" and _conversational(mapped):
            turns, untrained = _prompt_and_answer(mapped, names)
            return [turns, sorted(untrained)]
        rendered = render(record, "auto", names, None)  # text or prompt/completion; no format raises
        return [rendered.text, rendered.spans]
    except UserError:
        return None


def _turns(record: Record, fmt: str, names: FieldMap, field: str = "messages") -> list[dict[str, str]]:
    """The turns in a record's list field ``field`` (lmtune's name) as ``{role, content}`` under
    lmtune's role names; their own role and content fields are named as ``names`` says (ShareGPT's
    ``from`` and ``value`` by default in ``sharegpt`` records)."""
    return _conversation(record, fmt, names, field)[0]


def _conversation(
    record: Record, fmt: str, names: FieldMap, field: str = "messages", every_turn: bool = False
) -> tuple[list[dict[str, str]], frozenset[int]]:
    """:func:`_turns`, with the turns that their own flag keeps from training (``every_turn``:
    --train-on-prompt, which trains the others, so that a user turn's flag may ask to train)."""
    plain = PLAIN_FIELDS.fields if fmt != "sharegpt" else SHAREGPT_TURNS
    if fmt == "sharegpt" and field == "messages" and "messages" not in names.fields:
        field = SHAREGPT_TURNS["messages"]
    role_key = names.fields.get("role", plain.get("role", "role"))
    content_key = names.fields.get("content", plain.get("content", "content"))
    shown = names.name(field)
    raw = record.fields.get(field)
    if raw is None:
        problem, found = field_kind(record, field), names.found(record.fields)
        raise UserError(f"{record.where}: record has {problem} '{shown}' field (fields found: {found})")
    if not isinstance(raw, list) or not raw:
        raise UserError(
            f"{record.where}: '{shown}' must be a non-empty list of {{{role_key}, {content_key}}} objects"
        )
    roles = {**SHAREGPT_ROLES, **{r: r for r in ROLES}, **names.roles}
    label = "message" if field in ("messages", SHAREGPT_TURNS["messages"]) else f"'{shown}' message"
    turns, untrained = [], set()
    for i, m in enumerate(raw):
        where = f"{label} {i + 1}"
        calls = next((k for k in ("tool_calls", "function_call") if isinstance(m, Mapping) and m.get(k)), "")
        if calls:  # a template would see only the text: the call trained as an empty reply
            alone = "its text alone, without the call" if m.get(content_key) else "an empty reply"
            raise UserError(
                f"{record.where}: {where} holds {calls}; lmtune trains on the text of each turn and has no "
                f"tool calling, so the call would not train (the turn would train as {alone}): leave "
                "such records out (--skip-bad-lines skips them)"
            )
        content = text_content(record, m.get(content_key), where) if isinstance(m, Mapping) else None
        if isinstance(m, Mapping) and role_key in m and content_key in m and m[content_key] is None:
            raise UserError(  # was "must be an object with a 'role' and a 'content'", which it has
                f"{record.where}: {where} has a null '{content_key}'; lmtune trains on each turn's text: "
                "give it a string, or leave such records out (--skip-bad-lines skips them)"
            )
        if content is None or role_key not in m:
            sharegpt = isinstance(m, Mapping) and {"from", "value"} <= set(m) and role_key != "from"
            hint = "; ShareGPT turns name them with --field-map role=from,content=value" if sharegpt else ""
            if isinstance(m, Mapping) and {"role", "content"} <= set(m) and role_key == "from":
                hint = (
                    f"; turns of role and content under '{shown}' are read with --field-map messages={shown}"
                )
            raise UserError(
                f"{record.where}: {where} must be an object with a '{role_key}' and a '{content_key}' "
                f"that is a string or a list of text parts{hint}"
            )
        role = roles.get(m[role_key]) if isinstance(m[role_key], str) else None
        if role is None:
            raise UserError(
                f"{record.where}: {label} {i + 1} has unknown role {brief(m[role_key])} (roles: "
                f"{', '.join(ROLES)}; ShareGPT's {', '.join(SHAREGPT_ROLES)}; name others with "
                f"--field-map ROLE=VALUE, such as {suggested_roles(raw, role_key, roles)})"
            )
        if not turn_trains(record, m, where, role, every_turn):
            untrained.add(i)
        turns.append({"role": role, "content": content})
    return turns, frozenset(untrained)


def messages_field(record: Record, name: str, names: FieldMap) -> list[dict[str, str]]:
    """The record's list of ``{role, content}`` messages in field ``name`` (lmtune's name), checked;
    their role and content fields and roles named as ``names`` says."""
    return _turns(record, "messages", names, name)


def chat_text(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    """The messages rendered by the tokenizer's chat template."""
    return render_chat(tokenizer, messages, generation_prompt)


def _render_messages(
    record: Record,
    tokenizer: Any,
    messages: list[dict[str, str]],
    fmt: str,
    untrained: frozenset[int],
    every_turn: bool = False,
) -> Rendered:
    """Render with the tokenizer's chat template; each assistant turn's own text is trainable
    (``every_turn``: all of the text), less the turns in ``untrained`` (:func:`conversation_spans`)."""
    try:
        text = chat_text(tokenizer, messages, generation_prompt=False)
        spans = conversation_spans(tokenizer, messages, text, untrained, every_turn)
    except UserError as e:
        raise UserError(f"{record.where}: {e}") from None
    left_out = _system_left_out(tokenizer, messages, text)
    return Rendered(
        text, tuple(spans), add_special_tokens=False, append_eos=False, format=fmt, system_left_out=left_out
    )


def _system_left_out(tokenizer: Any, messages: list[dict[str, str]], text: str) -> bool:
    """Whether the template leaves a system turn's text out of ``text`` (``messages`` rendered).
    Where its words are there as often as the turns hold them, they are written; where fewer
    times, the copy there may be another turn's (a user's that repeats them), so the conversation
    is rendered again with a word of no one's in their place (only then: most conversations hold
    their system prompt once)."""
    system = [m["content"].strip() for m in messages if m["role"] == "system" and m["content"].strip()]
    if any(words not in text for words in system):
        return True
    if all(text.count(words) >= sum(m["content"].count(words) for m in messages) for words in system):
        return False
    probe = [{**m, "content": _SYSTEM_PROBE} if m["role"] == "system" else m for m in messages]
    return _SYSTEM_PROBE not in chat_text(tokenizer, probe, generation_prompt=False)


_SYSTEM_PROBE = "lmtune0system0probe"


def chat_prompt(record: Record, tokenizer: Any) -> tuple[str, str]:
    """A conversation's last turn before the reply, and the conversation rendered up to the
    assistant's reply. A conversation that ends in replies (a line of training data) is taken up to
    them: the model writes its own, not a turn after the one it was given."""
    ensure_chat_template(tokenizer)
    messages = _turns(record, "messages", PLAIN_FIELDS)
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise UserError(f"{record.where}: the conversation has no turn before the assistant's reply")
    try:
        return messages[-1]["content"], chat_text(tokenizer, messages, generation_prompt=True)
    except UserError as e:
        raise UserError(f"{record.where}: {e}") from None


def builtin_template_note(tokenizer: Any, loaded_with: str | None) -> str | None:
    """What the log says where the tokenizer had no chat template as loaded (``loaded_with``) and
    conversations are rendered with the built-in one (:func:`ensure_chat_template`), or None. A
    model lmtune saved has the built-in one as its own."""
    if loaded_with or getattr(tokenizer, "chat_template", None) != BUILTIN_CHAT_TEMPLATE:
        return None
    from lmtune.data.chat import TEMPLATES

    return (
        "chat data: the tokenizer has no chat template, so lmtune's built-in one renders the "
        "conversations (<|role|> lines, each turn ending in EOS) and is saved with the model; "
        f"--chat-template {'|'.join(TEMPLATES)} or a .jinja file chooses another"
    )


def ensure_chat_template(tokenizer: Any) -> None:
    """Give a tokenizer without a chat template the built-in one (saved with the model)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = BUILTIN_CHAT_TEMPLATE
    check_chat_template(tokenizer, known=(BUILTIN_CHAT_TEMPLATE,))
