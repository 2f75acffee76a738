"""`lmtune report`: one self-contained HTML page (plots embedded) for one run or several overlaid.

It reads what a run folder holds (metrics.jsonl, run.json, the data cache it names) and works on a
run that is still going: a line cut off mid-write is left out, missing parts are said to be missing.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmtune.checkpoint.attempts import attempts_line, finished_status
from lmtune.checkpoint.card_rows import past_max_steps, wall_time
from lmtune.checkpoint.lock import lock_status
from lmtune.checkpoint.resume import earlier_layouts, rerun_outcome, resume_changes
from lmtune.config.marks import HTML_HEAD, PNG_METADATA
from lmtune.data.pairs import counted_as
from lmtune.errors import UserError
from lmtune.outputs.reporters import is_number
from lmtune.outputs.runlog import own_loss
from lmtune.tools.recorded import RecordedRun, load_runs, settings_of

SMOOTHING = 0.9  # exponential moving average of the training loss (as TensorBoard's slider)


def _smooth(values: list[float]) -> list[float]:
    out, average = [], 0.0
    for i, v in enumerate(values, 1):
        average = SMOOTHING * average + (1 - SMOOTHING) * v
        out.append(average / (1 - SMOOTHING**i))  # debiased, so the start is not pulled to 0
    return out


def _lengths(run: RecordedRun) -> list[int]:
    """Token lengths of the training examples, from the data cache the run names (if still there)."""
    import numpy as np

    from lmtune.data.dataset import OFFSETS_FILE, read_offsets

    cache = run.info.get("data", {}).get("train", {}).get("cache")
    if not isinstance(cache, str) or "\0" in cache:
        return []
    try:
        offsets = read_offsets(Path(cache) / OFFSETS_FILE)
    except (OSError, UserError, ValueError):
        return []
    return [int(n) for n in np.diff(offsets)]


Plot = Callable[[Any, list[RecordedRun]], bool]  # draws on an Axes; False when there was nothing to draw


def _plot_loss(ax: Any, runs: list[RecordedRun]) -> bool:
    drawn = False
    for i, run in enumerate(runs):
        color = f"C{i}"
        steps, loss = run.series("loss")
        if steps:
            ax.plot(steps, loss, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(steps, _smooth(loss), color=color, label=f"{run.name} train (smoothed)")
            drawn = True
        steps, loss = run.series("eval_loss", "eval")
        if steps:
            ax.plot(steps, loss, "o--", color=color, label=f"{run.name} eval")
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    return drawn


def _per_source(rows: list[dict[str, Any]]) -> list[str]:
    """The sources evaluated apart in eval rows (their eval_loss/NAME), in order of appearance."""
    return list(
        dict.fromkeys(k.removeprefix("eval_loss/") for r in rows for k in r if k.startswith("eval_loss/"))
    )


def _plot_eval_per_source(ax: Any, runs: list[RecordedRun]) -> bool:
    drawn = False
    for i, run in enumerate(runs):
        for k, source in enumerate(_per_source(run.kind("eval"))):
            steps, loss = run.series(f"eval_loss/{source}", "eval")
            if steps:
                marker = "osd^v<>px*"[k % 10]
                ax.plot(steps, loss, f"{marker}--", color=f"C{i}", label=f"{run.name} {source}")
                drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("eval loss")
    return drawn


def _train_and_eval(key: str, label: str) -> Plot:
    """A train metric (raw and smoothed) with its eval counterpart (``eval_`` + key) as points."""

    def draw(ax: Any, runs: list[RecordedRun]) -> bool:
        drawn = False
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, values, color=f"C{i}", alpha=0.25, linewidth=0.8)
                ax.plot(steps, _smooth(values), color=f"C{i}", label=f"{run.name} train (smoothed)")
                drawn = True
            steps, values = run.series(f"eval_{key}", "eval")
            if steps:
                ax.plot(steps, values, "o--", color=f"C{i}", label=f"{run.name} eval")
                drawn = True
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        return drawn

    return draw


def _plot_loss_tokens(ax: Any, runs: list[RecordedRun]) -> bool:
    drawn = False
    for i, run in enumerate(runs):
        rows = [r for r in run.kind("train") if is_number(r.get("loss")) and is_number(r.get("tokens"))]
        if rows:
            tokens, total = [], 0.0
            for r in rows:
                total += r["tokens"]
                tokens.append(total)
            ax.plot(tokens, _smooth([r["loss"] for r in rows]), color=f"C{i}", label=run.name)
            drawn = True
    ax.set_xlabel("tokens trained (logged steps)")
    ax.set_ylabel("train loss (smoothed)")
    return drawn


def _series_plot(key: str, label: str, scale: float = 1.0) -> Plot:
    def draw(ax: Any, runs: list[RecordedRun]) -> bool:
        drawn = False
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, [v * scale for v in values], color=f"C{i}", label=run.name)
                drawn = True
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        return drawn

    return draw


def _plot_memory_per_rank(ax: Any, runs: list[RecordedRun]) -> bool:
    bars = [(run.name, rank, b) for run in runs for rank, b in enumerate(_peaks(run))]
    for i, (name, _, b) in enumerate(bars):
        ax.bar(i, b / 2**20, color=f"C{[r.name for r in runs].index(name)}")
    ax.set_xticks(range(len(bars)), [f"{n}\nrank {r}" for n, r, _ in bars], fontsize=7)
    ax.set_ylabel("peak MiB (end of run)")
    return bool(bars)


def _peaks(run: RecordedRun) -> list[int]:
    peaks = (run.info.get("result") or {}).get("peak_memory_per_rank") or []
    return [int(p) for p in peaks if is_number(p)]


def _plot_phases(ax: Any, runs: list[RecordedRun]) -> bool:
    drawn = False
    for i, run in enumerate(runs):
        for key, style in (("step_time_max_s", "-"), ("step_time_min_s", ":")):
            steps, values = run.series(key)
            if steps:
                ax.plot(steps, values, style, color=f"C{i}", label=f"{run.name} {key[10:13]} over ranks")
                drawn = True
        phases = sorted(
            {k for r in run.kind("train") for k in r if k.startswith("time_") and k.endswith("_s")}
        )
        for j, key in enumerate(phases):
            steps, values = run.series(key)
            ax.plot(steps, values, color=f"C{(i + j + 1) % 10}", alpha=0.7, label=f"{run.name} {key[5:-2]}")
            drawn = True
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    return drawn


def _plot_lengths(ax: Any, runs: list[RecordedRun]) -> bool:
    drawn = False
    for i, run in enumerate(runs):
        lengths = _lengths(run)
        if lengths:
            ax.hist(lengths, bins=40, color=f"C{i}", alpha=0.6, label=run.name)
            drawn = True
    ax.set_xlabel("tokens per training example")
    ax.set_ylabel("examples")
    return drawn


PLOTS: dict[str, tuple[str, Plot]] = {
    "loss": ("Loss against steps (train raw and smoothed; eval)", _plot_loss),
    "eval_per_source": ("Eval loss per source (--eval-data NAME=PATH,...)", _plot_eval_per_source),
    "loss_tokens": ("Train loss against tokens", _plot_loss_tokens),
    "reward_margins": (
        "Reward margin, chosen minus rejected (preference objectives)",
        _train_and_eval("rewards/margins", "reward margin"),
    ),
    "reward_accuracies": (
        "Pairs whose chosen answer earns the higher reward",
        _train_and_eval("rewards/accuracies", "reward accuracy"),
    ),
    "lr": ("Learning rate", _series_plot("lr", "learning rate")),
    "grad_norm": ("Gradient norm (before clipping)", _series_plot("grad_norm", "grad norm")),
    "tokens_per_s": ("Throughput", _series_plot("tokens_per_s", "tokens/s")),
    "mfu": ("Model FLOPs utilisation", _series_plot("mfu", "MFU %", 100.0)),
    "memory": ("Peak memory of rank 0", _series_plot("peak_memory_bytes", "MiB", 1 / 2**20)),
    "memory_per_rank": ("Peak memory per rank", _plot_memory_per_rank),
    "step_times": ("Step times (per rank, per phase where recorded)", _plot_phases),
    "lengths": ("Training example lengths", _plot_lengths),
}


def render_plots(runs: list[RecordedRun]) -> dict[str, bytes | None]:
    """PNG bytes per plot name; None where the runs hold nothing to draw."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("lmtune report draws with matplotlib: pip install 'lmtune[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes | None] = {}
    with matplotlib.rc_context({"text.parse_math": False}):  # a "$" in a run's name is text, not TeX
        for name, (title, draw) in PLOTS.items():
            out[name] = _render_one(plt, title, draw, runs)
    return out


