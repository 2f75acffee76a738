"""What a run that ran out of memory can still lower, as its settings have them: said once for a
step that failed to allocate (lmtune.training.failures) and for a rank the kernel's out-of-memory
killer took (lmtune.parallel.failure_report)."""

from __future__ import annotations

from lmtune.config.settings import TrainConfig


def memory_advice(cfg: TrainConfig, *, on_gpu: bool, batched: bool, processes: int = 1) -> str:
    """``; to fit, try ...``: ``batched``: what ran out held several examples at once; ``processes``:
    the CPU processes of one machine, each with its own copy of the model and optimizer."""
    ways = []
    if batched:
        ways.append(
            f"a smaller --micro-batch-size (the global batch stays {cfg.batch.global_batch_size}: "
            "more micro-batches a step, the same training)"
        )
    if not cfg.model.activation_checkpointing:
        ways.append("--activation-checkpointing")
    ways.append(f"a shorter --max-length (now {cfg.examples.max_length:,})")
    if on_gpu and cfg.model.precision == "fp32":
        ways.append("--precision bf16")
    if on_gpu and not cfg.lora.enabled:
        ways.append("--lora (or --optimizer adamw8bit)")
    if not on_gpu and processes > 1:
        ways.append(f"fewer --nproc-per-node (now {processes}; each holds the model and its optimizer)")
    listed = ", ".join(ways[:-1]) + f" or {ways[-1]}" if len(ways) > 1 else ways[0]
    return f"; to fit, try {listed} (`lmtune plan` with the same model, data and batch flags shows what fits)"
