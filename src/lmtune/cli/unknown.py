"""What a command did not take, explained in one line: other tools' option names, hints, the
closest names, and torchtune's ``key=value`` overrides."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

# torchtune's command-line overrides: batch_size=4, optimizer.lr=2e-5 (a dotted key names a field
# of a component; its last part is the setting).
OVERRIDE = re.compile(r"[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*=")


def unknown_arguments(parser: argparse.ArgumentParser, extra: list[str], parsed: dict[str, Any]) -> str:
    """What ``parser`` (a subcommand's) did not take, in one line: per unknown option a peer's name in
    lmtune, a hint or the closest names; then stray arguments. ``parsed``: what it took, by destination."""
    from lmtune.config.aliases import (
        accumulation_here,
        as_arguments,
        canonical,
        explain_unknown,
        switch_given,
    )
    from lmtune.config.recipes import COMPONENT, component_answer, group_entry_answer
    from lmtune.config.settings import option_name

    known = {canonical(o) for o in parser._option_string_actions if o.startswith("--")}
    options = [a for a in extra if a.startswith("--") or (a.startswith("-") and not _is_number(a))]
    overrides = {a: _leaf(a) for a in extra if OVERRIDE.match(a)}
    values = {o: _value_of(o, extra) for o in options}
    given = {a: a.split("=", 1)[1] for a in overrides}
    # torchtune's and litgpt's dotted names (--optimizer.lr, --train.save_interval): the last part's.
    dotted = {a: _leaf(a) for a in options if "." in a.split("=", 1)[0]}
    given |= {a: values[a] or "" for a in dotted}
    # torchtune's --batch_size or batch_size=4 too
    parsed = {**parsed, **values, **{flag: given[a] for a, flag in overrides.items()}}

    def explained(option: str, value: str | None) -> str:
        return (
            explain_unknown(option, known, option_name, parser.prog, value)
            + accumulation_here(option, value, parsed, option_name)
            + switch_given(option, value, parsed, option_name)
            + as_arguments(option, parser)
        )

    problems = [explained(a, values[a]) for a in options if a not in dotted]
    for token, flag in [*overrides.items(), *dotted.items()]:
        value, ours = given[token], canonical(flag)
        group, name = _dotted(token)
        if flag == f"--{COMPONENT}":  # dataset._component_=...: a recipe's component
            said = component_answer(group.split(".", 1)[0])
        elif answer := group_entry_answer(group.rsplit(".", 1)[-1], name):  # --eval.max_iters
            said = answer
        elif ours in known:
            lora = "--lora " if ours.startswith("lora_") else ""  # torchtune's model.lora_rank=8
            said = f"give {lora}{flag.replace('_', '-')} {_shown(ours, value)}"
        else:
            said = explained(flag, value).removeprefix(f"{option_name(ours)}: ")
        how = "options are --name value here, not key=value overrides"
        problems.append(f"{token}: {how if token in overrides else 'options are not dotted here'} ({said})")
    taken = {i + 1 for i, a in enumerate(extra) if a in options and "=" not in a}  # --bogus 1: its value
    stray = [a for i, a in enumerate(extra) if not (a.startswith("-") or a in overrides or i in taken)]
    if stray:
        # litgpt's `finetune checkpoints/x` takes the model as an argument; lmtune's train takes options.
        paths = "the model is --model PATH, the data --data FILE; " if parser.prog.endswith(" train") else ""
        # Files after an option's value: most likely an unquoted glob that the shell expanded.
        glob = "; quote a glob, as --data 'data/*.jsonl': lmtune expands it" if _all_files(stray) else ""
        problems.append(
            f"unexpected argument{'s' if len(stray) > 1 else ''} {' '.join(stray)} ({paths}an option takes "
            f"one value; give a list comma-separated, as --lora-target-modules q_proj,v_proj{glob})"
        )
    return f"{parser.prog}: " + "; ".join(problems)


def _all_files(arguments: list[str]) -> bool:
    try:
        return all(Path(a).is_file() for a in arguments)
    except (OSError, ValueError):  # a name too long, or holding NUL
        return False


def _leaf(token: str) -> str:
    """The option a dotted name means: its last part, by lmtune's name where litgpt's group names it
    otherwise (train.save_interval: --save_every)."""
    from lmtune.config.recipes import in_group

    group, name = _dotted(token)
    return "--" + (in_group(group.rsplit(".", 1)[-1], name) or name)


def _dotted(token: str) -> tuple[str, str]:
    """``--train.save_interval=8`` or ``train.save_interval=8`` as ("train", "save_interval")."""
    group, _, name = token.lstrip("-").split("=", 1)[0].rpartition(".")
    return group, name


def _shown(name: str, value: str) -> str:
    """An override's value as the option would take it: a value the option does not take (litgpt's
    precision=bf16-mixed) is shown as its choices."""
    from lmtune.config.aliases import ALIASES
    from lmtune.config.settings import config_fields

    choices = next((s.choices for s in config_fields() if s.name == ALIASES.get(name, name)), ())
    if not value:
        return "VALUE"
    return value if not choices or value in choices else " | ".join(choices)


def _value_of(option: str, extra: list[str]) -> str | None:
    """The value given to an unknown ``option``: ``--name=V`` or ``--name V``."""
    if "=" in option:
        return option.split("=", 1)[1]
    after = extra.index(option) + 1
    return extra[after] if after < len(extra) and not extra[after].startswith("--") else None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
