"""Settings in and out: YAML files and flags -> TrainConfig (each value coerced to its setting's
type, each error naming the option), and TrainConfig -> flags for the subprocesses lmtune starts.

A YAML file is flat (``lora_rank: 16``), nested by group (``lora: {rank: 16}``), or both."""

from __future__ import annotations

import math
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml

from lmtune.config.aliases import ALIASES, lmtune_name, resolve_names, value_switched
from lmtune.config.files import SETTINGS_BYTES, read_text
from lmtune.config.hints import HINTS
from lmtune.config.mixture import yaml_sources
from lmtune.config.recipes import recipe_groups, refuse_recipe
from lmtune.config.replay import is_run_record, recorded_settings
from lmtune.config.settings import (
    GROUPS,
    Setting,
    TrainConfig,
    as_text,
    config_fields,
    option_name,
    setting_named,
    to_dict,
    value_of,
)
from lmtune.config.switches import peer_unset
from lmtune.config.validate import split_written_as_decimal
from lmtune.errors import SettingError, UserError, WrongType, WrongValue, brief, one_line

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
    "push_to_hub": None,
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
    for s in config_fields():
        value = value_of(cfg, s)
        if value == s.default:
            continue
        if value is None:  # only settings defaulting to None may be None, so this cannot be said
            raise ValueError(f"{s.name}: None cannot be given as a flag")
        if isinstance(value, bool):
            argv.append(option_name(s.name) if value else "--no-" + option_name(s.name)[2:])
        else:  # "=": a value that starts with "-" stays a value; str() of a float round-trips
            argv.append(f"{option_name(s.name)}={value}")
    return argv


def _coerce(s: Setting, value: Any) -> Any:
    """Convert a YAML/CLI value to the setting's type, or explain which option is wrong."""
    name, kind = s.name, s.type
    value = peer_unset(name, value)
    if (problem := split_written_as_decimal(name, value)) is not None:
        raise UserError(f"{option_name(name)}: {brief(value)} {problem}")
    if value is None:
        # An empty key is unset in Axolotl's configs (they list many); where lmtune's default is
        # "none" (0, off) that is what it means here too. Elsewhere (the model, the data, a rate)
        # an empty value is more likely a value left out.
        if s.optional or (s.default == 0 and s.type in (int, float, bool)):
            return s.default
        # Another tool's null (torchtune's max_seq_len: null): lmtune's default is one value to give.
        default = f"; remove it for the default, {s.default}" if name not in ("model", "data") else ""
        raise UserError(f"{option_name(name)}: needs a value (got null){_NULL.get(name, '')}{default}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "false", "no", "0"):
            return value.lower() in ("true", "yes", "1")
        raise UserError(f"{option_name(name)}: expected true or false, got {brief(value)}")
    if kind is str and (text := as_text(value, name)) is not value:
        return text  # a YAML list (data files, target modules, weights) or mapping (--field-map)
    if {"on", "off"} <= set(s.choices):  # packing: true, as TRL writes it (--packing True too)
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):  # as YAML 1.1's
            return "on" if value.lower() in ("true", "yes") else "off"
    if name == "eval_split" and (type(value) is int or (isinstance(value, str) and value.strip().isdigit())):
        return int(value)  # a count stays one: TrainConfig refuses a split of 40.0 as written so
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if kind is int and isinstance(value, str) and (whole := _WHOLE.fullmatch(value)):
        value = whole.group(1)  # --num_train_epochs 3.0, as HF's float arguments are written
    if kind is int and isinstance(value, str) and _SCIENTIFIC.fullmatch(value):
        value = _whole_scientific(value)  # max_steps: 1e3, which YAML reads as text without a dot
    if (
        isinstance(value, bool)
        or (kind is int and isinstance(value, float))
        or isinstance(value, (list, dict))
    ):
        raise UserError(_expected(name, kind, value))
    try:
        converted = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise UserError(_expected(name, kind, value)) from None
    if kind is float and not math.isfinite(converted):
        raise UserError(f"{option_name(name)}: must be a finite number (got {brief(value)})")
    return converted


_WHOLE = re.compile(r"\s*([+-]?\d+)\.0*\s*")
_SCIENTIFIC = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d{1,3}\s*")


def _whole_scientific(value: str) -> int | str:
    """``1e3`` as 1000 where it is a whole number (exactly: ``1.5e0`` stays text, refused as
    one); a number past what any setting takes stays text too (its refusal names it as written)."""
    number = Decimal(value.strip())
    if number != number.to_integral_value() or abs(number) >= 10**30:
        return value
    return int(number)


