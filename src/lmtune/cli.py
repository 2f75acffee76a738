"""Command line: argv + YAML -> config -> command. User errors become a message and exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from lmtune.errors import USER_ERROR_EXIT_CODE, StoppedBySignal, TrainingStopped, UserError


def _add_train_options(parser: argparse.ArgumentParser) -> None:
    from lmtune.config import config_fields, field_type, option_name

    parser.add_argument(
        "--config",
        metavar="YAML",
        default=argparse.SUPPRESS,
        help="YAML file with any of the settings below; flags given here override it.",
    )
    for f in config_fields():
        kind = field_type(f)
        text = f"{f.metadata['help']} (default: {f.default})".replace("%", "%%")  # argparse formats %
        if kind is bool:
            parser.add_argument(
                option_name(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=text,
            )
        else:
            parser.add_argument(
                option_name(f.name), dest=f.name, metavar=f.name.upper(), default=argparse.SUPPRESS, help=text
            )


def build_parser() -> argparse.ArgumentParser:
    from lmtune import __version__

    parser = argparse.ArgumentParser(
        prog="lmtune",
        allow_abbrev=False,
        description="Fine-tune causal language models on one device, DataParallel, DDP or several machines.",
    )
    parser.add_argument("--version", action="version", version=f"lmtune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = commands.add_parser(
        "train",
        allow_abbrev=False,
        help="fine-tune a model",
        description="Fine-tune a causal LM. Every setting can also come from --config run.yaml.",
    )
    _add_train_options(train)
    train.set_defaults(run=_cmd_train)
    gen = commands.add_parser("generate", allow_abbrev=False, help="complete a prompt with a trained model")
    gen.add_argument(
        "--model", required=True, help="model folder (for example OUTPUT/final), hub id or preset"
    )
    gen.add_argument(
        "--prompt", default=None, help="text to continue; with --chat, the user's turn (default: read stdin)"
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
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0)")
    gen.add_argument("--seed", type=int, default=0, help="seed for sampling (default: 0)")
    gen.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    gen.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code")
    gen.set_defaults(run=_cmd_generate)
    bench = commands.add_parser(
        "bench",
        allow_abbrev=False,
        help="measure throughput, MFU and memory per strategy and precision",
        description="Train --steps steps after --warmup for every strategy x precision on your model and "
        "data and print one table (tokens/s, MFU against this device's measured matmul peak, peak "
        "memory, step time split). Combinations that cannot run here are listed with the reason.",
    )
    bench.add_argument("--model", default="tiny", help="as in train (default: tiny)")
    bench.add_argument("--data", default="sample", help="as in train (default: sample)")
    bench.add_argument("--strategies", default="single,ddp", help="comma-separated (default: single,ddp)")
    bench.add_argument("--precisions", default="fp32,bf16", help="comma-separated (default: fp32,bf16)")
    bench.add_argument(
        "--nproc-per-node", type=int, default=2, help="processes for ddp and fsdp (default: 2)"
    )
    bench.add_argument("--steps", type=int, default=20, help="timed steps (default: 20)")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first (default: 5)")
    bench.add_argument("--global-batch-size", type=int, default=32, help="as in train (default: 32)")
    bench.add_argument("--micro-batch-size", type=int, default=None, help="as in train")
    bench.add_argument("--max-length", type=int, default=512, help="as in train (default: 512)")
    bench.add_argument("--packing", default="auto", help="as in train (default: auto)")
    bench.add_argument(
        "--json", metavar="PATH", default="bench.json", help="table as JSON (default: bench.json)"
    )
    bench.add_argument(
        "--measure-peak",
        action="store_true",
        help="only measure this device's matmul peak again for --precisions (several longer probes) and "
        "store it as the peak MFU divides by; do it on an idle machine",
    )
    bench.add_argument("--device", default="auto", help="with --measure-peak: auto | cpu | cuda")
    bench.set_defaults(run=_cmd_bench)
    pl = commands.add_parser(
        "plan",
        allow_abbrev=False,
        help="predict peak memory per device before training",
        description="Build the model from its config on a fake device (no weights loaded) and predict "
        "the peak memory per device of the setup the train options describe: weights, gradients, "
        "optimizer state, activations, logits, communication buffers. Then list the setups "
        "(strategy x optimizer x checkpointing x LoRA) that fit --memory-per-device, each with its "
        "largest micro-batch.",
    )
    pl.add_argument(
        "--memory-per-device",
        default=None,
        metavar="SIZE",
        help="memory of one device, such as 80GiB (default: this GPU's, or this machine's RAM per process)",
    )
    pl.add_argument(
        "--calibrate",
        action="store_true",
        help="train two real steps at two micro-batch sizes and correct the prediction by what they measure",
    )
    pl.add_argument("--json", metavar="PATH", default=None, help="also write the plan as JSON")
    _add_train_options(pl)
    pl.set_defaults(run=_cmd_plan)
    exp = commands.add_parser(
        "export",
        allow_abbrev=False,
        help="write a Hugging Face model folder from a checkpoint",
        description="Write config, model.safetensors and the tokenizer of a training checkpoint to DIR.",
    )
    exp.add_argument("checkpoint", help="checkpoint folder, for example OUTPUT/checkpoints/step-000100")
    exp.add_argument("out", metavar="DIR", help="folder to write")
    exp.add_argument("--trust-remote-code", action="store_true", help="allow the model's own Python code")
    exp.set_defaults(run=_cmd_export)
    doc = commands.add_parser(
        "doctor",
        allow_abbrev=False,
        help="check a machine or cluster before a run",
        description="Start the job's processes as train would and check: versions and hosts, devices and "
        "free memory, the matmul peak of every rank, all-reduce correctness and speed, the output and "
        "cache folders (writable, the same folder on every node), free disk for the model's "
        "checkpoints, the data on every rank, clock offsets. One table; exit 0 when all is well, 2 with "
        "what to fix.",
    )
    doc.add_argument("--nproc-per-node", type=int, default=1, help="as in train (default: 1)")
    doc.add_argument("--nnodes", default="1", help="as in train (default: 1)")
    doc.add_argument("--node-rank", type=int, default=None, help="as in train")
    doc.add_argument("--rdzv-endpoint", default=None, help="as in train")
    doc.add_argument("--rdzv-id", default="lmtune-doctor", help="as in train (default: lmtune-doctor)")
    doc.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    doc.add_argument("--output-dir", default=None, help="check this folder (writable, shared, free disk)")
    doc.add_argument("--cache-dir", default=None, help="check this folder (writable, shared)")
    doc.add_argument("--data", default=None, help="check that every rank can read this data")
    doc.add_argument("--model", default=None, help="size the checkpoints by this model's config")
    doc.set_defaults(run=_cmd_doctor)
    rep = commands.add_parser(
        "report",
        allow_abbrev=False,
        help="one HTML page with the plots of one run or several overlaid",
        description="Read OUTPUT folders (finished or still running) and write one self-contained HTML "
        "file: loss and eval loss against steps and tokens, learning rate, gradient norm, tokens/s, MFU, "
        "peak memory per rank, step times, example lengths, the data summary, the final evaluation, the "
        "configuration, and with several runs the settings that differ.",
    )
    rep.add_argument("outputs", nargs="+", metavar="OUTPUT", help="run output folders")
    rep.add_argument("--out", default="report.html", help="HTML file to write (default: report.html)")
    rep.add_argument("--png", metavar="DIR", default=None, help="also write every plot as a PNG file here")
    rep.set_defaults(run=_cmd_report)
    data = commands.add_parser("data", allow_abbrev=False, help="inspect training data").add_subparsers(
        dest="data_command", required=True, metavar="COMMAND"
    )
    aud = data.add_parser(
        "audit",
        allow_abbrev=False,
        help="report what training would make of a data set",
        description="Read every record and report formats, bad lines, token lengths, truncation, "
        "untrainable examples, EOS labels and rank imbalance. Exit 0 when clean, 2 when errors were found.",
    )
    aud.add_argument("data", nargs="+", metavar="DATA", help="files, globs, folders or data set names")
    aud.add_argument("--model", default="tiny", help="tokenizer to count with (default: tiny)")
    aud.add_argument("--max-length", type=int, default=512, help="as in train (default: 512)")
    aud.add_argument("--data-format", default="auto", help="as in train (default: auto)")
    aud.add_argument("--text-field", default="text", help="as in train (default: text)")
    aud.add_argument("--truncation", default="right", help="as in train (default: right)")
    aud.add_argument("--txt-mode", default="line", help="as in train (default: line)")
    aud.add_argument(
        "--chat-template", default=None, help="as in train: chatml | llama3 | gemma | FILE.jinja"
    )
    aud.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        help="report the token imbalance between this many ranks (default: 1)",
    )
    aud.add_argument("--global-batch-size", type=int, default=32, help="as in train (default: 32)")
    aud.add_argument(
        "--micro-batch-size", type=int, default=None, help="as in train (default: global / ranks)"
    )
    aud.add_argument("--seed", type=int, default=42, help="as in train (default: 42)")
    aud.add_argument("--plot", metavar="PNG", default=None, help="also write the length histogram as a PNG")
    aud.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own Python code")
    aud.set_defaults(run=_cmd_audit)
    return parser


def _train_config(args: argparse.Namespace) -> Any:
    from lmtune.config import build_config, config_fields, load_yaml

    values: dict[str, Any] = {}
    source = ""
    if hasattr(args, "config"):
        values.update(load_yaml(args.config))
        source = args.config
    values.update({f.name: getattr(args, f.name) for f in config_fields() if hasattr(args, f.name)})
    return build_config(values, source)


def _cmd_train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from lmtune.config import validate
    from lmtune.distributed import launched_world_size

    cfg = _train_config(args)
    if launched_world_size() == 1:
        from lmtune.launch import needs_launcher, relaunch, world_size_bounds

        if needs_launcher(cfg):
            # Check in the launcher first: a bad option is then reported once, before N processes start.
            for world_size in sorted(set(world_size_bounds(cfg))):
                validate(cfg, world_size)
            return relaunch(list(argv), cfg)
    from lmtune.train import train

    train(cfg)  # a run stopped by a signal has saved a checkpoint and exits cleanly too
    return 0


def _cmd_generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import torch

    from lmtune.distributed import read_dist_env
    from lmtune.modeling import load_model

    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (got {args.temperature})")
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (got {args.top_p})")
    if args.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda (got {args.device!r})")
    if args.prompt is None and not args.chat:
        raise UserError("--prompt is needed (or --chat, which reads turns from stdin)")
    if args.system is not None and not args.chat:
        raise UserError("--system needs --chat")
    device = read_dist_env(args.device).device
    loaded = load_model(args.model, seed=args.seed, trust_remote_code=args.trust_remote_code)
    model = loaded.model.to(device)
    options = {
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
    }
    with torch.inference_mode():
        if args.chat:
            _chat(model, loaded.tokenizer, args.prompt, args.system, options)
        else:
            from lmtune.generate import complete

            print(args.prompt + complete(model, loaded.tokenizer, args.prompt, **options))
    return 0


def _chat(
    model: Any, tokenizer: Any, prompt: str | None, system: str | None, options: dict[str, Any]
) -> None:
    """One reply to --prompt, or a conversation over stdin's lines (interactive on a terminal)."""
    from lmtune.data.formats import ensure_chat_template
    from lmtune.generate import chat_reply

    ensure_chat_template(tokenizer)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = prompt is None and sys.stdin.isatty()
    turns = [prompt] if prompt is not None else _stdin_turns(interactive)
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        reply = chat_reply(model, tokenizer, messages, **options)
        messages.append({"role": "assistant", "content": reply})
        print(f"assistant> {reply}" if interactive else reply, flush=True)


