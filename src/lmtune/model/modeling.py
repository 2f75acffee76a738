"""Load a causal LM and its tokenizer from a preset, a local folder or the Hugging Face hub."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmtune.config.environment import hub_offline, hub_reachable
from lmtune.config.files import read_json_object
from lmtune.config.verbosity import no_progress_bars
from lmtune.errors import UserError, brief
from lmtune.model.architecture import check_causal, complete, load_error, reason
from lmtune.model.configs import CONFIG_BYTES, check_config, check_folder
from lmtune.model.names import looks_like_path, near_folder, run_preset
from lmtune.model.quantization import (
    BASE_QUANTIZATION_FILE,
    DTYPE_NAMES,
    Quantization,
    base_quantization,
    conv1d_restored,
    dequantized,
    load_quantized,
    quantize_built,
)

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"


@dataclass(frozen=True)
class Preset:
    """A small Llama-style architecture built offline, with a byte-level tokenizer."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    lr: float


# Presets are trained from scratch, so their default learning rate is far above a fine-tuning one.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, max_positions=1024, lr=1e-3
    ),
    "small": Preset(
        hidden_size=512, intermediate_size=1376, num_layers=6, num_heads=8, max_positions=2048, lr=5e-4
    ),
    # ~100M parameters: large enough that matrix products dominate a step even with bf16 matrix
    # units (AMX) on a CPU, as they do for the models people fine-tune.
    "medium": Preset(
        hidden_size=1024, intermediate_size=2816, num_layers=8, num_heads=16, max_positions=2048, lr=3e-4
    ),
}
FINETUNE_LR = 2e-5


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    default_lr: float
    source: str
    quantization: Quantization | None = None  # the frozen base's (QLoRA), None in full precision


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table that byte-level BPE uses."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> Any:
    """A tokenizer with one token per byte (id == byte value) plus pad, bos and eos.

    It needs no download, round-trips any UTF-8 text, and saves as a normal ``tokenizer.json``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    for special in (PAD, BOS, EOS):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    bos_id = vocab[BOS]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, model_max_length=1 << 20
    )


def build_preset(name: str, seed: int) -> LoadedModel:
    """Build a preset model with seeded weights, so the same seed gives the same model."""
    from transformers import LlamaForCausalLM

    p = PRESETS[name]
    tok = byte_tokenizer()
    config = preset_config(name, tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return LoadedModel(model=model, tokenizer=tok, default_lr=p.lr, source=f"preset {name}")


def preset_config(name: str, tok: Any) -> Any:
    from transformers import LlamaConfig

    p = PRESETS[name]
    return LlamaConfig(
        vocab_size=len(tok),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_layers,
        num_attention_heads=p.num_heads,
        num_key_value_heads=p.num_heads,
        max_position_embeddings=p.max_positions,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=True,
    )


def load_config(name: str, trust_remote_code: bool = False, *, fits_memory: bool = False) -> Any:
    """Only the model's config (no weights): for planning memory before anything is loaded. Its
    sizes are checked (and, with ``fits_memory``, that the model fits this machine's memory)."""
    if name in PRESETS:
        return preset_config(name, byte_tokenizer())
    base = _adapter_base(name)
    if base is not None:  # training starts from base and adapter merged: the base's shapes
        return load_config(base, trust_remote_code, fits_memory=fits_memory)
    where = _source(name, need_config=True)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            where.source, trust_remote_code=trust_remote_code, local_files_only=where.local_only
        )
    except Exception as e:  # transformers checks types with errors of its own kinds
        raise load_error(name, where.tried, e, PRESETS) from None
    check_config(config.to_dict(), f"--model {name}: config.json", fits_memory=fits_memory)
    check_causal(name, config)
    return config


def no_such_folder(name: str, option: str = "--model") -> UserError | None:
    """The error for a model ``name`` written as a path (``./x``, ``a/b/c``, ``x/``) that is not
    there, else None (a preset, a hub id, or a folder)."""
    if looks_like_path(name) and not Path(name).expanduser().exists():
        return UserError(f"{option} {name}: no such folder (presets: {', '.join(PRESETS)})")
    return None


@dataclass(frozen=True)
class _Where:
    source: str  # what from_pretrained gets
    tried: str  # how an error describes it
    local_only: bool  # the hub is out of reach: read the local cache only


