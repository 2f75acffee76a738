"""Data preparation: first run (read, render, tokenize, write the cache) vs a cache hit.

Generates a corpus of ``--examples`` records (text, prompt/completion and chat, a third each, or
one format with ``--format``) and prepares it twice with the tiny preset's tokenizer:

    python benchmarks/data_prep.py [--examples 200000] [--format mixed|text|prompt_completion|messages]

Prints the wall time of each, examples per second, and the speed-up of the cache hit.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from lmtune.config.groups import ExampleSettings
from lmtune.data.prepare import prepare
from lmtune.model.modeling import byte_tokenizer
from lmtune.parallel.distributed import read_dist_env

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
    "his",
    "her",
    "it",
    "an",
    "be",
    "this",
    "are",
]


def sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def record(rng: random.Random, fmt: str) -> dict[str, object]:
    if fmt == "text":
        return {"text": sentence(rng, 10, 120)}
    if fmt == "prompt_completion":
        return {"prompt": sentence(rng, 5, 60) + "\n", "completion": sentence(rng, 5, 60)}
    turns = [{"role": r, "content": sentence(rng, 3, 30)} for r in ("user", "assistant") * rng.randint(1, 3)]
    return {"messages": turns}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=200_000)
    p.add_argument("--format", default="mixed", choices=["mixed", "text", "prompt_completion", "messages"])
    args = p.parse_args()
    rng = random.Random(0)
    formats = ["text", "prompt_completion", "messages"] if args.format == "mixed" else [args.format]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "corpus.jsonl"
        with data.open("w") as f:
            for i in range(args.examples):
                f.write(json.dumps(record(rng, formats[i % len(formats)])) + "\n")
        size_mb = data.stat().st_size / 1e6
        env = read_dist_env("cpu")
        timings = []
        for _ in range(2):
            started = time.perf_counter()
            prepared = prepare(str(data), byte_tokenizer(), ExampleSettings(), env, Path(tmp) / "cache")
            timings.append((time.perf_counter() - started, prepared))
    (first, built), (hit, cached) = timings
    assert built.built and not cached.built
    n = built.dataset.meta["examples"]
    print(
        f"corpus: {args.examples:,} records ({args.format}), {size_mb:.0f} MB JSONL, "
        f"{built.dataset.meta['tokens']:,} tokens"
    )
    print(f"{'run':<28}{'seconds':>10}{'examples/s':>14}")
    print(f"{'first (tokenize + write)':<28}{first:>10.2f}{n / first:>14,.0f}")
    print(f"{'second (cache hit)':<28}{hit:>10.2f}{n / hit:>14,.0f}")
    print(f"cache hit is {first / hit:,.0f}x faster")


if __name__ == "__main__":
    main()
