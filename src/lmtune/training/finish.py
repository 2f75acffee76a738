"""The end of a finished run: final/ (the best model under --load-best-at-end), the merged model
under --merge-lora, and the demo's answers."""

from __future__ import annotations

from pathlib import Path

from lmtune.checkpoint.card import write_run_cards
from lmtune.checkpoint.export import save_final, save_hf_folder
from lmtune.checkpoint.store import load_checkpoint
from lmtune.config.settings import SAMPLE_DATA
from lmtune.model.lora import merged_model
from lmtune.model.modeling import load_model
from lmtune.parallel.distributed import barrier
from lmtune.training.best import BestTracker
from lmtune.training.build import Built, Run
from lmtune.training.demo import final_model, show_answers
from lmtune.training.loop import FitResult


def finalize(run: Run, b: Built, result: FitResult, best: BestTracker | None, trained_from: int) -> None:
    """final/ (the best model under --load-best-at-end), the merged model, the demo's answers."""
    cfg, env, log = run.cfg, run.env, run.log
    final_dir, steps = run.output_dir / "final", result.state.step
    trained = (
        f"loss {result.last_loss:.4f} at step {steps}"
        if steps > trained_from
        else f"step {steps}, no steps left to train"
    )
    if cfg.eval.load_best_at_end and best is not None and best.best is not None and best.best.step != steps:
        load_checkpoint(Path(best.best.checkpoint), b.parts, b.optimizer, env, b.scaler)
        trained = f"the best model: step {best.best.step}, {best.best.metric} {best.best.value:.4f}"
    save_final(b.parts, b.tokenizer, final_dir, env)
    what = "LoRA adapter (PEFT format)" if cfg.lora.enabled else "model"
    log.info(f"saved the {what} to {final_dir} ({trained})")
    if cfg.lora.merge and env.is_main:
        merged = merged_model(
            load_model(cfg.model.name, cfg.seed, cfg.model.trust_remote_code).model, final_dir
        )
        save_hf_folder(merged, b.tokenizer, final_dir / "merged")
        log.info(f"saved the base model with the adapter merged to {final_dir / 'merged'}")
    if env.is_main:
        write_run_cards(run.output_dir)  # README.md: how it was trained, its results, how to load it
    barrier(env)
    if env.is_main and cfg.data.train == SAMPLE_DATA:
        show_answers(final_model(cfg, final_dir) if b.parts.sharded else b.parts.model, b.tokenizer, log)
