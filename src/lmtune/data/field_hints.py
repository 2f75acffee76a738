"""The --field-map that would read a record of other names: other data sets' names for lmtune's
fields, lmtune's own misspelled or in other case, a list of turns under another key."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmtune.data.sources import Record
from lmtune.errors import UserError, one_line

# Other data sets' names for a prompt and its completion, to suggest a --field-map.
PROMPT_NAMES = ("question", "query", "input", "prompt_text", "problem", "source")
# ... and for what an instruction is about (its input).
INPUT_NAMES = ("context", "passage", "document")
COMPLETION_NAMES = ("answer", "response", "output", "target", "completion_text", "solution", "reply")


def unknown_format(record: Record, found: str, expected: str) -> UserError:
    """A record of no format: the --field-map that would read it, or where its records are (a JSON
    object holding them in a list under one key, as load_dataset's ``field="data"`` reads)."""
    lists = [n for n, v in record.fields.items() if _records(v) and not _turn_list(v)]
    if len(lists) == 1 and not any(isinstance(v, list) for n, v in record.fields.items() if n != lists[0]):
        key = lists[0]  # {"rows": [...], "version": 1}: one list of records, the rest its metadata
        return UserError(
            f"{record.where}: the records sit in the list under {key!r} (the layout load_dataset reads "
            f"with field={key!r}); lmtune reads a JSON list of records, or one record a line: give the "
            f"list itself (such as jq -c '.{key}[]' FILE > FILE.jsonl)"
        )
    if _run_metrics(record):  # a glob over a run's folder (DIR/*.jsonl) read its metrics as data
        return UserError(
            f"{record.where}: the metrics an lmtune run wrote beside its run.json, not data; leave it out "
            "of the data given (a run's output folder is best kept apart from its data)"
        )
    return UserError(
        f"{record.where}: cannot tell the format (fields found: {found}; expected: {expected}; name other "
        f"fields with --field-map OURS=THEIRS{suggested_map(record)})"
    )


def _run_metrics(record: Record) -> bool:
    path = Path(record.source)
    return path.name == "metrics.jsonl" and (path.parent / "run.json").is_file() and "kind" in record.fields


def _records(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) for m in value)


def suggested_map(record: Record) -> str:
    """``, such as prompt=question,completion=answer`` where the record has such fields: another
    tool's names, lmtune's own misspelled or in other case (promt, Prompt), or a list of turns
    under another name (dialog)."""
    fields = record.fields
    ours = ("text", "prompt", "completion", "instruction", "output", "messages")
    suggested: dict[str, str] = {}
    for name in fields:
        close = difflib.get_close_matches(name.lower(), ours, n=1, cutoff=0.8)
        if name not in ours and close and close[0] not in fields:
            suggested.setdefault(close[0], name)
    completion = next((n for n in COMPLETION_NAMES if isinstance(fields.get(n), str)), None)
    if completion is not None and isinstance(fields.get("instruction"), str):  # lmtune's output
        suggested.setdefault("output", completion)
        passage = next((n for n in INPUT_NAMES if isinstance(fields.get(n), str)), None)
        if passage is not None and "input" not in fields:  # Dolly's context: the instruction is about it
            suggested.setdefault("input", passage)
    elif completion is not None:
        prompt = next((n for n in ("prompt", *PROMPT_NAMES) if isinstance(fields.get(n), str)), None)
        if prompt is not None:
            if prompt != "prompt":
                suggested.setdefault("prompt", prompt)
            suggested.setdefault("completion", completion)
    turns = next(
        (n for n, v in fields.items() if _turn_list(v) and n not in ("messages", "conversations")), None
    )
    if turns is not None and "messages" not in fields:
        suggested.setdefault("messages", turns)
    return ", such as " + ",".join(f"{k}={v}" for k, v in suggested.items()) if suggested else ""


def _turn_list(value: Any) -> bool:
    """A list of chat turns: objects with a role or a speaker (records under another key are not)."""
    return _records(value) and all({"role", "from", "content", "value"} & set(m) for m in value)


# Other preference data sets' names for the prompt (Axolotl's chatml.intel: question; Alpaca-like
# pairs: instruction). "source" is left out: such sets use it for where a pair came from.
PAIR_PROMPT_NAMES = ("question", "query", "instruction", "input", "problem", "prompt_text")


def unread_pair_prompt(fields: Mapping[str, Any]) -> str | None:
    """A text field of a pair without a ``prompt`` that another data set names its prompt so
    (``question``; ``instruction`` before ``input``), or ``prompt`` misspelled or in other case:
    it would not be read."""
    answers = ("chosen", "rejected")
    texts = {n.lower(): n for n, v in fields.items() if isinstance(v, str) and n not in answers}
    named = next((texts[n] for n in PAIR_PROMPT_NAMES if n in texts), None)
    close = difflib.get_close_matches("prompt", list(texts), n=1, cutoff=0.8)
    return named or (texts[close[0]] if close else None)


def suggested_pair_field(fields: Mapping[str, Any], missing: str) -> str:
    """``; --field-map rejected=rejectd`` where a field of the pair is ``missing`` (lmtune's name)
    and another is that name misspelled or in other case, else ""."""
    others = {n.lower(): n for n in fields if n not in ("prompt", "chosen", "rejected")}
    close = difflib.get_close_matches(missing, list(others), n=1, cutoff=0.75)
    return f"; such as --field-map {missing}={others[close[0]]}" if close else ""


# Other data sets' role names, by lmtune's role (matched in lower case, as are lmtune's own).
OTHER_ROLES = {
    "human": "user", "prompter": "user", "customer": "user", "question": "user",
    "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant", "chatbot": "assistant",
    "answer": "assistant", "sys": "system", "function": "tool", "ipython": "tool",
}  # fmt: skip


def suggested_roles(turns: list[Any], role_key: str, known: Mapping[str, str]) -> str:
    """The --field-map entries that read every role of a conversation's ``turns`` not in ``known``
    (``user=User,assistant=Assistant``: all at once, not one per run), lmtune's role told by its
    name in any case or another tool's; ``ROLE=VALUE`` where none is known (a guess could train
    the user's turns as the assistant's)."""
    values = [t[role_key] for t in turns if isinstance(t, Mapping) and isinstance(t.get(role_key), str)]
    unknown = list(dict.fromkeys(v for v in values if v not in known))[:8]
    return ",".join(f"{_role_named(v, known)}={one_line(v, 40)}" for v in unknown) or "ROLE=VALUE"


def _role_named(value: str, known: Mapping[str, str]) -> str:
    lower = value.strip().lower()
    return known.get(lower) or OTHER_ROLES.get(lower, "ROLE")
