"""fit: the training loop over optimizer steps, with evaluation and logging."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from lmtune.data.collate import Batch
from lmtune.data.sampling import TrainSampler, steps_per_epoch
from lmtune.distributed import DistEnv
from lmtune.errors import UserError
from lmtune.evaluate import EvalResult
from lmtune.metrics import RunLog
from lmtune.step import StepResult, train_step


@dataclass(frozen=True)
class StepPlan:
    """How the global batch maps onto micro-steps, and how many optimizer steps the run takes."""

    accumulation: int  # micro-steps per optimizer step on each rank
    steps_per_epoch: int
    total_steps: int
    epochs: int


def plan_steps(
    n_examples: int,
    global_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    epochs: int,
    max_steps: int | None,
    data_name: str,
) -> StepPlan:
    per_epoch = steps_per_epoch(n_examples, global_batch_size)
    if per_epoch == 0:
        raise UserError(
            f"--data {data_name}: {n_examples} examples, fewer than one global batch "
            f"(--global-batch-size {global_batch_size})"
        )
    total = max_steps if max_steps is not None else epochs * per_epoch
    return StepPlan(
        accumulation=global_batch_size // (micro_batch_size * world_size),
        steps_per_epoch=per_epoch,
        total_steps=total,
        epochs=-(-total // per_epoch),
    )


@dataclass
class FitResult:
    steps: int
    last_loss: float
    evals: list[EvalResult]


def _micro_batches(batches: Iterator[Batch], count: int, device: torch.device) -> list[Batch]:
    return [next(batches).to(device) for _ in range(count)]


def fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    loader: DataLoader[Batch],
    sampler: TrainSampler,
    plan: StepPlan,
    env: DistEnv,
    log: RunLog,
    max_grad_norm: float,
    autocast: Callable[[], AbstractContextManager[object]],
    run_eval: Callable[[], EvalResult] | None,
    eval_every: int,
    log_every: int,
) -> FitResult:
    """Train for ``plan.total_steps`` optimizer steps; evaluate every ``eval_every`` and at the end."""
    result = FitResult(steps=0, last_loss=float("nan"), evals=[])

    def evaluate_now(step: int, epoch: int) -> None:
        assert run_eval is not None
        ev = run_eval()
        result.evals.append(ev)
        log.record(
            {
                "kind": "eval",
                "step": step,
                "epoch": epoch,
                "eval_loss": ev.loss,
                "eval_perplexity": ev.perplexity,
                "eval_tokens": ev.target_tokens,
                "eval_examples": ev.examples,
            }
        )
        log.info(
            f"step {step}: eval loss {ev.loss:.4f}, perplexity {ev.perplexity:.3f} "
            f"({ev.examples} examples, {ev.target_tokens} tokens)"
        )

    log.start_progress(plan.total_steps)
    model.train()
    step, epoch = 0, 0
    started = last = time.perf_counter()
    while step < plan.total_steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        epoch_loss, epoch_tokens = 0.0, 0
        for _ in range(min(plan.steps_per_epoch, plan.total_steps - step)):
            # Wall time from the end of the last step: data waiting counts against tokens/s.
            micro = _micro_batches(batches, plan.accumulation, env.device)
            lr = scheduler.get_last_lr()[0]
            r: StepResult = train_step(model, optimizer, scheduler, micro, env, max_grad_norm, autocast())
            step += 1
            now = time.perf_counter()
            tokens_per_s = r.tokens / max(now - last, 1e-9)
            last = now
            result.steps, result.last_loss = step, r.loss
            epoch_loss += r.loss * r.target_tokens
            epoch_tokens += r.target_tokens
            if step % log_every == 0 or step == plan.total_steps:
                log.record(
                    {
                        "kind": "train",
                        "step": step,
                        "epoch": epoch,
                        "loss": r.loss,
                        "lr": lr,
                        "grad_norm": r.grad_norm,
                        "tokens": r.tokens,
                        "target_tokens": r.target_tokens,
                        "tokens_per_s": tokens_per_s,
                        "elapsed_s": now - started,
                    }
                )
            log.advance({"loss": f"{r.loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tokens_per_s:,.0f}"})
            if run_eval is not None and eval_every and step % eval_every == 0 and step < plan.total_steps:
                evaluate_now(step, epoch)
        log.info(f"epoch {epoch + 1}/{plan.epochs}: train loss {epoch_loss / max(epoch_tokens, 1):.4f}")
        epoch += 1
    log.end_progress()
    if run_eval is not None:
        evaluate_now(step, epoch - 1)
    return result
