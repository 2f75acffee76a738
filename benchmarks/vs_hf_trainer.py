"""One epoch, whole process, same model, data and global batch: `lmtune train` vs a Hugging Face
Trainer script, each timed from its command's start to its exit.

Needs the benchmark extra: pip install -c constraints.txt -e '.[bench]'

    python benchmarks/vs_hf_trainer.py [--precisions fp32,bf16] [--examples 600] [--load 6]

The workload is built offline in a temporary folder: a 13M-parameter Llama (hidden 512, 4 layers,
byte-level tokenizer) saved as a model folder, and --examples prompt/completion records of uneven
length (a 3-15 word prompt, a 5-80 word answer). Both train it for one epoch at global batch
--batch-size and the same learning rate. The Trainer gets the usual recipe: a tokenized
`datasets.Dataset` of prompt + completion + EOS, `DataCollatorForLanguageModeling(mlm=False)`, no
checkpoints; lmtune runs with its defaults otherwise (it also writes a final checkpoint and the
model). Each command runs --repeats times, alternating, and the median wall time counts.

--load N starts N busy processes for the measurements (a competing load, like other jobs on a
shared machine). --first-step also times `lmtune train --max-steps 1` of the built-in preset (the
README's demo, one step): time to first step, whole process.

Last, a floor per precision: the arithmetic one epoch needs (the decoder's matrix products on
the real tokens, forward and backward, and causal attention's two products) at the best rate this
machine's products reach in that precision, measured here before any load starts. No program that
trains every real token does it faster, imports and saving aside (a loss on the answers alone may
skip a little of the last layer's work on the prompts: ~3% here), so "3x the Trainer" is out of
reach wherever that floor is well above a third of the Trainer's time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "an",
    "be",
    "this",
    "are",
    "which",
    "or",
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "theta",
    "kappa",
    "lambda",
    "sigma",
]


def build_workload(folder: Path, examples: int) -> tuple[Path, Path]:
    """A 13M Llama folder and a prompt/completion file, seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmtune.model.modeling import byte_tokenizer

    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )
    from lmtune.config.verbosity import no_progress_bars

    torch.manual_seed(0)
    model_dir = folder / "model"
    with no_progress_bars():  # the workload's own save: its bar read as a run's output
        LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rng = random.Random(0)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    data = folder / "train.jsonl"
    with data.open("w") as f:
        for _ in range(examples):
            f.write(json.dumps({"prompt": f"Q: {words(3, 15)}\nA:", "completion": f" {words(5, 80)}"}) + "\n")
    return model_dir, data


def epoch_flops(model_dir: Path, data: Path) -> float:
    """Floating-point operations one epoch cannot do without, on the real tokens (prompt +
    completion + EOS): 6 per token for each weight of the decoder's matrix products (forward, and
    two products backward) and causal attention's two products per layer, three times over."""
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmtune.config.verbosity import no_progress_bars

    tok = AutoTokenizer.from_pretrained(model_dir)
    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    head = model.get_output_embeddings()  # left out: a loss on the answers alone needs it there only
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    cfg = model.config
    lengths = [
        len(tok(r["prompt"] + r["completion"] + tok.eos_token)["input_ids"])
        for r in map(json.loads, data.read_text().splitlines())
    ]
    heads_width = cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads)
    attention = sum(2 * cfg.num_hidden_layers * n * n * heads_width for n in lengths)
    return 6 * weights * sum(lengths) + 3 * attention


SHAPES = ((2048, 512, 1376), (2048, 1376, 512), (2048, 512, 512), (2048, 2048, 2048))


def _has_units(dtype: Any) -> bool:
    """Whether this CPU multiplies in ``dtype`` at more than a few GFLOP/s (bf16 without bf16 units
    does not: timing it would take minutes)."""
    import torch

    probe = torch.randn(256, 256, dtype=dtype)
    probe @ probe
    started = time.perf_counter()
    probe @ probe
    return time.perf_counter() - started < 0.01


def products_rate(precision: str) -> float:
    """The best FLOP/s of matrix products of this workload's widths (and a large square one); for
    bf16 the better of bf16 and fp32 products (a CPU without bf16 units runs bf16 products at a
    few GFLOP/s, and lmtune then takes fp32 products of bf16 operands: lmtune.model.paths)."""
    import torch

    dtypes = (torch.float32, torch.bfloat16) if precision == "bf16" else (torch.float32,)
    best = 0.0
    for dtype, (m, k, n) in itertools.product(filter(_has_units, dtypes), SHAPES):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        for _ in range(3):
            a @ b
        repeats = max(3, int(5e10 / (2 * m * k * n)))
        for _ in range(3):  # the best of three rounds: a floor must not count a stolen time slice
            started = time.perf_counter()
            for _ in range(repeats):
                a @ b
            best = max(best, repeats * 2 * m * k * n / (time.perf_counter() - started))
    return best


