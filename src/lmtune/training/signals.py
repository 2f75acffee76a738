"""Graceful stop on SIGTERM/SIGINT: finish the current step, save a checkpoint, exit cleanly."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

import torch

from lmtune.errors import StoppedBySignal
from lmtune.parallel.health import ended_ranks


class StopRequest:
    """A flag the signals set; fit reads it once per step and all ranks agree on it.

    A second Ctrl+C stops at once, for a user who does not want to wait for the checkpoint.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self.signum = 0
        self.stepping = False  # fit has asked (its first step has begun): a signal now saves
        self._previous: dict[int, Any] = {}

    def __call__(self) -> bool:
        self.stepping = True
        return self.requested

    def raise_if_requested(self) -> None:
        """For the waits before training (data cache, tokenization): stop there, nothing to save."""
        if self.requested:
            raise StoppedBySignal(self.signum)

    def before_first_step(self, last: bool = True) -> int:
        """Fit's looks before it trains: the signal that came while the run was being built (0 if
        none), which stops it with nothing to save. After the last look, a signal finishes its step
        and saves."""
        self.stepping = last
        return self.pending()

    def pending(self) -> int:
        """The signal this rank got (0 if none)."""
        return self.signum if self.requested else 0

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = signum
        if os.environ.get("RANK", "0") != "0":  # every rank gets it from the launcher: said once
            return
        then = (
            "finishing this step and saving a checkpoint"
            if self.stepping
            else "stopping before training begins, with nothing to save"
        )
        if ended := ended_ranks():  # the launcher stops the job: no step can finish without that rank
            then = f"rank {ended[0]} has ended, so this one stops too (the launcher says why)"
        print(f"lmtune: {signal.Signals(signum).name} received: {then}", file=sys.stderr, flush=True)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@contextmanager
def ctrl_c_raised(stop: StopRequest, python: bool) -> Iterator[list[bool]]:
    """From Python (``python``), Ctrl+C ends the call as Python's own Ctrl+C does, with
    KeyboardInterrupt, once the run has stopped (its step finished and saved, or before training
    began): lmtune.train returned, and a loop of runs or a notebook cell went on to the next one;
    before the first step it raised StoppedBySignal, an Exception that ``except Exception`` took.
    The caller appends to the list it is given whether the run finished all the same (Ctrl+C
    during its last step or final save): its message then says so, not that a call resumes it."""
    finished: list[bool] = []
    try:
        yield finished
    except StoppedBySignal as e:
        if python and e.signum == signal.SIGINT:
            raise KeyboardInterrupt(str(e)) from None
        raise
    if python and stop.pending() == signal.SIGINT:
        raise KeyboardInterrupt(
            "stopped by Ctrl+C after the run's last step: it finished (final/ and run.json's result "
            "are written), nothing is left to resume"
            if any(finished)
            else "stopped by Ctrl+C with its last step saved (the log says which); the same call resumes"
        )


@contextmanager
def threads_kept() -> Iterator[None]:
    """torch's thread count as it was before the run set its own: the caller's work runs as before."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
