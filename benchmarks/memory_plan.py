"""`lmtune plan` against the measured peak: predicted, calibrated and measured memory per device.

For each setup (strategy x optimizer x activation checkpointing x LoRA) this runs `lmtune plan`
(and `lmtune plan --calibrate`), then trains the same setup for a few real steps and reads the peak
per rank from run.json (CUDA allocator peak on a GPU, resident set size on CPU). It prints one row
per setup with the errors.

    python benchmarks/memory_plan.py                 # small preset, 7 setups, on this machine
    python benchmarks/memory_plan.py --model tiny --no-calibrate
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

SETUPS: dict[str, list[str]] = {
    "single adamw": [],
    "single adamw8bit": ["--optimizer", "adamw8bit"],
    "single adamw ckpt B=8": ["--activation-checkpointing", "--micro-batch-size", "8"],
    "single lora": ["--lora"],
    "ddp x2 adamw": ["--nproc-per-node", "2"],
    "fsdp x2 adamw": ["--nproc-per-node", "2", "--strategy", "fsdp"],
    "ddp x2 lora ckpt": ["--nproc-per-node", "2", "--lora", "--activation-checkpointing"],
    "ddp x2 adamw8bit bf16": ["--nproc-per-node", "2", "--optimizer", "adamw8bit", "--precision", "bf16"],
}


def write_data(path: Path, rows: int, words: int) -> None:
    """Texts longer than --max-length, so every row is full and the width is known."""
    rng = random.Random(0)
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"]
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n")


def lmtune(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "lmtune", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"lmtune {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def predicted(common: list[str], extra: list[str], work: Path, calibrate: bool) -> int:
    out = work / "plan.json"
    lmtune(["plan", *common, *extra, "--json", str(out), *(["--calibrate"] if calibrate else [])])
    return int(json.loads(out.read_text())["requested"]["total"])


def measured(common: list[str], extra: list[str], work: Path, steps: int) -> int:
    out = work / "run"
    lmtune(["train", *common, *extra, "--max-steps", str(steps), "--output-dir", str(out), "--no-progress"])
    return int(max(json.loads((out / "run.json").read_text())["result"]["peak_memory_per_rank"]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated names from the table")
    parser.add_argument("--json", default="memory_plan.json")
    args = parser.parse_args()
    names = [n.strip() for n in args.setups.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "data.jsonl"
        write_data(data, 200, words=args.max_length)
        common = [
            *("--model", args.model, "--data", str(data)),
            *("--max-length", str(args.max_length), "--packing", "off"),
            *("--global-batch-size", str(args.global_batch_size), "--cache-dir", str(root / "cache")),
        ]
        heads = ("predicted", 10), ("calibrated", 11), ("measured", 9), ("error", 7), ("calib. err", 10)
        print(f"{'setup':<24}" + "".join(f" {h:>{w}}" for h, w in heads))
        for name in names:
            extra = SETUPS[name]
            if "--micro-batch-size" not in extra:
                extra = [*extra, "--micro-batch-size", str(args.micro_batch_size)]
            work = root / name.replace(" ", "_").replace("=", "")
            work.mkdir()
            plain = predicted(common, extra, work, calibrate=False)
            calibrated = None if args.no_calibrate else predicted(common, extra, work, calibrate=True)
            real = measured(common, extra, work, args.steps)
            error = (plain - real) / real
            cal_error = None if calibrated is None else (calibrated - real) / real
            rows.append(
                {
                    "setup": name,
                    "predicted": plain,
                    "calibrated": calibrated,
                    "measured": real,
                    "error": error,
                    "calibrated_error": cal_error,
                }
            )
            mib = 2**20
            cal = f"{calibrated / mib:>11,.0f}" if calibrated is not None else f"{'-':>11}"
            cal_err = f"{100 * cal_error:>+9.1f}%" if cal_error is not None else f"{'-':>10}"
            print(
                f"{name:<24} {plain / mib:>10,.0f} {cal} {real / mib:>9,.0f} {100 * error:>+6.1f}% {cal_err}"
            )
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {100 * worst:.1f}% (target 15%)", end="")
    cal_errors = [abs(r["calibrated_error"]) for r in rows if r["calibrated_error"] is not None]
    print(f"; after --calibrate {100 * max(cal_errors):.1f}% (target 10%)" if cal_errors else "")
    Path(args.json).write_text(json.dumps(rows, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
