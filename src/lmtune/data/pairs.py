"""Preference pairs: a prompt and two answers to it, chosen and rejected, as tokens that share the
prompt.

A record holds ``prompt``, ``chosen`` and ``rejected`` as strings, or as lists of messages (TRL's
conversational form: the prompt's messages, then each answer's assistant turn or turns; without a
``prompt`` the messages both answers start with are the prompt; of two whole texts, the text both
start with, as TRL's extract_prompt takes it). Strings are tokenized as
prompt_completion examples are, with the tokenizer's special tokens and an EOS after each answer;
messages are rendered with the chat template, the prompt with its generation prompt, so each answer
ends with the template's end of turn.

Prompt and answer are tokenized together, as TRL does, and the answer starts where the tokens of the
prompt alone and of the prompt with that answer first differ: a token that merges across the
boundary belongs to the answer, and both answers see the same prompt tokens. Only answer tokens
train. A pair is stored as its prompt, chosen and rejected tokens back to back, with the prompt's
and the chosen answer's lengths (:class:`lmtune.data.dataset.TokenizedDataset`).

Truncation (``right`` and ``left`` alike): a pair fits when its prompt and its longer answer fit
``max_length``; otherwise the prompt is cut from the left to at most what leaves the longer answer
room, but never below half of ``max_length``, and the answers are cut from the right to the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmtune.data.field_hints import suggested_pair_field, unread_pair_prompt
from lmtune.data.formats import FieldMap, chat_text, field_kind, messages_field
from lmtune.data.sources import BadLines, Record, first_places, in_parentheses, skipped_lines
from lmtune.errors import UserError

PAIR_FIELDS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class PairTexts:
    """A pair as three texts: the prompt alone, and the prompt followed by each answer."""

    prompt: str
    chosen: str
    rejected: str
    add_special_tokens: bool  # the tokenizer's BOS and the like (chat templates write their own)
    append_eos: bool  # an EOS ends each answer (chat templates end their own turns)
    format: str  # preference | preference_messages


@dataclass(frozen=True)
class PairTokens:
    """A tokenized pair; the prompt's tokens are shared by both answers."""

    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


def is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, Mapping) for m in value)


def _text(record: Record, name: str, names: FieldMap) -> str:
    value = record.fields.get(name)
    if not isinstance(value, str):
        problem = field_kind(record, name)
        kinds = (
            '; it takes text, or a list of messages ({"role": ..., "content": ...})'
            if isinstance(value, list)
            else ""
        )
        raise UserError(
            f"{record.where}: preference record has {problem} '{names.name(name)}' field "
            f"(fields found: {names.found(record.fields)}){kinds}"
        )
    return value


def _answer_messages(record: Record, name: str, names: FieldMap) -> list[dict[str, str]]:
    """An answer given as messages, or as a string (one assistant turn)."""
    if isinstance(record.fields.get(name), str):
        return [{"role": "assistant", "content": record.fields[name]}]
    return messages_field(record, name, names)


def _no_prompt(chosen: list[dict[str, str]], rejected: list[dict[str, str]]) -> str:
    """Why two answers given as whole conversations leave no prompt and two answers after it."""
    if chosen == rejected:
        return "its chosen and rejected messages are the same"
    for name, short, other in (("chosen", chosen, rejected), ("rejected", rejected, chosen)):
        if short == other[: len(short)]:
            return (
                f"its {name} messages are turns the other answer starts with: {name} has no answer after them"
            )
    return "its chosen and rejected messages share no leading turn to take as one"


