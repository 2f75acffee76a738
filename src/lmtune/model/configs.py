"""A model folder's files checked before transformers reads them and before anything is allocated:
its entries are regular files (a FIFO would hang the reader), its JSON files are small and well
formed, the sizes its config.json states are whole numbers in a sane range, the model they describe
fits this machine's memory, and generation_config.json holds token ids where ids belong."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmtune.config.files import MIB, is_int, read_json_object
from lmtune.errors import UserError, brief

CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "adapter_config.json")
CONFIG_BYTES = 16 * MIB
# Upper bounds far above any released model: a value past one is an edited file, not a model.
SIZE_FIELDS = {
    "num_hidden_layers": 1024,
    "n_layer": 1024,
    "num_layers": 1024,
    "hidden_size": 1 << 16,
    "n_embd": 1 << 16,
    "d_model": 1 << 16,
    "intermediate_size": 1 << 20,
    "n_inner": 1 << 20,
    "ffn_dim": 1 << 20,
    "num_attention_heads": 1 << 12,
    "n_head": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 26,
    "n_positions": 1 << 26,
}
TOKEN_ID_FIELDS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")


def check_folder(folder: Path, option: str) -> None:
    """Every entry of a model folder is a regular file or a folder, and its JSON files are objects
    of at most 16 MiB (read without blocking; a link to /dev/zero is refused)."""
    for entry in folder.iterdir():
        if not (entry.is_file() or entry.is_dir()):
            raise UserError(f"{option}: {entry} is not a regular file (a FIFO, device or dangling link)")
    for name in CONFIG_FILES:
        path = folder / name
        if path.exists():
            try:
                read_json_object(path, limit=CONFIG_BYTES, follow_links=True)
            except UserError as e:
                raise UserError(f"{option}: {e}") from None
    generation = folder / "generation_config.json"
    if generation.is_file():
        check_generation_config(read_json_object(generation, follow_links=True), f"{option}: {generation}")


def _sizes(raw: dict[str, Any], where: str) -> dict[str, int]:
    """The size fields of a config (and of a nested ``text_config``), checked."""
    found: dict[str, int] = {}
    for section in (raw, raw.get("text_config")):
        if not isinstance(section, dict):
            continue
        for name, bound in SIZE_FIELDS.items():
            value = section.get(name)
            if value is None:
                continue
            if not is_int(value, 0, bound):
                raise UserError(
                    f"{where}: {name} must be a whole number in [0, {bound:,}] (got {brief(value)})"
                )
            found.setdefault(name, value)
    return found


def check_config(raw: dict[str, Any], where: str, *, fits_memory: bool) -> None:
    """The sizes a model config states; with ``fits_memory`` also that the model it describes fits
    this machine's memory in fp32 (lmtune loads weights in fp32 on the host first), so a huge
    ``num_hidden_layers`` is refused before any allocation rather than failing after minutes."""
    sizes = _sizes(raw, where)
    if not fits_memory:
        return
    layers = sizes.get("num_hidden_layers", sizes.get("n_layer", sizes.get("num_layers", 0)))
    hidden = sizes.get("hidden_size", sizes.get("n_embd", sizes.get("d_model", 0)))
    inner = (
        sizes.get("intermediate_size", sizes.get("n_inner", sizes.get("ffn_dim", 4 * hidden))) or 4 * hidden
    )
    vocab = sizes.get("vocab_size", 0)
    # A lower estimate (attention's q and o, a gated MLP, one embedding): refused only when even it
    # does not fit.
    parameters = vocab * hidden + layers * (2 * hidden * hidden + 3 * hidden * inner)
    memory = _memory_bytes()
    if memory and parameters * 4 > memory:
        raise UserError(
            f"{where}: describes a model of at least {parameters / 1e9:,.1f} B parameters "
            f"({parameters * 4 / 2**30:,.0f} GiB in fp32; num_hidden_layers {layers}, hidden_size {hidden}, "
            f"vocab_size {vocab}), more than this machine's {memory / 2**30:,.0f} GiB of memory"
        )


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 0


def check_generation_config(raw: dict[str, Any], where: str) -> None:
    """Token ids where generation_config.json names them: an id, a list of ids, or null."""
    for name in TOKEN_ID_FIELDS:
        value = raw.get(name)
        ids = value if isinstance(value, list) else [value]
        if value is not None and not all(is_int(i, 0, 1 << 31) for i in ids):
            raise UserError(f"{where}: {name} must be a token id or a list of them (got {brief(value)})")
    for name in ("max_length", "max_new_tokens", "min_length", "top_k", "num_beams"):
        value = raw.get(name)
        if value is not None and not is_int(value, 0, 1 << 31):
            raise UserError(f"{where}: {name} must be a whole number (got {brief(value)})")
