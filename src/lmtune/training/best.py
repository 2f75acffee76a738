"""The best model so far by an evaluation metric, and early stopping when it stops improving.

Every evaluation is offered to :class:`BestTracker`; an improvement names the checkpoint that holds
it (saved at that step), which pruning never removes. Each checkpoint carries the tracker's state
(``best.json``), so a resumed run goes on counting exactly where the saved one was.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmtune.checkpoint.layout import step_folder
from lmtune.config.files import is_int
from lmtune.config.run_groups import BEST_METRICS, EvalSettings
from lmtune.errors import UserError

BEST_FILE = "best.json"
# Metrics that improve upwards whatever --greater-is-better says (reward accuracy and margin).
GREATER_IS_BETTER = ("eval_rewards/accuracies", "eval_rewards/margins")


@dataclass(frozen=True)
class Best:
    step: int
    metric: str
    value: float
    # Relative to the output folder (checkpoints/step-NNNNNN): a moved run still finds it. run.json's
    # result has the path of another run's when final/ took the best from the run this one continued.
    checkpoint: str


@dataclass
class BestTracker:
    """The best evaluation so far and the patience count, as Hugging Face Trainer keeps them: the
    best is decided by the metric alone (any improvement is the new best model); the threshold
    only decides whether an improvement is large enough to reset the patience count. Checkpoints
    carry it (``best.json``, through the checkpoint manager)."""

    file_name = BEST_FILE  # its record in every checkpoint (lmtune.checkpoint.manager)
    metric: str  # an eval metric as metrics.jsonl names it: eval_loss, eval_perplexity, ...
    greater_is_better: bool
    patience: int  # evaluations without a large enough improvement before stopping; 0: never
    threshold: float  # how much better a value must be to reset the patience count
    best: Best | None = None
    without_improvement: int = 0

    def observe(self, step: int, value: float) -> bool:
        """Take an evaluation of ``step``; True when it is the new best (save a checkpoint of it)."""
        previous = self.best.value if self.best is not None else None
        better = math.isfinite(value) and (
            previous is None or (value > previous if self.greater_is_better else value < previous)
        )
        if better and (previous is None or abs(value - previous) > self.threshold):
            self.without_improvement = 0
        else:
            self.without_improvement += 1
        if better:
            relative = step_folder(Path(), step).as_posix()
            self.best = Best(step=step, metric=self.metric, value=value, checkpoint=relative)
        return better

    @property
    def should_stop(self) -> bool:
        return 0 < self.patience <= self.without_improvement

    def folder(self, output_dir: Path) -> Path | None:
        """The checkpoint holding the best model, inside ``output_dir`` (None: no best yet)."""
        return step_folder(output_dir, self.best.step) if self.best is not None else None

    def to_json(self) -> dict[str, Any]:
        return {
            "best": asdict(self.best) if self.best else None,
            "without_improvement": self.without_improvement,
        }

    def restore(self, record: dict[str, Any], step: int) -> None:
        """Continue counting from the record saved with the checkpoint (of ``step``) a run resumes
        from. The best checkpoint's path is derived from its step, never taken from the record:
        inside this output folder whatever the record says, and found after the folder was moved or
        renamed. A best step after ``step`` is no record lmtune wrote."""
        saved, count = record.get("best"), record.get("without_improvement")
        value = saved.get("value") if isinstance(saved, dict) else None
        valid = is_int(count) and (
            saved is None
            or (
                isinstance(saved, dict)
                and is_int(saved.get("step"), 0, step)
                and isinstance(saved.get("metric"), str)
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
        )
        if not valid:
            raise UserError(
                f"{BEST_FILE}: not a best-model record lmtune wrote (counts, a step up to {step}, a "
                "finite value)"
            )
        assert isinstance(count, int)
        if saved is None:
            self.best, self.without_improvement = None, count
        elif saved["metric"] == self.metric:
            step = saved["step"]
            relative = step_folder(Path(), step).as_posix()
            self.best = Best(step=step, metric=self.metric, value=float(saved["value"]), checkpoint=relative)
            self.without_improvement = count


def best_tracker(settings: EvalSettings) -> BestTracker | None:
    """The tracker of ``--metric-for-best`` (None without one)."""
    if settings.metric_for_best is None:
        return None
    return BestTracker(
        metric=settings.metric_for_best,
        greater_is_better=settings.greater_is_better
        or _of_all(settings.metric_for_best) in GREATER_IS_BETTER,
        patience=settings.early_stopping_patience,
        threshold=settings.early_stopping_threshold,
    )


def _of_all(metric: str) -> str:
    """The metric of the whole eval set a source's is (eval_loss of eval_loss/NAME)."""
    return metric if metric in BEST_METRICS else metric.rpartition("/")[0]
