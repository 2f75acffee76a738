"""The sources of a data mixture as the settings name them: ``--data NAME=PATH,...`` and
``--data-weights W,...``. Pure string checks (nothing is read from disk); lmtune.data.mixture
turns them into the order of the examples."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import PurePath

from lmtune.errors import SettingError, UserError, brief

# NAME=PATH: a name is letters, digits, '_', '.', '-' (so a path like ./a=b.jsonl stays a path).
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_NAMED = re.compile(rf"({_NAME.pattern})=(.+)")


def named_items(spec: str) -> list[tuple[str, str]]:
    """The comma-separated items of a --data or --eval-data value, as (name, item): an item's name
    is given as ``NAME=ITEM``, else it is the item's file stem (``chat`` for ``data/chat.jsonl``).
    A comma inside a path is written ``\\,`` (a YAML list of paths is joined so: :func:`joined`)."""
    return [(name or item_name(item), item) for name, item in _split(spec) if item]


def _split(spec: str) -> list[tuple[str | None, str]]:
    """Each item of ``spec`` as (the name given as ``NAME=``, or None; the item), empty ones kept."""
    items: list[tuple[str | None, str]] = []
    for raw in (s.strip().replace("\\,", ",") for s in re.split(r"(?<!\\),", spec)):
        named = _NAMED.fullmatch(raw)
        items.append((named.group(1), named.group(2).strip()) if named else (None, raw))
    return items


def with_paths(spec: str, path: Callable[[str], str]) -> str:
    """``spec`` with each item's path as ``path`` gives it, its name and the commas in paths kept."""
    return joined(
        [f"{name}={path(item)}" if name else path(item) if item else item for name, item in _split(spec)]
    )


def item_name(item: str) -> str:
    """The name a source goes by when none is given: its file's stem."""
    return PurePath(item.rstrip("/")).stem or item


def shown_spec(spec: str) -> str:
    """``spec`` as a message shows it: one file's name as it is (a comma in it unescaped)."""
    items = named_items(spec)
    return items[0][1] if len(items) == 1 and items[0][1].replace(",", "\\,") == spec else spec


def source_names(spec: str, option: str) -> list[str]:
    """The names of ``spec``'s sources, each unique.

    Raises:
        UserError: naming ``option`` and the name given twice.
    """
    items = named_items(spec)
    names = [name for name, _ in items]
    for name, item in items:
        # A glob's or an odd file's stem: the metric names of a mixture's sources hold it.
        if len(items) > 1 and not _NAME.fullmatch(name):
            raise UserError(
                f"{option}: the source {brief(item)} has no usable name ({brief(name)}: a name is letters, "
                f"digits, '_', '.', '-'); name it as NAME={brief(item)}"
            )
        if names.count(name) > 1:
            raise UserError(
                f"{option}: two sources are named {name!r}; name them apart as NAME=PATH (e.g. {name}_a=PATH)"
            )
    return names


def parse_weights(text: str, sources: int) -> list[float]:
    """``--data-weights``: one positive finite number per --data source.

    Raises:
        UserError: naming --data-weights, for a count that does not match, a non-number, zero or less.
    """
    parts = [p.strip() for p in text.split(",")]
    weights = []
    for part in parts:
        try:
            weight = float(part)
        except ValueError:
            raise SettingError("data_weights", "--data-weights", f"{brief(part)} is not a number") from None
        if not math.isfinite(weight) or weight <= 0:
            raise SettingError(
                "data_weights",
                "--data-weights",
                f"every weight must be a positive number (got {brief(part)})",
            )
        weights.append(weight)
    if len(weights) != sources:
        raise SettingError(
            "data_weights",
            "--data-weights",
            f"{len(weights)} weight{'s' if len(weights) != 1 else ''} for {sources} --data "
            f"source{'s' if sources != 1 else ''}; give one per source, in order",
        )
    return weights


def same_weights(a: object, b: object) -> bool:
    """Whether two --data-weights values give the sources the same shares (2,2 is 1,1)."""
    if not (isinstance(a, str) and isinstance(b, str)) or a.count(",") != b.count(","):
        return False
    try:
        first, second = (parse_weights(w, w.count(",") + 1) for w in (a, b))
    except UserError:
        return False
    return all(math.isclose(x / sum(first), y / sum(second)) for x, y in zip(first, second, strict=True))


def yaml_sources(entries: list[object], option: str, where: str) -> tuple[str, str | None]:
    """A YAML list of sources (``- {path: P, weight: W, name: N}``) as the flat values (--data,
    --data-weights): weights all given or none.

    Raises:
        UserError: naming ``where`` and the entry that is not such a mapping.
    """
    items, weights, unweighted = [], [], []
    for k, entry in enumerate(entries, start=1):
        if isinstance(entry, str):
            entry = {"path": entry}
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str)):
            raise UserError(f"{where}{option}: entry {k} is not a path or a mapping with a path")
        unknown = set(entry) - {"path", "weight", "name"}
        if unknown:
            raise UserError(
                f"{where}{option}: entry {k}: unknown key {brief(sorted(unknown, key=str)[0])} (an entry "
                "takes path, weight and name)"
            )
        name = entry.get("name")
        if name is not None and not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise UserError(f"{where}{option}: entry {k}: name {brief(name)} is not letters, digits, _ . -")
        items.append(f"{name}={entry['path']}" if name is not None else entry["path"])
        if "weight" in entry:
            weight = entry["weight"]
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise UserError(f"{where}{option}: entry {k}: weight {brief(weight)} is not a number")
            weights.append(str(weight))
        else:
            unweighted.append(k)
    if weights and unweighted:
        raise UserError(
            f"{where}{option}: entry {unweighted[0]} has no weight, and {len(weights)} of the {len(items)} "
            "have one: give each entry a weight, or none (the sources then train as they come, each "
            "example once an epoch)"
        )
    return joined(items), ",".join(weights) if weights else None


def joined(items: list[str]) -> str:
    """Items as one comma-separated value, the commas inside them kept (``\\,``)."""
    return ",".join(item.replace(",", "\\,") for item in items)
