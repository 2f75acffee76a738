"""The end of a finished run: final/ (the best model under --load-best-at-end), the merged model
under --merge-lora, their model cards, the demo's answers, and the upload under --push-to-hub."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtune.checkpoint.card import write_run_cards
from lmtune.checkpoint.export import save_hf_folder
from lmtune.checkpoint.finished import changed_settings, earlier_record
from lmtune.checkpoint.layout import lmtune_wrote, resume_instead, saved_checkpoints, step_folder, verify
from lmtune.checkpoint.manager import CheckpointManager
from lmtune.checkpoint.owned import record_written
from lmtune.config.files import is_int
from lmtune.config.python_values import python_spelling
from lmtune.config.settings import SAMPLE_DATA, to_dict
from lmtune.model.modeling import merged_into_base
from lmtune.outputs.hub import push_final
from lmtune.parallel.distributed import barrier
from lmtune.parallel.launch import report_outcome
from lmtune.training.best import Best
from lmtune.training.build import Built
from lmtune.training.context import RunContext
from lmtune.training.demo import final_model, show_answers
from lmtune.training.evaluate import EvalResult
from lmtune.training.loop import FitResult


def finish(
    run: RunContext,
    built: Built,
    result: FitResult,
    checkpoints: CheckpointManager,
    trained_from: int,
    record: dict[str, Any],
) -> None:
    """final/ (the best model under --load-best-at-end), the merged model, the demo's answers;
    run.json (``record``) says which step's model final/ holds before the model cards read it."""
    cfg, env, log = run.cfg, run.env, run.log
    steps, best = result.state.step, result.best
    trained = (
        f"loss {result.last_loss:.4f} at step {steps}"
        if steps > trained_from
        else f"step {steps}, no steps left to train"
    )
    if cfg.eval.load_best_at_end and best is not None and best.step != steps:
        holding = checkpoints.holding(best.step)
        if holding is not None:
            steps = checkpoints.load(holding).step
            if holding.parent.parent.resolve() != run.output_dir.resolve():  # the run this one continued
                record["result"]["best"]["checkpoint"] = str(holding)
            trained = f"the best model: step {best.step}, {best.metric} {best.value:.4f}, from {holding}"
        else:
            log.info(
                f"--load-best-at-end: the best evaluation (step {best.step}, {best.metric} {best.value:.4f}) "
                f"is in no checkpoint here or in the run this one continued (pruned or removed); "
                "final/ holds the last model"
            )
    final_dir = checkpoints.save_final()
    what = "LoRA adapter (PEFT format)" if cfg.lora.enabled else "model"
    log.info(f"saved the {what} to {final_dir} ({trained})")
    if skipped := result.state.skipped_steps:  # 26 of 30 skipped ended as quietly as none
        log.info(
            f"warning: {skipped} of the run's {result.state.step} steps were skipped (--on-nan skip: a "
            "non-finite loss or gradient norm), their updates not applied"
            + (
                "; the model may have trained little: a lower --lr may help"
                if skipped * 10 > result.state.step
                else ""
            )
        )
    if cfg.lora.merge and env.is_main:
        save_merged(run, built, final_dir)
    record["result"]["final_step"] = steps
    log.write_json("run.json", record)
    if env.is_main:
        write_run_cards(run.output_dir)  # README.md: how it was trained, its results, how to load it
        record_written(final_dir)  # what a later run may replace there: these files, as they are now
    barrier(env)
    if env.is_main and cfg.data.train == SAMPLE_DATA:
        model = final_model(cfg, final_dir) if built.parts.sharded else built.parts.model
        show_answers(model, built.tokenizer, log)
    if cfg.checkpoint.push_to_hub is not None and env.is_main:
        run.heartbeat.beat("upload")  # as long as the network takes: not watched as a hang
        push_final(run.output_dir, cfg.checkpoint, cfg.lora.merge, log)


@dataclass(frozen=True)
class TrainResult:
    """What ``lmtune.train`` returns: the run's folder, its last step (``steps``), that step's loss
    and the last evaluation; run.json holds everything else the run recorded."""

    output_dir: Path
    steps: int
    last_loss: float
    eval: EvalResult | None
    stopped_by: str | None = None  # signal | early_stopping: ended before its last step
    # A finished run called again: its recorded result, and the settings of this call it did not
    # apply (a loop over learning rates into one output_dir returned the first run's result each
    # time), named as the call names them (``lr 0.5, was ...`` from Python, ``--lr 0.5`` from the CLI).
    not_applied: tuple[str, ...] = ()
    # The best evaluation by --metric-for-best (None without one), as run.json's result.best: under
    # --load-best-at-end final/ holds its model, not the last step's (``eval`` is the last step's).
    best: Best | None = None
    final_step: int | None = None  # the step whose model final/ holds (None: no final/, stopped)


