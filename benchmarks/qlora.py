"""QLoRA (LoRA on a 4-bit base, `--load-in-4bit`) against plain LoRA on the same model and data.

A Llama model of ~113M parameters (hidden 768, 12 blocks, MLP 3072, the byte-level vocabulary) is
built and saved as a model folder, as a user's model would be; both runs load it from there and
train the same steps. Reported for each: the whole-process peak memory (resident set size on CPU,
CUDA allocator peak on a GPU: run.json's), the median step time, the loss after the last step,
and `lmtune plan`'s prediction. Targets (CPU): QLoRA's peak at most 0.75x LoRA's, its loss within
5% of LoRA's, plan within 15% of both peaks.

On CPU a QLoRA run serves buffers of 1 MiB and more from their own memory maps (glibc's mmap
threshold; see lmtune.model.quantization.return_freed_buffers), which plain LoRA runs do not do; a
third run, plain LoRA with the same threshold (MALLOC_MMAP_THRESHOLD_), shows what of the saving is
the 4-bit base alone.

    python benchmarks/qlora.py                                   # ~113M, CPU, fp32, 30 steps
    python benchmarks/qlora.py --steps 10 --no-plan
    python benchmarks/qlora.py --size 1b --device cuda --precision bf16 --steps 20   # a lent GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# hidden, MLP, blocks, heads: ~113M (GPT-2 small's shape) and ~1.0B (TinyLlama's) parameters.
SIZES = {"100m": (768, 3072, 12, 12), "1b": (2048, 5632, 22, 32)}


def build_model(folder: Path, size: str) -> int:
    """Save a seeded Llama of ``size`` with the byte-level tokenizer; its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmtune.model.modeling import byte_tokenizer

    hidden, mlp, layers, heads = SIZES[size]
    tok = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_data(path: Path, rows: int, words: int) -> None:
    """Texts longer than --max-length, so packed rows are full and their width is known."""
    rng = random.Random(0)
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven"]
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words))}) + "\n")


def lmtune(args: list[str], env: dict[str, str] | None = None) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lmtune", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        raise SystemExit(f"lmtune {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def measure(
    common: list[str], extra: list[str], out: Path, steps: int, plan: bool, env: dict[str, str] | None = None
) -> dict[str, float]:
    train_args = [
        "train",
        *common,
        *extra,
        "--lr",
        "1e-3",
        "--max-steps",
        str(steps),
        "--output-dir",
        str(out),
    ]
    lmtune([*train_args, "--no-progress"], env)
    run = json.loads((out / "run.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    step_s = [b - a for a, b in itertools.pairwise(r["elapsed_s"] for r in train)]
    result = {
        "peak_bytes": max(run["result"]["peak_memory_per_rank"]),
        "step_s": statistics.median(step_s) if step_s else float("nan"),
        "last_loss": train[-1]["loss"],
        "first_loss": train[0]["loss"],
    }
    if plan:
        lmtune(["plan", *common, *extra, "--json", str(out / "plan.json")])
        result["planned_bytes"] = json.loads((out / "plan.json").read_text())["requested"]["total"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="100m")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--no-plan", action="store_true", help="skip lmtune plan's predictions")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lmtune-qlora-"))
    params = build_model(work / "model", args.size)
    batch = args.micro_batch_size
    write_data(work / "data.jsonl", batch * (args.steps + 2), args.length)
    common = [
        *("--model", str(work / "model"), "--data", str(work / "data.jsonl"), "--lora"),
        *("--max-length", str(args.length), "--packing", "on", "--seed", "0"),
        *("--micro-batch-size", str(batch), "--global-batch-size", str(batch)),
        *("--precision", args.precision, "--device", args.device, "--cache-dir", str(work / "cache")),
    ]
    results = {}
    for name, extra in (("lora", []), ("qlora", ["--load-in-4bit"])):
        results[name] = measure(common, extra, work / name, args.steps, not args.no_plan)
    if args.device != "cuda":
        mapped = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        results["lora, mmap 1 MiB"] = measure(common, [], work / "lora-mmap", args.steps, False, mapped)
    print(
        f"Llama {params / 1e6:,.0f}M parameters, {batch} x {args.length} tokens per step, "
        f"{args.steps} steps, {args.precision}"
    )
    print(f"{'':18}{'peak MiB':>10}{'plan MiB':>10}{'plan err':>10}{'step s':>9}{'loss':>10}")
    for name, r in results.items():
        planned = r.get("planned_bytes")
        err = f"{100 * (planned / r['peak_bytes'] - 1):>9.1f}%" if planned else f"{'-':>10}"
        plan_mib = f"{planned / 2**20:>10,.0f}" if planned else f"{'-':>10}"
        peak = r["peak_bytes"] / 2**20
        print(f"{name:18}{peak:>10,.0f}{plan_mib}{err}{r['step_s']:>9.2f}{r['last_loss']:>10.4f}")
    lora, qlora = results["lora"], results["qlora"]
    print(
        f"QLoRA: peak x{qlora['peak_bytes'] / lora['peak_bytes']:.2f} of LoRA's (target <= 0.75), "
        f"step time x{qlora['step_s'] / lora['step_s']:.2f}, loss {qlora['last_loss']:.4f} vs "
        f"{lora['last_loss']:.4f} ({100 * (qlora['last_loss'] / lora['last_loss'] - 1):+.1f}%, "
        "target within 5%)"
    )
    if "lora, mmap 1 MiB" in results:
        mapped_peak = results["lora, mmap 1 MiB"]["peak_bytes"]
        print(
            f"QLoRA's peak x{qlora['peak_bytes'] / mapped_peak:.2f} of LoRA's with the same allocator setting"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
