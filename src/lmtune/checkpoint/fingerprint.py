"""A run's fingerprint: what defines it, which a checkpoint records and a resume compares.

A checkpoint records what defines its run: the data's content (the cache key hashes the files,
the tokenizer and every data setting), the model's config, the global batch, the seed, the
optimizer and the LoRA settings. A run that differs in any of these cannot continue it, and is
told each difference (saved -> now). Settings that may change between attempts (learning rate and
schedule, run length, cadences, precision, world size) are applied from the resume step and
listed, so nothing changes silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lmtune.checkpoint.finished import REFERENCE_WEIGHTS
from lmtune.checkpoint.layout import FINGERPRINT_FILE
from lmtune.config.files import read_json_object
from lmtune.config.mixture import named_items, parse_weights
from lmtune.config.settings import TrainConfig, config_fields, option_name, warmup_steps
from lmtune.errors import UserError, one_line
from lmtune.model.quantization import fingerprint_value

# Config entries that describe how a model runs here, not what it is. (A quantized base's
# quantization_config names its compute and storage dtypes, which follow --precision and the
# strategy; what the quantization is, is the fingerprint's "base quantization".)
_VOLATILE_CONFIG = (
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "architectures",
    "quantization_config",
)


@dataclass(frozen=True)
class Fingerprint:
    """``fixed``: must match to resume; ``adjustable``: applied from the resume step when changed;
    ``described``: the settings behind the hashes among ``fixed`` (the model's config, the data's),
    never compared, only named when a hash differs."""

    fixed: dict[str, Any]
    adjustable: dict[str, Any]
    described: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"fixed": self.fixed, "adjustable": self.adjustable, "described": self.described}

    def with_reference(self, digest: str | None) -> Fingerprint:
        """With the --reference-model's weights' hash, known once it is loaded (None: no such model)."""
        return self if digest is None else replace(self, fixed=self.fixed | {REFERENCE_WEIGHTS: digest})


def config_hash(config: Any) -> str:
    """The model's architecture as its config states it (names and runtime choices left out)."""
    raw = json.loads(config.to_json_string(use_diff=False))
    kept = {k: v for k, v in raw.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG}
    return hashlib.blake2b(json.dumps(kept, sort_keys=True).encode(), digest_size=12).hexdigest()


def fingerprint(
    cfg: TrainConfig,
    *,
    data_key: str,
    examples: int,
    model_config: Any,
    lr: float,
    total_steps: int,
    starting_weights: str | None = None,
) -> Fingerprint:
    fixed: dict[str, Any] = {
        "training data (content, tokenizer and data settings)": data_key,
        "training examples": examples,
        "--eval-split": cfg.data.eval_split,
        "model config": config_hash(model_config),
        "--max-length": cfg.examples.max_length,
        "--data-format": cfg.examples.format,
        "--truncation": cfg.examples.truncation,
        "--global-batch-size": cfg.batch.global_batch_size,
        "--seed": cfg.seed,
        "--optimizer": cfg.optim.name,
        "--lora": cfg.lora.enabled,
    }
    if cfg.objective.name != "sft":  # (a checkpoint of an sft run names no objective)
        o = cfg.objective
        fixed |= {"--objective": o.name, "--reference": o.reference, "--reference-model": o.reference_model}
    if cfg.lora.enabled:
        # The frozen base is rebuilt from --model on resume, so it must be the same one.
        fixed |= {
            "--model": _as_recorded(cfg.model.name),
            "--lora-rank": cfg.lora.rank,
            "--lora-alpha": cfg.lora.alpha,
            "--lora-dropout": cfg.lora.dropout,
            "--lora-target-modules": cfg.lora.target_modules,
        }
    if cfg.data.weights is not None:  # recorded only for a mixture: older checkpoints stay comparable
        # Other weights make another order of the examples: the run could not continue exactly.
        fixed["--data-weights (mixture)"] = mixture_fingerprint(cfg.data.train, cfg.data.weights)
    if starting_weights is not None:  # where the run depends on them (a LoRA base, the reference)
        fixed[STARTING_WEIGHTS] = starting_weights
    quantization = fingerprint_value(cfg.model)
    if quantization is not None:  # recorded only when quantized: older checkpoints stay comparable
        fixed["base quantization"] = quantization
    adjustable = {
        "--lr": lr,
        "--lr-schedule": cfg.schedule.name,
        "warmup steps": warmup_steps(cfg.schedule, total_steps),
        "--min-lr-ratio": cfg.schedule.min_lr_ratio,
        "--decay-ratio": cfg.schedule.decay_ratio,
        "--weight-decay": cfg.optim.weight_decay,
        "--adam-beta1": cfg.optim.adam_beta1,
        "--adam-beta2": cfg.optim.adam_beta2,
        "--adam-eps": cfg.optim.adam_eps,
        "--momentum": cfg.optim.momentum,
        "--max-grad-norm": cfg.optim.max_grad_norm,
        "total steps": total_steps,
        "--eval-every": cfg.eval.every,
        "--save-every": cfg.checkpoint.save_every,
        "--precision": cfg.model.precision,
        # How each rank's share of a step is split: any split trains the same, so it may change.
        "--micro-batch-size": cfg.batch.micro_batch_size or "auto",
        **_computed_as(cfg),
    }
    if cfg.schedule.name == "cosine":  # recorded since its warmup is transformers' (from 0)
        adjustable[COSINE_WARMUP] = "step/warmup"
    if cfg.objective.name != "sft":
        o = cfg.objective
        adjustable |= {
            "--beta": o.beta,
            "--label-smoothing": o.label_smoothing,
            "--simpo-gamma": o.simpo_gamma,
            "--orpo-lambda": o.orpo_lambda,
        }
    if cfg.objective.neftune_alpha:  # recorded only when on: older checkpoints stay comparable
        adjustable["--neftune-alpha"] = cfg.objective.neftune_alpha
    described: dict[str, Any] = {"--model": cfg.model.name, "--data": cfg.data.train}
    for s in config_fields():
        if s.group == "examples":  # the data settings the training data's hash takes in
            described[option_name(s.name)] = getattr(cfg.examples, s.field)
    return Fingerprint(fixed, adjustable, described)


