"""The one exception type that means "the user asked for something we cannot do"."""

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
