"""Training objectives: what the loop optimises. Each is an :class:`~lmtune.objectives.base.Objective`;
``--objective`` names one of :data:`OBJECTIVES` (supervised fine-tuning, ``sft``, by default)."""

from __future__ import annotations

from collections.abc import Callable

from lmtune.config.groups import ObjectiveSettings
from lmtune.objectives.base import Objective
from lmtune.objectives.sft import SupervisedObjective

# --objective NAME -> the objective built from the objective settings.
OBJECTIVES: dict[str, Callable[[ObjectiveSettings], Objective]] = {
    "sft": lambda settings: SupervisedObjective(),
}


def objective_for(settings: ObjectiveSettings) -> Objective:
    """The objective ``--objective`` names (its settings are checked by config validation)."""
    return OBJECTIVES[settings.name](settings)
