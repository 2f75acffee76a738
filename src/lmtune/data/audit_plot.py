"""The audit's token-length histogram as a PNG (`lmtune data audit --plot`)."""

from __future__ import annotations

import io

from lmtune.config.marks import PNG_METADATA
from lmtune.data.audit import AuditReport
from lmtune.errors import UserError


def plot_histogram(report: AuditReport) -> bytes:
    """The token-length histogram as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'lmtune[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(report.lengths, bins=50, color="#4477aa")
    ax.axvline(report.max_length, color="#cc3311", linestyle="--", label=f"--max-length {report.max_length}")
    ax.set_xlabel("tokens per example (after truncation)")
    ax.set_ylabel("examples")
    ax.set_title(f"{report.spec}: {len(report.lengths):,} examples")
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, metadata=PNG_METADATA)
    plt.close(fig)
    return buffer.getvalue()
