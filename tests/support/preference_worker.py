"""Trains several preference-tuning settings through lmtune's own build and fit, in one process or
as a rank of ``torch.distributed.run`` (one launch for all of them); every rank writes its weights,
rank 0 the per-step results and the final evaluation of each setting.

    python -m tests.support.preference_worker OUT DATA NAME [NAME ...]

Settings by NAME are in ``SETTINGS``; ``*-fsdp`` names run FSDP2 where there are several ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from lmtune.checkpoint.state import TrainerState
from lmtune.config.settings import TrainConfig
from lmtune.outputs.runlog import RunLog
from lmtune.parallel.distributed import DistEnv, process_group, read_dist_env
from lmtune.parallel.health import Heartbeat
from lmtune.parallel.wrap import resolve_strategy, unwrap
from lmtune.training.build import build, loaders, schedule
from lmtune.training.callbacks import Callback, Control, StepEnd
from lmtune.training.context import RunContext
from lmtune.training.evaluate import evaluate
from lmtune.training.loop import FitSettings, LoopParts, fit
from lmtune.training.signals import StopRequest
from lmtune.training.step import StepOptions, Trainee

STEPS = 6
SETTINGS: dict[str, dict[str, Any]] = {
    "dpo": {"objective": "dpo"},
    "dpo-live": {"objective": "dpo", "reference": "live"},
    "dpo-lora-live": {"objective": "dpo", "lora": True, "lora_dropout": 0.0, "reference": "live"},
    "dpo-fsdp": {"objective": "dpo", "strategy": "fsdp"},
    "dpo-fsdp-live": {"objective": "dpo", "strategy": "fsdp", "reference": "live"},
    "dpo-fsdp-bf16": {"objective": "dpo", "strategy": "fsdp", "precision": "bf16"},
    "ipo-packed": {"objective": "ipo", "packing": "on", "beta": 0.5},
    "simpo": {"objective": "simpo", "beta": 2.0},
    "orpo-full-logits": {"objective": "orpo", "loss_chunk_size": 0},
}


class Steps(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, object]] = []

    def on_step_end(self, step: StepEnd, control: Control) -> None:
        r = step.result
        self.rows.append({"loss": r.loss, "count": r.count, "metrics": r.metrics, "examples": r.examples})


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v  # FSDP2 shards
        out[k] = full.detach().cpu().clone().contiguous()
    return out


def train_one(env: DistEnv, out: Path, data: str, name: str) -> None:
    settings = dict(SETTINGS[name])
    cfg = TrainConfig(
        model="tiny",
        data=data,
        eval_split=16,
        global_batch_size=8,
        micro_batch_size=2,
        max_steps=STEPS,
        max_length=64,
        lr=settings.pop("lr", 1e-3),
        seed=7,
        output_dir=str(out / name),
        progress=False,
        **settings,
    )
    with RunLog(env, out / name, progress=False) as log, StopRequest() as stop:
        run = RunContext(
            cfg=cfg,
            env=env,
            strategy=resolve_strategy(cfg.launch.strategy, env),
            threads=1,
            log=log,
            stop=stop,
            heartbeat=Heartbeat(None, env.rank),
        )
        built = build(run)
        start = TrainerState.fresh(8, env.world_size, 7, len(built.train_data))
        trainee = Trainee(built.model, built.optimizer, schedule(cfg, built, 0))
        data_loader, eval_loader = loaders(run, built)
        assert eval_loader is not None
        steps = Steps()
        options = StepOptions(cfg.optim.max_grad_norm, built.autocast, None, built.objective)
        fit(trainee, data_loader, start, LoopParts(callbacks=[steps]), FitSettings(env=env, step=options))
        ev = evaluate(
            unwrap(built.model),
            eval_loader,
            env,
            built.autocast(),
            built.parts.sharded,
            objective=built.objective,
        )
        save_file(_weights(built.parts.model), str(out / name / f"weights-rank{env.rank}.safetensors"))
        if env.is_main:
            result = {"steps": steps.rows, "eval": ev.metrics, "eval_examples": ev.examples}
            (out / name / "result.json").write_text(json.dumps(result))


def main(out: Path, data: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    env = read_dist_env("cpu")
    with process_group(env):
        for name in names:
            train_one(env, out, data, name)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