def _render_one(plt: Any, title: str, draw: Plot, runs: list[RecordedRun]) -> bytes | None:
    """One plot as PNG bytes (None: nothing to draw)."""
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=100)
    try:
        if not draw(ax, runs):
            return None
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", metadata=PNG_METADATA)
        return buffer.getvalue()
    finally:
        plt.close(fig)


def _status(run: RecordedRun) -> str:
    """Finished, stopped (by a signal, or its process gone: the lock tells) or running."""
    folder, result = run.folder, run.info.get("result") or {}
    if (folder / "final").is_dir():
        return finished_status((run.info.get("resolved") or {}).get("attempts"))
    config = run.info.get("config") or {}
    then = rerun_outcome(folder, config.get("resume"), config.get("overwrite") is True)
    if result:
        return f"stopped ({'by a signal; ' if result.get('stopped_by') == 'signal' else ''}{then})"
    status = lock_status(folder)
    if status is None:  # a run holds its folder's lock from before its first record to its end
        return f"stopped (it ended without a result: it failed, or a node of its job did; {then})"
    if status != "gone":
        return "running" if status == "running" else "running or stopped"
    return f"stopped (its process is gone: killed, or the machine restarted; {then})"


def _summary(run: RecordedRun) -> dict[str, str]:
    resolved, result = run.info.get("resolved") or {}, run.info.get("result") or {}
    env = run.info.get("environment") or {}
    train, evals = run.kind("train"), run.kind("eval")
    last = train[-1] if train else {}
    done, total = result.get("steps", last.get("step", 0)), resolved.get("total_steps", "?")
    return {
        "status": _status(run),
        "model": str((run.info.get("config") or {}).get("model", "?")),
        "strategy": f"{resolved.get('strategy', '?')} on {env.get('world_size', '?')} "
        f"x {env.get('device', '?')}{earlier_layouts(resolved.get('changed_on_resume'))}",
        "steps": past_max_steps(done, total) or f"{done} of {total}",
        "earlier attempts": attempts_line(resolved.get("attempts")) or "-",
        # The settings below are the last attempt's: the earlier steps ran with these changed.
        "changed on resume": resume_changes(resolved.get("changed_on_resume")) or "-",
        # The last step's own, as the final line and the card say it (a --log-every row's is a mean).
        "last train loss": f"{own_loss(last):.4f}" if is_number(own_loss(last)) else "-",
        "objective": str(resolved.get("objective", "sft"))
        + (f" (reference: {resolved['reference']})" if resolved.get("reference") else ""),
        "last eval loss": f"{evals[-1]['eval_loss']:.4f} (step {evals[-1]['step']})"
        if evals and is_number(evals[-1].get("eval_loss"))
        else "-",
        "last eval loss per source": ", ".join(
            f"{name} {evals[-1][f'eval_loss/{name}']:.4f}"
            for name in _per_source(evals[-1:])
            if is_number(evals[-1][f"eval_loss/{name}"])
        )
        or "-",
        "last eval reward accuracy": f"{evals[-1]['eval_rewards/accuracies']:.3f}"
        if evals and is_number(evals[-1].get("eval_rewards/accuracies"))
        else "-",
        "best": json.dumps(result["best"]) if result.get("best") else "-",
        "peak memory per rank": ", ".join(f"{p / 2**20:,.0f} MiB" for p in _peaks(run)) or "-",
        "wall time": wall_time(result, resolved),
        "loss": str(resolved.get("loss", "-")),
        "attention": str(resolved.get("attention", "-")),
    }