def _source(name: str, need_config: bool) -> _Where:
    """Where ``name`` loads from, and how to describe that in an error."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UserError(f"--model {name}: not a folder (a model is a folder with config.json)")
        if need_config and not (path / "config.json").is_file():
            final = path / "final"  # a run's folder: its model is there
            ran = any((final / f).is_file() for f in ("config.json", "adapter_config.json"))
            run = f"; a run's folder? Its model is --model {final}" if ran else ""
            raise UserError(f"--model {name}: folder has no config.json, so it is not a model folder{run}")
        check_folder(path, f"--model {name}")
        if (path / "config.json").is_file():  # before transformers reads it: a clear message
            raw = read_json_object(path / "config.json", limit=CONFIG_BYTES, follow_links=True)
            check_config(raw, f"--model {name}: config.json", fits_memory=False)
        # Absolute: transformers records it as the model's name, which a LoRA adapter keeps as
        # its base, so the adapter loads from any directory.
        return _Where(str(path.resolve()), f"local folder {path}", local_only=True)
    if (missing_folder := no_such_folder(name)) is not None:
        raise missing_folder
    # "run/final" of a run that has not finished reads as a hub id: say the folder is not there.
    first = Path(name.split("/")[0]).expanduser()
    missing = f"; no folder {name} here, though {first} is one" if "/" in name and first.is_dir() else ""
    if missing and (near := near_folder(first, name.split("/", 1)[1])):
        missing += f": did you mean {near}?"
    if hub_reachable():
        return _Where(name, f"hub id {name}{missing}", local_only=False)
    # Without this, the hub client retries for most of a minute before saying the same.
    why = "HF_HUB_OFFLINE is set" if hub_offline() else "the hub is out of reach"
    return _Where(name, f"hub id {name} ({why}, so only the local cache{missing})", local_only=True)


# The files a tokenizer is saved as: tokenizers' own, or a slow tokenizer's vocabulary.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def _no_tokenizer(name: str, folder: Path) -> UserError:
    return UserError(
        f"--model {name}: the folder has no tokenizer (none of {', '.join(TOKENIZER_FILES[:3])}, ...); "
        f"save the tokenizer of the model it came from into it: "
        f"AutoTokenizer.from_pretrained(BASE).save_pretrained('{folder}')"
    )


def load_model(
    name: str,
    seed: int,
    trust_remote_code: bool = False,
    quantization: Quantization | None = None,
    device: torch.device | None = None,
    merge_adapter: bool = True,
) -> LoadedModel:
    """Load a model and tokenizer by preset name, local folder or hub id; a LoRA adapter folder
    loads into its base, merged unless ``merge_adapter`` is off.

    Weights load from safetensors when the folder has them; ``trust_remote_code`` stays off unless
    the user turns it on. With ``quantization`` the linear layers load quantized, straight onto
    ``device`` (default: the CPU). A missing folder or an unreachable hub id is a
    :class:`UserError` that names what was tried.
    """
    target = device or torch.device("cpu")
    if name in PRESETS:
        built = build_preset(name, seed)
        if quantization is not None:
            built.model = quantize_built(built.model, quantization, target)
            built.quantization = quantization
        return built
    base = _adapter_base(name)
    if base is not None:
        if quantization is not None:
            raise UserError(
                f"--model {name}: a LoRA adapter folder; {quantization.option} quantizes a full model, so "
                "give the merged model folder (final/merged) instead"
            )
        if base in PRESETS and (preset := run_preset(Path(name).expanduser(), PRESETS)) is not None:
            seed = preset[1]  # a preset's weights are its seed's: the run's, not this command's
        return _merged_adapter(name, base, seed, trust_remote_code, merge_adapter)
    # A quantized base is checked against memory by plan's account of it, not as fp32 weights.
    config = load_config(name, trust_remote_code, fits_memory=quantization is None)
    where = _source(name, need_config=True)
    tokenizer = load_tokenizer(name, trust_remote_code)
    if quantization is not None:
        _check_not_quantized(name, config, quantization)
        model = _loaded(
            name,
            where,
            lambda: load_quantized(
                where.source,
                config,
                quantization,
                target,
                local_only=where.local_only,
                trust_remote_code=trust_remote_code,
            ),
        )
        return LoadedModel(
            model=model,
            tokenizer=tokenizer,
            default_lr=FINETUNE_LR,
            source=where.source,
            quantization=quantization,
        )
    from transformers import AutoModelForCausalLM

    model = _loaded(
        name,
        where,
        lambda: complete(
            name,
            AutoModelForCausalLM.from_pretrained(
                where.source,
                config=config,
                trust_remote_code=trust_remote_code,
                dtype=torch.float32,
                use_safetensors=None,
                local_files_only=where.local_only,
                output_loading_info=True,
            ),
        ),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, default_lr=FINETUNE_LR, source=where.source)


def merged_into_base(
    name: str,
    seed: int,
    adapter_folder: Path,
    *,
    trust_remote_code: bool,
    quantization: Quantization | None,
    device: torch.device | None = None,
) -> tuple[nn.Module, str]:
    """The base model ``name`` with the LoRA adapter saved in ``adapter_folder`` merged in, and what
    it was merged into, for the log.

    A quantized base is loaded quantized again onto ``device`` (the same values training saw) and
    dequantized to the compute dtype, one layer at a time onto the CPU; the adapter merges into
    that. Merging into the 4-bit weights instead would round most of the update away.
    """
    from lmtune.model.lora import merged_model

    q = quantization
    base = _base_to_merge_into(name, seed, trust_remote_code, q, device)
    if q is None:
        return merged_model(base, adapter_folder), "the base model"
    kept = "'s values, kept in fp32" if q.compute_dtype != torch.float32 else ""
    what = f"the {q.bits}-bit base dequantized to {DTYPE_NAMES[q.compute_dtype]}{kept}"
    merged = conv1d_restored(merged_model(base, adapter_folder))
    return merged, f"{what} (the weights the adapter was trained on)"


def _base_to_merge_into(
    name: str, seed: int, trust_remote_code: bool, q: Quantization | None, device: torch.device | None
) -> nn.Module:
    """The base model ``name`` as an adapter trained on it saw it: quantized again onto ``device``
    and dequantized to the compute dtype where ``q`` says so (QLoRA), else as it is."""
    loaded = load_model(name, seed, trust_remote_code, q, device if q is not None else None)
    return dequantized(loaded.model, q.compute_dtype) if q is not None else loaded.model


def merge_device() -> torch.device | None:
    """Where a quantized base loads to be merged: the GPU when there is one (bitsandbytes' own
    device), else the CPU (None)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def _merged_adapter(name: str, base: str, seed: int, trust_remote_code: bool, merge: bool) -> LoadedModel:
    """The LoRA adapter folder ``name`` merged into ``base``, the model it names: into the base
    quantized and dequantized again where the adapter was trained on a quantized base (QLoRA), the
    values training saw, as ``--merge-lora`` merges it."""
    from lmtune.model.lora import merged_model

    folder = Path(name).expanduser()
    q = base_quantization(folder)
    try:
        into = _base_to_merge_into(base, seed, trust_remote_code, q, merge_device())
    except UserError as e:
        trained_on = f", {q.bits}-bit as the adapter trained on it ({BASE_QUANTIZATION_FILE})" if q else ""
        raise UserError(f"--model {name}: its base model (adapter_config.json){trained_on}: {e}") from None
    merged = merged_model(into, folder, merge)
    merged = conv1d_restored(merged) if q is not None and merge else merged
    return LoadedModel(
        model=merged,
        tokenizer=load_tokenizer(name, trust_remote_code),
        default_lr=FINETUNE_LR,
        # The loss of a QLoRA adapter is its quantized base's: said, so it is not read as the full model's.
        source=f"{base}{f' ({q.bits}-bit {q.quant_type}, as trained)' if q else ''} + adapter {name}",
    )


