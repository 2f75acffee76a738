"""Other packages' warnings that say nothing to lmtune's user, hidden where lmtune calls them.

bitsandbytes logs on import that optional 4-bit CPU kernels are missing, peft touches a deprecated
transformers property and transformers announces its own deprecations: none of it is about the
user's run. :func:`quiet_calls` hides those around one call into such a package (no process-wide
filter, so a warning raised anywhere else still shows), and shows everything when
``LMTUNE_VERBOSE=1`` is set (``-v``/``--verbose`` on any command sets it, for the job's processes
too).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from lmtune.config.environment import VERBOSE as VERBOSE_ENV
from lmtune.config.environment import switch

# What bitsandbytes' import logs through: its own loggers, and on an AVX-512 BF16 CPU the `kernels`
# package it asks for a faster 4-bit kernel from the hub (offline: a skipped trust check).
KERNELS_HUB_LOGGER = "kernels._internals.hf_hub"
BITSANDBYTES_LOGGERS = ("bitsandbytes", KERNELS_HUB_LOGGER)
# Quieted for a whole run (the int8 notice comes at every product), put back when lmtune.train returns.
RUN_QUIETED_LOGGERS = (
    "bitsandbytes.backends.cpu.ops",
    KERNELS_HUB_LOGGER,
    "bitsandbytes.autograd._functions",  # a logger's record in bitsandbytes 0.50
)
# Warning categories other packages use for their own plans (deprecations, renamed properties).
_FOREIGN_CATEGORIES = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)


def verbose() -> bool:
    """Whether other packages' warnings are shown (``LMTUNE_VERBOSE=1``)."""
    return switch(VERBOSE_ENV)


@contextmanager
def quiet_calls(*loggers: str) -> Iterator[None]:
    """Around a call into another package: its deprecation warnings, and warnings the named
    ``loggers`` log, are not shown (unless verbose). Levels and filters are restored after."""
    if verbose():
        yield
        return
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in loggers]
    with warnings.catch_warnings():
        for category in _FOREIGN_CATEGORIES:
            warnings.filterwarnings("ignore", category=category)
        for logger, _ in saved:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in saved:
                logger.setLevel(level)


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars (``Writing model shards``) off around one call, as the CLI has
    them off: lmtune's own log says what was saved. The setting is restored after (a notebook
    calling lmtune.train keeps its bars elsewhere)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    enabled = hf_logging.is_progress_bar_enabled()
    if enabled and not verbose():
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if enabled and not verbose():
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


@contextmanager
def run_quiet_restored() -> Iterator[None]:
    """What a run quiets for its whole length (bitsandbytes' notices: the int8 one comes at every
    product) put back when the call into lmtune returns: a notebook's own later use of those
    packages warns as it did before."""
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in RUN_QUIETED_LOGGERS]
    with warnings.catch_warnings():
        try:
            yield
        finally:
            for logger, level in saved:
                logger.setLevel(level)
