"""TrainConfig: every setting of a training run once, in groups, each with one flat name.

In code a setting is read through its group (``cfg.optim.lr``, ``cfg.lora.rank``), and a function
takes the group it needs (:mod:`lmtune.config.groups`). To users settings are flat: a flag
(``--lr``, ``--lora-rank``), a YAML key, an entry of run.json's ``config`` all use one name, and
``TrainConfig(lr=1e-4, lora=True)`` builds a config from such names. A whole group may be given
instead (``TrainConfig(lora=LoraSettings(rank=8))``), and flat names read as attributes too
(``cfg.lr``), for scripts written against the flat config.

Four groups share their name with a setting (``model``, ``data``, ``objective``, ``lora``): given a group
object (or, in YAML, a mapping) the name means the group, given a plain value the setting
(``--model``, ``--data``, ``--lora``); ``cfg.model`` is the group and ``cfg.model.name`` the model.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

from lmtune.config.groups import (
    DEFAULT_EPOCHS,
    SAMPLE_EPOCHS,
    BatchSettings,
    DataSettings,
    ExampleSettings,
    LoraSettings,
    ModelSettings,
    ObjectiveSettings,
    OptimSettings,
    ScheduleSettings,
    setting,
)
from lmtune.config.python_values import (
    FOLDERS_MADE,
    SOURCES,
    folder_named,
    in_memory,
    typed_as,
    unknown_answer,
)
from lmtune.config.run_groups import (
    CheckpointSettings,
    EvalSettings,
    HealthSettings,
    LaunchSettings,
    LoggingSettings,
    SampleSettings,
)
from lmtune.config.switches import peer_unset
from lmtune.errors import UnknownSetting, UserError, WrongType, WrongValue, brief

__all__ = [
    "DEFAULT_EPOCHS",
    "GROUPS",
    "PLAN_SETTINGS",
    "SAMPLE_DATA",
    "SAMPLE_EPOCHS",
    "SAMPLE_EVAL",
    "Setting",
    "TrainConfig",
    "choices",
    "config_fields",
    "field_type",
    "option_name",
    "parse_nnodes",
    "to_dict",
    "warmup_steps",
]

# --data sample: the built-in addition task, and its held-out split (the default evaluation data).
SAMPLE_DATA = "sample"
SAMPLE_EVAL = "sample:eval"

# The groups of TrainConfig by attribute name, in the order --help shows them.
GROUPS: dict[str, type] = {
    "model": ModelSettings,
    "data": DataSettings,
    "examples": ExampleSettings,
    "objective": ObjectiveSettings,
    "batch": BatchSettings,
    "optim": OptimSettings,
    "schedule": ScheduleSettings,
    "lora": LoraSettings,
    "eval": EvalSettings,
    "samples": SampleSettings,
    "checkpoint": CheckpointSettings,
    "launch": LaunchSettings,
    "logging": LoggingSettings,
    "health": HealthSettings,
}


@dataclass(frozen=True)
class Setting:
    """One setting as users name it: the flag without its dashes, the YAML key, run.json's key."""

    name: str  # flat name: lora_rank (--lora-rank)
    group: str | None  # the group's attribute in TrainConfig (None: a setting of the run itself)
    field: str  # the field in its group: rank
    default: Any
    type: type  # the scalar type (int for ``int | None``)
    optional: bool  # None is a value
    help: str
    choices: tuple[str, ...]  # allowed values; empty: any value of its type

    @property
    def metadata(self) -> dict[str, Any]:
        return {"help": self.help, "choices": self.choices}


def _scalar(hint: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, True)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    assert isinstance(hint, type)
    return hint, False


def _fields_of(kind: type, group: str | None) -> list[Setting]:
    hints = typing.get_type_hints(kind)
    found = []
    for f in dataclasses.fields(kind):
        if kind is TrainConfig and f.name in GROUPS:
            continue
        scalar, optional = _scalar(hints[f.name])
        found.append(
            Setting(
                name=f.metadata.get("flag") or f.name,
                group=group,
                field=f.name,
                default=f.default,
                type=scalar,
                optional=optional,
                help=f.metadata["help"],
                choices=f.metadata["choices"],
            )
        )
    return found


