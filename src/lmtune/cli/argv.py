"""The command line as other tools write it, rewritten before argparse reads it (HF Trainer's
``--flag True``, ``--snake_case`` names, its upload flags), and the setting given twice."""

from __future__ import annotations

import argparse
import re
from typing import Any

from lmtune.errors import UserError

YES, NO = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def hyphenated(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with ``--snake_case`` options as ``--kebab-case`` where only that spelling is one of
    ``parser``'s (train takes both; generate, plan and the others take the second)."""
    known = set(parser._option_string_actions)
    out = []
    for token in argv:
        name, eq, value = token.partition("=")
        dashed = name.replace("_", "-")
        ours = name.startswith("--") and name not in known and dashed in known
        out.append(dashed + eq + value if ours else token)
    return out


def spelled_out_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with ``--flag True`` / ``--flag False`` (how HF Trainer's examples write yes/no
    options) as ``--flag`` / ``--no-flag``, for the yes/no options ``parser`` has."""
    flags = {
        o for o, a in parser._option_string_actions.items() if isinstance(a, argparse.BooleanOptionalAction)
    }
    out: list[str] = []
    i = 0
    while i < len(argv):
        token, value = argv[i], argv[i + 1].lower() if i + 1 < len(argv) else ""
        if token in flags and not token.startswith("--no-") and value in YES + NO:
            out.append(token if value in YES else "--no-" + token[2:])
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def negative_values(argv: list[str]) -> list[str]:
    """``--data-weights -1,2`` as ``--data-weights=-1,2``: argparse takes a value that starts with a
    dash and is not a plain number for an option, and says only "expected one argument"; lmtune
    then names what is wrong with the value."""
    out: list[str] = []
    for token in argv:
        if (
            out
            and out[-1].startswith("--")
            and "=" not in out[-1]
            and re.fullmatch(r"-[\d.][\d.,eE+-]*(?:[kKmMgGtT]i?[bB]?)?", token)  # -5GiB as a size
        ):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


PUSH_FLAGS, HUB_ID_FLAGS = ("--push-to-hub", "--push_to_hub"), ("--hub-model-id", "--hub_model_id")


def hub_flags(argv: list[str]) -> list[str]:
    """``argv`` with HF Trainer's upload flags as lmtune's: there ``--push_to_hub`` is yes/no (bare,
    or True/False) and ``--hub_model_id`` names the repository; lmtune's ``--push-to-hub`` takes
    the repository. Yes with a repository becomes ``--push-to-hub NAME/REPO``, no drops both.

    Raises:
        UserError: yes without a repository.
    """
    switch, repo, out, i = None, None, [], 0
    while i < len(argv):
        name, eq, inline = argv[i].partition("=")
        following = argv[i + 1] if i + 1 < len(argv) else "-"
        value = inline if eq else ("" if following.startswith("-") else following)
        taken = 1 if eq or not value else 2
        if name in PUSH_FLAGS and value.lower() in ("", *YES, *NO):
            switch = value.lower() not in NO
        elif name in HUB_ID_FLAGS and value:
            repo = value
        else:
            out.append(argv[i])
            taken = 1
        i += taken
    if switch is None:
        return argv  # lmtune's own spelling, --push-to-hub NAME/REPO (--hub_model_id alone is answered)
    if switch and repo is None:
        raise UserError(
            "--push-to-hub: takes the repository to upload to (NAME/REPO, HF Trainer's hub_model_id)"
        )
    return [*out, "--push-to-hub", repo] if switch and repo else out


def spelled_twice(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """A setting given under two of its names with other values (``--lr 1e-4 --learning-rate
    2e-4``): which was meant is not for lmtune to guess (a YAML file that does so is refused too;
    the same value under both is taken, as there). The same name repeated, or a yes/no option with
    its ``--no-`` form, is argparse's rule: the last one wins (a later flag overrides a script's);
    not for a list (``--data a.jsonl --data b.jsonl`` would train on b alone), which takes its items
    comma-separated."""
    from lmtune.config.aliases import same_value
    from lmtune.config.settings import option_name

    first: dict[str, str] = {}
    values: dict[str, Any] = {}
    configs = 0
    for at, token in enumerate(argv):
        option = token.split("=", 1)[0]
        action = parser._option_string_actions.get(option) if option.startswith("--") else None
        configs += action is not None and action.dest == "config"
        if configs > 1:  # the first file was left unread without a word
            return (
                "--config is given twice; it reads one file: put the settings in one, and flags override it"
            )
        if action is None or action.dest in ("help", "config", "verbose"):
            continue
        name = option.replace("_", "-").removeprefix("--no-").removeprefix("--")
        if action.dest in LIST_SETTINGS and action.dest in first:
            return (
                f"{option_name(action.dest)} is given twice; give its items once, comma-separated "
                f"({option_name(action.dest)} {LIST_SETTINGS[action.dest]})"
            )
        value = _flag_value(action, token, argv[at + 1 : at + 2])
        earlier = first.setdefault(action.dest, name)
        if earlier != name and not same_value(values[action.dest], value):
            return f"{option_name(action.dest)} is set twice (as --{earlier} and {option}); give it once"
        values.setdefault(action.dest, value)
    return None


def _flag_value(action: argparse.Action, token: str, after: list[str]) -> Any:
    """The value ``token`` gives its option: a yes/no flag's, or the text after ``=`` or next."""
    if action.nargs == 0:
        return not token.startswith("--no-")
    return token.split("=", 1)[1] if "=" in token else (after[0] if after else None)


# Settings that hold several items, and an example of them.
LIST_SETTINGS = {
    "data": "a.jsonl,b.jsonl",
    "eval_data": "a.jsonl,b.jsonl",
    "data_weights": "3,1",
    "lora_target_modules": "q_proj,v_proj",
    "field_map": "prompt=question,completion=answer",
    "report_to": "tensorboard,wandb",
}
