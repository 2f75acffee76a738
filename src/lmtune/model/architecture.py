"""What a --model must be for lmtune to train it as its config says: a causal language model
whose weights are all there. Refusals, and transformers' load errors, worded for the user."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from torch import nn

from lmtune.errors import UserError, brief

# Encoders with a causal-LM class in transformers that attends both ways unless is_decoder is set:
# trained as a causal LM, each token saw the ones it predicts.
ENCODERS = (
    "bert",
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "camembert",
    "electra",
    "ernie",
    "data2vec-text",
    "rembert",
    "roformer",
    "megatron-bert",
    "bert-generation",
    "big_bird",
    "xmod",
)


def check_causal(name: str, config: Any) -> None:
    """Refuse a model that is not a causal (decoder-only) language model: an encoder-decoder
    (T5, BART: transformers' causal class of BART drops its encoder) or an encoder."""
    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UserError(
            f"--model {name}: an encoder-decoder model ({kind}); lmtune fine-tunes causal (decoder-only) "
            "language models"
        )
    if kind in ENCODERS and not getattr(config, "is_decoder", False):
        raise UserError(
            f"--model {name}: an encoder ({kind}), whose attention looks both ways; lmtune fine-tunes causal "
            "language models (such a model trains as one only with is_decoder: true in its config.json)"
        )


def complete(name: str, loaded: Any) -> nn.Module:
    """The model ``from_pretrained(..., output_loading_info=True)`` loaded, refused where weights
    it needs were not in the checkpoint: transformers starts them random with a warning lmtune's
    quiet logging hid, and the run trained from them without a word."""
    model, info = loaded
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise UserError(
            f"--model {name}: its weights lack {len(missing)} the model needs ({_first(missing)}), which "
            "would start random: a damaged or partial checkpoint, or a base model saved without its "
            "language-model head"
        )
    # Said now, naming the weight: at the first step it was only "non-finite loss".
    broken = next(
        (n for n, t in model.named_parameters() if t.is_floating_point() and not t.isfinite().all()), None
    )
    if broken is not None:
        raise UserError(
            f"--model {name}: its weights hold NaN or infinite values (the first: {broken}); a damaged "
            "checkpoint"
        )
    return model  # type: ignore[no-any-return]


def _first(names: Collection[str], shown: int = 3) -> str:
    listed = list(names)[:shown]
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(listed) + more


def reason(e: Exception) -> str:
    """transformers' error in a line: its first may only say which field; the second says what is
    wrong with it."""
    lines = [" ".join(line.split()) for line in str(e).strip().splitlines()[:2]]
    return brief(": ".join(line for line in lines if line), 200).strip("'\"") or type(e).__name__


def load_error(name: str, tried: str, e: Exception, presets: Collection[str]) -> UserError:
    """A failed load of ``--model name`` as the user's error, saying what to do where it can."""
    text = str(e)
    if "trust_remote_code" in text or "custom code" in text:
        return UserError(
            f"--model {name}: its config names code of its own (auto_map), which runs only with "
            "--trust-remote-code (it runs as you: read it first)"
        )
    if "deserializing header" in text:  # safetensors' words for a file cut short or not one
        files = sorted(p.name for p in Path(name).expanduser().glob("*.safetensors"))
        return UserError(
            f"--model {name}: a weights file ({', '.join(files) or 'safetensors'}) is damaged or incomplete "
            f"(a download or copy cut short?): {reason(e)}"
        )
    if "Unrecognized configuration class" in text:
        return UserError(f"--model {name}: transformers has no causal language model of its kind")
    folder = Path(name).expanduser()
    if folder.is_dir():  # a folder it is: what it holds is the problem
        # A training checkpoint (its manifest.json) holds training state, not a model folder.
        # transformers' reason (no model.safetensors in an FSDP one) would only be noise before it.
        if (folder / "manifest.json").is_file() and (folder / "trainer.json").is_file():
            return UserError(
                f"--model {name}: a training checkpoint, not a model folder: `lmtune export {name} DIR` "
                "writes a model folder from it"
            )
        return UserError(f"--model {name}: could not load the local folder: {reason(e)}")
    # Offline, transformers' own words (a URL, cut mid-sentence at 200 characters) say only this.
    offline = "offline mode" in text or "couldn't connect" in text.lower()
    return UserError(
        f"--model {name}: could not load it as a preset ({', '.join(presets)}), a local folder, "
        f"or {tried}: {'not in the local cache' if offline else reason(e)}"
    )
