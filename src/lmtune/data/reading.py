"""Read JSONL / NDJSON records, with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from lmtune.errors import UserError


def read_jsonl_texts(path: str, text_field: str) -> list[str]:
    """Return the ``text_field`` string of every record in a JSONL file.

    Blank lines are skipped. Malformed JSON, invalid UTF-8, a record that is not an object, or a
    missing or non-string field is a :class:`UserError` naming ``path:line``.
    """
    texts = [text for _, text in _iter_field(Path(path), text_field)]
    if not texts:
        raise UserError(f"{path}: no records (the file is empty or only blank lines)")
    return texts


def _iter_field(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(
                    f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
            if not isinstance(record, dict):
                raise UserError(
                    f"{path}:{lineno}: expected a JSON object with a '{text_field}' field, "
                    f"got {type(record).__name__}"
                )
            value = record.get(text_field)
            if not isinstance(value, str):
                found = ", ".join(repr(k) for k in record) or "none"
                problem = "has no" if value is None else f"has a non-string ({type(value).__name__})"
                raise UserError(
                    f"{path}:{lineno}: record {problem} '{text_field}' field (fields found: "
                    f"{found}; expected: '{text_field}', set another with --text-field)"
                )
            yield lineno, value
