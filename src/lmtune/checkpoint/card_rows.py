"""The model card's tables: how the model was trained (objective, data, hyperparameters, hardware,
time) and what it reached, each row from the run's run.json."""

from __future__ import annotations

from typing import Any

from lmtune.checkpoint.attempts import attempts_line
from lmtune.config.validate import PREFERENCE
from lmtune.data.formats import CHAT_FORMATS


def plural(n: Any, thing: str, many: str = "") -> str:
    if not isinstance(n, int):
        return f"{n} {many or thing + 's'}"
    return f"{n:,} {thing if n == 1 else many or thing + 's'}"


# The weights of each preference objective, as its run.json config names them.
OBJECTIVE_WEIGHTS = {
    "dpo": ("beta", "label_smoothing"),
    "ipo": ("beta",),
    "simpo": ("beta", "simpo_gamma", "label_smoothing"),
    "orpo": ("orpo_lambda",),
}


def _objective(config: dict[str, Any], formats: dict[str, int], reference: Any = None) -> str:
    name = config.get("objective", "sft")
    if name != "sft":
        weights = [
            f"{k} {config[k]}" for k in OBJECTIVE_WEIGHTS.get(name, ()) if config.get(k) not in (None, 0, 0.0)
        ]
        return (
            f"`{name}` (lmtune's --objective)"
            + (f": {', '.join(weights)}" if weights else "")
            + (f"; reference: {reference}" if reference else "")
        )
    every = bool(config.get("train_on_prompt")) or set(formats) <= {"text"}
    trained = (
        "every token"
        if every
        else "the completions"
        + (" and assistant turns" if set(formats) & set(CHAT_FORMATS) else "")
        + " (prompts and other turns masked)"
    )
    noise = config.get("neftune_alpha")
    return (
        f"supervised fine-tuning: next-token cross-entropy on {trained}, normalised by the number of "
        "trained tokens over all processes"
        + (f"; NEFTune noise on the input embeddings (alpha {noise})" if noise else "")
    )


def _data_line(info: dict[str, Any], max_length: Any) -> str:
    counts = info.get("formats", {})
    examples = info.get("examples", 0)
    line = f"`{info.get('spec')}`: {plural(examples, 'example')}"
    if counts:
        dropped = sum(counts.values()) - examples
        more = f"; {dropped:,} more dropped: too long, or nothing to train" if dropped > 0 else ""
        line += f" ({', '.join(sorted(counts))}{more})"
    if "tokens" in info:
        # Targets: the positions with a label. Counted before an --eval-split holds some out.
        line += f", {info['tokens']:,} tokens, {info.get('target_tokens', 0):,} of them targets"
    if info.get("truncated"):
        line += f"; {info['truncated']:,} truncated to {max_length} tokens"
    if info.get("held_out"):
        line += (
            f"; {info['held_out']:,} held out for evaluation, so {info.get('training_examples', 0):,} "
            "trained on"
        )
    return line