def _stdin_turns(interactive: bool) -> Iterator[str]:
    while True:
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:  # Ctrl+D at the prompt
            print()
            return
        if not interactive and not line:
            return
        if line.strip():
            yield line.strip()


def _cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import json

    from lmtune.bench import format_table, measure_peaks, run_bench, to_json

    if args.measure_peak:
        print("\n".join(measure_peaks(args.precisions.split(","), args.nproc_per_node, args.device)))
        return 0

    train_args = [
        "--model",
        args.model,
        "--data",
        args.data,
        "--global-batch-size",
        str(args.global_batch_size),
        "--max-length",
        str(args.max_length),
        "--packing",
        args.packing,
    ]
    if args.micro_batch_size:
        train_args += ["--micro-batch-size", str(args.micro_batch_size)]
    rows = run_bench(
        train_args,
        args.strategies.split(","),
        args.precisions.split(","),
        args.nproc_per_node,
        args.steps,
        args.warmup,
    )
    print(format_table(rows))
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(to_json(rows), f, indent=2)
    print(f"wrote {args.json}")
    return 0


def _cmd_plan(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import json
    import tempfile
    from pathlib import Path

    from lmtune.config import validate
    from lmtune.plan import format_report, parse_size, plan, report_json

    cfg = _train_config(args)
    validate(cfg, cfg.nproc_per_node)
    memory = parse_size(args.memory_per_device) if args.memory_per_device else None
    with tempfile.TemporaryDirectory(prefix="lmtune-plan-") as workdir:
        report = plan(cfg, memory, args.calibrate, Path(workdir))
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report_json(report), indent=2))
        print(f"wrote {args.json}")
    return 0


