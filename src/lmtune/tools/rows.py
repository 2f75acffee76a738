"""How wide the rows of a micro-batch are, as training would lay them out (for `lmtune plan`):
packed rows of --max-length, the longest example of --data, or a preference pair's two rows."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from lmtune.config.settings import SAMPLE_DATA, TrainConfig


def model_obstacle(config: Any, device: str) -> str | None:
    """Why the model takes no mask of lmtune's (as training finds it, here on the model built
    without weights), or None: its preference pairs then run as two rows, --packing on is refused."""
    from lmtune.model.masks import mask_obstacle
    from lmtune.tools.trace import fake_device, fake_model

    with fake_device(device):
        return mask_obstacle(fake_model(config))


class Rows(NamedTuple):
    length: int  # tokens per row
    padded: bool  # the rows carry a mask (padding or packing)
    reason: str  # how the length was decided
    most: int = 0  # packed rows a micro-batch holds at most (0: as many as the micro-batch)


# The plan of no --data (the built-in sample's few tokens an example say nothing of a user's):
# full rows, the most any data fills; a trial read it as 3.6x the demo's own peak.
_WITHOUT_DATA = "no --data: packed rows of --max-length, the most any data fills; --data plans yours"


def row_length(cfg: TrainConfig, apart: str | None = None, per_rank: int = 0) -> Rows:
    """The rows of a micro-batch and how that was decided.

    Packed rows are --max-length wide, and a step's ``per_rank`` examples (a rank's share of the
    global batch) fill only so many of them: as many as the longest such examples of --data fill
    (short examples filled one row where 32 of --max-length were planned, 3.6x the real peak).
    Otherwise a micro-batch is as wide as its longest example, found by tokenizing --data (through
    the same cache as training): for pairs ``apart`` (see :func:`model_obstacle`), its prompt and
    longer answer.
    """
    from lmtune.model.modeling import load_tokenizer
    from lmtune.parallel.distributed import read_dist_env
    from lmtune.training.build import prepare_data

    if cfg.batch.packing == "on" and cfg.data.train == SAMPLE_DATA:
        return Rows(cfg.examples.max_length, True, _WITHOUT_DATA)
    env = read_dist_env("cpu")
    quiet = _QuietLog()
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
    if cfg.examples.chat_template is not None:  # the same tokens, and the same cache entry, as training
        from lmtune.data.chat import use_chat_template

        use_chat_template(tokenizer, cfg.examples.chat_template)
    train, _, info = prepare_data(cfg.replace(eval_data=None), tokenizer, env, quiet)
    lengths = train.lengths()
    longest = int(lengths.max())
    packs = cfg.batch.packing == "on" or (
        cfg.batch.packing == "auto"
        and set(info["train"]["formats"]) == {"text"}
        and int(lengths.min()) < longest
    )
    if packs:
        why = (
            "--packing on: rows of --max-length"
            if cfg.batch.packing == "on"
            else ("text data may be packed into rows of --max-length")
        )
        if cfg.data.train == SAMPLE_DATA or not per_rank or train.is_pairs:  # rows of --max-length
            return Rows(
                cfg.examples.max_length, True, _WITHOUT_DATA if cfg.data.train == SAMPLE_DATA else why
            )
        from lmtune.data.packing import pack_bins

        step = np.sort(np.minimum(lengths, cfg.examples.max_length))[-per_rank:]
        rows = pack_bins(step.tolist(), cfg.examples.max_length)
        widest = max(int(step[row].sum()) for row in rows)
        return Rows(widest, True, f"{why}; a step's {len(step)} longest examples fill {len(rows)}", len(rows))
    if apart is not None and train.is_pairs:
        parts = train.pair_lengths()
        rows = parts[:, 0] + parts[:, 1:].max(axis=1)
        # Two rows of a pair differ unless its answers do not: either way a mask pads them.
        widest = int(rows.max())
        return Rows(
            widest,
            True,
            f"longest prompt and answer of --data: {widest} tokens (each pair runs as two rows, its "
            f"prompt with each answer: {apart})",
        )
    padded = int(lengths.min()) < longest
    return Rows(longest, padded, f"longest example of --data: {longest} tokens")


class _QuietLog:
    def info(self, message: str) -> None:
        pass