def hf_trainer_child(model_dir: str, data: str, precision: str, batch: int, lr: float, out: str) -> None:
    """The Trainer side, run as its own process (``--hf-child``): imports included in its time."""
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
    )

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = [json.loads(line) for line in Path(data).read_text().splitlines()]
    ds = Dataset.from_dict({"text": [r["prompt"] + r["completion"] + tok.eos_token for r in rows]})
    ds = ds.map(
        lambda b: tok(b["text"], truncation=True, max_length=2048), batched=True, remove_columns=["text"]
    )
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=batch,
        num_train_epochs=1,
        learning_rate=lr,
        bf16=precision == "bf16",
        use_cpu=True,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        seed=42,
        disable_tqdm=True,
    )
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    Trainer(model=model, args=args, train_dataset=ds, data_collator=collator).train()
    model.save_pretrained(out)  # lmtune saves its model too


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(command)}\n{proc.stderr[-3000:]}")
    return elapsed


def busy() -> None:
    while True:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--examples", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load", type=int, default=0, help="busy processes competing during the runs")
    p.add_argument("--first-step", action="store_true", help="also time lmtune train --max-steps 1 (demo)")
    p.add_argument("--hf-child", nargs=6, metavar="ARG", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hf_child:
        model_dir, data, precision, batch, lr, out = args.hf_child
        hf_trainer_child(model_dir, data, precision, int(batch), float(lr), out)
        return

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir, data = build_workload(tmp / "workload", args.examples)
        flops = epoch_flops(model_dir, data)
        rates = {precision: products_rate(precision) for precision in args.precisions.split(",")}
        load = [multiprocessing.Process(target=busy, daemon=True) for _ in range(args.load)]
        for proc in load:
            proc.start()
        try:
            rows = measure(args, tmp, model_dir, data)
        finally:
            for proc in load:
                proc.terminate()
    print(
        f"{args.examples} prompt/completion examples, 13M Llama, 1 epoch, global batch {args.batch_size}, "
        f"{args.load} competing busy processes, median of {args.repeats} (whole process, seconds)"
    )
    print(f"{'':<28}{'HF Trainer':>12}{'lmtune':>10}{'ratio':>8}")
    for name, hf, ours in rows:
        if hf is None:
            print(f"{name:<28}{'':>12}{ours:>10.1f}")
        else:
            print(f"{name:<28}{hf:>12.1f}{ours:>10.1f}{hf / ours:>7.2f}x")
    print_floor(flops, rates, rows)


def print_floor(flops: float, rates: dict[str, float], rows: list[tuple[str, float | None, float]]) -> None:
    times = {name.removeprefix("one epoch, "): (hf, ours) for name, hf, ours in rows if hf is not None}
    print(f"floor: {flops / 1e12:.2f} TFLOP an epoch, at the best product rate measured here (quiet)")
    for precision, rate in rates.items():
        floor = flops / rate
        hf, ours = times[precision]
        left = hf / 3 - floor
        room = f"{left:.1f} s left for all else" if left > 0 else f"out of reach by {-left:.1f} s"
        print(
            f"  {precision}: {rate / 1e9:,.0f} GFLOP/s -> {floor:.1f} s of arithmetic "
            f"(lmtune {ours / floor:.1f}x it); 3x the Trainer = {hf / 3:.1f} s whole process: {room}"
        )


def measure(
    args: argparse.Namespace, tmp: Path, model_dir: Path, data: Path
) -> list[tuple[str, float | None, float]]:
    rows: list[tuple[str, float | None, float]] = []
    lmtune = [sys.executable, "-m", "lmtune", "train", "--no-progress"]
    for precision in args.precisions.split(","):
        hf_times, our_times = [], []
        for i in range(args.repeats):
            hf_out, our_out = tmp / f"hf-{precision}-{i}", tmp / f"lmtune-{precision}-{i}"
            hf = [sys.executable, str(HERE), "--hf-child", str(model_dir), str(data), precision]
            hf += [str(args.batch_size), str(args.lr), str(hf_out)]
            ours = [*lmtune, "--model", str(model_dir), "--data", str(data), "--precision", precision]
            ours += ["--epochs", "1", "--global-batch-size", str(args.batch_size), "--lr", str(args.lr)]
            hf_times.append(timed(hf))
            our_times.append(timed([*ours, "--output-dir", str(our_out)]))
        rows.append((f"one epoch, {precision}", statistics.median(hf_times), statistics.median(our_times)))
    if args.first_step:
        demo = [
            timed([*lmtune, "--max-steps", "1", "--output-dir", str(tmp / f"demo-{i}")])
            for i in range(args.repeats)
        ]
        rows.append(("demo, --max-steps 1", None, statistics.median(demo)))
    return rows


if __name__ == "__main__":
    main()