@dataclass(frozen=True, init=False)
class TrainConfig:
    """Everything one training run needs; a YAML file may set any setting, flags override it."""

    model: ModelSettings
    data: DataSettings
    examples: ExampleSettings
    objective: ObjectiveSettings
    batch: BatchSettings
    optim: OptimSettings
    schedule: ScheduleSettings
    lora: LoraSettings
    eval: EvalSettings
    samples: SampleSettings
    checkpoint: CheckpointSettings
    launch: LaunchSettings
    logging: LoggingSettings
    health: HealthSettings
    seed: int = setting(42, "Seed for model init, data order and dropout; shared by all ranks.")

    def __init__(self, **settings: Any) -> None:
        """Build from flat settings (``lr=1e-4``) and whole groups (``optim=OptimSettings(...)``);
        a flat setting overrides its group's value.

        Raises:
            UnknownSetting: (a UserError and a TypeError) for a name that is neither a setting nor a
                group, or a setting given twice.
        """
        values, given = _assembled(settings)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_given", given)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **settings: Any) -> TrainConfig:
        """The settings of a YAML or JSON file, read as ``lmtune train --config`` reads it (names
        with dashes or underscores, YAML's numbers, other tools' names, a run.json's config), with
        ``settings`` over them as flags override a file's.

        Raises:
            UserError: naming the file and line, for what ``--config`` refuses.
        """
        from lmtune.config.io import config_and_given, load_yaml

        try:
            cfg = config_and_given(load_yaml(os.fspath(path)), os.fspath(path))[0]
        except UserError as e:  # "--config: no such file" to a caller who gave no flag
            e.args = (re.sub(r"(?m)^--config\b", "TrainConfig.from_file", str(e)),)
            raise
        return cfg.replace(**settings) if settings else cfg

    def replace(self, **settings: Any) -> TrainConfig:
        """A copy with these settings (flat names, or whole groups) changed."""
        changed = copy.copy(self)
        current = {name: getattr(self, name) for name in (*GROUPS, "seed")}
        values, given = _assembled(settings, current)
        for name, value in values.items():
            object.__setattr__(changed, name, value)
        object.__setattr__(changed, "_given", given_names(self) | given)
        return changed


def given_names(cfg: TrainConfig) -> frozenset[str]:
    """The settings given to ``cfg`` by name (flat names, peers' names resolved), as the CLI knows
    the ones its flags and file gave: what is given for a feature that is off is refused even at
    its default value. Not those of a group given whole (its changed values count)."""
    return getattr(cfg, "_given", frozenset())


def _all_settings() -> tuple[Setting, ...]:
    found: list[Setting] = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in GROUPS:
            found += _fields_of(GROUPS[f.name], f.name)
    return (*found, *_fields_of(TrainConfig, None))


SETTINGS = _all_settings()
_BY_NAME = {s.name: s for s in SETTINGS}


