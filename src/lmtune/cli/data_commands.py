"""`lmtune data show` and `lmtune data audit`: what training would make of a data set."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lmtune.cli.commands import data_and_tokenizer, output_file
from lmtune.config.marks import write_output
from lmtune.errors import UserError


def show_data(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from lmtune.data.show import Marks, shown_records

    if args.start < 1 or args.count < 1:
        raise UserError(f"lmtune data show: {'--start' if args.start < 1 else '--count'} must be >= 1")
    cfg, tokenizer = data_and_tokenizer(args, "data show")
    marks = Marks.choose(sys.stdout.isatty())
    blocks = shown_records(
        cfg.data.train, tokenizer, cfg.examples, args.start, args.count, marks, args.tokens
    )
    for i, block in enumerate(blocks):
        if i == 0 and not args.tokens:
            print(f"({marks.legend})")
        print(block, flush=True)
    return 0


def audit(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from dataclasses import replace

    from lmtune.data.audit import audit, format_report, holding_out
    from lmtune.data.audit_plot import plot_histogram
    from lmtune.data.pair_audit import kind_refused

    cfg, tokenizer = data_and_tokenizer(args, "data audit")
    plot = output_file(args.plot, "--plot", "png") if args.plot is not None else None
    report = audit(
        cfg.data.train,
        tokenizer,
        cfg.examples,  # every line is read either way; a bad one is reported
        cfg.launch.nproc_per_node,
        cfg.batch.global_batch_size,
        cfg.batch.micro_batch_size,
        cfg.seed,
        cfg.data.weights,
    )
    report = holding_out(report, cfg.data.eval_split, cfg.seed, cfg.data.weights)
    if hasattr(args, "config") or hasattr(args, "objective"):
        # The objective a --config file (or --objective) gives takes the data's kind: what training
        # refuses is no "clean" audit (pairs under sft said exit 0 where train stopped).
        refused = kind_refused(report.pairs is not None, cfg.objective.name)
        report = replace(report, kind_refused=refused, objective=cfg.objective.name)
    print(format_report(report))
    if plot is not None:
        write_output(plot, plot_histogram(report), "--plot")
        print(f"  histogram           {plot}")
    if cfg.data.eval is None:
        return report.exit_code
    # The evaluation data, as training reads it (a bad line there stops the run too), and what of
    # it training trains on: its loss would say how well the model remembers, not generalises.
    held = audit(cfg.data.eval, tokenizer, cfg.examples, seed=cfg.seed, global_batch_size=1)
    if held.repeats is not None and report.repeats is not None:
        held = replace(held, in_training=held.repeats.also_in(report.repeats))
    print("\n" + format_report(held).replace("audit of ", "audit of --eval-data ", 1))
    return max(report.exit_code, held.exit_code)
