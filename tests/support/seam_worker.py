"""Trains with the test objective through lmtune's own build and fit, in one process or as a rank
of ``torch.distributed.run``; rank 0 writes the per-step results and the weights.

    python -m tests.support.seam_worker OUT DATA MICRO_BATCH_SIZE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from lmtune.checkpoint.state import TrainerState
from lmtune.config.settings import TrainConfig
from lmtune.model.products import choose_products
from lmtune.outputs.runlog import RunLog
from lmtune.parallel.distributed import process_group, read_dist_env
from lmtune.parallel.health import Heartbeat
from lmtune.parallel.wrap import resolve_strategy
from lmtune.training.build import build, loaders, schedule
from lmtune.training.callbacks import Callback, Control, StepEnd
from lmtune.training.context import RunContext
from lmtune.training.loop import FitSettings, LoopParts, fit
from lmtune.training.signals import StopRequest
from lmtune.training.step import StepOptions, Trainee
from tests.support.sequence_mean import SequenceMeanObjective

STEPS = 6


class Steps(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        r = step.result
        self.rows.append({"loss": r.loss, "count": r.count, "metrics": r.metrics, "examples": r.examples})


def main(out: Path, data: str, micro: int) -> None:
    torch.set_num_threads(1)
    env = read_dist_env("cpu")
    cfg = TrainConfig(
        model="tiny",
        data=data,
        global_batch_size=8,
        micro_batch_size=micro,
        max_steps=STEPS,
        max_length=64,
        lr=1e-3,
        seed=7,
        output_dir=str(out),
        progress=False,
    )
    with process_group(env), RunLog(env, out, progress=False) as log, StopRequest() as stop:
        run = RunContext(
            cfg=cfg,
            env=env,
            strategy=resolve_strategy("auto", env),
            threads=1,
            log=log,
            stop=stop,
            heartbeat=Heartbeat(None, env.rank),
            products=choose_products("fp32", env.device),
        )
        objective = SequenceMeanObjective()
        built = build(run, objective)
        start = TrainerState(
            step=0,
            epoch=0,
            step_in_epoch=0,
            global_batch_size=8,
            world_size=env.world_size,
            seed=7,
            examples=0,
        )
        trainee = Trainee(built.model, built.optimizer, schedule(cfg, built, 0))
        data_loader, _ = loaders(run, built)
        steps = Steps()
        options = StepOptions(cfg.optim.max_grad_norm, run.autocast, None, objective)
        fit(trainee, data_loader, start, LoopParts(callbacks=[steps]), FitSettings(env=env, step=options))
        if env.is_main:
            (out / "steps.json").write_text(json.dumps(steps.rows))
            weights = {k: v.detach().clone() for k, v in built.parts.model.state_dict().items()}
            save_file(weights, str(out / "weights.safetensors"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
