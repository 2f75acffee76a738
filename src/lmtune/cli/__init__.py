"""Command line: argv + YAML -> config -> command. User errors become a message and exit code 2."""

from __future__ import annotations

import atexit
import errno
import logging
import os
import re
import sys
from collections.abc import Sequence
from contextlib import suppress
from typing import Any, NoReturn

from lmtune.cli.argv import hub_flags, hyphenated, negative_values, spelled_out_flags, spelled_twice
from lmtune.cli.parser import build_parser
from lmtune.cli.unknown import unknown_arguments
from lmtune.config.environment import VERBOSE as VERBOSE_ENV
from lmtune.config.threads import choose_thread_wait
from lmtune.errors import USER_ERROR_EXIT_CODE, SettingError, StoppedBySignal, TrainingStopped, UserError

# Other tools' commands (litgpt's, torchtune's `tune run`, Axolotl's), and lmtune's way to do what they do.
OTHER_COMMANDS = {
    "finetune": "lmtune train fine-tunes (full, or --lora; --load-in-4bit for QLoRA)",
    "finetune_lora": "lmtune train --lora fine-tunes with LoRA",
    "pretrain": "lmtune train fine-tunes an existing model (--model); it does not pretrain",
    "run": "lmtune train takes the settings of a recipe as options or a --config file",
    "download": "lmtune train --model ORG/NAME loads a hub model (downloaded on first use)",
    "chat": "lmtune generate --model FOLDER --chat talks with a chat model (one turn per line)",
    "evaluate": "lmtune eval DATA --model M scores a model on data (lmtune train --eval-data FILE "
    "evaluates during training)",
    "merge_lora": "lmtune export --merge-lora writes a merged model folder",
    "merge-lora": "lmtune export CHECKPOINT DIR --merge-lora writes a merged model folder",  # Axolotl's
    "preprocess": "lmtune data audit DATA reads and measures the data; lmtune train tokenizes it into its "
    "cache on first use",
    "inference": "lmtune generate --model FOLDER --prompt TEXT (--chat for a chat model)",
    "convert_from_litgpt": "lmtune writes Hugging Face folders already (final/, lmtune export)",
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    choose_thread_wait()  # before anything imports torch
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        if argv and argv[0] in OTHER_COMMANDS:  # litgpt's and torchtune's commands
            raise UserError(f"lmtune {argv[0]}: not a command of lmtune; {OTHER_COMMANDS[argv[0]]}")
        argv = negative_values(hub_flags(argv))  # HF's --push_to_hub [True] --hub_model_id NAME/REPO
        # Options a command does not take are ours to explain (argparse would print the top-level usage).
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if extra and (spelled := spelled_out_flags(args.parser, argv)) != argv:
            argv = spelled  # --gradient_checkpointing True, as HF Trainer's examples write it
            args, extra = parser.parse_known_args(argv)
        if extra and (dashed := hyphenated(args.parser, argv)) != argv:
            argv = dashed  # --max_new_tokens, as the train command takes it
            args, extra = parser.parse_known_args(argv)
        from lmtune.config.environment import check_environment

        if getattr(args, "verbose", False):
            os.environ[VERBOSE_ENV] = "1"  # this process, and every process it starts
        check_environment()
        from lmtune.config.verbosity import verbose

        if not verbose():
            _launcher_without_cpp_logs(args)  # before torch loads
            _quiet_libraries()
        if extra:
            raise UserError(unknown_arguments(args.parser, extra, vars(args)))
        if hasattr(args, "parser") and (twice := spelled_twice(args.parser, argv)):
            raise UserError(f"{args.parser.prog}: {twice}")
        code: int = args.run(args, argv)
        return code
    except UserError as e:
        from lmtune.parallel.launch import report_error

        report_error(_placed(e, args), USER_ERROR_EXIT_CODE)
        return USER_ERROR_EXIT_CODE
    except RuntimeError as e:  # lmtune train says its own, with the step; the other commands, here
        return _runtime_error(e, args)
    except OSError as e:
        if not _a_path_problem(e):
            raise
        from lmtune.parallel.launch import report_error

        # A file the user named that cannot be read or written (permissions, a missing folder, a
        # read-only disk): the path and the reason say it all; a traceback would not help.
        report_error(f"{e.filename}: {e.strerror}", USER_ERROR_EXIT_CODE)
        return USER_ERROR_EXIT_CODE
    except StoppedBySignal as e:
        from lmtune.parallel.launch import report_stopped

        report_stopped(str(e))
        return 128 + e.signum
    except TrainingStopped as e:
        from lmtune.parallel.launch import report_error

        report_error(str(e), 1)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


_PATH_ERRORS = frozenset(
    {
        errno.EACCES,
        errno.EPERM,
        errno.ENOENT,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.EROFS,
        errno.EEXIST,
        errno.ENOSPC,
        errno.EDQUOT,
        errno.ELOOP,
        errno.ENAMETOOLONG,
    }
)


def _runtime_error(e: RuntimeError, args: Any) -> int:
    """The exit code of a rank whose collective failed (another rank ended, or stopped answering)
    or of memory that ran out, each said in a line; any other error is raised on."""
    from lmtune.parallel.distributed import launched_rank
    from lmtune.parallel.failure_report import collective_timed_out, lost_connection
    from lmtune.parallel.health import HANG_EXIT_CODE
    from lmtune.parallel.launch import report_error
    from lmtune.training.failures import is_out_of_memory

    rank = launched_rank()
    if rank is not None and (lost := lost_connection(e, rank)) is not None:
        report_error(lost, 1, lost=True)  # not a traceback of this rank: another one ended
        return 1
    if rank is not None and (waited := collective_timed_out(e, rank)) is not None:
        report_error(waited, HANG_EXIT_CODE)  # a hang, found by the collective's own timeout
        return HANG_EXIT_CODE
    if not is_out_of_memory(e) or args is None:
        raise e
    report_error(_out_of_memory(e, args), USER_ERROR_EXIT_CODE)
    return USER_ERROR_EXIT_CODE


def _placed(e: UserError, args: Any) -> str:
    """The message of ``e``; a setting's bad value that came from the --config file (no flag set
    it) is named by the file's line and key rather than by its flag."""
    config = getattr(args, "config", None)
    if config is None:
        return str(e)
    from lmtune.config.io import yaml_places
    from lmtune.config.settings import config_fields

    names = {f.name for f in config_fields()}

    def as_key(m: re.Match[str]) -> str:  # other settings the reason names: as the file would
        name = m.group(1).replace("-", "_")
        return name if name in names and not hasattr(args, name) else m.group(0)

    if isinstance(e, SettingError):
        setting, said = e.setting, f": {re.sub(r'--([a-z][a-z0-9-]*)', as_key, e.reason)}"
    elif head := re.match(r"--([a-z][a-z0-9-]*)(?=[ :])(.*)", str(e), re.DOTALL):
        setting, said = head.group(1).replace("-", "_"), head.group(2)  # "--model ./x: no such folder"
    else:
        return str(e)
    if setting not in names or hasattr(args, setting):
        return str(e)
    with suppress(UserError):  # the file as it was read: this only rewords the message
        place = yaml_places(config).get(setting)
        if place is not None:
            return f"{place}{said}"
    return str(e)


def _out_of_memory(e: RuntimeError, args: Any) -> str:
    """A command's memory that ran out, with the options it has that would lower it."""
    from lmtune.training.failures import what_it_asked

    lower = {
        "batch_size": "a smaller --batch-size",
        "micro_batch_size": "a smaller --micro-batch-size",
        "max_length": "a shorter --max-length",
        "max_new_tokens": "fewer --max-new-tokens",
    }
    ways = [f"{way} (now {getattr(args, name)})" for name, way in lower.items() if getattr(args, name, None)]
    parser = getattr(args, "parser", None)
    said = f"{parser.prog if parser is not None else 'lmtune'}: out of memory{what_it_asked(e)}"
    return said + (f"; to fit, try {' or '.join(ways)}" if ways else "")


def _a_path_problem(e: OSError) -> bool:
    return e.filename is not None and e.errno in _PATH_ERRORS and not os.environ.get(VERBOSE_ENV)


def run() -> NoReturn:
    """The ``lmtune`` command: :func:`main`, then a quick exit.

    Tearing down the interpreter after torch and transformers are loaded takes ~0.8 s on 2 cores
    (a tenth of a short run), and nothing in it matters once the command returned: exit handlers
    (reporters, worker processes) run and the streams are flushed first."""
    try:
        code = main()
    except BrokenPipeError:  # `lmtune ... | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    exit_quickly(code)


def exit_quickly(code: int) -> NoReturn:
    """Run the exit handlers, flush, and leave without tearing the interpreter down."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with suppress(Exception):  # a closed or broken pipe cannot take more output
                stream.flush()
        os._exit(code)


CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"


def _launcher_without_cpp_logs(args: Any) -> None:
    """A job's launcher logs nothing of torch's C++ side: a rendezvous it cannot reach (node 0 not
    started, a wrong --rdzv-endpoint) printed ~40 lines of C++ frames per attempt before lmtune's
    one-line message. Its workers keep their own logs (NCCL's and gloo's errors are theirs), and so
    does a launcher given TORCH_CPP_LOG_LEVEL or --verbose."""
    from lmtune.cli import commands

    launching = (commands.train, commands.doctor)  # the commands that start a job's processes
    if CPP_LOG_ENV in os.environ or "RANK" in os.environ or getattr(args, "run", None) not in launching:
        return
    from lmtune.parallel.launch import needs_launcher

    with suppress(UserError):  # a bad setting is reported by the command, as it would be anyway
        if needs_launcher(commands.train_config(args).launch):
            os.environ[CPP_LOG_ENV] = "FATAL"
            import torch  # noqa: F401  (it reads the level as it loads)

            del os.environ[CPP_LOG_ENV]  # not for the workers this launcher starts


def _quiet_libraries() -> None:
    """Hide transformers' per-load progress bars and advice; lmtune reports what matters."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    # The hub client's retry notices ("Retrying in 1s [Retry 1/5]"): a failed load is reported once.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
