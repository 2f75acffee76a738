"""One epoch, same model, data and global batch: lmtune (packing on and off) vs Hugging Face Trainer.

Needs the benchmark extra: pip install -c constraints.txt -e '.[bench]'

    python benchmarks/vs_hf_trainer.py [--model tiny|small] [--precisions fp32,bf16] [--examples 4000]

Both train the same preset from the same seed on the same examples (the built-in addition task, or
uneven generated texts with --data uneven) for one epoch with global batch --batch-size. Trainer gets
the usual recipe: a tokenized `datasets.Dataset`, `DataCollatorForLanguageModeling(mlm=False)`, no
gradient accumulation. Throughput is non-padding tokens of the epoch over the training loop's wall
time (Trainer's train_runtime; lmtune's fit loop from metrics.jsonl). Prints one row per run and the
ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from lmtune.config.settings import TrainConfig
from lmtune.data.addition import addition_examples
from lmtune.model.modeling import build_preset
from lmtune.outputs.runlog import read_metrics, tokens_per_second
from lmtune.train import train


def texts_for(kind: str, n: int) -> list[str]:
    if kind == "addition":
        return addition_examples()[0][:n]
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 60))) for _ in range(n)]


def run_lmtune(texts: list[str], model: str, precision: str, batch: int, packing: str, tmp: Path) -> float:
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp / f"lmtune-{precision}-{packing}"
    train(
        TrainConfig(
            model=model,
            data=str(data),
            output_dir=str(out),
            epochs=1,
            global_batch_size=batch,
            lr=1e-3,
            precision=precision,
            packing=packing,
            progress=False,
            cache_dir=str(tmp / "cache"),
            resume="never",
        )
    )
    return tokens_per_second(read_metrics(out))


def run_trainer(texts: list[str], model_name: str, precision: str, batch: int, tmp: Path) -> float:
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    loaded = build_preset(model_name, seed=42)
    tok = loaded.tokenizer
    ds = Dataset.from_dict({"text": [t + tok.eos_token for t in texts]})
    ds = ds.map(
        lambda b: tok(b["text"], truncation=True, max_length=512), batched=True, remove_columns=["text"]
    )
    tokens = sum(len(x) for x in ds["input_ids"])
    args = TrainingArguments(
        output_dir=str(tmp / "hf"),
        per_device_train_batch_size=batch,
        num_train_epochs=1,
        learning_rate=1e-3,
        bf16=precision == "bf16",
        use_cpu=not torch.cuda.is_available(),
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        dataloader_drop_last=True,
        seed=42,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=loaded.model,
        args=args,
        train_dataset=ds,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
    )
    started = time.perf_counter()
    metrics = trainer.train().metrics
    runtime = metrics.get("train_runtime", time.perf_counter() - started)
    used = len(ds) // batch * batch / len(ds)  # drop_last: the tokens of whole batches
    return tokens * used / runtime


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--examples", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--data", default="addition", choices=["addition", "uneven"])
    args = p.parse_args()
    texts = texts_for(args.data, args.examples)
    print(
        f"model {args.model}, {len(texts)} {args.data} examples, 1 epoch, global batch {args.batch_size}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'run':<34}{'tokens/s':>12}{'vs Trainer':>12}")
    for precision in args.precisions.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            hf = run_trainer(texts, args.model, precision, args.batch_size, Path(tmp))
            default = run_lmtune(texts, args.model, precision, args.batch_size, "auto", Path(tmp))
            packed = run_lmtune(texts, args.model, precision, args.batch_size, "on", Path(tmp))
            padded = run_lmtune(texts, args.model, precision, args.batch_size, "off", Path(tmp))
        print(f"{'HF Trainer ' + precision:<34}{hf:>12,.0f}{1.0:>12.2f}")
        print(f"{'lmtune ' + precision + ' (defaults)':<34}{default:>12,.0f}{default / hf:>12.2f}")
        print(f"{'lmtune ' + precision + ' (packing on)':<34}{packed:>12,.0f}{packed / hf:>12.2f}")
        print(f"{'lmtune ' + precision + ' (packing off)':<34}{padded:>12,.0f}{padded / hf:>12.2f}")
        print(f"{'':<34}packing on / off: {packed / padded:.2f}x")


if __name__ == "__main__":
    main()
