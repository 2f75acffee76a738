"""Generated preference data for the tests: uneven prompts and answers, as strings or messages."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "12", "+", "="]


def pair_records(n: int, seed: int = 0, chat: bool = False) -> list[dict[str, Any]]:
    """``n`` records ``{prompt, chosen, rejected}`` of very different lengths; the chosen answer is
    the sum, the rejected a wrong one with noise (so a model can learn to prefer one)."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        noise = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12)))
        prompt = f"{a} + {b} = ? {noise}".strip()
        chosen = f" {a + b}" + " ok" * rng.randint(0, 3)
        rejected = (
            f" {a + b + rng.randint(1, 9)}"
            + " "
            + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 8)))
        )
        if chat:
            out.append(
                {
                    "prompt": [{"role": "user", "content": prompt}],
                    "chosen": [{"role": "assistant", "content": chosen.strip()}],
                    "rejected": [{"role": "assistant", "content": rejected.strip()}],
                }
            )
        else:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def write_pairs(path: Path, n: int, seed: int = 0, chat: bool = False) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in pair_records(n, seed, chat)), encoding="utf-8")
    return path