def _data_summary(run: RecordedRun) -> dict[str, str]:
    out, data = {}, run.info.get("data") or {}
    keys = "examples held_out training_examples tokens truncated dropped_too_long dropped_no_targets"
    train = data["train"] if isinstance(data.get("train"), dict) else {}
    unit = counted_as({"formats": train.get("formats") or {}})
    named = {"examples": unit, "training_examples": "left to train on"}
    for split, d in data.items():
        if isinstance(d, dict):
            kept = [k for k in [*keys.split(), "bad_lines"] if is_number(d.get(k))]
            counts = [f"{named.get(k, k).replace('_', ' ')} {d[k]:,}" for k in kept]
            files = [f for f in d.get("files") or [] if isinstance(f, dict)]  # a preference run's reference
            counts += [f"{d.get('model')}: {f.get('pairs')} pairs in {f.get('file')}" for f in files]
            out[split] = ", ".join(counts) or str(d.get("spec", ""))
    return out


def differing_settings(runs: list[RecordedRun]) -> dict[str, list[str]]:
    configs = [settings_of(run) for run in runs]
    # output_dir always differs, and the runs are named by it.
    keys = sorted({k for c in configs for k in c} - {"output_dir"})
    return {
        k: [json.dumps(c.get(k)) for c in configs]
        for k in keys
        if len({json.dumps(c.get(k)) for c in configs}) > 1
    }