# What an empty value means in other tools' configs, where lmtune needs one.
_NULL = {"seed": " (torchtune's null seed is a random one; lmtune's runs are seeded)"}

# The HF Trainer takes a value below 1 of these as a share of the run's steps; lmtune counts steps.
_STEPS_SHARE = " (the HF Trainer's share of the training steps: lmtune takes a number of optimizer steps)"
_FRACTIONS = {
    "save_every": _STEPS_SHARE,
    "eval_every": _STEPS_SHARE,
    "log_every": _STEPS_SHARE,
    "epochs": " (lmtune trains whole epochs: --max-steps N stops within one)",
    # transformers 5 takes warmup_steps=0.1 as a ratio.
    "warmup_steps": " (a share of the training steps is --warmup-ratio)",
}


def fraction_reason(name: str, value: Any) -> str:
    """What a share (0 < value < 1) means elsewhere for a whole-number setting that takes none
    (" (the HF Trainer's share ...)"), or "" for any other value."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    # HF's and Axolotl's epochs may be fractional (2.5): any part of one, not only a share.
    share = 0 < number < 1 or (name == "epochs" and math.isfinite(number) and not number.is_integer())
    return _FRACTIONS.get(name, "") if share else ""


def _expected(name: str, kind: type, value: Any) -> str:
    """The refusal of a value of another type, with what a share means elsewhere (:func:`fraction_reason`)."""
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    why = fraction_reason(name, value)
    if name == "resume" and isinstance(value, bool):  # litgpt's resume: true | false
        meant = "auto continues the newest checkpoint" if value else "never starts anew"
        why = f" (auto | never | PATH; {meant})"
    if name == "eval_split" and isinstance(value, str) and math.isnan(number):  # a split's name
        why = (
            " (a share of the data to hold out, such as 0.1, or a number of examples; a data set's own "
            "split is given as --eval-data: DIR/test for one saved with save_to_disk, NAME:test on the hub)"
        )
    return f"{option_name(name)}: expected {kind.__name__}, got {brief(value)}{why}"


# A settings file has tens of values; aliases and merge keys that expand past this are a bomb.
MAX_YAML_VALUES = 100_000


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` stands for with every alias and merge key expanded, counted on the
    node graph (each shared node once), so a billion laughs costs as little as it is long."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    sizes[id(node)] = min(size, MAX_YAML_VALUES + 1)
    return sizes[id(node)]


_MAX_BITS = 14_000  # ~4,200 decimal digits: Python prints no int past 4,300 (nor str() it)


def _check_numbers(value: Any, where: str) -> None:
    """No integer in ``value`` too long to print: YAML reads hex, binary and base-60 ones of any
    length, which failed later as a traceback wherever one was shown."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_BITS:
        raise UserError(f"{where}: not valid YAML here (a number of over 4,000 digits)")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(key, where)
            _check_numbers(item, where)
    elif isinstance(value, list):
        for item in value:
            _check_numbers(item, where)


def parse_yaml(text: str, where: str) -> Any:
    """Safe YAML (plain values only) with its expansion bounded; errors name ``where`` and a line."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None and _expanded_size(node, {}) > MAX_YAML_VALUES:
            raise UserError(
                f"{where}: expands to over {MAX_YAML_VALUES:,} values (YAML aliases); not settings"
            )
        document = loader.construct_document(node) if node is not None else None
        _check_numbers(document, where)
        return document
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark is not None else where
        problem = " ".join(str(getattr(e, "problem", None) or "").split())[:100] or "unreadable"
        raise UserError(f"{at}: not valid YAML ({problem})") from None
    except RecursionError:
        raise UserError(f"{where}: not valid YAML (nested too deeply)") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise UserError(f"{where}: not valid YAML here ({str(e).split(':')[0]})") from None
    finally:
        loader.dispose()


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping of settings; keys may use dashes or underscores."""
    return _read_yaml(path)[0]


def yaml_places(path: str) -> dict[str, str]:
    """Where each setting of a YAML file is, as its messages name it: ``--config FILE:LINE: key``."""
    return _read_yaml(path)[1]


