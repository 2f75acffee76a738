"""The Python API's own cases: values a TrainConfig is given that no file or flag holds (a model
or data already in memory, folders written with ``~`` or a variable, as a script's strings keep
them), names it does not take, and messages naming settings as a call gives them, not as flags."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lmtune.errors import SettingError, TrainingStopped, UserError, brief

SOURCES = ("data", "eval_data")  # lists of sources: a YAML mapping each, a path's commas escaped


def in_memory(name: str, value: Any) -> str | None:
    """What to give instead of a model or data already in memory (an HF user's habit), which
    lmtune's runs take by name, as their processes and checkpoints do: "expected str" before."""
    if name in ("model", "reference_model") and hasattr(value, "save_pretrained"):
        return (
            f"takes a model's name or folder, not a loaded {type(value).__name__}: save it with "
            "model.save_pretrained(DIR) and its tokenizer's save_pretrained(DIR), then give DIR"
        )
    if name in SOURCES and hasattr(value, "save_to_disk"):
        return (
            f"takes files or folders, not a loaded {type(value).__name__}: save it with "
            "dataset.save_to_disk(DIR), then give DIR"
        )
    if name in SOURCES and hasattr(value, "to_json") and hasattr(value, "columns"):  # a pandas frame
        return (
            "takes files or folders, not a DataFrame: write it with df.to_json(PATH, orient='records', "
            "lines=True), then give PATH"
        )
    if name == "lora" and type(value).__name__ == "LoraConfig":  # TRL's peft_config habit
        return (
            "takes True or lmtune's LoRA settings, not peft's LoraConfig: give lora=True with lora_rank "
            "(its r), lora_alpha, lora_dropout and lora_target_modules"
        )
    records = isinstance(value, (list, tuple)) and value and all(isinstance(e, dict) for e in value)
    if name in SOURCES and records and not any("path" in e for e in value):
        return (
            "takes files or folders, not records: write them to a .jsonl file, one a line, and give its path"
        )
    kept = (str, bytes, os.PathLike, list, tuple, dict)  # paths, and the lists and groups of them
    streamed = hasattr(value, "__iter__") and not isinstance(value, kept)
    if name in SOURCES and streamed:  # a generator, an iterator, a datasets.IterableDataset
        return (
            f"takes files or folders, not an iterable ({type(value).__name__}): write its records "
            "to a .jsonl file, one a line, and give its path (lmtune reads its data whole, to shuffle it "
            "and count it the same way on every rank)"
        )
    return None


# Folders lmtune makes where a path names them: a ~ or a variable left as written made a folder of
# that name in the working folder (./~/runs/a, an invitation to rm -rf ~).
FOLDERS_MADE = ("output_dir", "cache_dir")


def folder_named(path: str) -> tuple[str, str | None]:
    """``path`` with ``~`` expanded, as the HF Trainer's output_dir is (``~user`` as a shell does),
    and why it is refused (None: it is not): a variable in it (``${HOME}/runs``, or ``$NAME`` of one
    that is set), which a shell expands but a file or a script's string does not; a folder that is
    there is taken as named."""
    expanded = os.path.expanduser(path)
    if expanded.startswith("~"):  # ~nosuch: later a traceback, "Could not determine home directory"
        user = expanded[1:].split("/", 1)[0]
        return path, f"{brief(path)}: no user {user!r}, so no home folder"
    variables = re.finditer(r"\$(?:\{(\w+)\}|([A-Za-z_]\w*))", path)
    if not os.path.exists(expanded) and any(v[1] or v[2] in os.environ for v in variables):
        return (
            path,
            f"names a variable, which lmtune does not expand (got {brief(path)}); write the path itself",
        )
    return expanded, None


@contextmanager
def in_python_names(python: bool) -> Iterator[None]:
    """From Python (``python``), an error of the run names the settings as a TrainConfig takes
    them (``micro_batch_size``, ``overwrite=True``), not as flags (``--micro-batch-size``,
    ``--overwrite``); one that names a command to run keeps its flags."""
    try:
        yield
    except SettingError as e:
        if not python:
            raise
        raise SettingError(e.setting, f"TrainConfig: {e.setting}", python_spelling(e.reason)) from None
    except (UserError, TrainingStopped) as e:
        if python and e.args and isinstance(e.args[0], str):
            e.args = (python_spelling(e.args[0]), *e.args[1:])
        raise


def python_spelling(text: str) -> str:
    """``text`` with the flags of settings written as a TrainConfig call writes them, unless it
    names an lmtune command, whose flags are for the shell. A switch said as an act (``or
    --overwrite)``, at a stop or the end) is ``overwrite=True``, a ``--no-`` one ``name=False``; one
    followed by a value (``--load-best-at-end False, was True``) or more words (``the same --lora
    and strategy``) is its name alone (``load_best_at_end=True False`` read as nonsense)."""
    if re.search(r"\blmtune (?:train|export|eval|generate|data|plan|bench|doctor|report|push)\b", text):
        return text
    from lmtune.config.settings import config_fields  # it reads this module

    switches = {s.name for s in config_fields() if s.type is bool}
    names = {s.name for s in config_fields()}

    def named(found: re.Match[str]) -> str:
        negated, name, after = found.group(1), found.group(2).replace("-", "_"), found.group(3)
        if name in switches:  # --no-progress is progress=False wherever it stands
            return f"{name}=False" if negated else (name if after.strip(" ") else f"{name}=True")
        return name if name in names and not negated else found.group(0)

    return re.sub(r"(?<![\w-])--(no-)?([a-z][a-z0-9-]*)(?=( *[\w'\"]?))", named, text)


def typed_as(value: object, kind: type, optional: bool) -> bool:
    """Whether ``value`` is of a setting's type: the CLI and YAML convert values, the Python API
    (``TrainConfig(lr="abc")``) does not, and a wrong type would fail later with a traceback."""
    if value is None:
        return optional
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def unknown_answer(key: str, value: Any, given: dict[str, Any] | None = None) -> str:
    """Why TrainConfig does not take ``key``, in one line (``given``: the call's other settings,
    which HF's gradient_accumulation_steps is answered with)."""
    from lmtune.config.aliases import accumulation_here, explain_unknown
    from lmtune.config.settings import GROUPS, config_fields, is_unknown  # it reads this module

    names = [s.name for s in config_fields()]
    python = key.replace("-", "_") if isinstance(key, str) else key
    if python != key and not is_unknown(python):
        # A YAML file's spelling (yaml.safe_load of lmtune's examples): "did you mean 'output_dir'?"
        return (
            f"TrainConfig: {key!r} is {python!r} in Python; TrainConfig.from_file reads a YAML file as "
            "lmtune train --config does"
        )
    # Not the groups' names: "did you mean 'batch'?" for batch_eval_metrics, and batch=5 is refused.
    why = explain_unknown(key, names, repr, "TrainConfig", value)
    if key in GROUPS and "did you mean" in why:  # batch=5 (optim="adamw_8bit" is HF's name, answered)
        fields = ", ".join(s.field for s in config_fields() if s.group == key)
        why = f"{key!r} is a group of settings ({fields}): give them by name, or as a mapping"
    return f"TrainConfig: {why}{accumulation_here(key, value, given or {}, repr)}"
