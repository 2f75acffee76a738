"""Evaluation across ranks: the objective's loss per unit over the whole eval set, each example
counted once, and the metrics the objective reports (perplexity for supervised fine-tuning)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lmtune.data.batch import Batch, idle_batch
from lmtune.data.mixture import SourceIndex
from lmtune.objectives.base import Objective, split_output
from lmtune.objectives.sft import SupervisedObjective
from lmtune.parallel.distributed import DistEnv, all_reduce_max, all_reduce_sum


@dataclass(frozen=True)
class EvalResult:
    loss: float  # per unit of the objective (per target token for sft)
    target_tokens: int
    examples: int
    count: int = 0  # the objective's units (target tokens, pairs)
    metrics: dict[str, float] = field(default_factory=dict)  # the eval row's: eval_loss, eval_perplexity...
    # Evaluated per source: their names; metrics also has each one's as eval_loss/NAME, ...
    sources: tuple[str, ...] = ()

    def value(self, metric: str) -> float:
        """The value of ``metric`` as metrics.jsonl names it (``eval_loss``, ...)."""
        return self.metrics[metric]

    @staticmethod
    def from_record(record: dict[str, Any]) -> EvalResult:
        """The result :meth:`record` wrote to run.json (a finished run's, read back)."""
        counts = ("target_tokens", "examples", "units")
        # Counts per source (tokens/NAME) stay whole numbers, as the run's own result has them.
        metrics = {
            f"eval_{k}": v if type(v) is int else float(v) for k, v in record.items() if k not in counts
        }
        sources = tuple(sorted({k.split("/", 1)[1] for k in record if k.startswith("loss/")}))
        return EvalResult(
            loss=float(record["loss"]),
            target_tokens=int(record["target_tokens"]),
            examples=int(record["examples"]),
            count=int(record.get("units", 0)),  # 0 in a run.json written before it was kept
            metrics=metrics,
            sources=sources,
        )

    def record(self) -> dict[str, float | int]:
        """run.json's ``result.eval``: the metrics without their ``eval_`` prefix, and the counts
        (``units``: what the loss is a mean over, as metrics.jsonl's rows say it)."""
        named = {k.removeprefix("eval_"): v for k, v in self.metrics.items()}
        return named | {"target_tokens": self.target_tokens, "examples": self.examples, "units": self.count}


@torch.no_grad()
def evaluate(
    loss_module: nn.Module,
    batches: Sequence[Batch] | DataLoader[Batch],
    env: DistEnv,
    autocast: AbstractContextManager[object],
    lockstep: bool = False,
    on_batch: Callable[[], None] = lambda: None,
    objective: Objective | None = None,
    sources: SourceIndex | None = None,
) -> EvalResult:
    """The objective's loss over every unit of the eval set, each example counted once; with
    ``sources``, also each source's (a batch holds examples of one source: lmtune.data.sampling's
    ``EvalBatches``), and the overall figures are their sums.

    ``loss_module`` is the unwrapped module: a DDP forward may run collectives, and ranks may hold
    different numbers of eval batches. Under FSDP (``lockstep``) every forward gathers parameters
    from all ranks, so ranks with fewer batches run extra forwards that count for nothing.
    """
    objective = objective or SupervisedObjective()
    names = objective.metric_names
    was_training = loss_module.training
    loss_module.eval()
    # Per source: the loss and metric sums, then the objective's units, target tokens and examples.
    groups = len(sources.names) if sources is not None else 1
    sums = torch.zeros(groups, 4 + len(names), dtype=torch.float64, device=env.device)
    rounds = len(batches)
    if lockstep:
        rounds = int(all_reduce_max(torch.tensor([rounds], device=env.device), env).item())
    idle = itertools.repeat(None, rounds - len(batches))
    for item in itertools.chain(batches, idle):
        on_batch()  # progress, for the hang watchdog: an evaluation may take long, a batch does not
        batch = (item or idle_batch()).to(env.device)
        with autocast:
            loss_sum, metric_sums = split_output(loss_module(*batch.model_inputs()), len(names))
        if item is not None:
            row = sums[sources.of(batch.example_ids[0]) if sources is not None else 0]
            row[0] += loss_sum.double()
            row[1 : 1 + len(names)] += metric_sums.double()
            counts = (objective.count(batch), batch.target_tokens(), len(batch.example_ids))
            row[1 + len(names) :] += torch.tensor(counts, dtype=torch.float64, device=env.device)
    loss_module.train(was_training)
    per_group = all_reduce_sum(sums, env)
    loss, count, tokens, examples, metrics = _summed(per_group.sum(0).tolist(), names, objective)
    for k, name in enumerate(sources.names if sources is not None else ()):
        _, _, source_tokens, _, of_source = _summed(per_group[k].tolist(), names, objective)
        metrics |= {f"{key}/{name}": value for key, value in of_source.items()}
        metrics[f"eval_tokens/{name}"] = source_tokens
    return EvalResult(
        loss=loss,
        target_tokens=tokens,
        examples=examples,
        count=count,
        metrics=metrics,
        sources=sources.names if sources is not None else (),
    )


def _summed(
    totals: list[float], names: Sequence[str], objective: Objective
) -> tuple[float, int, int, int, dict[str, float]]:
    """(loss per unit, units, target tokens, examples, the objective's eval metrics) of sums."""
    count, tokens, examples = (int(x) for x in totals[1 + len(names) :])
    loss = totals[0] / max(count, 1)
    means = {
        name: value / max(count, 1) for name, value in zip(names, totals[1 : 1 + len(names)], strict=True)
    }
    return loss, count, tokens, examples, objective.report(loss, means, count, prefix="eval_")