def _read_yaml(path: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings of a YAML file under lmtune's names, and where each is (:func:`yaml_places`)."""
    try:
        text = read_text(Path(path).expanduser(), limit=SETTINGS_BYTES)
    except FileNotFoundError:
        raise UserError(f"--config: no such file: {path}") from None
    except UserError as e:
        raise UserError(f"--config: {e}") from None
    loaded = parse_yaml(text, f"--config: {path}")
    if loaded is None:  # a run of the built-in demo, which the user surely did not mean
        raise UserError(f"--config: {path}: holds no settings (empty, or only comments)")
    if not isinstance(loaded, dict):
        raise UserError(f"--config: {path}: expected a mapping of settings, got {type(loaded).__name__}")
    lines = _key_lines(text, path)
    if is_run_record(loaded):
        loaded, lines = recorded_settings(loaded, lines)

    def at(key: str) -> str:
        return f"--config {path}" + (f":{lines[key]}" if key in lines else "") + ": "

    # torchtune's or litgpt's recipe: its groups and its other keys are answered in one message.
    groups = recipe_groups(loaded)
    others = {k: v for k, v in loaded.items() if k not in groups}
    known = {s.name for s in config_fields()}
    refuse_recipe(loaded, at, known, lambda: _named_settings(others, path, lines))
    return _named_settings(loaded, path, lines)


# A group's name may mean something else given a value: a setting (lora: true), another tool's (optim).
_FLAT = frozenset(s.name for s in config_fields()) | set(HINTS) | set(ALIASES)


def _named_settings(
    loaded: dict[Any, Any], path: str, lines: dict[str, int]
) -> tuple[dict[str, Any], dict[str, str]]:
    settings: dict[str, Any] = {}
    origin: dict[str, str] = {}  # flat name -> the key that gave it
    if problems := [p for key in loaded if (p := _key_problem(key, path, lines))]:
        raise UserError("\n".join(problems))
    for key, value in loaded.items():
        # A JSON key with a space around it ("lr ") was "unknown setting lr; did you mean lr?", while
        # "learning_rate " was taken (aliases are matched stripped).
        name = str(key).strip().replace("-", "_")
        group = GROUPS.get(name)
        entries = {name: (str(key), value)}
        if group and not isinstance(value, dict) and name not in _FLAT:  # `batch: 5`: "unknown setting"
            fields = ", ".join(s.field for s in config_fields() if s.group == name)
            line = f":{lines[str(key)]}" if str(key) in lines else ""
            raise UserError(
                f"--config {path}{line}: {name} is a group of settings ({fields}): give them under it"
            )
        if group and isinstance(value, dict):
            entries = _group_entries(name, value, f"--config {path}", {str(key): lines})
        for flat, (given, item) in entries.items():
            if flat in settings:
                first = lines.get(origin[flat])
                at = f" on line {first}" if first else ""
                both = f"as {one_line(origin[flat], 60)}{at} and {one_line(given, 60)}"
                here = f"--config {path}" + (f":{lines[given]}" if given in lines else "")
                raise UserError(f"{here}: {flat} is set twice ({both}); give it once")
            settings[flat], origin[flat] = item, given

    def where(flat: str) -> str:
        line = lines.get(origin.get(flat, flat))
        return f"--config {path}{f':{line}' if line else ''}: "

    for flat, option in (("data", "--data"), ("eval_data", "--eval-data")):
        value = settings.get(flat)
        if isinstance(value, list) and any(isinstance(v, dict) for v in value):
            settings[flat], weights = yaml_sources(value, option, where(flat))
            if weights is not None and flat == "eval_data":
                raise UserError(f"{where(flat)}--eval-data: evaluation sources take no weight")
            if weights is not None:
                if "data_weights" in settings:
                    raise UserError(f"{where(flat)}--data-weights is set twice (in data: and data_weights:)")
                settings["data_weights"], origin["data_weights"] = weights, origin[flat]

    # Names of HF Trainer, TRL and Axolotl: an alias becomes lmtune's name, others are explained.
    known = {s.name for s in config_fields()}
    resolved = resolve_names(settings, known, where)
    places = {}
    # A value of the wrong type is named as the file has it (key and line), not only by its flag.
    for key, value in settings.items():
        name = lmtune_name(key, known)
        places[name] = f"{where(key)}{one_line(origin.get(key, key), 60)}"
        for switched, ours in value_switched(key, value).items():  # TRL's precompute_ref_log_probs
            places.setdefault(switched, f"{places[name]} ({switched} {str(ours).lower()} in lmtune)")
        if name in resolved and resolved[name] is value:
            try:
                _coerce(setting_named(name), value)
            except UserError as e:
                reason = str(e).removeprefix(f"{option_name(name)}: ")
                raise UserError(f"{places[name]}: {as_file_names(reason)}") from None
    return resolved, places


def as_file_names(text: str) -> str:
    """``text`` with the settings it names by flag (--warmup-ratio) named as a file or a TrainConfig
    call names them (warmup_ratio)."""
    names = {s.name for s in config_fields()}

    def named(found: re.Match[str]) -> str:
        name = found.group(1).replace("-", "_")
        return name if name in names else found.group(0)

    return re.sub(r"(?<![\w-])--([a-z][a-z0-9-]*)", named, text)


def _key_problem(key: Any, path: str, lines: dict[str, int]) -> str | None:
    """A key that cannot be a setting's name as YAML read it: an unquoted ``NO:`` (YAML 1.1's false)
    was "unknown setting False", and a flag written as a key (``--lr: 0.1``) "unknown setting __lr"."""
    if isinstance(key, str) and not key.strip().startswith("-"):
        return None
    raw = (
        key
        if isinstance(key, str)
        else next((r for r in lines if _scalar(r) == key and type(_scalar(r)) is type(key)), None)
    )
    here = f"--config {path}" + (f":{lines[raw]}" if raw in lines else "")
    if isinstance(key, str):
        name = key.strip().lstrip("-").replace("-", "_")
        return f"{here}: {one_line(key, 60)} is written as a flag: a file's key is {one_line(name, 60)}"
    read = "null" if key is None else str(key).lower()
    return (
        f"{here}: the key {one_line(str(raw or key), 60)} reads as {read}, not a setting's name "
        "(YAML takes an unquoted number, yes/no, on/off or true/false as a value): quote it if it is a name"
    )


def _scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _key_lines(text: str, path: str) -> dict[str, int]:
    """The line of each top-level key of a YAML mapping, and of each key of a mapping under one
    (``batch.packing``: a group's settings), from the node graph (nothing is expanded).

    Raises:
        UserError: for a key given twice, which YAML loaders resolve silently (the last wins).
    """
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(node, yaml.MappingNode):
        return {}
    lines: dict[str, int] = {}

    def note(key: yaml.Node, name: str) -> None:
        line = key.start_mark.line + 1
        if name in lines:
            raise UserError(
                f"--config {path}:{line}: {one_line(name, 60)} is set twice (also on line {lines[name]}); "
                "give it once"
            )
        lines[name] = line

    for key, value in node.value:
        note(key, str(key.value))
        if isinstance(value, yaml.MappingNode):
            for sub, _ in value.value:
                note(sub, f"{key.value}.{sub.value}")
    return lines


def _group_entries(
    group: str, values: dict[Any, Any], place: str, lines: dict[str, dict[str, int]]
) -> dict[str, tuple[str, Any]]:
    """A nested group (``lora: {rank: 16}``) as flat settings (``lora_rank: 16``), each with the
    key that gave it (``lora.rank``); a key may be the group's field name or the setting's flat
    name. ``place``: ``--config FILE``; ``lines``: the group's key as the file writes it -> the
    file's key lines (:func:`_key_lines`)."""
    fields = {s.field: s.name for s in config_fields() if s.group == group}
    flat_names = set(fields.values())
    ((written, file_lines),) = lines.items()
    entries = {}
    for key, value in values.items():
        name = str(key).strip().replace("-", "_")
        given = f"{written}.{key}"
        if name not in fields and name not in flat_names:
            line = file_lines.get(given, file_lines.get(written))
            raise UserError(
                f"{place}{f':{line}' if line else ''}: {group}: unknown setting {brief(key)} (its settings: "
                f"{', '.join(fields)})"
            )
        entries[fields.get(name, name)] = (given, value)
    return entries


def build_config(values: dict[str, Any], source: str = "") -> TrainConfig:
    """Make a config from a mapping of settings (YAML and flags already merged)."""
    return config_and_given(values, source)[0]


def config_and_given(values: dict[str, Any], source: str = "") -> tuple[TrainConfig, frozenset[str]]:
    """:func:`build_config`, and the settings ``values`` give under lmtune's names (aliases and
    other tools' switches resolved: Axolotl's `adapter: qlora` gives lora and load_in_4bit)."""
    values = resolve_names(
        values, (s.name for s in config_fields()), lambda _: f"{source}: " if source else ""
    )
    kwargs = {k: _coerce(setting_named(k), v) for k, v in values.items()}
    try:
        return TrainConfig(**kwargs), frozenset(values)
    except (WrongType, WrongValue) as e:  # named by the flag (or the file's line), not by the API's keyword
        raise SettingError(e.setting, option_name(e.setting), e.reason) from None


def dump_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
