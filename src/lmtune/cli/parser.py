"""The argument parser of every subcommand; train's options come from the settings."""

from __future__ import annotations

import argparse
from typing import Any

from lmtune.cli import commands, data_commands, generation, publishing
from lmtune.config.environment import VERBOSE as VERBOSE_ENV

# A setting a command needs given (on the command line or in its --config file), as its help says.
REQUIRED = "(required: here or in the --config file)"


def _add_train_options(
    parser: argparse.ArgumentParser,
    only: tuple[str, ...] = (),
    *,
    config_file: bool = True,
    defaults: dict[str, object] | None = None,
) -> None:
    """Train's settings as flags (``only``: just these), in one argparse group per settings group,
    all defaulting to "not given" so that a --config YAML file and then the settings' own defaults
    fill the rest. ``defaults``: the few a command defaults otherwise (shown in its --help)."""
    from lmtune.config.settings import GROUPS, config_fields, option_name

    if config_file:
        parser.add_argument(
            "--config",
            metavar="YAML",
            default=argparse.SUPPRESS,
            help="YAML file with any of the settings below (flat, or nested by group); flags given "
            "here override it.",
        )
    sections: dict[str | None, Any] = {}
    for s in config_fields():
        if only and s.name not in only:
            continue
        if s.group not in sections:
            doc = (GROUPS[s.group].__doc__ or "").split("\n")[0] if s.group else "The run itself."
            sections[s.group] = parser.add_argument_group(f"{s.group or 'run'} settings", doc)
        default = (defaults or {}).get(s.name, s.default)
        # An unset default (None) is said by the help where it means something ("Default: the
        # tokenizer's own ..."); "(default: None)" after that read as a contradiction.
        shown = (
            f" {REQUIRED}"
            if default == REQUIRED
            else f" (default: {default})"
            if default is not None
            else ""
            if "efault" in s.help
            else " (default: none)"
        )
        text = f"{s.help}{shown}".replace("%", "%%")  # argparse formats %
        kind: dict[str, Any] = (
            {"action": argparse.BooleanOptionalAction}
            if s.type is bool
            else {"metavar": "{" + ",".join(s.choices) + "}" if s.choices else s.name.upper()}
        )
        if {"on", "off"} <= set(s.choices):  # TRL's bare --packing (a bool there) is on
            kind |= {"nargs": "?", "const": "on"}
        sections[s.group].add_argument(
            option_name(s.name), dest=s.name, default=argparse.SUPPRESS, help=text, **kind
        )
        # Hidden: the same setting under the names of HF Trainer, TRL and Axolotl, and spelled with
        # underscores as their command lines do (--learning_rate).
        for alias in _hidden_names(s.name):
            parser.add_argument(alias, dest=s.name, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kind)


def _hidden_names(name: str) -> list[str]:
    from lmtune.config.aliases import aliases_of

    names = [f"--{name}"] if "_" in name else []
    for alias in aliases_of(name):
        names += [f"--{alias.replace('_', '-')}", f"--{alias}"]
    return list(dict.fromkeys(names))


