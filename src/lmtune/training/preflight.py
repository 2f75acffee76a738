"""validate(cfg, world_size): every setting and every input it names checked before anything runs
(in the launcher before N processes start, and in each process), each error naming its option."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lmtune.checkpoint.finished import began_from
from lmtune.checkpoint.layout import not_a_checkpoint, verify
from lmtune.checkpoint.rundir import check_output_dir, check_outside_inputs
from lmtune.config.groups import ExampleSettings
from lmtune.config.mixture import joined
from lmtune.config.run_groups import names_checkpoint
from lmtune.config.settings import TrainConfig, config_fields, option_name, value_of
from lmtune.config.validate import PREFERENCE, check_settings
from lmtune.data.audit import stops_lost_warning
from lmtune.data.chat import read_template
from lmtune.data.dataset import TokenizedDataset, shared_examples
from lmtune.data.formats import FieldMap, unused_names
from lmtune.data.readers import iter_records
from lmtune.data.sources import BadLines, resolve_sources
from lmtune.errors import SettingError, UserError, brief
from lmtune.model.modeling import is_adapter_folder, no_such_folder
from lmtune.model.quantization import require_bitsandbytes
from lmtune.outputs.hub import check_push
from lmtune.outputs.reporters import check_installed, parse_report_to
from lmtune.parallel.distributed import DistEnv, all_gather_object, launched_rank
from lmtune.parallel.launch import needs_launcher


def checked(cfg: Any) -> TrainConfig:
    """``cfg``, when it is a TrainConfig (``lmtune.train({...})`` would fail deep inside), with
    lmtune's variables checked, from Python as the CLI checks them first (a typo is not ignored)."""
    from lmtune.config.environment import check_environment

    check_environment()
    if not isinstance(cfg, TrainConfig):
        raise UserError(
            f"lmtune.train takes a TrainConfig (lmtune.TrainConfig(**settings)), not {type(cfg).__name__}"
        )
    return cfg


def validate(
    cfg: TrainConfig, world_size: int, in_process: bool = False, given: frozenset[str] | None = None
) -> None:
    """Reject settings that cannot work and inputs that are not there; ``world_size`` is the
    process count; ``in_process``: the run is about to train in this process, which settings that
    ask for more processes cannot mean unless a launcher started it (the Python API); ``given``:
    the settings the user gave (None: not known)."""
    if in_process and launched_rank() is None and needs_launcher(cfg.launch):
        raise UserError(
            "--nproc-per-node, --nnodes and --max-restarts start processes through a launcher, and "
            "lmtune.train runs in this process: use `lmtune train` (it launches them) or torchrun"
        )
    check_settings(cfg, world_size, given)
    if cfg.lora.enabled and is_adapter_folder(cfg.model.name):
        merged = Path(cfg.model.name, "merged")
        raise UserError(
            f"--model {cfg.model.name}: a LoRA adapter; a new adapter trained on it with --lora would sit "
            "on its base with this adapter merged in, a model no folder holds, so the new adapter could "
            "not name its base. Give the merged model ("
            + (
                f"{merged}"
                if (merged / "config.json").is_file()
                else "`lmtune export RUN/checkpoints/step-N DIR --merge-lora` writes it"
            )
            + ") as --model, or train without --lora (the merged weights train)"
        )
    if cfg.examples.max_prompt_length is not None and cfg.objective.name not in PREFERENCE:
        # Here, not among check_settings' rules: `data audit` takes it for pair data, with no objective.
        raise SettingError(
            "max_prompt_length",
            "--max-prompt-length",
            f"applies to preference pairs (--objective {', '.join(PREFERENCE)}), not to --objective "
            f"{cfg.objective.name}",
        )
    FieldMap.of(cfg.examples)  # a malformed --field-map fails here, not on the first record
    for spec, option in ((cfg.data.train, "--data"), (cfg.data.eval, "--eval-data")):
        if spec is not None:
            resolve_sources(spec, option)  # missing files and empty globs fail here
    if cfg.examples.chat_template is not None:
        read_template(cfg.examples.chat_template)
    if cfg.samples.prompts is not None and not Path(cfg.samples.prompts).expanduser().is_file():
        raise UserError(f"--sample-prompts: no such file (got {brief(cfg.samples.prompts)})")
    resume = cfg.checkpoint.resume
    if not resume.strip():  # Path("") is the working folder
        raise UserError("--resume: empty; give a checkpoint folder (RUN/checkpoints/step-N), auto or never")
    if names_checkpoint(resume):
        if Path(resume).exists() and not Path(resume).is_dir():
            raise UserError(f"--resume {resume}: not a folder; it takes a checkpoint, RUN/checkpoints/step-N")
        # The same command as the folder's run began with: it continues from where the run got to,
        # which --keep-last may have pruned that checkpoint behind.
        if not Path(resume).is_dir() and not began_from(Path(cfg.checkpoint.output_dir), resume):
            raise UserError(f"--resume: no such checkpoint folder: {resume}")
        if Path(resume).is_dir() and verify(Path(resume)) and (instead := not_a_checkpoint(Path(resume))):
            raise UserError(f"--resume {resume}: {instead}; it takes a checkpoint, RUN/checkpoints/step-N")
    _check_outside_launcher(cfg)
    _check_reference_folder(cfg.objective.reference_model)
    check_installed(parse_report_to(cfg.logging.report_to))
    if cfg.checkpoint.push_to_hub is not None:
        check_push(cfg.checkpoint.push_to_hub)  # a missing token is found now, not after training
    one = _one_path
    inputs = {
        "--data": cfg.data.train,
        "--eval-data": cfg.data.eval or "",
        "--model": one(cfg.model.name),
        "--reference-model": one(cfg.objective.reference_model or ""),
        "--sample-prompts": one(cfg.samples.prompts or ""),
        "--chat-template": one(cfg.examples.chat_template or ""),
    }
    if cfg.checkpoint.overwrite and names_checkpoint(resume):
        # Without --overwrite a checkpoint of the folder itself is what a resume continues.
        inputs["--resume"] = one(resume)
    check_output_dir(Path(cfg.checkpoint.output_dir), inputs, cfg.checkpoint.overwrite)
    if cfg.data.cache_dir:
        check_outside_inputs(Path(cfg.data.cache_dir), "--cache-dir", inputs)
    for option, on in (
        ("--load-in-4bit", cfg.model.load_in_4bit),
        ("--load-in-8bit", cfg.model.load_in_8bit),
    ):
        if on:
            require_bitsandbytes(option, _device(cfg.model.device))


