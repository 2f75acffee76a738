"""The chunked linear cross-entropy against full logits on a model with a real vocabulary.

A model built from a config with Qwen2.5-0.5B's vocabulary (151,936) and hidden size (896), with
fewer decoder blocks so that a CPU runs it, trains a few steps of 2 x 1024 tokens both ways
(`--loss-chunk-size 0` and the default chunking). Reported: the measured peak memory (CUDA
allocator peak on a GPU, resident set size on CPU), the median step time, and `lmtune plan`'s
prediction for each. Targets: peak at least 35% lower, step time at most 1.03x, plan within 15%.

    python benchmarks/vocab_memory.py                    # 2 blocks, fp32, 4 steps
    python benchmarks/vocab_memory.py --layers 4 --precision bf16 --steps 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import string
import subprocess
import sys
import tempfile
from pathlib import Path


def build_model(folder: Path, layers: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lmtune.model.modeling import byte_tokenizer

    tok = byte_tokenizer()
    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        num_hidden_layers=layers,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def write_data(path: Path, rows: int, chars: int) -> None:
    rng = random.Random(0)
    letters = string.ascii_lowercase + " "
    path.write_text(
        "".join(json.dumps({"text": "".join(rng.choices(letters, k=chars))}) + "\n" for _ in range(rows))
    )


def lmtune(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "lmtune", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"lmtune {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument(
        "--chunk-sizes",
        default="",
        help="comma-separated --loss-chunk-size values to run too, beside the default's (e.g. 1024,4096)",
    )
    parser.add_argument("--no-plan", action="store_true", help="skip lmtune plan (its measuring runs)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmtune-vocab-"))
    build_model(work / "model", args.layers)
    write_data(work / "data.jsonl", 4 * args.micro_batch_size, args.length + 64)
    common = [
        *(
            "--model",
            str(work / "model"),
            "--data",
            str(work / "data.jsonl"),
            "--max-length",
            str(args.length),
        ),
        *(
            "--micro-batch-size",
            str(args.micro_batch_size),
            "--global-batch-size",
            str(args.micro_batch_size),
        ),
        *("--packing", "off", "--precision", args.precision, "--device", args.device, "--seed", "0"),
        *("--cache-dir", str(work / "cache")),
    ]
    results = {}
    # Each row is printed as its runs end, so that a run cut short by a device's time limit still reports.
    print(
        f"Qwen2.5-0.5B vocabulary and width, {args.layers} blocks, {args.micro_batch_size} x {args.length} "
        f"tokens, {args.precision}"
    )
    print(f"{'':16}{'peak MiB':>10}{'plan MiB':>10}{'plan err':>10}{'step ms':>9}  loss", flush=True)
    runs = [("full logits", ["--loss-chunk-size", "0"]), ("chunked", [])]
    runs += [(f"chunks of {n}", ["--loss-chunk-size", n]) for n in args.chunk_sizes.split(",") if n.strip()]
    for name, extra in runs:
        out = work / name.replace(" ", "-")
        lmtune(
            [
                "train",
                *common,
                *extra,
                "--max-steps",
                str(args.steps),
                "--output-dir",
                str(out),
                "--no-progress",
            ]
        )
        run = json.loads((out / "run.json").read_text())
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        elapsed = [r["elapsed_s"] for r in rows if r["kind"] == "train"]
        steps = [b - a for a, b in itertools.pairwise(elapsed)]
        plan = {"total": float("nan"), "logits": float("nan")}
        if not args.no_plan:
            lmtune(["plan", *common, *extra, "--json", str(out / "plan.json")])
            plan = json.loads((out / "plan.json").read_text())["requested"]
        results[name] = {
            "loss": run["resolved"]["loss"],
            "measured_peak_bytes": max(run["result"]["peak_memory_per_rank"]),
            "planned_peak_bytes": plan["total"],
            "planned_logits_bytes": plan["logits"],
            "step_s": statistics.median(steps),
            "last_loss": run["result"]["last_loss"],
        }
        r = results[name]
        err = r["planned_peak_bytes"] / r["measured_peak_bytes"] - 1
        print(
            f"{name:16}{r['measured_peak_bytes'] / 2**20:>10,.0f}{r['planned_peak_bytes'] / 2**20:>10,.0f}"
            f"{100 * err:>9.1f}%{1000 * r['step_s']:>9.1f}  {r['loss']}",
            flush=True,
        )
    full, chunked = results["full logits"], results["chunked"]
    saved = 1 - chunked["measured_peak_bytes"] / full["measured_peak_bytes"]
    ratio = chunked["step_s"] / full["step_s"]
    print(
        f"peak {100 * saved:.0f}% lower (target >= 35%), step time x{ratio:.3f} (target <= 1.03), "
        f"last loss {chunked['last_loss']:.6f} vs {full['last_loss']:.6f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
