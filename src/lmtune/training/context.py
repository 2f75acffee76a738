"""RunContext: one process's run, its settings and the services every part of it shares."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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

    @property
    def output_dir(self) -> Path:
        return Path(self.cfg.checkpoint.output_dir)
