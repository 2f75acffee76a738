"""The commands behind `lmtune`'s subcommands: parsed arguments -> work. Each imports what it needs
when it runs, so `lmtune --help` and a mistyped option cost no torch import."""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmtune.config.marks import Kind, check_replaceable, json_marked, write_output
from lmtune.errors import UserError

if TYPE_CHECKING:
    from lmtune.config.settings import TrainConfig


def output_file(given: str, option: str, kind: Kind) -> Path:
    """Where a command writes ``option``'s file, checked before its work: a file named for its
    kind outside a run's own entries, new or lmtune's earlier one (its missing folders are made
    when it is written)."""
    if not given.strip():  # Path("") is the working folder
        raise UserError(f"{option}: give a file's name (got an empty one)")
    path = Path(given).expanduser()
    suffixes = {"png": (".png",), "report": (".html", ".htm")}.get(kind, ())
    if suffixes and path.suffix.lower() not in suffixes:
        raise UserError(f"{option} {given}: name a {' or '.join(suffixes)} file")
    there = next(p for p in (path.parent, *path.parents) if p.exists() or p.is_symlink())  # "." or "/"
    if not there.is_dir():
        raise UserError(f"{option} {given}: {there} is not a folder")
    _outside_run_entries(path.parent, option, given)
    check_replaceable(path, option, kind)
    return path


def _json_output(given: str, kind: Kind) -> Path | None:
    """``--json``'s file, or None for ``-``: the JSON goes to standard output alone (for a pipe),
    and the table meant for a person to standard error."""
    return None if given == "-" else output_file(given, "--json", kind)


def _write_json(out: Path | None, text: str) -> None:
    if out is None:
        sys.stdout.write(text + "\n")
        return
    write_output(out, text, "--json")
    print(f"wrote {out}")


def _outside_run_entries(folder: Path, option: str, given: str) -> None:
    """Refuse a folder inside a run's checkpoints, final model or other entries: a file there would
    make a checkpoint fail its manifest, or a final folder refuse to be replaced. A folder of its
    own beside them (RUN/plots) is not the run's, as for --output-dir."""
    from lmtune.checkpoint.rundir import run_entry_holding

    if (entry := run_entry_holding(folder.resolve())) is not None:
        raise UserError(
            f"{option} {given}: lies inside {entry}, which the run in {entry.parent} wrote; choose another "
            "folder"
        )


def train_config(args: argparse.Namespace) -> Any:
    return _train_config_given(args)[0]