def _table(rows: list[list[str]], head: list[str] | None = None) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    top = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>" if head else ""
    return f"<table>{top}{cells}</table>"


STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;"
    "font-size:13px;text-align:left;vertical-align:top}th{background:#f3f3f3}"
    ".plots{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0}img{max-width:540px}"
    "pre{background:#f7f7f7;padding:8px;font-size:12px;overflow:auto}"
)


def build_html(runs: list[RecordedRun], pngs: dict[str, bytes | None]) -> str:
    names = [run.name for run in runs]
    summaries = [_summary(run) for run in runs]
    # A row no run has a value for (reward accuracy of supervised runs) is left out.
    shown = [k for k in summaries[0] if {s[k] for s in summaries} != {"-"}]
    parts = [
        HTML_HEAD,
        f"<title>lmtune report: {html.escape(', '.join(names))}</title><style>{STYLE}</style></head><body>",
        f"<h1>lmtune report: {html.escape(', '.join(names))}</h1>",
        "<h2>Runs</h2>",
        _table([[k, *(s[k] for s in summaries)] for k in shown], ["", *names]),
    ]
    if len(runs) > 1:
        diff = differing_settings(runs)
        parts += [
            "<h2>Settings that differ</h2>",
            _table([[k, *v] for k, v in diff.items()], ["setting", *names]),
        ]
    parts.append("<h2>Plots</h2><div class='plots'>")
    for name, (title, _) in PLOTS.items():
        png = pngs.get(name)
        if png is None:
            caption = f"<figcaption>{html.escape(title)}: nothing recorded</figcaption>"
            parts.append(f"<figure id='plot-{name}'>{caption}</figure>")
        else:
            encoded = base64.b64encode(png).decode()
            image = f"<img alt='{html.escape(title)}' src='data:image/png;base64,{encoded}'>"
            parts.append(f"<figure id='plot-{name}'>{image}</figure>")
    parts.append("</div>")
    for run in runs:
        parts.append(f"<h2>{html.escape(run.name)}</h2>")
        data_summary = _data_summary(run)
        if data_summary:
            parts += ["<h3>Data</h3>", _table([[k, v] for k, v in data_summary.items()])]
        evals = run.kind("eval")
        if evals:
            final = evals[-1]
            parts += [
                "<h3>Final evaluation</h3>",
                _table([[k, str(v)] for k, v in final.items() if k != "kind"]),
            ]
        samples = run.kind("sample")
        if samples:
            step = samples[-1]["step"]
            rows = [[str(r.get("prompt")), str(r.get("completion"))] for r in samples if r["step"] == step]
            parts += [f"<h3>Samples at step {step}</h3>", _table(rows, ["prompt", "completion"])]
        config = settings_of(run)
        if config:
            text = html.escape(json.dumps(config, indent=2))
            parts.append(f"<details><summary>Configuration</summary><pre>{text}</pre></details>")
    parts.append("</body></html>")
    return "\n".join(parts)


def report(folders: list[Path]) -> tuple[str, dict[str, bytes]]:
    """The report's page, and the PNG of each plot that had data, by name."""
    runs = load_runs(folders)
    pngs = render_plots(runs)
    return build_html(runs, pngs), {name: png for name, png in pngs.items() if png is not None}