def finished_result(run: RunContext, step: int) -> TrainResult:
    """A finished run run again: said (:func:`say_finished`), and its result as run.json has it."""
    changed = say_finished(run, step)
    report_outcome(step, stopped=False, env=run.env)  # a node without rank 0 says so too
    recorded: Any = earlier_record(run.output_dir).get("result")
    loss, evaluated = recorded_result(recorded)
    named = tuple(changed if run.given is not None else map(python_spelling, changed))
    return TrainResult(run.output_dir, step, loss, evaluated, not_applied=named, **recorded_outcome(recorded))


def recorded_result(result: Any) -> tuple[float, EvalResult | None]:
    """A finished run's last loss and last evaluation, as its run.json's ``result`` recorded them
    (nan and None where it holds none, or not in lmtune's form)."""
    try:
        loss = float(result["last_loss"])
        evaluated = result.get("eval")
        return loss, EvalResult.from_record(evaluated) if isinstance(evaluated, dict) else None
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError):
        return float("nan"), None


def recorded_best(result: Any) -> Best | None:
    """run.json's ``result.best`` (None where it holds none, or not in lmtune's form)."""
    best: Any = result.get("best") if isinstance(result, dict) else None
    try:
        return Best(int(best["step"]), str(best["metric"]), float(best["value"]), str(best["checkpoint"]))
    except (KeyError, TypeError, ValueError, OverflowError):  # an edited record: "step": Infinity
        return None


def recorded_outcome(result: Any) -> dict[str, Any]:
    """TrainResult's ``stopped_by``, ``best`` and ``final_step`` as run.json's ``result`` has them
    (None where it holds none, or not in lmtune's form)."""
    record = result if isinstance(result, dict) else {}
    stopped, final = record.get("stopped_by"), record.get("final_step")
    return {
        "stopped_by": stopped if stopped in ("signal", "early_stopping") else None,
        "best": recorded_best(record),
        "final_step": final if is_int(final) else None,
    }


def say_finished(run: RunContext, step: int) -> list[str]:
    """A finished run run again: nothing to do, and which of this command's changed settings
    therefore apply to nothing (returned: on rank 0)."""
    out = run.output_dir
    saved = step_folder(out, step)
    wrote = lmtune_wrote(saved)
    damage = verify(saved, hashes=False) if wrote else None
    held = saved if wrote and damage is None else None
    # More steps continue from a checkpoint of the last one; without it, they are refused.
    older = [c for c in saved_checkpoints(out) if c != saved and verify(c, hashes=False) is None]
    onward = (
        "Raise --max-steps or --epochs to train on"
        if held is not None
        else f"Its checkpoint {saved} is damaged ({damage}): to train on, "
        + resume_instead(older, "no earlier whole checkpoint is left to continue from")
        + "; --overwrite starts afresh"
        if damage
        else f"No checkpoint holds step {step} to train on from (--save-every); --overwrite starts afresh"
    )
    model = _model_of(out, step, held)
    run.log.info(f"{out} holds this run, finished at step {step} ({model}): nothing to do. {onward}")
    changed = changed_settings(out, to_dict(run.cfg)) if run.env.is_main else []
    if changed:
        # Merging needs no step: the checkpoint's adapter merges as it is.
        merge = (
            f"; a merged model of this one: lmtune export {held} DIR --merge-lora"
            if held is not None and any(c.startswith("--merge-lora") for c in changed)
            else ""
        )
        run.log.info(
            f"  not applied ({'; '.join(changed)}): they would apply to further steps only; "
            f"for a new run with them, choose another --output-dir or add --overwrite{merge}"
        )
    return changed


def _model_of(output_dir: Path, step: int, held: Path | None) -> str:
    """Where the finished run's model is: final/, or where it is gone (moved or deleted since), the
    checkpoint of the same step (``held``, None where there is none)."""
    final = output_dir / "final"
    if any((final / name).is_file() for name in ("config.json", "adapter_config.json")):
        return f"the model is in {final}"
    if held is not None:
        return (
            f"{final} is gone; the model of step {step} is in its checkpoint {held}: "
            f"`lmtune export {held} DIR` writes it as a model folder"
        )
    return f"{final} is gone, and no checkpoint holds step {step}: --overwrite trains it again"


def save_merged(run: RunContext, built: Built, final_dir: Path) -> None:
    """final/merged: the base with the adapter in final/ merged in (a quantized base dequantized
    first: lmtune.model.modeling.merged_into_base)."""
    cfg = run.cfg
    merged, what = merged_into_base(
        cfg.model.name,
        cfg.seed,
        final_dir,
        trust_remote_code=cfg.model.trust_remote_code,
        quantization=built.loaded.quantization,
        device=run.env.device,
    )
    save_hf_folder(merged, built.tokenizer, final_dir / "merged")
    run.log.info(f"saved {what} with the adapter merged to {final_dir / 'merged'}")