def _check_reference_folder(reference: str | None) -> None:
    """Found now, not when it loads, after the data is tokenized and the model built."""
    if reference and (missing := no_such_folder(reference, "--reference-model")) is not None:
        raise missing


def _one_path(path: str) -> str:
    """``path`` as one item of a list of sources: a comma in its name kept, ``lr=1e-3/final`` not
    read as a source named ``lr``."""
    one = joined([path])
    return one if "=" not in path.split("/")[0] or Path(path).is_absolute() else f"./{one}"


def warn_unmatched_names(cfg: TrainConfig, info: Callable[[str], None]) -> None:
    """A warning when the first record of --data has none of the fields --text-field and
    --field-map name, but lmtune's own name for one: it is read as it is, so the mapped name was
    likely misspelled (the formats alone cannot tell: the record still has a format)."""
    names = FieldMap.of(cfg.examples)
    top = {ours: theirs for ours, theirs in names.fields.items() if ours != theirs}
    # Read as a stream (its first line), not a whole .json or a hub data set.
    first = next(
        (s for s in resolve_sources(cfg.data.train, "--data") if s.kind in ("jsonl", "csv", "tsv")), None
    )
    if not top or first is None:
        return
    record = next(iter_records(first, "text", BadLines(skip=True)), None)
    if record is None:
        return
    for ours, theirs in top.items():
        if theirs not in record.fields and ours in record.fields:
            by_text_field = ours == "text" and cfg.examples.text_field == theirs
            option = f"--text-field {theirs}" if by_text_field else f"--field-map {ours}={theirs}"
            info(
                f"warning: {option}: the first record of {first.name} has no {theirs!r} field, and its "
                f"{ours!r} field is read as it is (a misspelled name?)"
            )


def _check_outside_launcher(cfg: TrainConfig) -> None:
    """Settings given to the launcher that started this process (torchrun, accelerate launch),
    which lmtune would otherwise ignore without a word: refused, naming lmtune's option."""
    env = os.environ
    local = env.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and cfg.launch.nproc_per_node not in (1, int(local)):
        raise UserError(
            f"--nproc-per-node {cfg.launch.nproc_per_node}, but the launcher started {local} processes "
            "on this node: drop --nproc-per-node under torchrun (its own --nproc-per-node decides)"
        )
    # accelerate launch passes its settings in the environment; lmtune reads its own options.
    problems = []
    precision = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if precision not in ("no", cfg.model.precision):
        problems.append(f"--mixed_precision {precision} (give --precision {precision})")
    if env.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        problems.append("DeepSpeed (lmtune does not run it; --strategy fsdp shards the model)")
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true" and cfg.launch.strategy != "fsdp":
        problems.append("--use_fsdp (give --strategy fsdp)")
    if env.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper() != "NO" and not cfg.model.compile:
        problems.append("--dynamo_backend (give --compile)")
    if problems:
        raise UserError(f"accelerate launch settings that lmtune does not read: {'; '.join(problems)}")


