"""Metrics outputs beside metrics.jsonl (``--report-to``): TensorBoard, Weights & Biases, MLflow.

Rank 0 writes every row that goes to metrics.jsonl to each of them, under Hugging Face Trainer's
scalar names (``train/loss``, ``eval/loss``, ...) so that dashboards built for it carry over.
A resumed run continues the same run of each tool with every step once: TensorBoard drops what
earlier attempts wrote and is given the history again; W&B and MLflow, which cannot drop history,
are given the steps they do not hold (resume is exact, so the values held are the ones the
resumed run computes again).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from lmtune.config.files import read_json
from lmtune.errors import SettingError, UserError

# --report-to name -> (module imported, pip extra)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
STATE_FILE = "reporting.json"  # each tool's run id, continued on resume
# The preference objectives' metrics, as TRL names them: all of them report the first six, ORPO
# the rest too (lmtune.objectives.pair_losses).
PREFERENCE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
)
SCALARS = {
    "train": {
        "loss": "train/loss",
        "lr": "train/learning_rate",
        "grad_norm": "train/grad_norm",
        "tokens_per_s": "train/tokens_per_second",
        "mfu": "train/mfu",
        "peak_memory_bytes": "train/peak_memory_bytes",
        "epoch": "train/epoch",
        **{name: f"train/{name}" for name in PREFERENCE_METRICS},
    },
    "eval": {
        "eval_loss": "eval/loss",
        "eval_perplexity": "eval/perplexity",
        **{f"eval_{name}": f"eval/{name}" for name in PREFERENCE_METRICS},
    },
}


def parse_report_to(text: str) -> list[str]:
    """``"tensorboard,wandb"`` -> the names; ``"none"`` -> []."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"] or not names:
        return []
    unknown = [n for n in names if n not in PACKAGES]
    if unknown:
        hf = " (the HF Trainer's all: name them)" if "all" in unknown else ""
        raise SettingError(
            "report_to",
            f"--report-to {text}",
            f"unknown {', '.join(unknown)} (choose from none, {', '.join(PACKAGES)}){hf}",
        )
    return list(dict.fromkeys(names))


def check_installed(names: list[str]) -> None:
    missing = [name for name in names if importlib.util.find_spec(PACKAGES[name]) is None]
    if missing:  # all at once: one install, not one rerun per package
        packages = " and ".join(f"the {PACKAGES[name]} package" for name in missing)
        raise UserError(
            f"--report-to {','.join(missing)}: {packages} {'is' if len(missing) == 1 else 'are'} not "
            f"installed; pip install 'lmtune[{','.join(missing)}]'"
        )


def is_number(value: Any) -> bool:
    """A finite int or float (a bool is not a measurement)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl row's values under the reporting names (numbers only)."""
    names = SCALARS.get(row.get("kind", ""), {})
    out = {name: float(row[key]) for key, name in names.items() if is_number(row.get(key))}
    if row.get("kind") == "eval":  # a source evaluated apart: eval_loss/NAME -> eval/loss/NAME
        per_source = {**names, "eval_tokens": "eval/tokens"}
        for key, value in row.items():
            of_all, _, source = key.rpartition("/")
            if source and of_all in per_source and is_number(value):
                out[f"{per_source[of_all]}/{source}"] = float(value)
    return out


class Reporter(Protocol):
    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _flat(config: dict[str, Any]) -> dict[str, str | int | float | bool]:
    """Hyperparameters as the tools take them (no None, no nesting)."""
    return {k: v if isinstance(v, (str, int, float, bool)) else str(v) for k, v in config.items()}


class TensorBoard:
    def __init__(self, output_dir: Path, config: dict[str, Any], resume_step: int):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # The history up to the checkpoint is written again (an attempt that died may not have
        # flushed all of it, and what it wrote after its checkpoint is not this run's), so the
        # earlier attempt's event file goes: readers other than TensorBoard's (tbparse) saw its
        # steps twice. Events of a file lmtune did not record are dropped when read (purge from step 1).
        folder = output_dir / "tensorboard"
        earlier = _drop_earlier_events(folder, _run_ids(output_dir).get("tensorboard"))
        before = set(folder.glob(_EVENTS)) if folder.is_dir() else set()
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=1)
        ours = sorted(set(folder.glob(_EVENTS)) - before)  # the writer opens its file at once
        if len(ours) == 1:
            _remember_run_id(output_dir, "tensorboard", ours[0].name)
        # A resumed run writes them where no event file holds them: the earlier attempt's was
        # dropped, or it had none (--report-to tensorboard given at the resume).
        if resume_step == 0 or earlier or not before:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)
            # In this run's own folder (add_hparams would start another run beside it).
            events = self.writer._get_file_writer()  # type: ignore[no-untyped-call]
            for summary in hparams(_flat(config), {}):  # type: ignore[no-untyped-call]
                events.add_summary(summary)

    def write(self, row: dict[str, Any]) -> None:
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, row["step"])
        if row.get("kind") == "sample":
            self.writer.add_text("samples", f"**{row['prompt']}** {row['completion']}", row["step"])

    def close(self) -> None:
        self.writer.close()