def conversation(
    record: Record, names: FieldMap
) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]:
    """(prompt, chosen, rejected) messages; without a prompt, or with a text one beside whole
    conversations, the turns both answers start with; a text prompt before answers that share no
    turn is one user turn. The record's fields are under lmtune's names; ``names`` names the
    messages' own fields and roles."""
    chosen, rejected = _answer_messages(record, "chosen", names), _answer_messages(record, "rejected", names)
    text = record.fields.get("prompt")
    if "prompt" in record.fields and not isinstance(text, str):
        prompt = messages_field(record, "prompt", names)
    else:
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if shared:  # as TRL's maybe_extract_prompt: whole conversations' shared turns are the prompt
            prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        elif isinstance(text, str):  # a question as text, answers as assistant turns
            prompt = [{"role": "user", "content": text}]
        else:
            raise UserError(
                f"{record.where}: preference record has no 'prompt', and {_no_prompt(chosen, rejected)}"
            )
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        _check_answer(record, names.name(name), answer, prompt)
    return prompt, chosen, rejected


def _check_answer(
    record: Record, shown: str, answer: list[dict[str, str]], prompt: list[dict[str, str]]
) -> None:
    """An answer is the model's: it starts and ends with an assistant turn. A user turn there would
    train the model to write the user's part (TRL renders it as given)."""
    if prompt and answer[: len(prompt)] == prompt:
        # A conversion's slip: answers as whole conversations beside the prompt. Mapping the
        # user's role to the assistant's (the hint below) trained the prompt as the answer.
        n = len(prompt)
        raise UserError(
            f"{record.where}: the '{shown}' answer repeats the prompt's {n} turn{'s' if n != 1 else ''}; an "
            "answer holds only the reply after the prompt: remove them from both answers, or drop the "
            "prompt field (the turns both answers start with are then the prompt, as in TRL)"
        )
    for where, message in (("starts", answer[0]), ("ends", answer[-1])):
        if message["role"] != "assistant":
            raise UserError(
                f"{record.where}: the '{shown}' answer {where} with a {message['role']} turn; an answer is "
                "the assistant's reply (name another role assistant with --field-map assistant=ROLE)"
            )


def render_pair(record: Record, tokenizer: Any, names: FieldMap) -> PairTexts:
    """A preference record (fields under lmtune's names) as three texts (see the module docstring);
    ``names`` names its messages' role and content fields and roles."""
    for name in ("chosen", "rejected"):
        if name not in record.fields:
            raise UserError(
                f"{record.where}: preference record has no '{names.name(name)}' field (fields found: "
                f"{names.found(record.fields)}{suggested_pair_field(record.fields, name)})"
            )
    # Messages in the prompt or either answer: a conversation (a text prompt beside whole
    # conversations, as UltraFeedback's, is what their shared turns say: conversation()).
    prompt = record.fields.get("prompt")
    if is_messages(prompt) or (
        (prompt is None or isinstance(prompt, str))
        and any(is_messages(record.fields[n]) for n in ("chosen", "rejected"))
    ):
        turns, chosen, rejected = conversation(record, names)
        return PairTexts(
            prompt=chat_text(tokenizer, turns, generation_prompt=True),
            chosen=chat_text(tokenizer, turns + chosen, generation_prompt=False),
            rejected=chat_text(tokenizer, turns + rejected, generation_prompt=False),
            add_special_tokens=False,
            append_eos=False,
            format="preference_messages",
        )
    if is_messages(record.fields["chosen"]) or is_messages(record.fields["rejected"]):
        raise UserError(
            f"{record.where}: 'prompt' must be text or a list of messages when the answers are messages"
        )
    if "prompt" in record.fields:
        question = _text(record, "prompt", names)
        answers = _text(record, "chosen", names), _text(record, "rejected", names)
    else:
        question, chosen_text, rejected_text = _implicit_prompt(record, names)
        answers = chosen_text, rejected_text
    return PairTexts(
        prompt=question,
        chosen=question + answers[0],
        rejected=question + answers[1],
        add_special_tokens=True,
        append_eos=True,
        format="preference",
    )


_HH_TURN = "\n\nAssistant:"  # Anthropic HH's marker of an assistant turn


