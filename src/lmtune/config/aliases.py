"""The names users bring from Hugging Face Trainer, TRL and Axolotl, and what lmtune makes of them.

A name with the same meaning as an lmtune setting is an accepted alias (``--learning-rate``,
``learning_rate:``): it sets that setting, which run.json records under lmtune's name. A name whose
meaning differs, or that lmtune derives instead of taking, is refused with a hint that says what to
do (exit 2). Any other unknown name gets the closest names as suggestions. Flags and YAML keys go
through the same table.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from lmtune.config.axolotl_data import datasets_here, separator
from lmtune.config.hints import BY_VALUE, HINTS, IN_COMMAND
from lmtune.config.switches import DTYPES, PEER_NULLS, READ_AS, VALUE_SWITCHES, steps_left_unset
from lmtune.errors import UserError, one_line

# Foreign name -> the lmtune setting of the same meaning.
ALIASES: dict[str, str] = {
    "learning_rate": "lr",  # HF Trainer, TRL, Axolotl
    "num_train_epochs": "epochs",  # HF Trainer, TRL
    "num_epochs": "epochs",  # Axolotl
    "per_device_train_batch_size": "micro_batch_size",  # HF Trainer, TRL
    "max_seq_length": "max_length",  # TRL (before 0.20)
    "sequence_len": "max_length",  # Axolotl
    "save_steps": "save_every",  # HF Trainer
    "eval_steps": "eval_every",  # HF Trainer
    "logging_steps": "log_every",  # HF Trainer
    "save_total_limit": "keep_last",  # HF Trainer
    "load_best_model_at_end": "load_best_at_end",  # HF Trainer
    "metric_for_best_model": "metric_for_best",  # HF Trainer
    "overwrite_output_dir": "overwrite",  # HF Trainer
    "dataloader_num_workers": "num_workers",  # HF Trainer
    "adam_epsilon": "adam_eps",  # HF Trainer
    "gradient_checkpointing": "activation_checkpointing",  # HF Trainer, Axolotl
    "torch_compile": "compile",  # HF Trainer, Axolotl
    "model_name_or_path": "model",  # HF examples, TRL
    "base_model": "model",  # Axolotl
    "train_file": "data",  # HF examples
    "validation_file": "eval_data",  # HF examples
    "dataset_name": "data",  # TRL: a hub data set, which --data takes
    "dataset_text_field": "text_field",  # TRL
    "train_on_inputs": "train_on_prompt",  # Axolotl
    "val_set_size": "eval_split",  # Axolotl
    "lora_r": "lora_rank",  # TRL, Axolotl
    "use_peft": "lora",  # TRL
    "ddp_timeout": "collective_timeout",  # HF Trainer: seconds, as lmtune's
    "hub_private_repo": "hub_private",  # HF Trainer
    "neftune_noise_alpha": "neftune_alpha",  # HF Trainer, TRL, Axolotl
    "rl_beta": "beta",  # Axolotl
    "dpo_beta": "beta",  # Axolotl (before rl_beta)
    "orpo_alpha": "orpo_lambda",  # Axolotl: ORPO's weight, which it passes as TRL's ORPOConfig.beta
    "log_every_n_steps": "log_every",  # torchtune
    "enable_activation_checkpointing": "activation_checkpointing",  # torchtune
    "out_dir": "output_dir",  # litgpt
    "num_nodes": "nnodes",  # litgpt
}


# Names whose meaning a command takes under a name of its own (lmtune eval's --batch-size is its
# examples per forward), checked before the table's answer for lmtune train.
_MEANT_HERE = dict.fromkeys(
    ("per_device_eval_batch_size", "eval_batch_size", "per_device_train_batch_size", "micro_batch_size"),
    "batch_size",
)


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _styled(text: str, style: Callable[[str], str]) -> str:
    return _PLACEHOLDER.sub(lambda m: style(m.group(1)), text)


def yaml_hint(name: str) -> str:
    """The answer to another tool's ``name`` (in :data:`HINTS`), in a YAML file's names."""
    return _styled(HINTS[name], lambda setting: setting)


def canonical(name: str) -> str:
    """A flag or key as a setting-style name: ``--Learning-Rate`` -> ``learning_rate`` (at most 80
    characters of it: a message shows it, and a hostile file may hold a key of any length)."""
    return " ".join(name[:200].lstrip("-").split("=", 1)[0].replace("-", "_").lower().split())[:80]


def aliases_of(setting: str) -> list[str]:
    """The foreign names accepted for ``setting``."""
    return [foreign for foreign, ours in ALIASES.items() if ours == setting]


# What a short option means in other tools, by the names each command may have for it.
_SHORT = {"o": ("out", "output_dir", "json", "plot"), "m": ("model",), "c": ("config",), "d": ("data",)}


def as_arguments(option: str, parser: Any) -> str:
    """How ``parser``'s command takes ``option``'s values instead, as its arguments (data audit's
    files, report's output folders), or ""."""
    key = canonical(option.split("=", 1)[0])
    positional = [x for x in parser._actions if not x.option_strings]
    if key not in {canonical(x.dest) for x in positional}:
        return ""
    # All of them, in order: export's --out is its second (CHECKPOINT DIR), not its first.
    names = [(x.metavar or x.dest.upper()) + (" ..." if x.nargs in ("*", "+") else "") for x in positional]
    usage = " ".join(names)
    return f" (give it as arguments: {parser.prog} {usage})"


def explain_unknown(
    name: str, known: Iterable[str], style: Callable[[str], str], where: str, value: Any = None
) -> str:
    """Why ``name`` is not accepted ``where`` (a command, or a YAML file), in one line.

    ``known``: the setting-style names accepted there; ``style`` writes a name as it is written
    there (``--lr`` on the command line, ``lr`` in YAML); ``value``: what it was given, if known.
    """
    key, accepted = canonical(name), set(known)
    written = one_line(name, 80).split("=", 1)[0]
    upper = written != written.lower()
    # A short option (-q) is shown as written: its long form (--q) is no one's spelling.
    shown = written if upper or (written.startswith("-") and not written.startswith("--")) else style(key)
    kind = "option" if style(key).startswith("-") else "setting"
    meant = ALIASES.get(key, key)
    if upper and meant in accepted:  # names are matched exactly, as argparse matches options
        return f"{written}: names are lower case; did you mean {style(meant)}?"
    command = IN_COMMAND.get(where.removeprefix("lmtune "), {})
    if key not in accepted and (answer := command.get(key, command.get(meant))):
        return f"{shown}: {answer}"
    if (here := _MEANT_HERE.get(key)) in accepted and key not in accepted:
        return f"{shown} is {style(str(here))} in {where}"
    if key in ALIASES and ALIASES[key] not in accepted:
        return f"{shown} is {style(ALIASES[key])} in lmtune, which {where} does not take"
    from lmtune.config.settings import config_fields  # it explains its own unknown names with this

    if key not in accepted and any(s.name == key for s in config_fields()):
        plural = [c for c in sorted(accepted) if c == f"{key}s"]  # bench's --precisions
        instead = f"; it takes {style(plural[0])}" if plural else ""
        return f"{shown} is a setting of lmtune train, which {where} does not take{instead}"
    # The closest names: this place's own, and the foreign names of the table (a typo of one).
    candidates = sorted(accepted | set(ALIASES) | set(HINTS))
    # An abbreviation (refused: a later option could make it ambiguous) names what it abbreviates.
    prefixed = [c for c in candidates if len(key) >= 3 and c.startswith(key) and not c.startswith("no_")]
    close = [key] if key in HINTS else difflib.get_close_matches(key, candidates, n=3, cutoff=0.75)
    # What the name extends (report's --out for --output), or what a short option means elsewhere.
    extends = [c for c in sorted(accepted) if len(c) >= 3 and key.startswith(c)]
    short = (
        [c for c in _SHORT.get(key, ()) if c in accepted] if written.startswith("-") and len(key) == 1 else []
    )
    close = list(dict.fromkeys([*close, *prefixed[:3], *extends, *short]))
    given = str(value).lower() if isinstance(value, (str, bool, int, float)) else None
    answers = BY_VALUE.get(key, {})
    if given is not None and (answer := answers.get(given, answers.get("*"))):
        return f"{shown}: {_styled(answer, lambda n: one_line(given, 40) if n == 'value' else style(n))}"
    if close and close[0] in HINTS:
        hint = _styled(HINTS[close[0]], style)
        if close[0] == key:
            return f"{shown}: {hint}"
        # A near name's answer, not this one's: torchtune's max_steps_per_epoch is not saves_per_epoch.
        return f"unknown {kind} {shown}; did you mean {style(close[0])}? ({style(close[0])}: {hint})"
    suggestions = [ALIASES.get(c, c) for c in close if c not in HINTS]
    suggestions = [s for s in dict.fromkeys(suggestions) if s in accepted]
    if not suggestions:
        return f"unknown {kind} {shown}" + (f" (`{where} --help` lists them)" if kind == "option" else "")
    return f"unknown {kind} {shown}; did you mean {' or '.join(style(s) for s in suggestions)}?"


def switch_given(key: str, value: Any, values: dict[str, Any], style: Callable[[str], str]) -> str:
    """For another tool's switch whose lmtune settings are all given (in ``values``) as it means
    them (TRL's --loss_type sigmoid beside --objective dpo): it adds nothing, so say to drop it."""
    switched = value_switched(key, True if value is None else value)  # None: a bare --bf16
    given = {ALIASES.get(canonical(k), canonical(k)): v for k, v in values.items()}
    if not switched or any(not same_value(given.get(n), v) for n, v in switched.items()):
        return ""
    shown = ", ".join(f"{style(n)} {str(v).lower()}" for n, v in switched.items())
    return f"; {shown} {'is' if len(switched) == 1 else 'are'} given, so drop {style(canonical(key))}"


def accumulation_here(key: str, value: Any, values: dict[str, Any], style: Callable[[str], str]) -> str:
    """For gradient_accumulation_steps beside a micro-batch size (in ``values``): the global batch
    they make on one device, in this place's names."""
    if canonical(key) != "gradient_accumulation_steps":
        return ""

    def given(setting: str) -> Any:
        return next(
            (v for k, v in values.items() if ALIASES.get(canonical(k), canonical(k)) == setting), None
        )

    # Flags arrive as text, YAML values as numbers.
    value, micro, batch = (
        int(v) if isinstance(v, str) and v.isdigit() else v
        for v in (value, given("micro_batch_size") or given("batch_size"), given("global_batch_size"))
    )  # torchtune's batch_size is per device, as micro_batch_size
    if not (type(value) is int and value > 0):
        value = 4
    sep = separator(style)
    if type(batch) is int and batch > 0 and micro is None and batch % value == 0:
        return (  # the global batch given: what micro-batch it means with this accumulation
            f"; {style('global_batch_size')}{sep}{batch} with {value} accumulation on one device is "
            f"{style('micro_batch_size')}{sep}{batch // value}"
        )
    if not (type(micro) is int and micro > 0):
        micro = 8  # HF Trainer's default per_device_train_batch_size
    contradicted = (  # the global batch given too, which the accumulation contradicts
        f" (the {style('global_batch_size')}{sep}{batch} given with it is {batch // micro} accumulation "
        f"steps on one device: drop {style('gradient_accumulation_steps')} to keep it)"
        if type(batch) is int and batch > 0 and batch != micro * value and batch % micro == 0
        else ""
    )
    return (
        f"; {micro} per device x {value} accumulation on one device is {style('global_batch_size')}{sep}"
        f"{micro * value}, {style('micro_batch_size')}{sep}{micro}, and the same numbers train the same on "
        f"any number of processes{contradicted}"
    )


def lmtune_name(key: str, accepted: set[str]) -> str:
    """The setting ``key`` names: itself, or the one it is an alias of. Matched as written, lower
    case (as the command line's options are): `Learning_Rate` is refused with its lower-case name,
    as `LR` is."""
    return key if key in accepted or key != key.lower() else ALIASES.get(canonical(key), key)


def resolve_names(
    values: dict[str, Any],
    known: Iterable[str],
    where: Callable[[str], str],
    style: Callable[[str], str] = lambda name: name,
) -> dict[str, Any]:
    """``values`` under lmtune's names: aliases renamed, anything else unknown refused.

    Raises:
        UserError: starting with ``where(key)`` (the file and line), for a name that has a hint or
            is unknown, or a setting given twice (under its name and an alias).
    """
    accepted = set(known)
    values = peers_switched(values, where, style)
    out: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    unknown: list[str] = []  # all of them at once: a config from another tool has several
    for key, value in values.items():
        name = lmtune_name(key, accepted)
        if name not in accepted and value is None:
            continue  # another tool's key left empty (unset, as Axolotl's configs leave many) asks nothing
        if name not in accepted:
            why = explain_unknown(key, accepted, style, "lmtune train", value)
            here = accumulation_here(key, value, values, style) + datasets_here(canonical(key), value, style)
            unknown.append(where(key) + why + here)
            continue
        if value is None and canonical(key) in PEER_NULLS:
            value = PEER_NULLS[canonical(key)]
        read = READ_AS.get(name, lambda v: v)
        if name in out and (same_value(read(out[name]), read(value)) or value is None):
            # Two names of one setting that agree (TRL's dumps write gradient_checkpointing beside
            # its new name), or one of them left empty (a dump's null: unset, asking nothing).
            continue
        if name in out and out[name] is None:
            out[name], given_as[name] = value, key
            continue
        if name in out:
            both = f"as {one_line(given_as[name], 60)} and {one_line(key, 60)}"
            unknown.append(f"{where(key)}{style(name)} is set twice ({both}); give it once")
            continue
        out[name], given_as[name] = value, key
    if unknown:
        raise UserError("\n".join(unknown))
    return steps_left_unset(out)


def same_value(a: Any, b: Any) -> bool:
    """Two values of one setting that say the same (1e-4 and "1e-4", which YAML reads as text, or
    0.0001; True and "true"); not True and 1, which Python counts equal where the setting refuses 1."""
    if a is None or b is None:
        return a is b
    text_a, text_b = (str(v).strip().lower() for v in (a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return text_a == text_b
    numbers = [_number(v) for v in (a, b)]
    if numbers[0] is not None and numbers[1] is not None:
        return numbers[0] == numbers[1]
    return bool(a == b) or text_a == text_b


def _as_switch(value: Any) -> Any:
    """A yes/no as True or False, however written (``packing: true`` is lmtune's packing on)."""
    text = str(value).strip().lower()
    return True if text in ("true", "yes", "on") else False if text in ("false", "no", "off") else value


def _number(value: Any) -> float | None:
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def peers_switched(
    values: dict[str, Any],
    where: Callable[[str], str],
    style: Callable[[str], str],
    giver: str = "the file",
) -> dict[str, Any]:
    """``values`` with other tools' switches as lmtune's settings: HF Trainer's yes/no
    ``push_to_hub`` beside ``hub_model_id``, and :data:`VALUE_SWITCHES` (Axolotl's ``adapter:
    qlora``, TRL's ``loss_type: sigmoid``, ``bf16: true``); ``giver`` names what gave ``values``."""
    _check_pairs(values, where, style, giver)
    return _value_switches(_hub_switch(values, where, style), where, style, giver)


def _check_pairs(
    values: dict[str, Any], where: Callable[[str], str], style: Callable[[str], str], giver: str
) -> None:
    """Peers' keys whose meaning depends on another of the same file, refused where lmtune would
    take them for something else: Axolotl's adapter qlora (4-bit) beside load_in_8bit, TRL's
    CPOConfig (loss_type simpo with the default cpo_alpha 1.0 is CPO-SimPO; cpo_alpha belongs to
    it), bitsandbytes' compute dtype (of a 4-bit base only, and lmtune's is the run's precision)."""
    given = {canonical(k): k for k in values}

    def low(name: str) -> str | None:
        return str(values[given[name]]).lower() if name in given else None

    def refuse(name: str, why: str) -> None:
        raise UserError(f"{where(given[name])}{given[name]}: {_shown(values[given[name]])} {why}")

    if low("adapter") == "qlora" and low("load_in_8bit") == "true":  # Axolotl's 8-bit LoRA is adapter: lora
        refuse(
            "adapter",
            f"is LoRA on a 4-bit base in lmtune ({style('load_in_4bit')}), and {giver} asks for 8-bit "
            f"({style('load_in_8bit')}): for LoRA on an 8-bit base give {given['adapter']}: lora",
        )
    alpha, loss = low("cpo_alpha"), low("loss_type")
    if loss == "simpo" and alpha not in ("0", "0.0"):
        refuse(
            "loss_type",
            f"with cpo_alpha {alpha or '1.0 (its default)'} is TRL's CPO-SimPO (with an NLL term); "
            f"lmtune's {style('objective')} simpo is SimPO, TRL's cpo_alpha: 0",
        )
    if alpha is not None and loss != "simpo":
        refuse(
            "cpo_alpha",
            f"is a setting of TRL's CPOConfig, whose loss_type {loss or 'sigmoid (its default)'} is CPO, "
            f"which lmtune has not ({style('objective')} simpo is loss_type: simpo with cpo_alpha: 0)",
        )
    strategy = next((n for n in ("eval_strategy", "evaluation_strategy") if low(n) in ("no", "false")), None)
    asked = [given[k] for k in given if _asks_evaluation(k, values[given[k]])]
    if strategy is not None and asked:
        raise UserError(  # "no", as written: YAML reads an unquoted no as false
            f"{where(given[strategy])}{given[strategy]}: no never evaluates in the HF Trainer, and {giver} "
            f"gives {', '.join(asked)}, with which lmtune evaluates: remove {given[strategy]} to evaluate, "
            f"or {', '.join(asked)} not to"
        )
    compute = low("bnb_4bit_compute_dtype")
    if compute is not None and low("load_in_4bit") != "true" and low("adapter") != "qlora":
        refuse(
            "bnb_4bit_compute_dtype",
            f"applies to a 4-bit base ({style('load_in_4bit')}), which {giver} does not ask for",
        )
    ours = next((p for p, names in DTYPES.items() if compute in names), None)
    if ours in ("bf16", "fp16") and low(ours) == "false":
        refuse(
            "bnb_4bit_compute_dtype",
            f"is {style('precision')} {ours} in lmtune (a 4-bit layer computes in the run's "
            f"precision), which {giver} turns off ({ours}: false)",
        )


def _asks_evaluation(key: str, value: Any) -> bool:
    """Whether ``key`` (canonical) is a setting that makes lmtune evaluate, given ``value``."""
    name = ALIASES.get(key, key)
    return name in ("eval_every", "eval_data", "eval_split") and value not in (None, 0, "", [])


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else one_line(str(value), 40)


def value_switched(key: str, value: Any) -> dict[str, Any]:
    """The settings another tool's ``key: value`` sets, and their values (:data:`VALUE_SWITCHES`)."""
    switches = VALUE_SWITCHES.get(canonical(key))
    written = _switch_value(value)
    if switches is None or written is None:
        return {}
    return dict(switches.get(written, {}))


def _switch_value(value: Any) -> str | None:
    """A value as :data:`VALUE_SWITCHES` lists it: lower case, a list of one as that one, a
    mapping (from YAML, or a flag's JSON: HF's --gradient_checkpointing_kwargs '{"use_reentrant":
    false}') as ``key=value,...``; None for what it lists none of (a list)."""
    value = _one(value)
    if isinstance(value, str) and value.strip().startswith("{"):
        with contextlib.suppress(ValueError):
            value = json.loads(value)
    if isinstance(value, dict):
        return ",".join(f"{k}={_shown(v)}" for k, v in sorted(value.items(), key=str)).lower()
    if isinstance(value, list) or (isinstance(value, int) and abs(value) > 10**100):
        return None  # (str(value) of an int past 4,300 digits fails)
    return str(value).lower()


def _one(value: Any) -> Any:
    """A list of one value as that value (TRL 1.x's ``loss_type: [sigmoid]``)."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _value_switches(
    values: dict[str, Any], where: Callable[[str], str], style: Callable[[str], str], giver: str
) -> dict[str, Any]:
    """Another tool's key whose value lmtune's settings say (:data:`VALUE_SWITCHES`: Axolotl's
    ``adapter: qlora`` is ``lora: true`` and ``load_in_4bit: true``, TRL's ``loss_type: sigmoid`` is
    ``objective: dpo``) becomes them; the same setting given by the file too is fine when it agrees
    (Axolotl's QLoRA configs give ``load_in_4bit: true`` beside ``adapter: qlora``). Another value
    is left to be refused with its hint.

    Raises:
        UserError: the file gives one of those settings another value.
    """
    out = dict(values)
    for key, value in ((k, _one(v)) for k, v in values.items()):
        switches, written = VALUE_SWITCHES.get(canonical(key)), _switch_value(value)
        switched = switches.get(written) if switches is not None and written is not None else None
        if switched is None:
            continue
        given = {ALIASES.get(canonical(k), canonical(k)): v for k, v in out.items()}
        if canonical(key) == "lora_target_linear" and not switched and "lora_target_modules" not in given:
            # Axolotl adapts the layers its lora_target_modules names; with none named, lmtune's
            # default (every linear layer) is what "false" turned off.
            modules, sep = style("lora_target_modules"), separator(style)
            raise UserError(
                f"{where(key)}{key}: false adapts the layers {modules} names, and the file names none "
                f"(lmtune's default is every linear layer; name them, as {modules}{sep}[q_proj, v_proj])"
            )
        del out[key]
        if canonical(key) == "lora_target_linear" and switched:
            # Axolotl adds every linear layer to the ones lora_target_modules names: all of them.
            out = {
                k: v
                for k, v in out.items()
                if ALIASES.get(canonical(k), canonical(k)) != "lora_target_modules"
            }
            given.pop("lora_target_modules", None)
        for name, ours in switched.items():
            if name not in given:
                out[name] = ours
            elif not same_value(*(_as_switch(v) for v in (given[name], ours))):
                written, other = (_shown(v) for v in (value, given[name]))
                raise UserError(
                    f"{where(key)}{key}: {written} is {style(name)} {str(ours).lower()} in "
                    f"lmtune, which {giver} sets to {other}"
                )
    return out


def _hub_switch(
    values: dict[str, Any], where: Callable[[str], str], style: Callable[[str], str]
) -> dict[str, Any]:
    """HF Trainer's ``push_to_hub`` is yes/no, the repository in ``hub_model_id``; lmtune's names
    the repository. Yes with a repository becomes lmtune's, no drops both (as in HF, no upload).

    Raises:
        UserError: yes without a repository.
    """
    names = {canonical(k): k for k in values}
    switch, repo_key = values.get(names.get("push_to_hub", "")), names.get("hub_model_id")
    if not isinstance(switch, bool):
        return values
    out = {k: v for k, v in values.items() if k not in (names["push_to_hub"], repo_key)}
    if switch and repo_key is None:
        raise UserError(
            f"{where(names['push_to_hub'])}{style('push_to_hub')} takes the repository to upload to "
            "(NAME/REPO, HF Trainer's hub_model_id), not yes/no"
        )
    return {**out, "push_to_hub": values[repo_key]} if switch and repo_key else out
