"""Rank-zero output: the progress bar, messages, and the metrics.jsonl / run.json files.

Every rank builds a :class:`RunLog`; on ranks other than 0 each method does nothing, so callers
never branch on the rank themselves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from tqdm import tqdm

from lmtune.distributed import DistEnv


class RunLog:
    def __init__(self, env: DistEnv, output_dir: Path, progress: bool):
        self.active = env.is_main
        self.output_dir = output_dir
        self.progress = progress and self.active
        self._bar: tqdm[Any] | None = None
        self._metrics: Any = None
        if self.active:
            output_dir.mkdir(parents=True, exist_ok=True)
            self._metrics = (output_dir / "metrics.jsonl").open("w", encoding="utf-8")

    def __enter__(self) -> RunLog:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.end_progress()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def info(self, message: str) -> None:
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def start_progress(self, total_steps: int, initial: int = 0) -> None:
        if self.progress:
            self._bar = tqdm(
                total=total_steps, initial=initial, desc="train", unit="step", dynamic_ncols=True
            )

    def end_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def record(self, row: dict[str, Any]) -> None:
        """Append one JSON object to metrics.jsonl."""
        if self._metrics is not None:
            self._metrics.write(json.dumps(row) + "\n")
            self._metrics.flush()

    def advance(self, postfix: dict[str, str]) -> None:
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def write_json(self, name: str, payload: dict[str, Any]) -> None:
        if self.active:
            path = self.output_dir / name
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
            tmp.replace(path)
