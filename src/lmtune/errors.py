"""The exceptions that end a run with a message rather than a traceback, and their exit codes."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's options, data or paths.

    The CLI turns it into a one-line message on stderr and exit code 2, without a traceback, because
    the fix is on the user's side and a stack trace would only hide the message.
    """


USER_ERROR_EXIT_CODE = 2


class StoppedBySignal(Exception):
    """SIGTERM or SIGINT arrived before training began: there is nothing to save, so the run ends
    at once (exit code 128 + the signal's number, as a process killed by it would)."""

    def __init__(self, signum: int):
        import signal

        super().__init__(f"stopped by {signal.Signals(signum).name} before training began; nothing to save")
        self.signum = signum


class TrainingStopped(Exception):
    """Training cannot go on (a non-finite loss under --on-nan stop); the message says why.
    Exit code 1: the last checkpoint is intact."""
