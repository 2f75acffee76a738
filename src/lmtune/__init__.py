"""lmtune: fine-tune causal language models on one device, DataParallel, DDP or several machines."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["TrainConfig", "TrainResult", "__version__", "errors", "train"]

if TYPE_CHECKING:
    from lmtune.config.settings import TrainConfig
    from lmtune.train import train
    from lmtune.training.finish import TrainResult


def __getattr__(name: str) -> Any:
    # Imported lazily so `import lmtune` (and `lmtune --help`) does not pay for torch.
    if name == "TrainConfig":
        from lmtune.config.settings import TrainConfig

        return TrainConfig
    if name == "TrainResult":  # for a notebook's type hints
        from lmtune.training.finish import TrainResult

        return TrainResult
    if name == "train":
        from lmtune.train import train

        return train
    if name == "errors":  # `except lmtune.errors.UserError` before anything else was used
        import lmtune.errors

        return lmtune.errors
    raise AttributeError(f"module 'lmtune' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The lazy names too, so a REPL's or an IDE's completion offers them.
    return sorted({*__all__, "__doc__", "__file__", "__name__", "__path__", "__spec__"})
