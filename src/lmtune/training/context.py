"""RunContext: one process's run, its settings and the services every part of it shares; and the
module type that lets ``lmtune.train(cfg)`` call the run's entry point."""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtune.config.run_groups import CheckpointSettings
from lmtune.config.settings import TrainConfig
from lmtune.outputs.runlog import RunLog
from lmtune.parallel.distributed import DistEnv
from lmtune.parallel.health import Heartbeat
from lmtune.training.signals import StopRequest


@dataclass(frozen=True)
class RunContext:
    """One process's run: its settings and the services every part of it shares."""

    cfg: TrainConfig
    env: DistEnv
    strategy: str  # resolved: single | dp | ddp | fsdp
    threads: int  # CPU threads of this process
    log: RunLog
    stop: StopRequest
    heartbeat: Heartbeat
    given: frozenset[str] | None = None  # the settings the user gave; None: not known (Python API)
    # A restarted worker's (lmtune.checkpoint.resume.restart_settings); None: cfg's as given.
    restart: CheckpointSettings | None = None

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.checkpoint.output_dir)

    @property
    def checkpointing(self) -> CheckpointSettings:
        """The checkpoint settings the run decides by (where it resumes from, what --overwrite
        deletes). Its records and advice keep ``cfg``'s, what the user gave: with a restart's
        recorded, the same command run again later continued from elsewhere."""
        return self.restart or self.cfg.checkpoint


class CallableModule(types.ModuleType):
    """``lmtune.train`` names the module lmtune/train.py and its function ``train``; once the module
    is imported Python binds the name to the module, so the module calls its function:
    ``lmtune.train(cfg)`` works whichever of the two the name holds."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.train(*args, **kwargs)
