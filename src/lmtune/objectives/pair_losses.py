"""The preference losses and their metrics, per pair, from each pair's summed answer log-probs.

Inputs are ``[pairs, 2]`` float64 tensors, chosen then rejected: the policy's summed log-probs of
each answer, the answer's target tokens, and the reference's summed log-probs. The formulas are
TRL's for the same names:

- dpo (``DPOTrainer``, loss_type sigmoid): ``-log sigmoid(beta * delta)`` with ``delta`` the chosen
  log-ratio minus the rejected one (log-ratio: policy minus reference); with label smoothing
  ``eps`` the conservative DPO ``-(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)``.
- ipo (``DPOTrainer``, loss_type ipo): ``(delta' - 1 / (2 beta))**2``, each log-ratio divided by its
  answer's tokens.
- simpo (``CPOTrainer``, loss_type simpo, cpo_alpha 0): ``-log sigmoid(beta (a_c - a_r) - gamma)``
  over the length-averaged log-probs ``a`` (label smoothing as for dpo).
- orpo (``ORPOTrainer``): ``nll - lambda * log sigmoid(log odds(a_c) - log odds(a_r))`` with
  ``log odds(a) = a - log(1 - exp(a))``. Here ``nll`` is the chosen answer's mean token loss, per
  pair: TRL averages it over the tokens of the whole batch, prompts included, which depends on
  how the batch is cut; the paper's is per answer.

Rewards as TRL logs them: ``beta`` times the log-ratio (dpo, ipo) or the length-averaged log-prob
(simpo, orpo); ``logps/*`` are the summed log-probs (dpo, ipo) or the averaged ones (simpo, orpo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lmtune.outputs.reporters import PREFERENCE_METRICS

# The metrics every preference objective reports (TRL's names), and ORPO's extra ones; the
# reporters send them under these names (lmtune.outputs.reporters).
METRICS, ORPO_METRICS = PREFERENCE_METRICS[:6], PREFERENCE_METRICS[6:]
WITH_REFERENCE = ("dpo", "ipo")
LENGTH_AVERAGED = ("simpo", "orpo")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, without cancellation (branch at -ln 2, as TRL's), and
    with each branch given only inputs it is finite on, so neither poisons the gradient."""
    near = x > -math.log(2)
    safe_near = torch.where(near, x, torch.full_like(x, -1.0))
    safe_far = torch.where(near, torch.full_like(x, -1.0), x)
    return torch.where(near, torch.log(-torch.expm1(safe_near)), torch.log1p(-torch.exp(safe_far)))


def _smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


@dataclass(frozen=True)
class PairLoss:
    """One preference objective's loss and metrics (see the module docstring)."""

    name: str  # dpo | ipo | simpo | orpo
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1

    @property
    def needs_reference(self) -> bool:
        return self.name in WITH_REFERENCE

    @property
    def metric_names(self) -> tuple[str, ...]:
        return METRICS + (ORPO_METRICS if self.name == "orpo" else ())

    def losses(self, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Each pair's loss, ``[pairs]``."""
        ratios = logps - reference
        average = logps / counts.clamp(min=1)
        if self.name == "dpo":
            return _smoothed(self.beta * (ratios[:, 0] - ratios[:, 1]), self.label_smoothing)
        if self.name == "ipo":
            per_token = ratios / counts.clamp(min=1)
            return (per_token[:, 0] - per_token[:, 1] - 1 / (2 * self.beta)) ** 2
        if self.name == "simpo":
            margin = self.beta * (average[:, 0] - average[:, 1]) - self.simpo_gamma
            return _smoothed(margin, self.label_smoothing)
        assert self.name == "orpo"
        return -average[:, 0] - self.orpo_lambda * F.logsigmoid(_log_odds(average))

    def metrics(self, logps: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
        """Each pair's metrics ``[pairs, len(metric_names)]``, in :attr:`metric_names` order."""
        logged = logps / counts.clamp(min=1) if self.name in LENGTH_AVERAGED else logps
        # TRL's ORPO has one beta: the odds-ratio term's weight, which also scales its rewards.
        scale = self.orpo_lambda if self.name == "orpo" else self.beta
        rewards = scale * (logps - reference if self.needs_reference else logged)
        chosen, rejected = rewards[:, 0], rewards[:, 1]
        columns = [
            chosen,
            rejected,
            (chosen > rejected).double(),
            chosen - rejected,
            logged[:, 0],
            logged[:, 1],
        ]
        if self.name == "orpo":
            odds = _log_odds(logged)
            columns += [-logged[:, 0], F.logsigmoid(odds), odds]
        return torch.stack(columns, dim=1)


def _log_odds(average: torch.Tensor) -> torch.Tensor:
    """The log odds ratio of the chosen over the rejected answer from averaged log-probs."""
    return (average[:, 0] - average[:, 1]) - (log1mexp(average[:, 0]) - log1mexp(average[:, 1]))
