"""Training throughput: lmtune vs a tutorial-style loop, same model, data and batch, one invocation.

The baseline is our own minimal version of the loop the tutorial teaches: tokenization in the
Dataset's ``__getitem__`` on every step, padding in the collate function, the model's own mean loss,
AdamW. Both train the same tiny preset from the same seed on the same examples for the same number
of steps of ``--batch-size`` examples each; the first ``--warmup`` steps are not timed. The runs
alternate and repeat (``--repeats``), and the median is reported: on a shared 2-core machine the
order of two back-to-back runs alone moves the figures by ~10%.

    python benchmarks/throughput.py [--steps 80] [--warmup 10] [--repeats 3] [--model tiny]

Prints tokens/s of each (non-padding input tokens per second of wall time) and the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from lmtune.config.settings import TrainConfig
from lmtune.data.addition import addition_examples
from lmtune.model.modeling import build_preset
from lmtune.outputs.runlog import read_metrics, tokens_per_second
from lmtune.train import train


class TutorialDataset(Dataset[dict[str, Any]]):
    """Tokenizes in ``__getitem__``, as the tutorial does."""

    def __init__(self, texts: list[str], tokenizer: Any, max_length: int):
        self.texts, self.tokenizer, self.max_length = texts, tokenizer, max_length

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        text = self.texts[i] + self.tokenizer.eos_token
        return dict(self.tokenizer(text, truncation=True, max_length=self.max_length))


def tutorial_loop(
    texts: list[str], model_name: str, steps: int, warmup: int, batch: int, lr: float, seed: int
) -> float:
    torch.manual_seed(seed)
    loaded = build_preset(model_name, seed)
    model, tok = loaded.model, loaded.tokenizer
    ds = TutorialDataset(texts, tok, 512)

    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        padded = tok.pad(rows, return_tensors="pt")
        labels = padded["input_ids"].clone()
        labels[padded["attention_mask"] == 0] = -100
        return {**padded, "labels": labels}

    loader = DataLoader(ds, batch_size=batch, shuffle=True, collate_fn=collate, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    tokens, started, step = 0, 0.0, 0
    while step < steps:
        for b in loader:
            if step == warmup:
                tokens, started = 0, time.perf_counter()
            loss = model(**b).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            tokens += int(b["attention_mask"].sum())
            step += 1
            if step == steps:
                break
    return tokens / (time.perf_counter() - started)


def lmtune_run(
    texts: list[str],
    model_name: str,
    steps: int,
    warmup: int,
    batch: int,
    micro: int,
    lr: float,
    seed: int,
    workdir: Path,
) -> float:
    data = workdir / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = workdir / f"lmtune-micro{micro}"
    train(
        TrainConfig(
            model=model_name,
            data=str(data),
            output_dir=str(out),
            max_steps=steps,
            global_batch_size=batch,
            micro_batch_size=micro,
            lr=lr,
            seed=seed,
            progress=False,
        )
    )
    return tokens_per_second(read_metrics(out), warmup)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=8,
        help="micro-batch of lmtune's memory-saving run (accumulating to --batch-size)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    texts, _ = addition_examples()
    print(
        f"model {args.model}, {args.steps} steps of {args.batch_size} examples "
        f"({args.warmup} untimed), median of {args.repeats}, {torch.get_num_threads()} threads"
    )
    results: dict[str, list[float]] = {"tutorial": [], "lmtune": [], "lmtune_accum": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            common = (texts, args.model, args.steps, args.warmup, args.batch_size)
            results["lmtune"].append(lmtune_run(*common, args.batch_size, args.lr, args.seed, Path(tmp)))
            results["tutorial"].append(tutorial_loop(*common, args.lr, args.seed))
            results["lmtune_accum"].append(
                lmtune_run(*common, args.micro_batch_size, args.lr, args.seed, Path(tmp))
            )
    base = statistics.median(results["tutorial"])
    rows = [
        ("tutorial-style loop (tokenize per step)", base),
        ("lmtune, micro-batch = batch", statistics.median(results["lmtune"])),
        (
            f"lmtune, micro-batch {args.micro_batch_size} + accumulation",
            statistics.median(results["lmtune_accum"]),
        ),
    ]
    print(f"{'run':<46}{'tokens/s':>12}{'ratio':>8}")
    for name, value in rows:
        print(f"{name:<46}{value:>12,.0f}{value / base:>8.2f}")


if __name__ == "__main__":
    main()
