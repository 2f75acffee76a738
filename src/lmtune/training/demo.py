"""The built-in demo's proof of learning: after training on --data sample, answer held-out sums."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lmtune.config.settings import TrainConfig
from lmtune.data.addition import addition_examples, split_prompt
from lmtune.errors import UserError, visible
from lmtune.model.generate import complete_greedy
from lmtune.model.lora import merged_model
from lmtune.model.modeling import load_model
from lmtune.outputs.runlog import InfoLog


def final_model(cfg: TrainConfig, final_dir: Path) -> torch.nn.Module:
    """The trained model read back from ``final/`` (under FSDP no rank holds it whole)."""
    if cfg.lora.enabled:
        return merged_model(
            load_model(cfg.model.name, cfg.seed, cfg.model.trust_remote_code).model, final_dir
        )
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(final_dir)
    return model


def show_answers(model: torch.nn.Module, tokenizer: Any, log: InfoLog, n: int = 50) -> None:
    """Answer ``n`` held-out sums the model never trained on; log the score and a few answers."""
    right = 0
    lines: list[str] = []
    asked = [split_prompt(text) for text in addition_examples()[1][:n]]
    try:
        answers = complete_greedy(model, tokenizer, [prompt for prompt, _ in asked], max_new_tokens=8)
    except UserError as e:  # the run is done and saved: a sample it cannot draw does not undo that
        log.info(f"warning: no held-out answers: {e}")
        return
    for (prompt, expected), got in zip(asked, answers, strict=True):
        right += got == expected
        if len(lines) < 5:
            lines.append(f"  {prompt}{visible(got):<4} {'ok' if got == expected else 'expected ' + expected}")
    log.info(f"held-out answers: {right}/{n} correct\n" + "\n".join(lines))