def _loaded(name: str, where: _Where, load: Callable[[], nn.Module]) -> nn.Module:
    """``load()``, its failure worded as a :class:`UserError` naming the model; transformers'
    per-load progress bar off, from Python as from the CLI (the start line says what was loaded)."""
    try:
        with no_progress_bars():
            return load()
    except UserError:
        raise
    except Exception as e:  # a truncated weights file, weights that do not fit the config, ...
        if "mismatched" in str(e):  # transformers' own text points at a report it logged
            e = ValueError("its weights do not have the shapes its config.json describes")
        raise load_error(name, where.tried, e, PRESETS) from None


def _check_not_quantized(name: str, config: Any, quantization: Quantization) -> None:
    """A model saved already quantized (GPTQ, AWQ, bitsandbytes ...) is not quantized again."""
    existing = getattr(config, "quantization_config", None)
    if existing is not None:
        method = existing.get("quant_method") if isinstance(existing, dict) else existing.quant_method
        raise UserError(
            f"--model {name}: its weights are already quantized ({method}); {quantization.option} "
            "quantizes a full-precision model, so give the original model"
        )


def model_description(name: str) -> str:
    """What ``--model name`` loads, for a tool's output: an adapter folder names its base."""
    base = _adapter_base(name)
    return (
        name if base is None else f"{name} (a LoRA adapter, merged into its base {base}, as train loads it)"
    )