def training_rows(run: dict[str, Any]) -> list[tuple[str, str]]:
    config, resolved, data = run.get("config", {}), run.get("resolved", {}), run.get("data", {})
    if not config:
        return [("run", "not recorded (no run.json)")]
    train = data.get("train", {})
    rows = [("objective", _objective(config, train.get("formats", {}), resolved.get("reference")))]
    rows += [("training data", _data_line(train, config.get("max_length")))] if train else []
    if train.get("mixture"):
        rows.append(("data mixture", _mixture_line(train["mixture"])))
    if "eval" in data:
        rows.append(("evaluation data", _data_line(data["eval"], config.get("max_length"))))
    if resolved:
        rows.append(("steps", _steps(run.get("result", {}).get("steps"), resolved)))
        processes = plural(resolved.get("world_size"), "process", "processes")
        split = (  # unknown for a checkpoint of an earlier layout whose micro-batch was auto
            f" = {resolved['micro_batch_size']} per micro-batch x {processes} x "
            f"{resolved.get('accumulation')} accumulation"
            if resolved.get("micro_batch_size") is not None
            else f" over {processes}"
        )
        rows.append(
            (
                "global batch",
                f"{resolved.get('global_batch_size')} examples{split}"
                + _left_out(resolved.get("left_out_per_epoch")),
            )
        )
    warmup = config.get("warmup_steps")
    warmup_text = (
        f"{warmup} warmup steps"
        if warmup is not None
        else f"warmup over {100 * float(config.get('warmup_ratio') or 0):g}% of the steps"
    )
    lr = resolved.get("lr", config.get("lr"))
    rows += [
        ("learning rate", f"{lr}, {config.get('lr_schedule')} schedule, {warmup_text}"),
        (
            "optimizer",
            f"{config.get('optimizer')} (weight decay {config.get('weight_decay')}, betas "
            f"{config.get('adam_beta1')}/{config.get('adam_beta2')}, eps {config.get('adam_eps')}), "
            f"gradient norm clipped at {config.get('max_grad_norm')}",
        ),
        ("precision", f"{config.get('precision')} (fp32 weights and optimizer state)"),
        ("max length", f"{config.get('max_length')} tokens (truncation: {config.get('truncation')})"),
    ]
    if config.get("lora"):
        rows.append(("LoRA", _lora_line(config, resolved)))
    changed = resolved.get("changed_on_resume")
    if changed and isinstance(changed, list):
        entries = [c for c in changed if isinstance(c, dict)]
        # A checkpoint's card marks the changes after it (lmtune.checkpoint.card.checkpoint_record).
        of = "this checkpoint's" if any("after_checkpoint" in c for c in entries) else "the last resume's"
        lines = "; ".join(_change_line(c) for c in entries)
        rows.append(("changed on resume", f"{lines} (the rows above hold {of} settings)"))
    if earlier := attempts_line(resolved.get("attempts")):
        rows.append(("earlier attempts", earlier))
    if resolved.get("quantization"):
        rows.append(("quantized base", _quantization_line(resolved)))
    rows += _environment_rows(run)
    rows.append(("seed", str(config.get("seed"))))
    return rows


def _left_out(left: Any) -> str:
    if not isinstance(left, int) or left <= 0:
        return ""
    return f"; the {plural(left, 'example')} past an epoch's last whole batch sit it out (others each epoch)"


def past_max_steps(done: Any, total: Any) -> str | None:
    """The steps of a run resumed from a checkpoint already past its --max-steps (it trained
    nothing more), or None for any other run."""
    if isinstance(done, int) and isinstance(total, int) and done > total:
        return f"{done} (its checkpoint was past the {total} this run planned: nothing more was trained)"
    return None


def wall_time(result: dict[str, Any], resolved: dict[str, Any]) -> str:
    """This process's wall time; for a resumed run, also the training time of every attempt (the
    last attempt's alone read 5 s beside 21 s for the same run uninterrupted)."""
    seconds, trained = result.get("wall_time_s"), result.get("train_seconds")
    if not isinstance(seconds, (int, float)):
        return "-"
    wall = f"{seconds:,.0f} s"
    if resolved.get("resumed_from") and isinstance(trained, (int, float)):
        wall += f" (the last attempt; training {trained:,.0f} s over every attempt)"
    return wall


def _steps(done: Any, resolved: dict[str, Any]) -> str:
    total = resolved.get("total_steps")
    past = past_max_steps(done, total)
    return past or f"{total if done is None else done} of {total} ({_epochs(resolved)} planned)"


def _epochs(resolved: dict[str, Any]) -> str:
    """The planned epochs: whole ones, or the share of one a --max-steps run covers."""
    total, per_epoch = resolved.get("total_steps"), resolved.get("steps_per_epoch")
    if isinstance(total, int) and isinstance(per_epoch, int) and per_epoch and total % per_epoch:
        return f"{total / per_epoch:.2f} epochs of {per_epoch:,} steps"
    return plural(resolved.get("epochs"), "epoch")


def _mixture_line(sources: list[dict[str, Any]]) -> str:
    """Per source of a mixture: its share of an epoch and how often its examples come round."""
    return "; ".join(
        f"{s.get('name')} {100 * float(s.get('share', 0)):.1f}% of an epoch: {s.get('per_epoch', 0):,} "
        f"drawn from {plural(s.get('examples', 0), 'example')} (each x{float(s.get('repeats', 0)):.2f})"
        for s in sources
    )


