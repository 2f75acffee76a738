"""bitsandbytes, where lmtune uses it (8-bit optimizers), imported quietly."""

from __future__ import annotations

import logging


def quiet_bitsandbytes() -> None:
    """bitsandbytes warns on CPU that optional 4-bit matmul kernels are missing; the 8-bit optimizer
    and LoRA never use them, so the warning would only alarm users."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