def _implicit_prompt(record: Record, names: FieldMap) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) of a pair given as two whole texts (Anthropic HH's form): the
    text both start with is the prompt, up to HH's last assistant marker in it, else less a space
    it ends with, as TRL's extract_prompt takes it, but not inside a word. Not beside a field that
    looks like the prompt under another name: the answers' shared start ("The answer is") would
    have trained as the prompt, that field unread, without a word."""
    other = unread_pair_prompt(record.fields)
    if other is not None:
        raise UserError(
            f"{record.where}: preference record has no '{names.name('prompt')}' field but a {other!r} one, "
            f"which would not be read (the prompt would be what chosen and rejected start with); give "
            f"--field-map prompt={other}"
        )
    whole = _text(record, "chosen", names), _text(record, "rejected", names)
    n = 0
    while n < min(map(len, whole)) and whole[0][n] == whole[1][n]:
        n += 1
    turn = whole[0].rfind(_HH_TURN, 0, n)
    if turn >= 0:  # HH's answers start after its last assistant marker: "...Assistant: blue" / "big"
        n = turn + len(_HH_TURN)
    elif n >= min(map(len, whole)):  # "hello" and "hello there": either may be the prompt's end
        raise UserError(
            f"{record.where}: preference record has no '{names.name('prompt')}' field, and one of its "
            "chosen and rejected texts is the other's beginning, so where the answers start cannot be "
            "told; give the prompt as its own field (--skip-bad-lines passes over such records)"
        )
    elif not whole[0][n - 1 : n].isspace() and not (whole[0][n].isspace() and whole[1][n].isspace()):
        n = max(whole[0].rfind(c, 0, n) for c in " \n\t") + 1  # not inside a word: "blue" / "big"
    n -= n > 0 and whole[0][n - 1] == " "
    if n == 0:
        raise UserError(
            f"{record.where}: preference record has no '{names.name('prompt')}' field, and its chosen and "
            "rejected texts share no beginning to take as one"
        )
    return whole[0][:n], whole[0][n:], whole[1][n:]


def _shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def split_pair(prompt: np.ndarray, chosen: np.ndarray, rejected: np.ndarray) -> PairTokens:
    """The pair's tokens from the tokens of its three texts: the prompt is where both full texts
    still agree with the prompt alone."""
    shared = min(_shared_prefix(prompt, chosen), _shared_prefix(prompt, rejected))
    return PairTokens(chosen[:shared], chosen[shared:], rejected[shared:])


@dataclass(frozen=True)
class Cut:
    """What truncation did to a pair (None: it is dropped)."""

    pair: PairTokens
    prompt_cut: bool
    answers_cut: bool


def fit_pair(pair: PairTokens, max_length: int) -> Cut:
    """The pair cut to ``max_length`` per sequence: the prompt from the left (keeping at least half
    of ``max_length`` when it is that long), the answers from the right."""
    p, longer = len(pair.prompt), max(len(pair.chosen), len(pair.rejected))
    keep = min(p, max(max_length - longer, max_length // 2))
    room = max_length - keep
    cut = PairTokens(pair.prompt[p - keep :], pair.chosen[:room], pair.rejected[:room])
    return Cut(cut, prompt_cut=keep < p, answers_cut=longer > room)


def answer_targets(pair: PairTokens) -> tuple[int, int]:
    """Each answer's trained positions after the causal shift: all its tokens, but for the first
    when no prompt token precedes it."""
    first = 0 if len(pair.prompt) else 1
    return max(len(pair.chosen) - first, 0), max(len(pair.rejected) - first, 0)


def tokenize_pairs(texts: list[PairTexts], tokenizer: Any) -> list[PairTokens]:
    """Tokenize every pair's three texts (the Rust tokenizer, a batch per kind of texts)."""
    backend = tokenizer.backend_tokenizer
    eos = tokenizer.eos_token_id
    out: list[PairTokens | None] = [None] * len(texts)
    for special in (True, False):
        idx = [i for i, t in enumerate(texts) if t.add_special_tokens == special]
        if not idx:
            continue
        flat = [s for i in idx for s in (texts[i].prompt, texts[i].chosen, texts[i].rejected)]
        encoded = backend.encode_batch(flat, add_special_tokens=special)
        for k, i in enumerate(idx):
            prompt, chosen, rejected = (np.asarray(e.ids, dtype=np.int32) for e in encoded[3 * k : 3 * k + 3])
            if texts[i].append_eos:
                chosen, rejected = (_with_eos(a, eos) for a in (chosen, rejected))
            out[i] = split_pair(prompt, chosen, rejected)
    return [p for p in out if p is not None]


def _with_eos(ids: np.ndarray, eos: int) -> np.ndarray:
    return ids if len(ids) and ids[-1] == eos else np.append(ids, np.int32(eos))


def rendered_pairs(
    chunk: list[Record], tokenizer: Any, bad: BadLines, names: FieldMap
) -> tuple[list[Record], list[PairTexts]]:
    """The records of ``chunk`` that render as pairs, and their texts; the others go to ``bad``."""
    records, texts = [], []
    for record in chunk:
        try:
            texts.append(render_pair(record, tokenizer, names))
        except UserError as e:
            bad.report(str(e))
            continue
        records.append(record)
    return records, texts


def answer_texts(record: Record, names: FieldMap) -> tuple[str, str]:
    """The answers' own text (of messages: their contents), to compare them."""
    fields = record.fields
    if is_messages(fields.get("prompt")) or ("prompt" not in fields and is_messages(fields.get("chosen"))):
        _, chosen, rejected = conversation(record, names)
        return "\n".join(m["content"] for m in chosen), "\n".join(m["content"] for m in rejected)
    return str(fields.get("chosen", "")), str(fields.get("rejected", ""))


def examples_noun(unit: str) -> str:
    """What the log calls the examples of an objective with this ``unit``: pairs, or examples."""
    return "pairs" if unit == "pairs" else "examples"


def counted_as(meta: dict[str, Any]) -> str:
    """What a tokenized data set's (its cache meta's) examples are called in the log."""
    return "pairs" if {"preference", "preference_messages"} & set(meta["formats"]) else "examples"


# What else the data line and the audit count of records trained without text they hold: (count's
# key, what is counted, what it holds, what it trains, what to do).
_UNREAD = (
    (
        "system_left_out",
        "conversation",
        "whose system turn the chat template does not write",
        "without it",
        "some templates, as Mistral v0.3's, write a system prompt only into a conversation that ends "
        "with a user turn; --chat-template FILE.jinja that writes it trains with it",
    ),
    (
        "unread_reasoning",
        "conversation",
        "whose last reply has its reasoning in a field of its own (reasoning_content, thinking) that "
        "lmtune does not render",
        "without it",
        "write the reasoning into the reply's content, as the template would show it: Qwen3's "
        "<think>...</think>",
    ),
    (
        "prompt_cut_away",
        "example",
        "whose prompt --truncation left cut away whole",
        "an answer to no question",
        "a larger --max-length keeps the prompt; --truncation drop leaves such examples out",
    ),
    (
        "unread_context",
        "record",
        "with a context (or an input) its format does not read",
        "without it",
        "an instruction record, as Dolly's, reads it as its input: --field-map input=context, with "
        "instruction and output, not prompt",
    ),
)


def unread_said(meta: dict[str, Any]) -> str:
    """What the data line and the audit say of records (their cache meta's counts) trained without
    text they hold: a system prompt in a field of its own, a prompt --truncation left cut away,
    Dolly's context ("" when none)."""
    where, formats = meta.get("where", {}), set(meta.get("formats", ()))
    said = []
    if count := meta.get("unread_system", 0):
        one = count == 1
        if counted_as({"formats": formats}) == "pairs":
            kind, fix = (
                "preference",
                f"write {'it' if one else 'them'} as a prompt of messages, a system turn then the user's",
            )
        elif formats <= {"messages", "sharegpt"}:
            kind, fix = "conversation", "put it in the conversation as its first turn, of role system"
        else:
            kind = (
                "prompt/completion or instruction" if formats <= {"prompt_completion"} else "single-example"
            )
            fix = f"write {'it' if one else 'them'} as messages with a system turn"
        said.append(
            f"{count:,} {kind} record{'' if one else 's'} with a 'system' field"
            f"{in_parentheses(first_places(where, 'unread_system', count))}, which that format does not "
            f"render: {'it trains' if one else 'they train'} without it ({fix})"
        )
    for key, noun, what, trains, fix in _UNREAD:
        if count := meta.get(key, 0):
            one, places = count == 1, in_parentheses(first_places(where, key, count))
            said.append(
                f"{count:,} {noun}{'' if one else 's'} {what}{places}: "
                f"{'it trains' if one else 'they train'} {trains} ({fix})"
            )
    return "; ".join(said)


def pair_counts(meta: dict[str, Any]) -> str:
    """What truncation did to preference pairs, and how many have the same answer twice or an empty
    one, for the data line of the log; of single examples, how many have an empty answer."""
    if counted_as(meta) != "pairs":
        blank, unread = meta.get("empty_answers", 0), unread_said(meta)
        return (
            f"; {blank:,} with an empty or blank answer"
            f"{in_parentheses(first_places(meta.get('where', {}), 'empty_answer', blank))}: only the stop "
            "(after any blank space) trains, so the model learns to say nothing (most often a data error)"
            if blank
            else ""
        ) + (f"; {unread}" if unread else "")
    cut = (
        f" (pairs: {meta.get('prompts_truncated', 0)} prompts cut from the left, "
        f"{meta.get('answers_truncated', 0)} with answers cut from the right)"
    )
    same, empty = meta.get("identical_pairs", 0), meta.get("empty_answer_pairs", 0)
    unread = unread_said(meta)
    return (
        (cut if meta.get("truncated") else "")
        + (f"; {same:,} with the same answer as chosen and rejected (no preference to learn)" if same else "")
        + (f"; {empty:,} with an empty answer (most often a data error)" if empty else "")
        + ("; lmtune data audit lists them" if same or empty else "")
        + (f"; {unread}" if unread else "")
    )


def counted(n: int, meta: dict[str, Any]) -> str:
    """``1 example``, ``250 examples``, ``3 pairs``: ``n`` of what ``meta``'s data set holds."""
    noun = counted_as(meta)
    return f"{n:,} {noun if n != 1 else noun.removesuffix('s')}"


def data_line(named: str, meta: dict[str, Any], how: str, files: list[str] | None = None) -> str:
    """The log's line for a tokenized data set (its cache ``meta``), ``named`` as the run gives it,
    with the ``files`` a folder or a glob of it read."""
    where = meta.get("where", {})
    shown = (
        ", ".join(files[:4]) + (f" and {len(files) - 4:,} more" if len(files) > 4 else "") if files else ""
    )
    return (
        f"{named}{f' ({len(files):,} files: {shown})' if files else ''}: {counted(meta['examples'], meta)}, "
        f"{meta['tokens']:,} tokens ({how}); "
        + _split_part(meta)
        + f"{meta['truncated']} truncated, {meta['dropped_too_long']} dropped as too long"
        f"{in_parentheses(first_places(where, 'too_long', meta['dropped_too_long']))}, "
        f"{meta['dropped_no_targets']} dropped with no trainable tokens"
        f"{in_parentheses(first_places(where, 'no_targets', meta['dropped_no_targets']))}"
        + (f", {skipped_lines(meta['bad_lines'])}" if meta["bad_lines"] else "")
        + pair_counts(meta)
    )


def _split_part(meta: dict[str, Any]) -> str:
    """``2 documents split into 9 pieces of --max-length, `` (--truncation split), or ""."""
    split = meta.get("documents_split", 0)
    pieces = split + meta.get("pieces_added", 0)
    return (
        f"{split:,} document{'s' if split != 1 else ''} split into {pieces:,} pieces of --max-length, "
        if split
        else ""
    )