def _quantization_line(resolved: dict[str, Any]) -> str:
    """What the base was quantized to while the adapters trained (QLoRA), and its size."""
    line = f"{resolved['quantization']} (the adapters trained on it: QLoRA)"
    size = resolved.get("base_bytes") or {}
    if "quantized" in size and "full_precision" in size:
        line += (
            f"; {size['quantized'] / 2**20:,.1f} MiB quantized, {size['full_precision'] / 2**20:,.1f} MiB "
            "kept in full precision"
        )
    return line


def _lora_line(config: dict[str, Any], resolved: dict[str, Any]) -> str:
    # A preference objective turns LoRA's dropout off, whatever the setting's default says.
    dropout = "off" if config.get("objective") in PREFERENCE else config.get("lora_dropout")
    line = (
        f"rank {config.get('lora_rank')}, alpha {config.get('lora_alpha')}, dropout {dropout}, "
        f"targets {config.get('lora_target_modules')}"
    )
    total, trainable = resolved.get("parameters"), resolved.get("trainable_parameters")
    if total and trainable:
        line += f"; {trainable:,} of {total:,} parameters trained ({100 * trainable / total:.2f}%)"
    return line


def _environment_rows(run: dict[str, Any]) -> list[tuple[str, str]]:
    env, resolved, result = run.get("environment", {}), run.get("resolved", {}), run.get("result", {})
    if not env:
        return []
    world = env.get("world_size", 1)
    devices = env.get("cuda_devices") or []
    on_gpu = str(env.get("device", "")).startswith("cuda") and devices
    where = f"{world} x {devices[0]}" if on_gpu else f"{world} CPU process{'es' if world > 1 else ''}"
    rows = [("hardware", f"{where}, strategy {resolved.get('strategy', '?')}")]
    seconds = result.get("train_seconds", result.get("wall_time_s"))  # a resumed run's: every attempt's
    if isinstance(seconds, (int, float)):
        rows.append(("training time", _duration(float(seconds))))
    rows.append(
        (
            "software",
            f"lmtune {env.get('lmtune')}, torch {env.get('torch')}, transformers {env.get('transformers')}",
        )
    )
    return rows


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def result_rows(run: dict[str, Any]) -> list[tuple[str, str]]:
    result = run.get("result") or {}
    rows = []
    best = result.get("best") or {}
    # --load-best-at-end: the folder holds the best step's model; the last step's figures are not its.
    holds_best = bool(best and run.get("config", {}).get("load_best_at_end"))
    if "final_step" in result:  # the best's checkpoint may have been gone: then final/ is the last model
        holds_best = bool(best) and result["final_step"] == best.get("step")
    elsewhere = holds_best and best["step"] != result.get("steps")
    last = " (the last step's model, not this one)" if elsewhere else ""
    if isinstance(result.get("last_loss"), (int, float)):
        rows.append((f"train loss at step {result.get('steps')}{last}", f"{result['last_loss']:.4f}"))
    evaluated = result.get("eval") or {}
    if isinstance(evaluated.get("loss"), (int, float)):
        # Perplexity for supervised runs; reward accuracy and margin for preference ones.
        figures = [f"loss {evaluated['loss']:.4f}"] + [
            f"{name} {evaluated[key]:{form}}"
            for key, name, form in (
                ("perplexity", "perplexity", ".3f"),
                ("rewards/accuracies", "reward accuracy", ".4f"),
                ("rewards/margins", "reward margin", ".4f"),
            )
            if isinstance(evaluated.get(key), (int, float))
        ]
        at = evaluated.get("step", result.get("steps"))
        before = (
            f"evaluation at step {at} (the last one before this checkpoint)"
            if at != result.get("steps")
            else ""
        )
        noun = "pairs" if "rewards/accuracies" in evaluated else "examples"
        rows.append(
            (
                before or (f"evaluation at step {at}{last}" if last else "evaluation"),
                f"{', '.join(figures)} ({evaluated.get('examples', 0):,} {noun})",
            )
        )
    if best:
        kept = " (this is that model)" if holds_best else ""
        value = f"{best['metric']} {best['value']:.4f} at step {best['step']}{kept}"
        rows.append(("best evaluation", value))
    if result.get("stopped_by"):
        rows.append(("stopped early", str(result["stopped_by"]).replace("_", " ")))
    return rows


def _change_line(change: dict[str, Any]) -> str:
    later = ", later than this checkpoint" if change.get("after_checkpoint") else ""
    return f"after step {change.get('step')}{later}: {', '.join(str(c) for c in change.get('changes', []))}"