def _given(s: Setting, key: str, value: Any) -> Any:
    """A value given to TrainConfig as the setting holds it (text settings take what converts to
    text, a path, as the CLI and YAML do), refused where it is given (a traceback's line in the
    user's script), as Python refuses an unknown keyword, not when train() starts."""
    from lmtune.config.validate import split_written_as_decimal, value_problem  # it reads these settings

    if s.type is str and value is None and s.optional:
        return None  # an unset path or name: refused, where it needs one, by the run's checks
    if (loaded := in_memory(s.name, value)) is not None:
        raise WrongType(key, f"TrainConfig: {key}", loaded)
    if s.type is str and isinstance(value, bool) and {"on", "off"} <= set(s.choices):
        value = "on" if value else "off"  # TRL's packing=True, as YAML's packing: true is taken
    if s.type is str:
        value = as_text(value, s.name)
    if s.name in FOLDERS_MADE and isinstance(value, str):
        value, problem = folder_named(value)
        if problem:
            raise WrongValue(key, f"TrainConfig: {key}", problem)
    if s.type is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # num_train_epochs=3.0, as HF's TrainingArguments take it
    # The CLI's and YAML's "1.0" is refused as written (io._coerce): a split converted reads 40.0.
    problem = split_written_as_decimal(s.name, value) or value_problem(s, value)
    if problem is not None:
        from lmtune.config.io import as_file_names, fraction_reason  # it reads these settings

        wrong = WrongType if not typed_as(value, s.type, s.optional) else WrongValue
        why = fraction_reason(s.name, value) if s.type is int and isinstance(value, float) else ""
        reason = f"{problem} (got {brief(value)}){why}"
        error = wrong(key, f"TrainConfig: {key}", reason)  # its reason as the CLI names settings
        error.args = (f"TrainConfig: {key}: {as_file_names(reason)}",)  # as a call names them
        raise error
    return value


def _assembled(
    settings: dict[str, Any], start: dict[str, Any] | None = None
) -> tuple[dict[str, Any], frozenset[str]]:
    """TrainConfig's attributes from flat settings and groups, over ``start`` (else the defaults),
    and the names of the settings given."""
    values: dict[str, Any] = dict(start) if start else {n: k() for n, k in GROUPS.items()}
    values.setdefault("seed", _BY_NAME["seed"].default)
    flat = _Fields()
    # It reads the settings for its messages.
    from lmtune.config.aliases import ALIASES, peers_switched
    from lmtune.config.switches import PEER_NULLS, steps_left_unset

    settings = peers_switched(settings, lambda _: "TrainConfig: ", str, "the call")
    # All at once: another tool's dump has several. One left None (unset) asks nothing, as in YAML.
    unknown = [unknown_answer(k, v, settings) for k, v in settings.items() if is_unknown(k) and v is not None]
    if unknown:
        raise UnknownSetting("\n".join(unknown))

    for key, value in settings.items():
        if is_unknown(key):
            continue
        kind, written = GROUPS.get(key), key
        if key not in _BY_NAME and ALIASES.get(key) in _BY_NAME:
            value = PEER_NULLS.get(key, value) if value is None else value  # save_total_limit=None
            key = ALIASES[key]  # a peer's name (learning_rate, lora_r), as the CLI and YAML take it
        value = peer_unset(key, value)
        if (loaded := in_memory(key, value)) is not None:  # a DatasetDict is a mapping, not a group
            raise WrongType(key, f"TrainConfig: {key}", loaded)
        if key in SOURCES and isinstance(value, list) and any(isinstance(v, dict) for v in value):
            value = _sources(key, value, flat)
        if kind is not None and isinstance(value, dict):  # a group as YAML nests it: lora={"rank": 8}
            for name, field_value in _group_fields(key, value).items():
                flat.set(key, name, field_value, f"{key}={{{name!r}: ...}}")
        elif kind is not None and isinstance(value, kind):
            values[key] = value
        elif key in _BY_NAME:
            s = _BY_NAME[key]
            flat.set(s.group or "", s.field, _given(s, key, value), written)
        else:  # a group's name given a plain value (batch=5)
            raise UnknownSetting(unknown_answer(key, value))
    if (schedule := flat.by_group.get("schedule")) is not None and schedule != steps_left_unset(schedule):
        del schedule["warmup_steps"], flat.given_as["schedule", "warmup_steps"]
    for group, changes in flat.by_group.items():
        if group:
            values[group] = dataclasses.replace(values[group], **changes)
        else:
            values.update(changes)
    named = {(s.group or "", s.field): s.name for s in SETTINGS}
    dumped = _dumped(flat.given_as)
    return values, frozenset(named[key] for key in flat.given_as if key not in dumped)


