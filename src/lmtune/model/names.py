"""How a --model name reads before anything loads: written as a path, and a folder near a
mistyped one (a hub id and a preset are the other readings: lmtune.model.modeling)."""

from __future__ import annotations

import difflib
from collections.abc import Container
from pathlib import Path

from lmtune.config.files import RUN_RECORD_BYTES, read_json_object
from lmtune.errors import UserError


def looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(("/", "\\")) or name.count("/") > 1


def near_folder(parent: Path, rest: str) -> str:
    """A folder inside ``parent`` whose name is close to ``rest``'s first part (run/fnial:
    run/final), or ""."""
    head, _, tail = rest.partition("/")
    try:
        names = [p.name for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(head, names, n=1, cutoff=0.6)
    if not close:
        return ""
    return str(parent / close[0] / tail) if tail else str(parent / close[0])


def run_preset(adapter: Path, presets: Container[str]) -> tuple[str, int] | None:
    """The preset and seed a LoRA adapter that names no base was trained on, from its run's run.json
    (beside RUN/final, two up from RUN/checkpoints/step-N), or None: a preset's weights are its
    seed's, so the base is built again as the run built it."""
    checkpoint = (adapter / "manifest.json").is_file()
    record = (adapter.parent.parent if checkpoint else adapter.parent) / "run.json"
    try:  # read as any file of the user's folders: bounded, and a damaged one names no base
        config = read_json_object(record, limit=RUN_RECORD_BYTES, follow_links=True).get("config")
        fixed = read_json_object(adapter / "fingerprint.json").get("fixed") if checkpoint else None
    except (OSError, UserError):
        return None
    if not isinstance(config, dict) or not config.get("lora"):
        return None
    model, seed = config.get("model"), config.get("seed")
    if not isinstance(model, str) or model not in presets or type(seed) is not int:
        return None
    # A checkpoint saved under these settings (its fingerprint), not moved into another run's folder.
    saved = (fixed.get("--model"), fixed.get("--seed")) if isinstance(fixed, dict) else None
    return None if checkpoint and saved != (model, seed) else (model, seed)
