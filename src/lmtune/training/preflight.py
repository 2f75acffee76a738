"""validate(cfg, world_size): every setting and every input it names checked before anything runs
(in the launcher before N processes start, and in each process), each error naming its option."""

from __future__ import annotations

from lmtune.config.settings import TrainConfig, option_name
from lmtune.config.validate import check_settings
from lmtune.data.chat import read_template
from lmtune.data.sources import resolve_sources
from lmtune.outputs.reporters import check_installed, parse_report_to


def validate(cfg: TrainConfig, world_size: int) -> None:
    """Reject settings that cannot work and inputs that are not there; ``world_size`` is the
    process count."""
    check_settings(cfg, world_size)
    for name in ("data", "eval_data"):
        spec = getattr(cfg, name)
        if spec is not None:
            resolve_sources(spec, option_name(name))  # missing files and empty globs fail here
    if cfg.chat_template is not None:
        read_template(cfg.chat_template)
    check_installed(parse_report_to(cfg.report_to))