def _dumped(given_as: dict[tuple[str, str], str]) -> set[tuple[str, str]]:
    """The fields of the groups a call names every setting of: a dump's (``asdict(cfg)``, run.json's
    config), which names them all as a group object holds them; its changed values count, not its
    defaults as asked for (``lora_rank`` of a dump with LoRA off, refused given by name)."""
    dumped: set[tuple[str, str]] = set()
    for group in GROUPS:
        fields = {(group, s.field) for s in SETTINGS if s.group == group}
        if fields <= given_as.keys():
            dumped |= fields
    return dumped


def is_unknown(key: str) -> bool:
    """Whether TrainConfig takes no setting or group by the name ``key`` (nor a peer's alias)."""
    from lmtune.config.aliases import ALIASES

    return key not in _BY_NAME and key not in GROUPS and ALIASES.get(key) not in _BY_NAME


@dataclasses.dataclass
class _Fields:
    """The fields given to TrainConfig, per group ("" for the top level), and how each was written."""

    by_group: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    given_as: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    def set(self, group: str, name: str, value: Any, given_as: str) -> None:
        """Refused when given already (a group's mapping and a flat name: ``lora={"rank": 8},
        lora_r=4``), as YAML refuses it."""
        if (group, name) in self.given_as:
            from lmtune.config.aliases import same_value
            from lmtune.config.switches import READ_AS

            setting = next(s.name for s in SETTINGS if (s.group or "", s.field) == (group, name))
            earlier, read = self.by_group[group][name], READ_AS.get(setting, lambda v: v)
            # One value under two names (TRL's gradient_checkpointing beside its new one), or one
            # of them None (a dump's unset): taken, as YAML takes them.
            if same_value(read(earlier), read(value)) or value is None:
                return
            if earlier is None:
                self.by_group[group][name] = value
                return
            first = self.given_as[group, name]
            raise UnknownSetting(
                f"TrainConfig: {setting} is set twice (as {first} and {given_as}); give it once"
            )
        self.by_group.setdefault(group, {})[name] = value
        self.given_as[group, name] = given_as


def _sources(key: str, entries: list[Any], flat: _Fields) -> str:
    """``data=[{"path": ..., "weight": ...}, ...]`` as YAML writes it: the sources, and their
    weights into ``flat``."""
    from lmtune.config.mixture import yaml_sources

    def as_text(entry: Any) -> Any:  # {"path": Path(...)}, as a path is given anywhere else
        if isinstance(entry, dict) and isinstance(entry.get("path"), os.PathLike):
            return {**entry, "path": os.fspath(entry["path"])}
        return os.fspath(entry) if isinstance(entry, os.PathLike) else entry

    if (loaded := in_memory(key, entries)) is not None:
        raise WrongType(key, f"TrainConfig: {key}", loaded)
    spec, weights = yaml_sources([as_text(e) for e in entries], option_name(key), "TrainConfig: ")
    if weights is not None:
        flat.set("data", "weights", weights, f"{key}=[{{..., 'weight': ...}}]")
    return spec


def _group_fields(group: str, values: dict[Any, Any]) -> dict[str, Any]:
    """A group given as a mapping of its fields (``lora={"enabled": True, "rank": 8}``)."""
    settings = {s.field: s for s in SETTINGS if s.group == group}
    unknown = [str(k) for k in values if k not in settings]
    if unknown:
        known = ", ".join(settings)
        raise UnknownSetting(f"TrainConfig: {group}: unknown {unknown[0]!r} (its settings: {known})")
    return {k: as_text(v, settings[k].name) if settings[k].type is str else v for k, v in values.items()}


# The settings that take several values: a list as YAML and Python give it is joined as the flag
# writes it; a list for any other is refused (output_dir=["a", "b"] made a folder "a,b").
LISTS = (*SOURCES, "data_weights", "lora_target_modules", "report_to")  # HF's report_to=["wandb"]
MAPPINGS = ("field_map",)