def _device(device: str) -> torch.device:
    """The device type --device means here (bitsandbytes' backends are per type, not per index)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# Settings each process or node may hold its own value of: where and how it runs, not what trains.
_PER_PROCESS = frozenset({"progress", "doctor", "cache_dir", "cache_per_node", "num_workers"})


def check_same_settings(cfg: TrainConfig, env: DistEnv, strategy: str) -> None:
    """Every process of a job runs the same settings (collective): two nodes started with different
    commands or configs would train apart silently (a different --lr) or hang (a different
    --max-steps: one rank stops stepping while the others wait for it).

    Raises:
        UserError: on every rank, naming each setting that differs and where.
    """
    mine = {
        s.name: value_of(cfg, s)
        for s in config_fields()
        if s.group != "launch" and s.name not in _PER_PROCESS
    }
    # How each node launches may differ (its processes, its rank); the strategy it runs (``auto``
    # resolved) may not: DDP and FSDP ranks waited on each other's collectives for 30 minutes.
    mine["strategy"] = strategy
    problems = settings_differences(all_gather_object(mine, env))
    if problems:
        raise UserError(
            "the processes of this job were given different settings: "
            + "; ".join(problems[:5])
            + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            + " (every process must run the same: one command, or the same config on every node)"
        )


def warn_of_lost_stops(
    train: dict[str, Any], chat: bool, unit: str, examples: ExampleSettings, info: Callable[[str], None]
) -> None:
    """Where most training examples train no stop token, say so, with its likely cause."""
    kept, stopping = train["examples"], train["eos_trained"]
    if stopping < kept / 2:
        info(stops_lost_warning(kept - stopping, kept, chat, unit, examples, bool(train.get("truncated"))))


def check_same_data(name: str, spec: str, option: str, gathered: list[tuple[bool, str, int]]) -> None:
    """Every process read the same data (collective, each rank's count gathered): a node whose own
    copy of the files (or whose --cache-per-node cache) differs drew its samples from another order
    and epoch, silently, or ended its epoch early and hung the others. The cache key is rank 0's on
    every rank (it is broadcast), so only the count tells; a node's own copy of other content is
    caught by its builder's hash.

    Raises:
        UserError: on every rank, naming how many examples each read.
    """
    read: dict[int, list[int]] = {}
    for rank, (_, _, examples) in enumerate(gathered):
        read.setdefault(examples, []).append(rank)
    if len(read) > 1:
        shown = "; ".join(
            f"{examples:,} examples on rank{'s' * (len(ranks) > 1)} " + ",".join(map(str, ranks))
            for examples, ranks in read.items()
        )
        raise UserError(
            f"{option} {spec}: the processes of this job read different {name} data: {shown}; every node "
            "must read the same files (a node's own copy differs, or its --cache-per-node cache was built "
            "from other files)"
        )


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def settings_differences(by_rank: list[dict[str, Any]]) -> list[str]:
    """Each setting whose value is not the same on every rank: ``--lr 0.001 on rank 0, 0.002 on
    rank 1`` (ranks of one value together)."""
    found = []
    for name in by_rank[0]:
        ranks: dict[str, list[int]] = {}
        for rank, values in enumerate(by_rank):
            ranks.setdefault(repr(values.get(name)), []).append(rank)
        if len(ranks) > 1:
            shown = ", ".join(
                f"{_shown(by_rank[r[0]].get(name))} on rank{'s' * (len(r) > 1)} {','.join(map(str, r))}"
                for r in ranks.values()
            )
            found.append(f"{option_name(name)} {shown}")
    return found


def warn_unused_names(
    cfg: TrainConfig,
    data_info: dict[str, Any],
    info: Callable[[str], None],
    data: tuple[TokenizedDataset, TokenizedDataset | None] | None = None,
) -> None:
    """A warning for --text-field, --field-map and --txt-mode values the data never used: a setting
    that changed nothing usually means other data, or another field, was meant."""
    formats = {f for split in data_info.values() for f in split.get("formats", {})}
    unused = unused_names(cfg.examples, formats)
    if unused:
        info(
            f"warning: {', '.join(unused)} changed nothing: no record of the data was read through "
            f"{'it' if len(unused) == 1 else 'them'} (formats found: {', '.join(sorted(formats))})"
        )
    warn_unmatched_names(cfg, info)
    if cfg.data.eval is not None and data_info.get("eval", {}).get("key") == data_info["train"]["key"]:
        info(
            "warning: --eval-data is the training data: its loss says how well the model fits what it "
            "trains on, not how it does on examples it never saw (--eval-split N holds N of them out)"
        )
    elif cfg.data.eval is not None and data is not None and (held := data[1]) is not None:
        shared = shared_examples(data[0], held)  # (of its own examples: copies of training ones, say)
        if shared:
            info(
                f"warning: {shared:,} of the {len(held):,} --eval-data examples are training examples "
                "too: their loss says how well the model remembers them (lmtune data audit DATA --eval-data "
                "EVAL names them)"
            )
    mode = cfg.examples.txt_mode
    given = [(cfg.data.train, "--data"), (cfg.data.eval, "--eval-data")]
    if mode != ExampleSettings().txt_mode and not any(
        s.kind == "txt" for spec, option in given if spec for s in resolve_sources(spec, option)
    ):
        info(f"warning: --txt-mode {mode} changed nothing: the data has no .txt file")
