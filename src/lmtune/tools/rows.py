"""How wide the rows of a micro-batch are, as training would lay them out (for `lmtune plan`):
packed rows of --max-length, the longest example of --data, or a preference pair's two rows."""

from __future__ import annotations

from typing import Any

from lmtune.config.settings import TrainConfig


def model_obstacle(config: Any, device: str) -> str | None:
    """Why the model takes no mask of lmtune's (as training finds it, here on the model built
    without weights), or None: its preference pairs then run as two rows, --packing on is refused."""
    from lmtune.model.masks import mask_obstacle
    from lmtune.tools.trace import fake_device, fake_model

    with fake_device(device):
        return mask_obstacle(fake_model(config))


def row_length(cfg: TrainConfig, apart: str | None = None) -> tuple[int, bool, str]:
    """Tokens per row, whether rows carry a mask (padding or packing), and how that was decided.

    Packed rows are --max-length wide; otherwise a micro-batch is as wide as its longest example,
    found by tokenizing --data (through the same cache as training): for pairs ``apart`` (see
    :func:`model_obstacle`), its prompt and longer answer.
    """
    from lmtune.model.modeling import load_tokenizer
    from lmtune.parallel.distributed import read_dist_env
    from lmtune.training.build import prepare_data

    if cfg.batch.packing == "on":
        return cfg.examples.max_length, True, "--packing on: rows of --max-length"
    env = read_dist_env("cpu")
    quiet = _QuietLog()
    tokenizer = load_tokenizer(cfg.model.name, cfg.model.trust_remote_code)
    if cfg.examples.chat_template is not None:  # the same tokens, and the same cache entry, as training
        from lmtune.data.chat import use_chat_template

        use_chat_template(tokenizer, cfg.examples.chat_template)
    train, _, info = prepare_data(cfg.replace(eval_data=None), tokenizer, env, quiet)
    lengths = train.lengths()
    longest = int(lengths.max())
    if (
        cfg.batch.packing == "auto"
        and set(info["train"]["formats"]) == {"text"}
        and int(lengths.min()) < longest
    ):
        return cfg.examples.max_length, True, "text data may be packed into rows of --max-length"
    if apart is not None and train.is_pairs:
        parts = train.pair_lengths()
        rows = parts[:, 0] + parts[:, 1:].max(axis=1)
        # Two rows of a pair differ unless its answers do not: either way a mask pads them.
        widest = int(rows.max())
        return (
            widest,
            True,
            (
                f"longest prompt and answer of --data: {widest} tokens (each pair runs as two rows, its "
                f"prompt with each answer: {apart})"
            ),
        )
    padded = int(lengths.min()) < longest
    return longest, padded, f"longest example of --data: {longest} tokens"


class _QuietLog:
    def info(self, message: str) -> None:
        pass
