"""A run's run.json given as ``--config``: the run again. Its ``config`` records every setting; the
ones that differ from their defaults are the run's, and its relative paths are read from the folder
it started in where they name nothing in this one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmtune.config.mixture import with_paths
from lmtune.config.settings import config_fields, setting_named

# How the recorded run met its folder and the hub, not what it trained: taken again, --overwrite
# (without a new --output-dir) deleted the run being read, --resume continued its checkpoint.
_NOT_REPLAYED = ("resume", "overwrite", "push_to_hub", "hub_private")
# Settings that name files or folders: data specs (NAME=PATH items, commas in a path as \,) and paths.
_SPECS = ("data", "eval_data")
_PATHS = ("model", "reference_model", "sample_prompts", "cache_dir", "output_dir")


def is_run_record(loaded: dict[Any, Any]) -> bool:
    """A run's run.json: its settings under "config", beside the machine it ran on (written at the
    run's start, before any result)."""
    return isinstance(loaded.get("config"), dict) and isinstance(loaded.get("environment"), dict)


def recorded_settings(run: dict[Any, Any], lines: dict[str, int]) -> tuple[dict[Any, Any], dict[str, int]]:
    """The settings a run.json records that differ from their defaults (every setting is recorded,
    and one of a feature that is off, at its default, is refused as given), with the keys' lines."""
    known = {s.name for s in config_fields()}
    settings = {
        k: v
        for k, v in run["config"].items()
        if k not in _NOT_REPLAYED and (k not in known or v != setting_named(str(k)).default)
    }
    environment = run.get("environment")
    origin = environment.get("working_folder") if isinstance(environment, dict) else None
    if isinstance(origin, str) and Path(origin).is_dir():
        settings = {
            k: _from(Path(origin), v, spec=k in _SPECS) if k in _SPECS + _PATHS else v
            for k, v in settings.items()
        }
    return settings, {k.removeprefix("config."): n for k, n in lines.items() if k.startswith("config.")}


def _from(origin: Path, value: Any, spec: bool) -> Any:
    """``value``'s relative paths (each source of a data ``spec``, else the one path) that name
    nothing here but something in ``origin`` (the folder the run started in), made absolute: from
    another folder its data was "no such file"."""

    def there(path: str) -> str:
        found = origin / path
        return str(found) if not os.path.isabs(path) and not Path(path).exists() and found.exists() else path

    if not isinstance(value, str):
        return value
    return with_paths(value, there) if spec else there(value)