def _computed_as(cfg: TrainConfig) -> dict[str, Any]:
    """How a step is computed: the same training, said when a resume changes it (it was not)."""
    return {
        "--packing": cfg.batch.packing,
        "--group-by-length": cfg.batch.group_by_length,
        "--activation-checkpointing": cfg.model.activation_checkpointing,
        "--compile": cfg.model.compile,
        "--loss-chunk-size": cfg.model.loss_chunk_size or "auto",
    }


def mixture_fingerprint(spec: str, weights: str) -> str:
    """``NAME=SHARE,...``: the sources and their normalised weights (2,2 is 1,1)."""
    names = [name for name, _ in named_items(spec)]
    values = parse_weights(weights, len(names))
    return ",".join(f"{n}={w / sum(values):.12g}" for n, w in zip(names, values, strict=True))


def _as_recorded(model: str) -> str:
    """A local model folder by its absolute path (``S1/final``, ``./S1/final/`` and the same from
    another working folder are one), a hub id or preset as given."""
    return str(Path(model).expanduser().resolve()) if Path(model).expanduser().is_dir() else model


def read_fingerprint(folder: Path) -> Fingerprint | None:
    path = folder / FINGERPRINT_FILE
    if not path.is_file():
        return None  # saved by an lmtune before fingerprints
    raw = read_json_object(path)
    if not (isinstance(raw.get("fixed"), dict) and isinstance(raw.get("adjustable"), dict)):
        raise UserError(f"{path}: unreadable (not written by lmtune)")
    described = raw.get("described")
    return Fingerprint(
        dict(raw["fixed"]), dict(raw["adjustable"]), described if isinstance(described, dict) else {}
    )