# A feature's switch and the settings that apply only with it on: a flag that turns it off (--no-lora)
# sets aside a --config file's settings of it (its lora.rank was refused as given for LoRA off).
SWITCHED_OFF_WITH = {
    # Axolotl's adapter: qlora with --no-lora: a full fine-tune, which loads no quantized base.
    "lora": (
        *("lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "merge_lora"),
        *("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type"),
    ),
    "load_in_4bit": ("bnb_4bit_quant_type",),
}


def _train_config_given(args: argparse.Namespace) -> tuple[Any, frozenset[str]]:
    """The run's config, and the settings given by flag or in the --config file (lmtune's names)."""
    from lmtune.config.io import config_and_given, load_yaml
    from lmtune.config.settings import config_fields

    values: dict[str, Any] = {}
    source = ""
    flags = {f.name: getattr(args, f.name) for f in config_fields() if hasattr(args, f.name)}
    if hasattr(args, "config"):
        values.update(load_yaml(args.config))
        source = args.config
        for switch, settings in SWITCHED_OFF_WITH.items():
            if flags.get(switch) is False:  # the file's run with that feature off, as the flag asks
                for name in settings:
                    values.pop(name, None)
    values.update(flags)
    if isinstance(values.get("data"), list):  # the DATA arguments of eval and data audit/show
        values["data"] = _data_arguments(values["data"])
    for name in ("data", "eval_data"):
        if name in values:
            values[name] = _one_named_file(values[name])
    return config_and_given(values, source)


def _one_named_file(value: Any) -> Any:
    """A value with commas that names one file or folder as a whole is that one source, as a DATA
    argument is (`--data 'notes, 2024.jsonl'`), not the sources between its commas."""
    from pathlib import Path

    if isinstance(value, str) and "," in value and "\\," not in value and Path(value).expanduser().exists():
        return value.replace(",", "\\,")
    return value


def _data_arguments(items: list[str]) -> list[str]:
    """DATA arguments as sources, one an argument; an argument that names no file but holds commas
    is read as --data reads its value, a source between commas (`lmtune data audit a.jsonl,b.jsonl`
    as train's `--data a.jsonl,b.jsonl`)."""
    import re
    from pathlib import Path

    sources: list[str] = []
    for item in items:
        if "," in item and not Path(item).expanduser().exists():
            sources += [part.replace("\\,", ",") for part in re.split(r"(?<!\\),", item) if part.strip()]
        else:
            sources.append(item)
    return sources


def train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from lmtune.parallel.distributed import launched_rank
    from lmtune.training.preflight import validate

    cfg, given = _train_config_given(args)
    # Not started by a launcher (no RANK): this command launches the job when it needs one. A
    # job of one process (--max-restarts with one process) has WORLD_SIZE 1 and is launched too:
    # its worker must train, not launch again.
    if launched_rank() is None:
        from lmtune.config.settings import parse_nnodes
        from lmtune.parallel.launch import needs_launcher, world_size_bounds

        if needs_launcher(cfg.launch):
            # Check in the launcher first: a bad option is then reported once, before N processes
            # start. Nodes may each run their own --nproc-per-node, so a job of several has its size
            # only when they meet: its ranks check what depends on it then.
            one_node = parse_nnodes(cfg.launch.nnodes)[1] == 1
            for world_size in sorted(set(world_size_bounds(cfg.launch))) if one_node else [1]:
                validate(cfg, world_size, given=given)
            return _launch_job(list(argv), cfg)
    from lmtune.train import train

    train(cfg, given=given)  # a run stopped by a signal has saved a checkpoint and exits cleanly too
    return 0


def _launch_job(argv: list[str], cfg: Any) -> int:
    """The job's processes, started by lmtune's launcher under the output folder's lock: taken
    before any worker starts by the launcher that hosts the job and handed to its workers."""
    from contextlib import nullcontext
    from pathlib import Path

    from lmtune.checkpoint.rundir import acquire
    from lmtune.parallel.launch import job_of, relaunch, warn

    job = job_of(cfg.launch)
    lock = acquire(Path(cfg.checkpoint.output_dir), job.run_id, warn) if job.hosts else nullcontext()
    with lock as held:
        if held is None:
            return relaunch(argv, cfg, job, None, lambda: None)
        return relaunch(argv, cfg, job, held.holder.token, held.release)


def bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import json

    from lmtune.parallel.distributed import launched_rank
    from lmtune.tools.bench import check_combinations, format_table, measure_peaks, run_bench, to_json

    if launched_rank() is not None:  # each rank would run every combination, in folders of its own
        raise UserError(
            "lmtune bench starts the processes of each combination itself (--nproc-per-node N): run it "
            "directly, not under torchrun or another launcher"
        )
    if args.measure_peak:
        print("\n".join(measure_peaks(args.precisions.split(","), args.nproc_per_node, args.device)))
        return 0

    strategies, precisions = args.strategies.split(","), args.precisions.split(",")
    check_combinations(strategies, precisions, args.nproc_per_node, args.steps, args.warmup)
    # A refusal of the default names it as such: the user typed no --json.
    out = (
        _json_output(args.json, "bench")
        if args.json is not None
        else output_file("bench.json", "the default --json", "bench")
    )
    if args.json is None:  # said before the minutes of runs, not only after them
        print("lmtune bench: results go to bench.json (--json PATH, or - for standard output)", flush=True)
    rows = run_bench(
        train_config(args),
        strategies,
        precisions,
        args.nproc_per_node,
        args.steps,
        args.warmup,
    )
    print(format_table(rows), file=sys.stderr if out is None else sys.stdout)
    _write_json(out, json.dumps([json_marked(row, "bench") for row in to_json(rows)], indent=2))
    return 0


def plan(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import json
    import tempfile
    from pathlib import Path

    from lmtune.tools.plan import format_report, parse_size, plan, report_json
    from lmtune.training.preflight import validate

    cfg, given = _train_config_given(args)
    validate(cfg, cfg.launch.nproc_per_node, given=given)
    out = _json_output(args.json, "plan") if args.json is not None else None
    memory = parse_size(args.memory_per_device) if args.memory_per_device else None
    with tempfile.TemporaryDirectory(prefix="lmtune-plan-") as workdir:
        report = plan(cfg, memory, args.calibrate, Path(workdir))
    shown = sys.stderr if args.json == "-" else sys.stdout
    print(format_report(report), file=shown)
    if args.json:
        _write_json(out, json.dumps(json_marked(report_json(report), "plan"), indent=2))
    if report.requested.total > report.memory:  # a script's `lmtune plan && lmtune train` stops here
        size = (
            f"{report.memory / 2**30:,.1f} GiB"
            if report.memory >= 2**30
            else f"{report.memory / 2**20:,.0f} MiB"
        )
        print(f"the setup asked for does not fit {size} per device (exit code 1)", file=shown)
        return 1
    return 0


def evaluate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import json

    from lmtune.data.sources import skipped_lines
    from lmtune.tools.evaluation import evaluate_model

    cfg = _data_settings(args, "eval", scores_a_model=True)
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1 (got {args.batch_size})")
    out = _json_output(args.json, "eval") if args.json is not None else None
    cfg, held_out, scored = _evaluated_data(cfg, hasattr(args, "data"))
    done = evaluate_model(cfg, args.batch_size, held_out)
    r, meta = done.result, done.data
    if done.paths.products is not None:  # a CPU bf16 evaluation: the kernels it took, as a run says them
        print(done.paths.line(), file=sys.stderr)
    dropped = meta.get("dropped_too_long", 0) + meta.get("dropped_no_targets", 0)
    skipped = meta.get("bad_lines", 0)  # --skip-bad-lines': the score is of the other lines
    print(
        f"eval of {scored} with {done.model}: loss {r.loss:.4f}, perplexity "
        f"{r.metrics['eval_perplexity']:.3f} ({r.examples:,} example{'s' if r.examples != 1 else ''}, "
        f"{r.target_tokens:,} target tokens; "
        f"{meta.get('truncated', 0):,} truncated, {dropped:,} dropped"
        + (f", {skipped_lines(skipped)}: lmtune data audit lists them" if skipped else "")
        + ")",
        file=sys.stderr if args.json == "-" else sys.stdout,
    )
    if done.trained_on is not None:
        trained, held = done.trained_on
        print(
            f"note: these are the examples {cfg.model.name} was trained on (its run's --data {trained}"
            f"{held}): their loss says how well it fits them, not how it does on data it has not seen",
            file=sys.stderr,
        )
    for name in r.sources:
        tokens = r.metrics[f"eval_tokens/{name}"]
        print(
            f"  {name}: loss {r.metrics[f'eval_loss/{name}']:.4f}, perplexity "
            f"{r.metrics[f'eval_perplexity/{name}']:.3f} ({tokens:,} target tokens)",
            file=sys.stderr if args.json == "-" else sys.stdout,
        )
    if args.json:
        record = {"model": cfg.model.name, "data": cfg.data.train, **r.record(), "dropped": dropped}
        record["bad_lines_skipped"] = skipped
        record["trained_on"] = done.trained_on and done.trained_on[0]  # the run's --data, or None
        if held_out is not None:
            record["eval_split"] = held_out
        if done.paths.products is not None:
            record["paths"] = done.paths.to_json()
        _write_json(out, json.dumps(json_marked(record, "eval"), indent=2))
    return 0


def _evaluated_data(cfg: TrainConfig, named: bool) -> tuple[TrainConfig, float | None, str]:
    """The data `lmtune eval` scores, the share of it held out (or None: all of it), and how the
    result line names it. DATA given is scored whole; a --config file's evaluation data is what its
    run evaluates (its eval_data, or the examples its eval_split holds out), not its training data."""
    from lmtune.config.settings import SAMPLE_DATA, SAMPLE_EVAL

    plain = cfg.replace(eval_data=None, eval_split=None)
    if not named and cfg.data.train == SAMPLE_DATA and cfg.data.eval is None and cfg.data.eval_split is None:
        return plain.replace(data=SAMPLE_EVAL), None, "the built-in sample's held-out split (as its run)"
    if named or (cfg.data.eval is None and cfg.data.eval_split is None):
        return plain, None, cfg.data.train if named else f"{cfg.data.train} (the --config file's data)"
    if cfg.data.eval is not None:
        scored = f"{cfg.data.eval} (the --config file's eval_data)"
        return plain.replace(data=cfg.data.eval, data_weights=None), None, scored
    split = cfg.data.eval_split
    assert split is not None
    return (
        plain,
        split,
        f"the examples of {cfg.data.train} its --eval-split {split:g} holds out (the --config file's)",
    )


def doctor(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from lmtune.config.settings import parse_nnodes
    from lmtune.config.validate import check_settings
    from lmtune.data.prepare import default_cache_dir
    from lmtune.parallel.distributed import (
        cpu_threads_per_process,
        launched_rank,
        process_group,
        read_dist_env,
    )
    from lmtune.tools.doctor import WARN, DoctorSettings, check_or_fail

    if args.check_keep_last < 0:
        raise UserError(f"--keep-last: must be >= 0 (got {args.check_keep_last}; 0 keeps every one)")
    cfg, given = _train_config_given(args)
    check_settings(cfg, 1, given)
    launch = cfg.launch
    if launched_rank() is None and (launch.nproc_per_node > 1 or parse_nnodes(launch.nnodes)[1] > 1):
        from lmtune.parallel.launch import relaunch_unlocked

        return relaunch_unlocked(list(argv), cfg.replace(hang_timeout=0))
    env = read_dist_env(cfg.model.device)
    if env.device.type == "cpu":  # the threads each of train's processes runs, checked as train runs
        import torch

        torch.set_num_threads(cpu_threads_per_process(env, launch.threads_per_process))
    # Several nodes share the cache train uses (lmtune's default, unless --cache-dir or
    # --cache-per-node): with no --cache-dir named, that one is checked.
    default_cache = args.check_cache_dir is None and env.world_size > env.local_world_size
    settings = DoctorSettings(
        output_dir=args.check_output_dir,
        cache_dir=str(default_cache_dir()) if default_cache else args.check_cache_dir,
        data=args.check_data,
        model=args.check_model,
        default_cache=default_cache,
        keep_last=args.check_keep_last,
    )
    with process_group(env):
        checks = check_or_fail(env, settings)
    if env.is_main:  # a warning row above "all checks passed" read as nothing to heed
        warned = [c.name for c in checks if c.status == WARN]
        print("all checks passed" + (f", with warnings: {', '.join(warned)}" if warned else ""))
    return 0


def report(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from pathlib import Path

    from lmtune.tools.report import PLOTS, report

    if Path(args.out).expanduser().is_dir() or args.out.endswith("/"):  # a folder: the report goes in it
        args.out = str(Path(args.out) / "report.html")
    out = output_file(args.out, "--out", "report")
    folder = Path(args.png).expanduser() if args.png else None
    if folder is not None:
        if folder.exists() and not folder.is_dir():
            raise UserError(f"--png {args.png}: not a folder (--png names the folder the PNG files go to)")
        _outside_run_entries(folder, "--png", args.png)
    page, pngs = report([Path(o) for o in args.outputs])
    if folder is not None:  # each file checked before anything is written
        for name in pngs:
            check_replaceable(folder / f"{name}.png", "--png", "png")
    write_output(out, page, "--out")
    empty = [name for name in PLOTS if name not in pngs]
    print(
        f"wrote {args.out}: {len(pngs)} plot{'s' if len(pngs) != 1 else ''}"
        + (f" (nothing recorded for {', '.join(empty)})" if empty else "")
    )
    if folder is not None:
        removed = _write_pngs(folder, pngs, empty)
        print(
            f"wrote {len(pngs)} PNG file{'s' if len(pngs) != 1 else ''} to {args.png}"
            + (f" (removed {removed}: no data now)" if removed else "")
        )
    return 0


def _write_pngs(folder: Path, pngs: dict[str, bytes], empty: list[str]) -> str:
    """Write the plots that had data; remove lmtune's own PNG of a plot that has none now (a reward
    plot of an earlier preference run), so the folder shows this report. Returns what it removed."""
    from lmtune.config.marks import written_by_lmtune

    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        for name, png in pngs.items():
            write_output(folder / f"{name}.png", png, "--png")
    except UserError:  # a full disk: a folder this call made holds only this call's files
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    stale = [folder / f"{name}.png" for name in empty if written_by_lmtune(folder / f"{name}.png", "png")]
    for path in stale:
        path.unlink()
    return ", ".join(path.name for path in stale)


def data_and_tokenizer(args: argparse.Namespace, command: str) -> tuple[TrainConfig, Any]:
    """The settings of a ``lmtune data`` command (its DATA arguments are its --data) and the
    tokenizer training would use, with its chat template."""
    from lmtune.model.modeling import load_tokenizer

    cfg = _data_settings(args, command)
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
    if cfg.examples.chat_template is not None:
        from lmtune.data.chat import use_chat_template

        use_chat_template(tokenizer, cfg.examples.chat_template)
    return cfg, tokenizer


def _data_settings(args: argparse.Namespace, command: str, scores_a_model: bool = False) -> TrainConfig:
    """The settings of a command that reads DATA arguments as its --data (or a --config file's);
    ``scores_a_model``: the model must be named (train's default, the untrained preset, scored
    without a word of it)."""
    from lmtune.config.validate import check_settings

    if not hasattr(args, "data") and not hasattr(args, "config"):
        verb = command.split()[-1]
        raise UserError(f"lmtune {command}: name the DATA to {verb}, or a --config file whose data it reads")
    cfg: TrainConfig
    cfg, given = _train_config_given(args)
    check_settings(cfg, cfg.launch.nproc_per_node, given)
    from lmtune.data.sources import resolve_components

    if not hasattr(args, "data"):  # the --config file's: a missing one is named by its line
        resolve_components(cfg.data.train)
    if scores_a_model and "model" not in given:
        if hasattr(args, "data"):  # `eval RUN/final data.jsonl`: the model given as DATA is said so
            resolve_components(cfg.data.train, f"lmtune {command}")
        raise UserError(
            f"lmtune {command}: name the model to score with --model (a folder, a run's final/, an "
            "export, a hub id, or a preset such as tiny)"
        )
    from contextlib import suppress

    from lmtune.training.preflight import warn_unmatched_names

    with suppress(UserError):  # as train warns; unreadable data is refused in the command's words
        warn_unmatched_names(cfg, lambda message: print(message, file=sys.stderr))
    return cfg