_EVENTS = "events.out.tfevents.*"


def _drop_earlier_events(folder: Path, name: str | None) -> bool:
    """Whether the event file an earlier attempt recorded (``name``) was there and is removed."""
    earlier = folder / name if name else None
    if earlier is None or not earlier.match(_EVENTS) or earlier.parent != folder:
        return False
    if earlier.is_symlink() or not earlier.is_file():
        return False
    earlier.unlink()
    return True


def _run_ids(output_dir: Path) -> dict[str, str]:
    try:
        state = read_json(output_dir / STATE_FILE, limit=1 << 20)
    except (OSError, UserError):
        return {}
    return {k: v for k, v in state.items() if isinstance(v, str)} if isinstance(state, dict) else {}


def _remember_run_id(output_dir: Path, tool: str, run_id: str) -> None:
    state = _run_ids(output_dir)
    state[tool] = run_id
    (output_dir / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")


def _drop_offline_attempts(output_dir: Path, run_id: str) -> None:
    """Earlier attempts' offline folders of this W&B run: a killed attempt may have written part of
    its history there, and the resumed attempt writes the whole history again into its own, so
    keeping both would give `wandb sync` every step twice. Only lmtune's own run folders (named by
    the run id it recorded) are removed."""
    import shutil

    if not run_id.isalnum():  # W&B's ids are; anything else in reporting.json was not written by us
        return
    for folder in (output_dir / "wandb").glob(f"offline-run-*-{run_id}"):
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)


class WandB:
    def __init__(self, output_dir: Path, config: dict[str, Any], resume_step: int):
        import wandb

        # Offline (a run folder under OUTPUT/wandb, `wandb sync` uploads it) unless an account is set.
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run_id = _run_ids(output_dir).get("wandb") if resume_step else None
        if run_id and mode == "offline":
            _drop_offline_attempts(output_dir, run_id)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "lmtune"),
            name=output_dir.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(output_dir),
            config=config,
            mode=mode,  # type: ignore[arg-type]
        )
        # Online, a resumed run starts at the step after the last one the server holds; offline
        # each attempt is a run folder of its own that holds nothing yet (the previous one may
        # have lost what it had not written when it died), so the history is written again.
        self.next_step = int(self.run.step or 0) if resume_step else 0
        _remember_run_id(output_dir, "wandb", self.run.id)

    def write(self, row: dict[str, Any]) -> None:
        values = scalars(row)
        if values and int(row["step"]) >= self.next_step:
            self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


class MLflow:
    def __init__(self, output_dir: Path, config: dict[str, Any], resume_step: int):
        import mlflow
        from mlflow.tracking import MlflowClient

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # A file store in the output folder; MLflow 3 asks for this opt-in to use one.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((output_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "lmtune"))
        self.mlflow = mlflow
        run_id = _run_ids(output_dir).get("mlflow") if resume_step else None
        self.run = mlflow.start_run(run_id=run_id, run_name=output_dir.resolve().name)
        # MLflow writes each value as it is logged, so what the run holds is known exactly.
        self.held: dict[str, int] = {}
        if run_id is None:
            mlflow.log_params(_flat(config))
        else:
            client = MlflowClient()
            for name in self.run.data.metrics:
                self.held[name] = max((m.step for m in client.get_metric_history(run_id, name)), default=0)
        _remember_run_id(output_dir, "mlflow", self.run.info.run_id)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["step"])
        values = {k: v for k, v in scalars(row).items() if step > self.held.get(k, 0)}
        if values:
            self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def open_reporters(
    names: list[str], output_dir: Path, config: dict[str, Any], history: list[dict[str, Any]]
) -> list[Reporter]:
    """Open each tool's run; a resumed run (``history``: the metrics.jsonl rows up to its
    checkpoint) continues the same one, and each is given the rows it does not hold yet."""
    kinds: dict[str, type[TensorBoard] | type[WandB] | type[MLflow]] = {
        "tensorboard": TensorBoard,
        "wandb": WandB,
        "mlflow": MLflow,
    }
    resume_step = max((int(r["step"]) for r in history), default=0)
    reporters: list[Reporter] = []
    for name in names:
        reporter = kinds[name](output_dir, config, resume_step)
        for row in history:
            reporter.write(row)
        reporters.append(reporter)
    return reporters
