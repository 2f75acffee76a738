"""The settings groups of how a run is watched and kept: evaluation, samples, checkpoints, the
launch, logging and health (lmtune.config.groups has what is trained and how; the same rules)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

from lmtune.config.groups import setting
from lmtune.config.switches import metric_as_read

# --metric-for-best: these, or one of them of a source evaluated apart (eval_loss/NAME).
BEST_METRICS = ("eval_loss", "eval_perplexity", "eval_rewards/accuracies", "eval_rewards/margins")


@dataclass(frozen=True)
class EvalSettings:
    """When to evaluate, which checkpoint is the best, and early stopping."""

    every: int = setting(
        0, "Evaluate every N optimizer steps; 0 evaluates only at the end.", flag="eval_every"
    )
    on_start: bool = setting(
        False,
        (
            "Also evaluate before the first step: the starting model's figures, as step 0 (a baseline; a "
            "resumed run has it already)."
        ),
        flag="eval_on_start",
    )
    metric_for_best: str | None = setting(
        None,
        (
            "Keep the best checkpoint by this eval metric (eval_loss | eval_perplexity, lower is better; "
            "preference objectives: eval_rewards/accuracies | eval_rewards/margins, higher is better), or "
            "one source's (eval_loss/NAME) when evaluating per source: it is saved when it improves and "
            "never pruned."
        ),
    )
    greater_is_better: bool = setting(
        False, "With --metric-for-best eval_loss or eval_perplexity: higher is better."
    )
    load_best_at_end: bool = setting(
        False,
        (
            "final/ is the best model by --metric-for-best (eval_loss unless given, as in the HF "
            "Trainer), not the last one."
        ),
    )
    early_stopping_patience: int = setting(
        0,
        (
            "With --metric-for-best: stop (saved, exit 0) after this many evaluations without improvement; 0 "
            "never stops early."
        ),
    )
    early_stopping_threshold: float = setting(
        0.0, "How much better an evaluation must be to count as an improvement."
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "metric_for_best", metric_as_read(self.metric_for_best))
        if self.load_best_at_end and self.metric_for_best is None:
            # As the HF Trainer's load_best_model_at_end: the best by the loss unless told otherwise.
            object.__setattr__(self, "metric_for_best", "eval_loss")


@dataclass(frozen=True)
class SampleSettings:
    """Generations from fixed prompts during training."""

    prompts: str | None = setting(
        None,
        (
            'JSONL file of prompts to generate from during training: each line a string, {"prompt": ...} or '
            '{"messages": [...]} (rendered with the chat template). The generations go to metrics.jsonl '
            '("kind": "sample") and the log.'
        ),
        flag="sample_prompts",
    )
    every: int = setting(
        0, "With --sample-prompts: generate every N optimizer steps; 0 only at the end.", flag="sample_every"
    )
    temperature: float = setting(
        0.0, "With --sample-prompts: 0 decodes greedily, above 0 samples (seeded).", flag="sample_temperature"
    )
    max_new_tokens: int = setting(
        48, "With --sample-prompts: the most tokens generated per prompt.", flag="sample_max_new_tokens"
    )


@dataclass(frozen=True)
class CheckpointSettings:
    """The output folder, resumable checkpoints and resuming."""

    output_dir: str = setting("lmtune-output", "Folder for final/, metrics.jsonl and run.json.")
    save_every: int = setting(
        500,
        "Save a resumable checkpoint every N optimizer steps and at the end of the run, so that a "
        "stopped run resumes and a finished one can be continued with more steps; 0 saves only "
        "when stopped by SIGTERM/SIGINT or early stopping.",
    )
    keep_last: int = setting(3, "Keep the newest K checkpoints; 0 keeps all.")
    resume: str = setting(
        "auto",
        (
            "auto (continue from the newest valid checkpoint in --output-dir, if any) | never | PATH of a "
            "checkpoint folder."
        ),
    )
    overwrite: bool = setting(
        False,
        (
            "Start afresh in an --output-dir that holds an earlier run: its checkpoints, final/, metrics and "
            "records are deleted first (without it, such a folder is refused)."
        ),
    )
    push_to_hub: str | None = setting(
        None,
        (
            "At the end, upload final/ (the merged model with --merge-lora) with its model card to this "
            "Hugging Face hub repo (user/name), created if missing; the token is huggingface_hub's "
            "(HF_TOKEN or `hf auth login`). A failed upload is a warning with the command to retry."
        ),
    )
    hub_private: bool = setting(False, "With --push-to-hub: create the repo private.")


@dataclass(frozen=True)
class LaunchSettings:
    """Processes, machines and the parallel strategy."""

    strategy: str = setting(
        "auto",
        (
            "auto (ddp when launched with several processes, else single) | single | dp "
            "(nn.DataParallel over "
            "the visible GPUs) | ddp | fsdp (FSDP2: parameters, gradients and optimizer state sharded"
            " over the"
            " processes; sharded checkpoints)."
        ),
        choices=("auto", "single", "dp", "ddp", "fsdp"),
    )
    nproc_per_node: int = setting(
        1,
        (
            "Start this many processes on this machine through torch.distributed.run (ignored under "
            "torchrun, "
            "which has already started them)."
        ),
    )
    threads_per_process: int = setting(
        0, "CPU threads per process; 0 shares this machine's cores evenly among its processes."
    )
    nnodes: str = setting("1", "Machines in the job: N, or MIN:MAX for an elastic job (c10d rendezvous).")
    node_rank: int | None = setting(
        None, "This machine's rank; node 0 hosts the rendezvous store at --rdzv-endpoint."
    )
    rdzv_endpoint: str | None = setting(
        None, "HOST:PORT of the rendezvous, the same on every node (multi-node)."
    )
    rdzv_id: str = setting("lmtune", "Job id shared by the nodes of one run.")
    max_restarts: int = setting(
        0, "Restart all workers this many times when one dies; they resume from the newest checkpoint."
    )


@dataclass(frozen=True)
class LoggingSettings:
    """What the run records: progress, metrics, profiles, dashboards."""

    log_every: int = setting(1, "Write a metrics.jsonl line every N optimizer steps.")
    progress: bool = setting(
        True, "Show a progress bar on rank 0, on a terminal (in a file or pipe the step lines show progress)."
    )
    profile: bool = setting(
        False, "Time each step's data wait, forward, backward and optimizer into metrics.jsonl."
    )
    report_to: str = setting(
        "none",
        (
            "Also send the metrics to: none | tensorboard | wandb | mlflow, or a comma list "
            "(TensorBoard under"
            " OUTPUT/tensorboard; W&B offline under OUTPUT/wandb unless WANDB_API_KEY or WANDB_MODE is set; "
            "MLflow to MLFLOW_TRACKING_URI, else OUTPUT/mlruns)."
        ),
    )
    record_samples: bool = setting(
        False, "Write the example ids of every step to samples/rank-R.jsonl (to audit data order)."
    )


@dataclass(frozen=True)
class HealthSettings:
    """Hangs, timeouts, non-finite losses and checks before a run."""

    hang_timeout: float = setting(
        30.0,
        (
            "Under lmtune's launcher, end the job (exit code 3, or a restart under --max-restarts) "
            "when a rank"
            " has not advanced for this long, or 10x its slowest step if longer (the first step and saving "
            "get 10 minutes, samples 3; an evaluation beats at every batch); OUTPUT/hang-report.txt says "
            "which rank, where. 0 turns the watchdog off."
        ),
    )
    collective_timeout: float = setting(
        300.0,
        (
            "After the first step, a collective that waits this long for another rank fails, at least 10 s "
            "(before: 30 minutes, for loading and warm-up; evaluation and saving keep 30 minutes)."
        ),
    )
    on_nan: str = setting(
        "stop",
        "A non-finite loss or gradient norm: stop (keep the last checkpoint) | skip the update.",
        choices=("stop", "skip"),
    )
    doctor: bool = setting(
        False,
        (
            "Before training, run lmtune doctor's checks on every rank (versions, devices, all-reduce, the "
            "output and cache folders shared and writable, free disk, data, clocks); stop on a failure."
        ),
    )


def names_checkpoint(resume: object) -> TypeGuard[str]:
    """Whether a --resume value names a checkpoint folder, not one of the words auto and never."""
    return isinstance(resume, str) and resume not in ("auto", "never")