def is_adapter_folder(name: str) -> bool:
    """Whether ``name`` is a LoRA adapter folder (PEFT format): a LoRA run's final/, or its training
    checkpoint (its manifest.json; the base's config.json beside the adapter is for `export`)."""
    path = Path(name).expanduser()
    checkpoint = (path / "manifest.json").is_file()
    return (path / "adapter_config.json").is_file() and (checkpoint or not (path / "config.json").is_file())


def _adapter_base(name: str) -> str | None:
    """The base model of a LoRA adapter folder (PEFT format, as lmtune's final/), or None.

    The base must be there and must not be an adapter itself (an adapter naming itself, or a chain
    of adapters, would recurse)."""
    path = Path(name).expanduser()
    if not is_adapter_folder(name):
        return None
    check_folder(path, f"--model {name}")
    base = read_json_object(path / "adapter_config.json", follow_links=True).get("base_model_name_or_path")
    if not base and (preset := run_preset(path, PRESETS)) is not None:
        return preset[0]  # built with the run's seed (load_model)
    if not base:
        merged = path / "merged"
        instead = (
            f"{merged}, beside it"
            if (merged / "config.json").is_file()
            else "`lmtune export RUN/checkpoints/step-N DIR --merge-lora` writes it for a finished run "
            "(training with --merge-lora writes final/merged)"
        )
        raise UserError(
            f"--model {name}: a LoRA adapter folder that names no base model (trained on a preset), "
            f"away from its run's run.json, which names the preset; use the merged model instead: {instead}"
        )
    if not isinstance(base, str) or "\0" in base:
        raise UserError(f"--model {name}: adapter_config.json's base_model_name_or_path is {brief(base)}")
    base_path = Path(base).expanduser()
    if base_path.exists() and (base_path / "adapter_config.json").is_file():
        raise UserError(
            f"--model {name}: the adapter's base model {base} is an adapter folder itself; "
            "name a full model as the base (adapter_config.json's base_model_name_or_path)"
        )
    if not base_path.exists() and base not in PRESETS and looks_like_path(base):
        raise UserError(
            f"--model {name}: the adapter's base model {base} (adapter_config.json's "
            "base_model_name_or_path) is not there; put the base model there or edit that entry"
        )
    return base


def load_tokenizer(name: str, trust_remote_code: bool = False) -> Any:
    """Only the tokenizer of a preset, folder or hub id: for tools that never need the weights."""
    if name in PRESETS:
        return byte_tokenizer()
    where = _source(name, need_config=False)
    folder = Path(where.source)
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise _no_tokenizer(name, folder)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            where.source, trust_remote_code=trust_remote_code, local_files_only=where.local_only
        )
    except Exception as e:  # transformers checks types with errors of its own kinds
        if not folder.is_dir():
            raise load_error(name, where.tried, e, PRESETS) from None
        # transformers' text never says that it was the tokenizer that failed.
        raise UserError(
            f"--model {name}: could not load its tokenizer from {where.tried}: {reason(e)}"
        ) from None
    ensure_pad_token(tokenizer)
    return tokenizer


def ensure_pad_token(tokenizer: Any) -> None:
    """Give the tokenizer a pad token: many causal LMs ship without one.

    Reusing EOS is safe because labels are masked from the attention mask, never by token id, so a
    real EOS keeps its label.
    """
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise UserError("the tokenizer has neither a pad nor an EOS token; cannot batch examples")
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no EOS token, so the model could not learn to stop")
