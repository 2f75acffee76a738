"""One epoch of DPO, same model, pairs, batch and learning rate: lmtune vs TRL's DPOTrainer, whole
process against whole process, with each one's peak resident memory.

Needs the benchmark extra: pip install -c constraints.txt -e '.[bench]'

    python benchmarks/vs_trl_dpo.py [--model small] [--pairs 512] [--batch-size 16] [--precision fp32]

A preset model is saved to a folder that both load. Each run is its own process, timed from its start
to its exit (imports, tokenization, the reference, the epoch, saving), and its peak RSS is read from
the kernel when it exits (the driver never imports torch: Linux keeps a parent's peak across a
child's exec, so the model is saved by a process of its own). TRL runs its defaults for the
reference (a frozen copy of the model in every step) and with ``precompute_ref_log_probs``; lmtune
with its default (the reference's log-probs computed once before training) and with
``--reference live``. Both drop the last partial batch, use the same maximum length (no pair here
is longer), cosine schedule with 5% warmup, ``beta`` 0.1, no checkpoints. Prints one row per run
and the ratios against TRL's default.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "it",
    "you",
    "that",
    "he",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "his",
    "they",
    "be",
    "at",
    "one",
    "have",
    "this",
]


def write_pairs(path: Path, n: int, seed: int = 0) -> None:
    """Pairs of uneven lengths: a prompt of 10-100 words, answers of 5-80 words (a word is about 5
    tokens of the presets' byte-level tokenizer, so no pair is longer than --max-length 1024)."""
    rng = random.Random(seed)

    def words(lo: int, hi: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    rows = [
        {"prompt": words(10, 100), "chosen": " " + words(5, 80), "rejected": " " + words(5, 80)}
        for _ in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def save_preset(name: str, folder: Path) -> None:
    """In its own process (``--save-preset``), so that the driver stays small."""
    from lmtune.model.modeling import build_preset

    loaded = build_preset(name, seed=42)
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)


@dataclass(frozen=True)
class Run:
    name: str
    seconds: float
    cpu_seconds: float  # user + system: what the run cost, less sensitive than wall time to a busy machine
    peak_rss_mib: float


def timed(name: str, cmd: list[str], env: dict[str, str]) -> Run:
    """Run ``cmd`` to its end; its wall time and the peak RSS the kernel reports for it."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    output = proc.stdout.read() if proc.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{name} failed:\n{output[-3000:]}")
    return Run(name, seconds, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)  # RSS in KiB


def lmtune_cmd(args: argparse.Namespace, model: Path, data: Path, out: Path, reference: str) -> list[str]:
    settings = {
        "--model": model,
        "--data": data,
        "--objective": "dpo",
        "--reference": reference,
        "--epochs": 1,
        "--global-batch-size": args.batch_size,
        "--lr": args.lr,
        "--max-length": args.max_length,
        "--precision": args.precision,
        "--output-dir": out,
        "--cache-dir": out.parent / f"cache-{reference}",
    }
    return [
        sys.executable,
        "-m",
        "lmtune",
        "train",
        *(str(x) for kv in settings.items() for x in kv),
        "--no-progress",
    ]


def trl_worker(
    model: str, data: str, out: str, batch: int, lr: float, max_length: int, precision: str, precompute: bool
) -> None:
    """The TRL run, in its own process (``--trl-worker``)."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    dataset = load_dataset("json", data_files=data, split="train")
    args = DPOConfig(
        output_dir=out,
        per_device_train_batch_size=batch,
        num_train_epochs=1,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=0.05,  # a ratio (transformers 5)
        beta=0.1,
        max_length=max_length,
        bf16=precision == "bf16",  # DPOConfig's default is bf16 even on the CPU
        use_cpu=True,
        save_strategy="no",
        report_to="none",
        logging_strategy="no",
        dataloader_drop_last=True,
        disable_tqdm=True,
        precompute_ref_log_probs=precompute,
        seed=42,
    )
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model),
        args=args,
        processing_class=AutoTokenizer.from_pretrained(model),
        train_dataset=dataset,
    )
    trainer.train()
    trainer.save_model(out + "/final")


def trl_cmd(args: argparse.Namespace, model: Path, data: Path, out: Path, precompute: bool) -> list[str]:
    worker = [str(model), str(data), str(out), str(args.batch_size), str(args.lr), str(args.max_length)]
    return [sys.executable, __file__, "--trl-worker", *worker, args.precision, str(int(precompute))]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        model, data, out, batch, lr, length, precision, precompute = sys.argv[2:]
        trl_worker(model, data, out, int(batch), float(lr), int(length), precision, precompute == "1")
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--save-preset":
        save_preset(sys.argv[2], Path(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--pairs", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--runs", default="trl,trl-precompute,lmtune,lmtune-live")
    args = p.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    with tempfile.TemporaryDirectory(prefix="vs-trl-dpo-") as tmp:
        root = Path(tmp)
        model, data = root / "model", root / "pairs.jsonl"
        saver = [sys.executable, __file__, "--save-preset", args.model, str(model)]
        subprocess.run(saver, env=env, check=True)
        write_pairs(data, args.pairs)
        commands = {
            "trl": ("TRL DPOTrainer (live reference)", trl_cmd(args, model, data, root / "trl", False)),
            "trl-precompute": (
                "TRL DPOTrainer (precompute_ref_log_probs)",
                trl_cmd(args, model, data, root / "trl-pre", True),
            ),
            "lmtune": (
                "lmtune (reference log-probs precomputed)",
                lmtune_cmd(args, model, data, root / "lm", "logprobs"),
            ),
            "lmtune-live": (
                "lmtune (--reference live)",
                lmtune_cmd(args, model, data, root / "lm-live", "live"),
            ),
        }
        wanted = args.runs.split(",")
        print(
            f"model {args.model}, {args.pairs} pairs, 1 epoch, batch {args.batch_size}, lr {args.lr}, "
            f"{args.precision}, {os.cpu_count()} CPUs; whole processes"
        )
        runs = {key: timed(*commands[key], env) for key in wanted}
        base = runs.get("trl")
        print(f"{'run':<44}{'seconds':>9}{'CPU s':>9}{'peak RSS MiB':>14}{'vs TRL (wall, CPU)':>20}")
        for run in runs.values():
            ratios = (
                f"{base.seconds / run.seconds:>12.2f}x {base.cpu_seconds / run.cpu_seconds:.2f}x"
                if base
                else ""
            )
            print(
                f"{run.name:<44}{run.seconds:>9.1f}{run.cpu_seconds:>9.1f}{run.peak_rss_mib:>14,.0f}{ratios}"
            )


if __name__ == "__main__":
    main()
