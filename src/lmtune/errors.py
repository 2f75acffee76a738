"""The one exception type that means "the user asked for something we cannot do"."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's options, data or paths.

    The CLI turns it into a one-line message on stderr and exit code 2, without a traceback, because
    the fix is on the user's side and a stack trace would only hide the message.
    """


USER_ERROR_EXIT_CODE = 2
