"""The best model so far by an evaluation metric, and early stopping when it stops improving.

Every evaluation is offered to :class:`BestTracker`; an improvement names the checkpoint that holds
it (saved at that step), which pruning never removes. Each checkpoint carries the tracker's state
(``best.json``, through the checkpoint manager), so a resumed run goes on counting exactly where
the saved one was.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmtune.checkpoint.layout import step_folder
from lmtune.config.groups import EvalSettings

BEST_FILE = "best.json"
# Metrics that improve upwards whatever --greater-is-better says (reward accuracy and margin).
GREATER_IS_BETTER = ("eval_rewards/accuracies", "eval_rewards/margins")


@dataclass(frozen=True)
class Best:
    step: int
    metric: str
    value: float
    checkpoint: str


@dataclass
class BestTracker:
    """The best evaluation so far and the evaluations since; checkpoints carry it (``best.json``)."""

    file_name = BEST_FILE  # its record in every checkpoint (lmtune.checkpoint.manager)
    metric: str  # an eval metric as metrics.jsonl names it: eval_loss, eval_perplexity, ...
    greater_is_better: bool
    patience: int  # evaluations without improvement before stopping; 0: never stop early
    threshold: float  # how much better a value must be to count as an improvement
    best: Best | None = None
    without_improvement: int = 0

    def observe(self, step: int, value: float, output_dir: Path) -> bool:
        """Take an evaluation of ``step``; True when it is the new best (save a checkpoint of it)."""
        better = (
            self.best is None
            or (self.greater_is_better and value > self.best.value + self.threshold)
            or (not self.greater_is_better and value < self.best.value - self.threshold)
        )
        if better and math.isfinite(value):
            self.best = Best(
                step=step, metric=self.metric, value=value, checkpoint=str(step_folder(output_dir, step))
            )
            self.without_improvement = 0
            return True
        self.without_improvement += 1
        return False

    @property
    def should_stop(self) -> bool:
        return 0 < self.patience <= self.without_improvement

    def to_json(self) -> dict[str, Any]:
        return {
            "best": asdict(self.best) if self.best else None,
            "without_improvement": self.without_improvement,
        }

    def restore(self, record: dict[str, Any]) -> None:
        """Continue counting from the record saved with the checkpoint a run resumes from (one of
        another metric, or not of this shape, starts the count afresh)."""
        try:
            best = Best(**record["best"]) if record["best"] else None
            count = int(record["without_improvement"])
        except (KeyError, TypeError, ValueError):
            return
        if best is None or best.metric == self.metric:
            self.best, self.without_improvement = best, count


def best_tracker(settings: EvalSettings) -> BestTracker | None:
    """The tracker of ``--metric-for-best`` (None without one)."""
    if settings.metric_for_best is None:
        return None
    return BestTracker(
        metric=settings.metric_for_best,
        greater_is_better=settings.greater_is_better or settings.metric_for_best in GREATER_IS_BETTER,
        patience=settings.early_stopping_patience,
        threshold=settings.early_stopping_threshold,
    )
