"""The built-in sample task: two-digit addition, generated deterministically.

It is small enough for the tiny preset to learn in a minute or two on two CPU cores, and its answers
are checkable, so the demo can show the trained model answering.
"""

from __future__ import annotations

import random

SAMPLE_SEED = 1234
TRAIN_SIZE = 9500
EVAL_SIZE = 250


def addition_examples(seed: int = SAMPLE_SEED) -> tuple[list[str], list[str]]:
    """Train and held-out texts like ``"17+58=75"``; no pair appears in both splits."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(pairs)
    texts = [f"{a}+{b}={a + b}" for a, b in pairs]
    return texts[:TRAIN_SIZE], texts[TRAIN_SIZE : TRAIN_SIZE + EVAL_SIZE]


def split_prompt(text: str) -> tuple[str, str]:
    """``"17+58=75"`` -> (``"17+58="``, ``"75"``)."""
    head, _, answer = text.partition("=")
    return head + "=", answer
