"""Axolotl's ``datasets:`` entries of local files, answered in lmtune's names (``here: data: ...,
field_map: ...``): lmtune reads files named by ``--data`` with one ``--field-map``, where Axolotl
lists entries with a loader, files and field names each."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmtune.errors import one_line


def separator(style: Callable[[str], str]) -> str:
    """What comes between a name and its value where ``style`` writes names: a flag takes its value
    after a space, a YAML key after a colon."""
    return " " if style("x").startswith("-") else ": "


# The datasets library's loaders an Axolotl entry names as its path, with its data_files.
_LOADERS = frozenset({"json", "csv", "parquet", "text", "arrow"})
# Axolotl's names of a data set entry's fields, by lmtune's --field-map names.
_AXOLOTL_FIELDS = {
    "field_messages": "messages", "message_field_role": "role", "message_field_content": "content",
    "field_instruction": "instruction", "field_input": "input", "field_output": "output",
    "field_prompt": "prompt", "field_chosen": "chosen", "field_rejected": "rejected",
}  # fmt: skip


def datasets_here(name: str, value: Any, style: Callable[[str], str]) -> str:
    """For Axolotl's ``datasets:`` (``test_datasets:``) list of local files: the data (eval data)
    and field map that read them; "" where one line cannot say it."""
    setting = {"datasets": "data", "test_datasets": "eval_data"}.get(name)
    if setting is None or not isinstance(value, list) or not value:
        return ""
    files, maps = [], []
    for entry in value:
        read = _axolotl_entry(entry) if isinstance(entry, dict) else None
        if read is None:
            return ""
        files += read[0]
        maps.append(read[1])
    if any(m != maps[0] for m in maps):  # one --field-map reads every file: said per file, it misleads
        return ""
    sep = separator(style)
    line = f"{style(setting)}{sep}{one_line(','.join(files), 300)}"
    renamed = ",".join(f"{ours}={theirs}" for ours, theirs in maps[0] if ours != theirs)
    return f"; here: {line}" + (f", {style('field_map')}{sep}{one_line(renamed, 300)}" if renamed else "")


def _axolotl_entry(entry: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]]] | None:
    """One ``datasets:`` entry's files and field map pairs (None: not local files said plainly):
    ``path: FILE``, or ``path: json`` (a datasets loader) with ``data_files``; its field names
    (``field_messages``, ..., ``message_property_mappings``) and ``roles``."""
    path, data_files = entry.get("path"), entry.get("data_files")
    if isinstance(data_files, str):
        data_files = [data_files]
    if isinstance(path, str) and path.lower() in _LOADERS:
        if not (isinstance(data_files, list) and data_files and all(isinstance(f, str) for f in data_files)):
            return None
        files = data_files
    elif isinstance(path, str) and data_files is None:
        files = [path]
    else:
        return None
    pairs = [(ours, entry[theirs]) for theirs, ours in _AXOLOTL_FIELDS.items() if theirs in entry]
    mapped = entry.get("message_property_mappings")
    if isinstance(mapped, dict):
        pairs += [(ours, mapped[ours]) for ours in ("role", "content") if ours in mapped]
    roles = entry.get("roles")
    if isinstance(roles, dict):
        for ours, theirs in roles.items():
            pairs += [(str(ours), t) for t in (theirs if isinstance(theirs, list) else [theirs])]
    if not all(isinstance(v, str) and v.strip() for _, v in pairs):
        return None
    return files, pairs
