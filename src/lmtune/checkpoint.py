"""Saving trained models in Hugging Face format."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from torch import nn


def save_hf_folder(model: nn.Module, tokenizer: Any, folder: Path) -> None:
    """Write config, ``model.safetensors`` and the tokenizer so ``from_pretrained`` loads it back.

    The folder is written beside its final name and renamed when complete, so a crash never leaves
    a half-written model where a finished one is expected.
    """
    tmp = folder.with_name(folder.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)  # type: ignore[operator]
    tokenizer.save_pretrained(tmp)
    if folder.exists():
        shutil.rmtree(folder)
    tmp.rename(folder)
