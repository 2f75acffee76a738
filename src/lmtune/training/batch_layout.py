"""BatchLayout: how the global batch maps onto processes and micro-steps, and how many optimizer
steps the run takes. Computed once per run from the settings and the data's size, then passed down."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lmtune.config.groups import MAX_STEPS
from lmtune.config.settings import DEFAULT_EPOCHS, SAMPLE_DATA, SAMPLE_EPOCHS, TrainConfig, micro_batch_size
from lmtune.data.sampling import largest_global_batch, steps_per_epoch
from lmtune.errors import SettingError, UserError


@dataclass(frozen=True)
class BatchLayout:
    global_batch_size: int  # examples per optimizer step, all processes
    micro_batch_size: int  # examples per forward on one process
    world_size: int
    accumulation: int  # micro-steps per optimizer step on each rank (at most this many when packing)
    steps_per_epoch: int
    total_steps: int
    epochs: int
    # Examples past an epoch's last whole global batch: they sit that epoch out (others the next,
    # as the order is reshuffled), as a DistributedSampler with drop_last does.
    left_out_per_epoch: int = 0

    @property
    def per_rank(self) -> int:
        """Examples of one optimizer step on one process."""
        return self.global_batch_size // self.world_size


def epochs(cfg: TrainConfig) -> int:
    if cfg.schedule.epochs is not None:
        return cfg.schedule.epochs
    return SAMPLE_EPOCHS if cfg.data.train == SAMPLE_DATA else DEFAULT_EPOCHS


def batch_layout(cfg: TrainConfig, world_size: int, n_examples: int) -> BatchLayout:
    """The layout of a run of ``cfg`` on ``world_size`` processes over ``n_examples`` examples."""
    per_epoch = steps_per_epoch(n_examples, cfg.batch.global_batch_size)
    if per_epoch == 0:
        fits = largest_global_batch(n_examples, cfg.batch.micro_batch_size, world_size)
        split = cfg.data.eval_split
        smaller = ", a smaller --eval-split" if split is not None else ""
        fix = f"give --global-batch-size {fits} or less{smaller}, or more data" if fits else "give more data"
        held = f" left to train on after --eval-split {split:g}" if split is not None else ""
        raise UserError(
            f"--data {cfg.data.train}: {n_examples} example{'' if n_examples == 1 else 's'}{held}, fewer "
            "than one global batch "
            f"(--global-batch-size {cfg.batch.global_batch_size}); {fix}"
        )
    micro = micro_batch_size(cfg, world_size)
    total = cfg.schedule.max_steps if cfg.schedule.max_steps is not None else epochs(cfg) * per_epoch
    if total > MAX_STEPS:
        raise UserError(
            f"--epochs {epochs(cfg):,} of {per_epoch:,} steps each: {total:,} steps, more than 2**40 "
            f"({MAX_STEPS:,}); give fewer --epochs, or --max-steps"
        )
    return BatchLayout(
        global_batch_size=cfg.batch.global_batch_size,
        micro_batch_size=micro,
        world_size=world_size,
        accumulation=cfg.batch.global_batch_size // (micro * world_size),
        steps_per_epoch=per_epoch,
        total_steps=total,
        epochs=-(-total // per_epoch),
        left_out_per_epoch=n_examples - per_epoch * cfg.batch.global_batch_size,
    )


BATCHING_NAMES = {
    "pack": "packed rows",
    "auto": "packed where it saves padding",
    "group": "grouped by length",
    "pad": "padded",
}


def pair_rows_note(obstacle: str | None, pairs: bool) -> str | None:
    """What the log says where preference pairs (``pairs``) run as two rows each, for a model that
    takes no mask of lmtune's: ``obstacle`` says why (lmtune.model.masks.mask_obstacle)."""
    if obstacle is None or not pairs:
        return None
    return (
        "preference pairs: each answer runs after its own copy of the prompt (two rows a pair, not "
        f"one under a mask), as {obstacle}"
    )


def batching_of(cfg: TrainConfig, formats: dict[str, int], obstacle: str | None) -> str:
    """pack | auto | group | pad: how a step's examples become micro-batches. ``obstacle``: why
    the model takes no mask of lmtune's, which packed rows need; --packing auto then pads."""
    if cfg.batch.packing == "on":
        if obstacle is not None:
            raise SettingError(
                "packing", "--packing on", f"packed rows are kept apart by a mask, and {obstacle}; use off"
            )
        return "pack"
    if cfg.batch.packing == "auto" and set(formats) == {"text"} and obstacle is None:
        return "auto"
    return "group" if cfg.batch.group_by_length else "pad"


def unpacked_note(cfg: TrainConfig, formats: dict[str, int], obstacle: str | None) -> str | None:
    """What the log says where --packing auto would pack this data but the model takes no mask of
    lmtune's (``obstacle``), or None."""
    if cfg.batch.packing != "auto" or set(formats) != {"text"} or obstacle is None:
        return None
    return f"--packing auto: rows are padded, not packed, as {obstacle}"


def check_model_layout(
    cfg: TrainConfig, obstacle: str | None, pairs: bool, info: Callable[[str], None]
) -> None:
    """Before the data is read, for a model that takes no mask of lmtune's (``obstacle``): say how
    its preference pairs run, refuse --packing on."""
    if (note := pair_rows_note(obstacle, pairs)) is not None:
        info(note)
    if cfg.batch.packing == "on":
        batching_of(cfg, {}, obstacle)