def as_text(value: Any, name: str) -> Any:
    """A list of strings or numbers (data files, target modules, weights) or a mapping of strings
    (--field-map) as the flag writes it, for YAML and the Python API alike, where setting ``name``
    takes one; a path as text (one source of data, its commas kept); anything else as it is (the
    settings check names a wrong type)."""
    from lmtune.config.mixture import joined

    if isinstance(value, os.PathLike):  # data=Path(...), output_dir=result.output_dir
        return joined([os.fspath(value)]) if name in SOURCES else os.fspath(value)
    items = isinstance(value, (list, tuple)) and name in LISTS
    if items and all(
        isinstance(v, (str, int, float, os.PathLike)) and not isinstance(v, bool) for v in value
    ):
        return joined([str(v) for v in value])
    if isinstance(value, dict) and name in MAPPINGS and all(isinstance(v, str) for v in value.values()):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return value


def _flat_reader(s: Setting) -> property:
    if s.group is None:
        return property(lambda cfg: getattr(cfg, s.field), doc=s.help)
    group = s.group
    return property(lambda cfg: getattr(getattr(cfg, group), s.field), doc=s.help)


# Flat names as read-only attributes, for scripts written against the flat config. Not declared to
# mypy on purpose: lmtune's own code reads settings through their groups.
for _s in SETTINGS:
    if _s.name not in GROUPS and _s.group is not None:
        setattr(TrainConfig, _s.name, _flat_reader(_s))


# The settings `lmtune plan` reads (the model, the data's shape, the setup): its --help lists these.
_PLAN = (
    "model data data_format text_field field_map train_on_prompt chat_template packing truncation "
    "skip_bad_lines txt_mode cache_dir max_length global_batch_size micro_batch_size seed strategy "
    "precision optimizer activation_checkpointing lora lora_rank lora_alpha lora_dropout "
    "lora_target_modules load_in_4bit load_in_8bit bnb_4bit_quant_type loss_chunk_size compile device "
    "nproc_per_node nnodes trust_remote_code objective reference"
)
PLAN_SETTINGS = tuple(_PLAN.split())


def config_fields() -> tuple[Setting, ...]:
    """Every setting, in --help order."""
    return SETTINGS


def setting_named(name: str) -> Setting:
    return _BY_NAME[name]


def value_of(cfg: TrainConfig, s: Setting) -> Any:
    return getattr(getattr(cfg, s.group), s.field) if s.group is not None else getattr(cfg, s.field)


def field_type(s: Setting) -> type:
    """The scalar type of a setting (``int | None`` gives ``int``)."""
    return s.type


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def choices(name: str) -> tuple[str, ...]:
    """The allowed values of a setting (empty: any value of its type)."""
    return _BY_NAME[name].choices


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    lo, _, hi = value.partition(":")
    try:
        low, high = int(lo), int(hi or lo)
    except ValueError:
        raise UserError(f"--nnodes: expected N or MIN:MAX, got {brief(value)}") from None
    if not 1 <= low <= high:
        raise UserError(f"--nnodes: expected 1 <= MIN <= MAX, got {brief(value)}")
    return low, high


def micro_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """The micro-batch size in effect: as set, or the whole per-process share of the global batch."""
    return cfg.batch.micro_batch_size or cfg.batch.global_batch_size // world_size


def to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Every setting by its flat name (run.json's ``config``, the dashboards' hyperparameters)."""
    return {s.name: value_of(cfg, s) for s in SETTINGS}


def warmup_steps(schedule: ScheduleSettings, total_steps: int) -> int:
    """Warmup in optimizer steps: as set, or --warmup-ratio of the run, rounded up as transformers
    rounds it (a ratio of a short run is at least one step)."""
    if schedule.warmup_steps is not None:
        return schedule.warmup_steps
    return math.ceil(schedule.warmup_ratio * total_steps)