def compare(saved: Fingerprint, now: Fingerprint, folder: Path, step: int | None = None) -> list[str]:
    """The adjustable settings that changed, as ``name old -> new``; ``step``: the checkpoint's (a
    change of the warmup's formula past its warmup changes nothing).

    Raises:
        UserError: naming every fixed setting that differs.
    """

    model = saved.fixed.get("--model")  # as typed by an older lmtune: a folder by its path now
    fixed = saved.fixed | ({"--model": _as_recorded(model)} if isinstance(model, str) else {})
    weights = saved.fixed.get(STARTING_WEIGHTS)  # the same under another name: moved, copied, a hub's
    if weights is not None and weights == now.fixed.get(STARTING_WEIGHTS) and "--model" in now.fixed:
        fixed["--model"] = now.fixed["--model"]
    reference = saved.fixed.get(REFERENCE_WEIGHTS)  # so for the reference (unloaded yet: decided later)
    if (
        reference
        and now.fixed.get("--reference-model")
        and now.fixed.get(REFERENCE_WEIGHTS, reference) == reference
    ):
        fixed["--reference-model"] = now.fixed["--reference-model"]
    refused = _changes(fixed, now.fixed)
    if any(c.startswith("base quantization") for c in refused) or STARTING_WEIGHTS not in now.fixed:
        # A hash that follows from another change listed: the quantization, a reference given now.
        refused = [c for c in refused if not c.startswith(STARTING_WEIGHTS)]
    objective = any(c.startswith("--objective ") for c in refused)
    if objective:
        # Another objective: its own settings that only one side has (an sft checkpoint records no
        # reference) add nothing to that.
        refused = [c for c in refused if c.split()[0] not in _OBJECTIVE_OWN or c.split()[0] in saved.fixed]
    if refused:
        # A hash says that the model or the data differ; the settings behind it say how.
        hashed = any(c.startswith(("training data", "model config")) for c in refused)
        behind = [
            c for c in _changes(saved.described, now.described, both=True) if c.split()[0] not in now.fixed
        ]
        said = f" (of the settings behind them: {'; '.join(behind)})" if hashed and behind else ""
        if any(c.startswith(STARTING_WEIGHTS) for c in refused):
            said += (
                f" (the weights of --model {now.described.get('--model')} changed since the checkpoint: "
                "a LoRA run's frozen base and a preference run's reference are read from there again)"
            )
        if any(c.startswith(REFERENCE_WEIGHTS) for c in refused):
            said += (
                f" (the weights of --reference-model {now.fixed.get('--reference-model')} changed since the "
                "checkpoint: the rest of the run would train against another reference)"
            )
        todo = (
            # Another objective on the weights a run trained (TRL's SFT, then DPO): a new run of them.
            f"To tune the model this checkpoint holds with another objective, start a new run from it: "
            f"--model {folder} (or its run's final/) with another --output-dir"
            if objective
            else "Use the same settings and data, or start afresh with another --output-dir (or --overwrite)"
        )
        raise UserError(
            f"cannot resume from {folder}: this run differs in what defines it: "
            f"{'; '.join(refused)}{said}. {todo}"
        )
    return _changes(*_warmup_compared(saved.adjustable, now.adjustable, step))


def _warmup_compared(
    saved: dict[str, Any], now: dict[str, Any], step: int | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both sides less the cosine warmup's formula where it changes nothing: a side that is not a
    cosine warmup (another schedule, no warmup), or a resume past the saved run's warmup."""
    warming = all(
        side.get("--lr-schedule") == "cosine" and (side.get("warmup steps") or 0) > 0 for side in (saved, now)
    )
    if warming and (step is None or step < saved["warmup steps"]):
        return saved, now
    saved, now = ({k: v for k, v in side.items() if k != COSINE_WARMUP} for side in (saved, now))
    return saved, now


COSINE_WARMUP = "cosine warmup"
# What a setting a checkpoint does not record was: an sft run's names no objective.
_UNRECORDED: dict[str, Any] = {
    "--objective": "sft",
    # An older checkpoint's, which recorded none of these: their defaults.
    "--packing": "auto",
    "--group-by-length": True,
    "--activation-checkpointing": False,
    "--compile": False,
    "--loss-chunk-size": "auto",
    # An older cosine run's warmup reached the learning rate a step sooner.
    COSINE_WARMUP: "(step+1)/warmup",
}
STARTING_WEIGHTS = "starting weights (--model)"
# Checked only where the checkpoint records them: an older one does not.
_IF_RECORDED = (STARTING_WEIGHTS, REFERENCE_WEIGHTS)
_OBJECTIVE_OWN = ("--reference", "--reference-model")


def _changes(a: dict[str, Any], b: dict[str, Any], both: bool = False) -> list[str]:
    """``name old -> new`` for each entry that differs; ``both``: of the entries both sides have."""

    def shown(value: Any) -> str:
        if isinstance(value, bool):  # as the flags and YAML write it, not Python's True
            return str(value).lower()
        return "none" if value is None else one_line(str(value), 80)

    # Both sides' entries: one recorded only by the checkpoint (a quantized base) differs too.
    keys = [k for k in [*b, *(k for k in a if k not in b)] if not both or (k in a and k in b)]
    keys = [k for k in keys if k in a or k not in _IF_RECORDED]
    # Checked once known: the checks before the reference is loaded leave it to the resume itself.
    keys = [k for k in keys if k in b or k != REFERENCE_WEIGHTS]
    return [
        f"{k} {shown(a.get(k, _UNRECORDED.get(k)))} -> {shown(b.get(k, _UNRECORDED.get(k)))}"
        for k in keys
        if a.get(k, _UNRECORDED.get(k)) != b.get(k, _UNRECORDED.get(k))
    ]