def _cmd_export(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from pathlib import Path

    from lmtune.checkpoint import export

    export(Path(args.checkpoint), Path(args.out), args.trust_remote_code)
    print(f"wrote {args.out}")
    return 0


def _cmd_doctor(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from lmtune.config import TrainConfig, parse_nnodes
    from lmtune.distributed import launched_world_size, process_group, read_dist_env
    from lmtune.doctor import DoctorSettings, check_or_fail

    if args.nproc_per_node < 1:
        raise UserError("--nproc-per-node must be >= 1")
    nodes = parse_nnodes(args.nnodes)[1]
    if nodes > 1 and args.rdzv_endpoint is None:
        raise UserError("--rdzv-endpoint is needed when --nnodes is more than 1")
    if launched_world_size() == 1 and (args.nproc_per_node > 1 or nodes > 1):
        from lmtune.launch import relaunch_unlocked

        launch = TrainConfig(
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id,
            hang_timeout=0,
        )
        return relaunch_unlocked(list(argv), launch)
    env = read_dist_env(args.device)
    settings = DoctorSettings(args.output_dir, args.cache_dir, args.data, args.model)
    with process_group(env):
        check_or_fail(env, settings)
    if env.is_main:
        print("all checks passed")
    return 0


def _cmd_report(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from pathlib import Path

    from lmtune.report import PLOTS, report

    drawn = report([Path(o) for o in args.outputs], Path(args.out), Path(args.png) if args.png else None)
    empty = [name for name in PLOTS if name not in drawn]
    print(
        f"wrote {args.out}: {len(drawn)} plots"
        + (f" (nothing recorded for {', '.join(empty)})" if empty else "")
    )
    if args.png:
        print(f"wrote {len(drawn)} PNG files to {args.png}")
    return 0


def _cmd_audit(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from pathlib import Path

    from lmtune.config import FORMATS, TRUNCATIONS, TXT_MODES
    from lmtune.data.audit import audit, format_report, plot_histogram
    from lmtune.data.prepare import DataSettings
    from lmtune.modeling import load_tokenizer

    for option, value, allowed in (
        ("--data-format", args.data_format, FORMATS),
        ("--truncation", args.truncation, TRUNCATIONS),
        ("--txt-mode", args.txt_mode, TXT_MODES),
    ):
        if value not in allowed:
            raise UserError(f"{option}: must be one of {', '.join(allowed)} (got {value!r})")
    if args.max_length < 2 or args.nproc_per_node < 1 or args.global_batch_size < 1:
        raise UserError("--max-length must be >= 2, --nproc-per-node and --global-batch-size >= 1")
    tokenizer = load_tokenizer(args.model, args.trust_remote_code)
    if args.chat_template is not None:
        from lmtune.chat import use_chat_template

        use_chat_template(tokenizer, args.chat_template)
    settings = DataSettings(
        args.data_format, args.text_field, args.max_length, args.truncation, True, args.txt_mode
    )
    report = audit(
        ",".join(args.data),
        tokenizer,
        settings,
        args.nproc_per_node,
        args.global_batch_size,
        args.micro_batch_size,
        args.seed,
    )
    print(format_report(report))
    if args.plot:
        plot_histogram(report, Path(args.plot))
        print(f"  histogram           {args.plot}")
    return 0 if report.clean else USER_ERROR_EXIT_CODE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _quiet_libraries()
    try:
        code: int = args.run(args, argv)
        return code
    except UserError as e:
        from lmtune.launch import report_error

        report_error(str(e), USER_ERROR_EXIT_CODE)
        return USER_ERROR_EXIT_CODE
    except StoppedBySignal as e:
        print(f"lmtune: {e}", file=sys.stderr, flush=True)
        return 128 + e.signum
    except TrainingStopped as e:
        from lmtune.launch import report_error

        report_error(str(e), 1)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _quiet_libraries() -> None:
    """Hide transformers' per-load progress bars and advice; lmtune reports what matters."""
    import os

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
