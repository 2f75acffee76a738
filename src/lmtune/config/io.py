"""Settings in and out: YAML files and flags -> TrainConfig (each value coerced to its field's type,
each error naming the option), and TrainConfig -> flags for the subprocesses lmtune starts."""

from __future__ import annotations

import math
import typing
from pathlib import Path
from typing import Any

import yaml

from lmtune.config.settings import TrainConfig, config_fields, field_type, option_name, to_dict
from lmtune.errors import UserError

# How a run that lmtune starts to measure something (plan --calibrate, bench) differs from the
# user's settings: alone on this machine, and nothing reported, sampled, saved, resumed or restarted.
MEASURING_RUN: dict[str, Any] = {
    "epochs": None,
    "progress": False,
    "resume": "never",
    "overwrite": False,
    "save_every": 0,
    "report_to": "none",
    "sample_prompts": None,
    "sample_every": 0,
    "record_samples": False,
    "doctor": False,
    "max_restarts": 0,
    "nnodes": "1",
    "node_rank": None,
    "rdzv_endpoint": None,
}


def to_argv(cfg: TrainConfig) -> list[str]:
    """``lmtune train`` flags that give back ``cfg`` (its settings that differ from the defaults):
    every subprocess lmtune starts for a run (plan --calibrate, bench) runs exactly these settings."""
    argv: list[str] = []
    for f in config_fields():
        value = getattr(cfg, f.name)
        if value == f.default:
            continue
        if value is None:  # only fields defaulting to None may be None, so this cannot be said
            raise ValueError(f"{f.name}: None cannot be given as a flag")
        if isinstance(value, bool):
            argv.append(option_name(f.name) if value else "--no-" + option_name(f.name)[2:])
        else:  # "=": a value that starts with "-" stays a value; str() of a float round-trips
            argv.append(f"{option_name(f.name)}={value}")
    return argv


def _optional(name: str) -> bool:
    hint = typing.get_type_hints(TrainConfig)[name]
    return type(None) in typing.get_args(hint)


def _coerce(name: str, value: Any, kind: type) -> Any:
    """Convert a YAML/CLI value to the field's type, or explain which option is wrong."""
    if value is None:
        if not _optional(name):
            raise UserError(f"{option_name(name)}: needs a value (got null)")
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.lower() in ("true", "yes", "1")
        raise UserError(f"{option_name(name)}: expected true or false, got {value!r}")
    if kind is str and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)  # a YAML list of data files
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if (
        isinstance(value, bool)
        or (kind is int and isinstance(value, float))
        or isinstance(value, (list, dict))
    ):
        raise UserError(f"{option_name(name)}: expected {kind.__name__}, got {value!r}")
    try:
        converted = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise UserError(f"{option_name(name)}: expected {kind.__name__}, got {value!r}") from None
    if kind is float and not math.isfinite(converted):
        raise UserError(f"{option_name(name)}: must be a finite number (got {value!r})")
    return converted


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping of settings; keys may use dashes or underscores."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--config: no such file: {path}")
    try:
        loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise UserError(f"--config: {where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise UserError(f"--config: {path}: expected a mapping of settings, got {type(loaded).__name__}")
    settings: dict[str, Any] = {}
    for key, value in loaded.items():
        name = str(key).replace("-", "_")
        if name in settings:
            raise UserError(f"--config: {path}: {option_name(name)} is set twice (as {name} and {key})")
        settings[name] = value
    return settings


def build_config(values: dict[str, Any], source: str = "") -> TrainConfig:
    """Make a config from a mapping of settings (YAML and flags already merged)."""
    known = {f.name: f for f in config_fields()}
    unknown = sorted(set(values) - set(known))
    if unknown:
        where = f" in {source}" if source else ""
        raise UserError(
            f"unknown setting{'s' if len(unknown) > 1 else ''}{where}: "
            + ", ".join(option_name(u) for u in unknown)
        )
    kwargs = {k: _coerce(k, v, field_type(known[k])) for k, v in values.items()}
    return TrainConfig(**kwargs)


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