def _command(sub: Any, name: str, **options: Any) -> argparse.ArgumentParser:
    """A subcommand's parser: no abbreviated options, -v, and itself as ``args.parser`` (for the
    message about options it does not take)."""
    parser: argparse.ArgumentParser = sub.add_parser(name, allow_abbrev=False, **options)
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help=f"also show other packages' warnings (as {VERBOSE_ENV}=1 does)",
    )
    parser.set_defaults(parser=parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from lmtune import __version__

    parser = argparse.ArgumentParser(
        prog="lmtune",
        allow_abbrev=False,
        description="Fine-tune causal language models on one device, DataParallel, DDP or several machines.",
    )
    parser.add_argument("--version", action="version", version=f"lmtune {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _train_parser(sub)
    _generate_parser(sub)
    _eval_parser(sub)
    _bench_parser(sub)
    _plan_parser(sub)
    _export_parser(sub)
    _push_parser(sub)
    _doctor_parser(sub)
    _report_parser(sub)
    _data_parser(sub)
    return parser


DOCTOR_RDZV_ID = "lmtune-doctor"
_DATA_HELP = "files, globs, folders, data set names, or 'sample' (default: a --config file's data)"
# What `lmtune data audit` reads of train's settings: the model's tokenizer, how records become
# examples (every setting of that group), and how a step's examples are dealt to the ranks.
_AUDIT = (
    "model trust_remote_code data_format text_field field_map train_on_prompt chat_template max_length "
    "truncation max_prompt_length skip_bad_lines txt_mode global_batch_size micro_batch_size seed "
    "nproc_per_node data_weights eval_split objective"
)
AUDIT_SETTINGS = tuple(_AUDIT.split())
# What `lmtune eval` reads: how records become examples, as training reads them, and how it runs.
_EVAL = (
    "model trust_remote_code data_format text_field field_map train_on_prompt chat_template max_length "
    "truncation skip_bad_lines txt_mode precision device loss_chunk_size cache_dir seed"
)
EVAL_SETTINGS = tuple(_EVAL.split())


def _train_parser(sub: Any) -> None:
    train = _command(
        sub,
        "train",
        help="fine-tune a model",
        usage="lmtune train [-h] [--config YAML] [--SETTING VALUE ...]",
        description="Fine-tune a causal LM. Every setting can also come from --config run.yaml.",
    )
    _add_train_options(train)
    train.set_defaults(run=commands.train)


def _generate_parser(sub: Any) -> None:
    gen = _command(sub, "generate", help="complete a prompt with a trained model")
    gen.add_argument(
        "--model", required=True, help="model folder (for example OUTPUT/final), hub id or preset"
    )
    gen.add_argument(
        "--prompt",
        default=None,
        help="text to continue (read from stdin when piped, or given as -); with --chat, the first turn",
    )
    gen.add_argument(
        "--chat",
        action="store_true",
        help="chat: apply the model's chat template to each user turn and answer until its end of turn; "
        "turns come from --prompt, else one per line of stdin (an interactive prompt on a terminal)",
    )
    gen.add_argument("--system", default=None, help="with --chat: a system message first")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to add (default: 64)")
    gen.add_argument(
        "--temperature", type=float, default=0.0, help="0 for greedy decoding, above 0 to sample (default: 0)"
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling threshold in (0, 1]; 1 is no cut (default: the model's generation config's, "
        "transformers' being 1)",
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="sample from the K likeliest tokens only; 0: from all (default: the model's generation "
        "config, where transformers' default is 50)",
    )
    gen.add_argument(
        "--seed", type=int, default=0, help="seed of sampling and of a preset's random weights (default: 0)"
    )
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    gen.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code")
    gen.set_defaults(run=generation.generate)


def _bench_parser(sub: Any) -> None:
    bench = _command(
        sub,
        "bench",
        help="measure throughput, MFU and memory per strategy and precision",
        description="Train --steps steps after --warmup for every strategy x precision on your model and "
        "data (and any other train setting from --config) and print one table (tokens/s, MFU against "
        "this device's measured matmul peak, peak memory, step time split). Combinations that cannot "
        "run here are listed with the reason.",
    )
    bench.add_argument("--strategies", default="single,ddp", help="comma-separated (default: single,ddp)")
    bench.add_argument("--precisions", default="fp32,bf16", help="comma-separated (default: fp32,bf16)")
    bench.add_argument(
        "--nproc-per-node", type=int, default=2, help="processes for ddp and fsdp (default: 2)"
    )
    bench.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    bench.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="untimed steps first, at least 1: the first step's start-up is never timed (default: 5)",
    )
    # The run itself: a train --config file, and the few settings most often varied, as in train.
    _add_train_options(
        bench,
        only=("model", "data", "global_batch_size", "micro_batch_size", "max_length", "packing", "objective"),
    )
    bench.add_argument(
        "--json", metavar="PATH", default=None, help="table as JSON (default bench.json, - stdout)"
    )
    bench.add_argument(
        "--measure-peak",
        action="store_true",
        help="only measure this device's matmul peak again for --precisions (several longer probes) and "
        "store it as the peak MFU divides by; do it on an idle machine",
    )
    bench.add_argument("--device", default="auto", help="with --measure-peak: auto | cpu | cuda")
    bench.set_defaults(run=commands.bench)


def _eval_parser(sub: Any) -> None:
    ev = _command(
        sub,
        "eval",
        help="a model's loss and perplexity on data, without training",
        description="Score a model (a folder, a run's final/, an export, a hub id or a preset) on DATA as "
        "a training run's evaluation does: records rendered, tokenized and truncated by train's "
        "settings, the loss per target token over the whole set. Compare the base model with the "
        "tuned one on the same held-out data.",
    )
    ev.add_argument(
        "data",
        nargs="*",
        default=argparse.SUPPRESS,
        metavar="DATA",
        help=(
            "files, globs, folders, data set names, or 'sample' (default: what a --config file's run "
            "evaluates: its eval_data, or the examples its eval_split holds out; else its data)"
        ),
    )
    ev.add_argument(
        "--json", metavar="PATH", default=None, help="also write the figures as JSON (- for stdout)"
    )
    ev.add_argument(
        "--batch-size",
        type=int,
        default=8,
        metavar="N",
        help="examples a forward (default: 8); the figures are the same for any (bf16: to rounding)",
    )
    # No model by default: train's, the untrained preset, was scored unasked.
    _add_train_options(ev, EVAL_SETTINGS, config_file=True, defaults={"model": REQUIRED})
    ev.set_defaults(run=commands.evaluate)


def _plan_parser(sub: Any) -> None:
    pl = _command(
        sub,
        "plan",
        help="predict peak memory per device before training",
        description="Build the model from its config on a fake device (no weights loaded) and predict "
        "the peak memory per device of the setup the train options describe: weights, gradients, "
        "optimizer state, activations, logits, communication buffers. Then list the setups "
        "(strategy x optimizer x checkpointing x LoRA) that fit --memory-per-device, each with its "
        "largest micro-batch. Exit 0 when the setup asked for fits, 1 when it does not.",
    )
    pl.add_argument(
        "--memory-per-device",
        default=None,
        metavar="SIZE",
        help="memory of one device, such as 80GiB (binary units: 80GB is read as 80GiB; default: this GPU's, "
        "or this machine's RAM per process)",
    )
    pl.add_argument(
        "--calibrate",
        action="store_true",
        help="train two real steps at two micro-batch sizes and correct the prediction by what they measure",
    )
    pl.add_argument("--json", metavar="PATH", default=None, help="also write the plan as JSON (- for stdout)")
    from lmtune.config.settings import PLAN_SETTINGS

    _add_train_options(pl, only=PLAN_SETTINGS)
    pl.set_defaults(run=commands.plan)


def _export_parser(sub: Any) -> None:
    exp = _command(
        sub,
        "export",
        help="write a Hugging Face model folder from a checkpoint",
        description="Write config, model.safetensors and the tokenizer of a training checkpoint to DIR "
        "(of a LoRA checkpoint: the PEFT adapter, or with --merge-lora the merged model).",
    )
    exp.add_argument("checkpoint", help="checkpoint folder, for example OUTPUT/checkpoints/step-000100")
    exp.add_argument("out", metavar="DIR", help="folder to write")
    exp.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code")
    exp.add_argument(
        "--merge-lora",
        action="store_true",
        help="of a LoRA checkpoint, write its base with the adapter merged in (a quantized base "
        "dequantized first) instead of the adapter",
    )
    exp.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DIR when it holds an earlier export (any other non-empty folder is refused)",
    )
    exp.set_defaults(run=publishing.export)


def _push_parser(sub: Any) -> None:
    push = _command(
        sub,
        "push",
        help="upload a model folder with its model card to the Hugging Face hub",
        description="Upload a saved model folder (OUTPUT/final, final/merged, an export) to a hub repo, "
        "created when missing, with a model card (README.md) unless the folder has its own. The token "
        "is huggingface_hub's: HF_TOKEN, or `hf auth login`.",
    )
    push.add_argument("folder", metavar="FOLDER", help="model or adapter folder, for example OUTPUT/final")
    push.add_argument("repo_id", metavar="REPO_ID", help="hub repo, user/name or org/name")
    push.add_argument("--private", "--hub-private", action="store_true", help="create the repo private")
    push.add_argument("--message", default=None, help="commit message (default: Upload FOLDER (lmtune))")
    push.set_defaults(run=publishing.push)


def _doctor_parser(sub: Any) -> None:
    doc = _command(
        sub,
        "doctor",
        help="check a machine or cluster before a run",
        description="Start the job's processes as train would and check: versions and hosts, devices and "
        "free memory, the matmul peak of every rank, all-reduce correctness and speed, the output and "
        "cache folders (writable, the same folder on every node), free disk for the model's "
        "checkpoints, the data on every rank, clock offsets. One table; exit 0 when all is well, 2 with "
        "what to fix.",
    )
    # The job's processes are train's settings; what to check is named by doctor's own options.
    launch = ("device", "nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id")
    _add_train_options(doc, launch, config_file=False, defaults={"rdzv_id": DOCTOR_RDZV_ID})
    doc.set_defaults(rdzv_id=DOCTOR_RDZV_ID)
    from lmtune.config.run_groups import CheckpointSettings

    checks = doc.add_argument_group("what to check")
    checks.add_argument(
        "--output-dir",
        dest="check_output_dir",
        metavar="DIR",
        default=None,
        help="this folder: writable, shared, free disk",
    )
    checks.add_argument(
        "--cache-dir",
        dest="check_cache_dir",
        metavar="DIR",
        default=None,
        help="this folder: writable, shared",
    )
    checks.add_argument(
        "--data", dest="check_data", metavar="DATA", default=None, help="that every rank can read this data"
    )
    checks.add_argument(
        "--model",
        dest="check_model",
        metavar="MODEL",
        default=None,
        help="size the checkpoints by this model",
    )
    checks.add_argument(
        "--keep-last",
        dest="check_keep_last",
        metavar="K",
        type=int,
        default=CheckpointSettings().keep_last,
        help="size the disk for the checkpoints train's --keep-last K keeps at once (default: %(default)s)",
    )
    doc.set_defaults(run=commands.doctor)


def _report_parser(sub: Any) -> None:
    rep = _command(
        sub,
        "report",
        help="one HTML page with the plots of one run or several overlaid",
        description="Read OUTPUT folders (finished or still running) and write one self-contained HTML "
        "file: loss and eval loss against steps and tokens, learning rate, gradient norm, tokens/s, MFU, "
        "peak memory per rank, step times, example lengths, the data summary, the final evaluation, the "
        "configuration, and with several runs the settings that differ.",
    )
    rep.add_argument("outputs", nargs="+", metavar="OUTPUT", help="run output folders")
    rep.add_argument(
        "--out",
        default="report.html",
        help="HTML file to write, or a folder to write report.html in (default: report.html)",
    )
    rep.add_argument("--png", metavar="DIR", default=None, help="also write every plot as a PNG file here")
    rep.set_defaults(run=commands.report)


def _data_parser(sub: Any) -> None:
    data = sub.add_parser("data", allow_abbrev=False, help="inspect training data").add_subparsers(
        dest="data_command", required=True, metavar="COMMAND"
    )
    aud = _command(
        data,
        "audit",
        help="report what training would make of a data set",
        description="Read every record and report formats, bad lines, token lengths, truncation, "
        "untrainable examples, stop-token labels and rank imbalance. Exit 0 when clean; 1 when it would "
        "train badly (an example loses its stop token's label, trains nothing, or has an empty answer; "
        "bad lines --skip-bad-lines skips); 2 when training would stop on it (bad lines without "
        "--skip-bad-lines, an over-long example under --truncation error, no example to train on, fewer "
        "examples than one --global-batch-size).",
    )
    aud.add_argument("data", nargs="*", default=argparse.SUPPRESS, metavar="DATA", help=_DATA_HELP)
    # Train's settings that decide what training makes of the data: the same names and defaults.
    _add_train_options(aud, (*AUDIT_SETTINGS, "eval_data"), config_file=True)
    aud.add_argument("--plot", metavar="PNG", default=None, help="also write the length histogram as a PNG")
    aud.set_defaults(run=data_commands.audit)
    show = _command(
        data,
        "show",
        help="print records as training sees them, the trained tokens marked",
        description="Render, tokenize and truncate records as training does, and print them with the "
        "tokens that train marked (green on a terminal, between [[ and ]] elsewhere); a record training "
        "would drop says why. Takes train's settings that decide what a record becomes.",
    )
    show.add_argument("data", nargs="*", default=argparse.SUPPRESS, metavar="DATA", help=_DATA_HELP)
    _add_train_options(show, AUDIT_SETTINGS, config_file=True)
    show.add_argument(
        "--start",
        type=int,
        default=1,
        metavar="N",
        help="the first record shown, counted from 1 (default: 1)",
    )
    show.add_argument(
        "-n", "--count", type=int, default=3, metavar="N", help="how many records to show (default: 3)"
    )
    show.add_argument(
        "--tokens", action="store_true", help="one line per token: position, id, piece, trained or not"
    )
    show.set_defaults(run=data_commands.show_data)
