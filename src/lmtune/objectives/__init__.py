"""Training objectives: what the loop optimises. Each is an :class:`~lmtune.objectives.base.Objective`;
``--objective`` names one of :data:`OBJECTIVES` (supervised fine-tuning, ``sft``, by default)."""

from __future__ import annotations

from collections.abc import Callable

from lmtune.config.groups import ObjectiveSettings
from lmtune.objectives.base import Objective
from lmtune.objectives.pair_losses import PairLoss
from lmtune.objectives.preference import PreferenceObjective
from lmtune.objectives.sft import SupervisedObjective


def _preference(settings: ObjectiveSettings) -> Objective:
    loss = PairLoss(
        name=settings.name,
        beta=settings.beta,
        label_smoothing=settings.label_smoothing,
        simpo_gamma=settings.simpo_gamma,
        orpo_lambda=settings.orpo_lambda,
    )
    return PreferenceObjective(loss)


# --objective NAME -> the objective built from the objective settings.
OBJECTIVES: dict[str, Callable[[ObjectiveSettings], Objective]] = {
    "sft": lambda settings: SupervisedObjective(),
    "dpo": _preference,
    "ipo": _preference,
    "simpo": _preference,
    "orpo": _preference,
}


def objective_for(settings: ObjectiveSettings) -> Objective:
    """The objective ``--objective`` names (its settings are checked by config validation)."""
    return OBJECTIVES[settings.name](settings)
