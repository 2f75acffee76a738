"""LoRA adapters through peft: add them, save them in PEFT format, merge them into the base."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmtune.config.groups import LoraSettings
from lmtune.config.verbosity import BITSANDBYTES_LOGGERS, quiet_calls
from lmtune.errors import SettingError, UserError
from lmtune.model.quantization import Quantization, write_base_quantization

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _peft() -> Any:
    try:
        with quiet_calls(*BITSANDBYTES_LOGGERS):  # some peft versions import bitsandbytes with it
            import peft
    except ImportError as e:
        raise UserError(
            f"--lora needs peft, which is not installed here ({e}); pip install 'lmtune[memory]' (or peft)"
        ) from None
    return peft


def target_modules(settings: LoraSettings) -> str | list[str]:
    """``--lora-target-modules`` as peft takes it: ``all-linear``, or the module names listed."""
    names = [n.strip() for n in settings.target_modules.split(",") if n.strip()]
    return "all-linear" if names == ["all-linear"] else names


def is_target(name: str, target: str) -> bool:
    """Whether the module called ``name`` is one ``target`` names, as peft matches: whole, or its
    dotted end (``self_attn.q_proj``)."""
    return name == target or name.endswith("." + target)


# Models whose out_proj and conv1d peft refuses to adapt (its Mamba check): all-linear leaves them out.
PEFT_MAMBA_MODELS = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})


def add_lora(
    model: nn.Module,
    settings: LoraSettings,
    info: Callable[[str], None] = lambda _: None,
    dropout_given: bool | None = None,
) -> nn.Module:
    """Freeze ``model`` and wrap it with trainable LoRA adapters (a ``PeftModelForCausalLM``).

    ``all-linear`` lets peft find every linear layer of the decoder blocks for this architecture
    (Llama's q/k/v/o and MLP projections, GPT-2's Conv1D c_attn/c_proj/c_fc, BLOOM's fused qkv ...)
    and leaves the output head alone; ``info`` hears what it leaves out or changes for a model
    that peft adapts otherwise. ``dropout_given``: whether the user gave --lora-dropout (None: not
    known, as from Python, where a value other than the default counts as given).
    """
    peft = _peft()
    names = settings.target_modules.strip()
    targets = target_modules(settings)
    exclude = _left_out(model, info) if targets == "all-linear" else None
    config = peft.LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        exclude_modules=exclude,
        task_type="CAUSAL_LM",
    )
    if settings.dropout and _adapts_weights(config, model):
        given = settings.dropout != LoraSettings().dropout if dropout_given is None else dropout_given
        if given:
            raise SettingError(
                "lora_dropout",
                f"--lora-dropout {settings.dropout:g}",
                "peft adapts this model's MoE expert weights (weights, not linear layers) only without "
                "dropout: give --lora-dropout 0, or --lora-target-modules naming linear layers",
            )
        config.lora_dropout = 0.0
    try:
        # peft reads transformers' is_gradient_checkpointing, which warns of its own deprecation.
        with _quiet_peft(), _tied_head_handled():
            wrapped: nn.Module = peft.get_peft_model(model, config)
    except ValueError as e:  # peft's message names the modules it could not find, or why not these
        if isinstance(targets, list) and "not found in the base model" in str(e):
            check_every_target(model, [], targets, names)  # the model's own names say what would match
        raise SettingError("lora_target_modules", f"--lora-target-modules {names}", str(e)) from None
    found: Any = wrapped.peft_config["default"]  # type: ignore[index]
    if exclude and isinstance(found.target_modules, set):
        # peft lists all-linear's layers before it leaves the excluded out: its adapter_config.json
        # would name layers that have no adapter.
        found.target_modules = {t for t in found.target_modules if not any(is_target(t, e) for e in exclude)}
    if isinstance(targets, list):
        adapted = [name for name, m in wrapped.named_modules() if hasattr(m, "lora_A")]
        check_every_target(wrapped, adapted, targets, names)
    if config.lora_dropout != settings.dropout:  # said once the targets are known good
        info(
            "LoRA: no dropout (--lora-dropout 0): peft adapts this model's MoE expert weights only without it"
        )
    if targets == "all-linear" and (experts := _unadapted_experts(wrapped)):
        info(
            f"LoRA: the MoE experts ({experts}: weights, not linear layers) are not adapted, as peft maps "
            "such weights for some models only; the adapter trains the other linear layers"
        )
    return wrapped


def _left_out(model: nn.Module, info: Callable[[str], None]) -> list[str] | None:
    """The modules all-linear must leave out of ``model``, said to ``info``: those peft refuses in
    Mamba-style models, and linear layers whose forward returns more than a tensor (Llama 4's
    router, a tuple), which LoRA's wrapper cannot take."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind in PEFT_MAMBA_MODELS:
        info(f"LoRA: all-linear leaves out {kind}'s out_proj and conv1d, which peft does not adapt there")
        return ["out_proj", "conv1d"]
    # The model's own classes, tried once each on one row of zeros: Falcon's linear layers have a
    # forward of their own too, and return their output (a quantized layer's is peft's to wrap).
    subclasses = {
        type(m): m
        for m in model.modules()
        if isinstance(m, nn.Linear)
        and type(m).forward is not nn.Linear.forward
        and type(m).__module__.startswith("transformers.")
    }
    unwrappable = {cls for cls, m in subclasses.items() if not _returns_a_tensor(m)}
    if not unwrappable:
        return None
    names = ", ".join(sorted(cls.__name__ for cls in unwrappable))
    info(f"LoRA: all-linear leaves out {names}: linear layers whose forward returns more than their output")
    return [name for name, m in model.named_modules() if type(m) in unwrappable]


def _returns_a_tensor(layer: nn.Linear) -> bool:
    weight = layer.weight
    try:
        with torch.no_grad():
            out = layer(torch.zeros(1, layer.in_features, dtype=weight.dtype, device=weight.device))
    except Exception:  # a layer that cannot be tried is left to peft, as before
        return True
    return isinstance(out, torch.Tensor)


def _unadapted_experts(wrapped: nn.Module) -> str:
    """The classes of the modules holding MoE expert weights (3-D) that no adapter reaches, or ""."""
    adapted = {name for name, m in wrapped.named_modules() if hasattr(m, "lora_A")}
    found = {
        type(m).__name__
        for name, m in wrapped.named_modules()
        if _expert_weights(m)
        and not any(a == name or a.startswith(f"{name}.") or name.startswith(f"{a}.") for a in adapted)
    }
    return ", ".join(sorted(found))


def _expert_weights(module: nn.Module) -> list[str]:
    """The names of ``module``'s own fused MoE expert weights: 3-D, and no convolution's (whose
    weight is 3-D too)."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return []
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() == 3]


def _adapts_weights(config: Any, model: nn.Module) -> bool:
    """Whether peft would adapt weights of ``model`` that are no layer of their own (transformers 5's
    fused MoE experts, mapped from the linear layers they were), which it does without dropout only."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # a peft before transformers 5: no such weights
        return False
    converted = copy.deepcopy(config)
    mapping = conversion.get_model_conversion_mapping(model)  # type: ignore[attr-defined,arg-type]
    conversion.convert_peft_config_for_transformers(converted, model=model, conversions=mapping)
    return bool(getattr(converted, "target_parameters", None))


def check_every_target(model: nn.Module, adapted: list[str], targets: list[str], option: str) -> None:
    """peft refuses a list that matches no module (in its own words), and drops a misspelled name
    beside one that matches (``q_proj,v_prj`` adapts q_proj alone): each name must adapt some
    module of ``adapted``; the message names ``model``'s linear layers."""
    missing = [t for t in targets if not any(is_target(n, t) for n in adapted)]
    if missing:
        linear = [
            name
            for name, m in model.named_modules()
            if (isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
            and "lora_" not in name
            and not name.endswith("base_layer")
        ]
        layers = sorted({name.rpartition(".")[2] for name in [*adapted, *linear]})
        # A fused MoE's expert weights are named like the layers they were.
        named = sorted(set(missing) & {w for m in model.modules() for w in _expert_weights(m)})
        experts = f"; {', '.join(named)}: MoE expert weights, which all-linear adapts where peft maps them"
        experts = experts if named else ""
        raise SettingError(
            "lora_target_modules",
            f"--lora-target-modules {option}",
            f"{', '.join(missing)} matched no layer of this model (its linear layers: {', '.join(layers)}; "
            f"all-linear takes those of its blocks){experts}",
        )


def adapter_state(model: nn.Module, state_dict: dict[str, Any] | None = None) -> dict[str, Any]:
    """The adapter's tensors under PEFT's file names (no adapter name in the keys). The embedding
    layers are never saved: lmtune does not grow them under LoRA (a new chat template's tokens are
    refused), and peft's "auto" would copy them whole when an adapter sits on the head, and ask the
    hub whether the base's vocabulary changed at every save."""
    state: dict[str, Any] = _peft().get_peft_model_state_dict(
        model, state_dict=state_dict, save_embedding_layers=False
    )
    return state


def load_adapter_state(model: nn.Module, folder: Path) -> None:
    from safetensors.torch import load_file

    result = _peft().set_peft_model_state_dict(model, load_file(str(folder / ADAPTER_FILE)))
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise UserError(f"{folder / ADAPTER_FILE} does not fit this model's adapters: {unexpected[:3]}")


def save_adapter(
    model: nn.Module, folder: Path, state: dict[str, Any], quantization: Quantization | None = None
) -> None:
    """PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors`` (``PeftModel`` loads it),
    and the base's ``quantization`` (QLoRA) recorded beside them."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config: Any = model.peft_config["default"]  # type: ignore[index]
    config.save_pretrained(str(folder))
    tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    write_base_quantization(folder, quantization)


def merged_model(base: nn.Module, adapter_folder: Path, merge: bool = True) -> nn.Module:
    """``base`` with the adapter saved in ``adapter_folder`` merged into its weights; with ``merge``
    off, beside them (a PeftModel), as training computed with it: merged, a bf16 product rounds the
    sum of base and adapter once instead of each product apart."""
    peft = _peft()
    with _quiet_peft(), _tied_head_handled():
        model = peft.PeftModel.from_pretrained(base, str(adapter_folder))
        untied = _untie_adapted_head(model.get_base_model())
        if not merge:
            return model  # type: ignore[no-any-return]
        merged: nn.Module = model.merge_and_unload()
    # peft froze the base to train the adapter; merged, every weight is the model's own and trains
    # like a freshly loaded model's (a run from an adapter folder without --lora trains them all).
    merged.requires_grad_(True)
    if untied:
        merged.config.tie_word_embeddings = False  # type: ignore[union-attr]
    if (adapter_folder / "generation_config.json").is_file():  # stop tokens set by training
        from transformers import GenerationConfig

        merged.generation_config = GenerationConfig.from_pretrained(adapter_folder)  # type: ignore[assignment]
    return merged


@contextmanager
def _quiet_peft() -> Iterator[None]:
    """:func:`quiet_calls` around peft, which also warns that the rank and alpha patterns it adds
    for a MoE's experts (doubling a fused gate_up_proj's rank, for adapters of transformers 4)
    match nothing in an adapter of transformers 5: true and harmless; nor that it sets
    fan_in_fan_out for GPT-2's Conv1D layers, as it should. peft imports bitsandbytes where it
    first builds an adapter layer (not on its own import): its missing-kernel notice, which names
    a ``trust_remote_code`` that is not lmtune's, came on every LoRA run."""
    with quiet_calls(*BITSANDBYTES_LOGGERS), warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"The following (rank|alpha)_pattern keys", RuntimeWarning)
        warnings.filterwarnings("ignore", r"fan_in_fan_out is set to False", UserWarning)
        yield


@contextmanager
def _tied_head_handled() -> Iterator[None]:
    """peft's warnings about an adapter on a head tied to the input embeddings, not shown: the
    adapter trains the head's product only (peft's default), and merged_model unties the head."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*tie_word_embeddings")
        yield


def _untie_adapted_head(base: nn.Module) -> bool:
    """Give the output head its own copy of a weight it shares with the input embeddings when an
    adapter sits on either. The adapter changed that layer's product only (peft adapts the input
    lookup or the head's product, never the shared weight); merged into the shared weight it would
    change the other layer too, and the merged model would not compute what base and adapter did."""
    get_head, get_embed = (
        getattr(base, "get_output_embeddings", None),
        getattr(base, "get_input_embeddings", None),
    )
    if not callable(get_head) or not callable(get_embed):
        return False
    layers = [get_head(), get_embed()]
    if not all(isinstance(layer, nn.Module) for layer in layers):
        return False
    # a peft LoRA layer wraps the layer it adapts
    inner = [getattr(layer, "base_layer", None) for layer in layers]
    if inner == [None, None]:
        return False
    head, embed = (own if isinstance(own, nn.Module) else one for own, one in zip(inner, layers, strict=True))
    shared = head.weight
    if not isinstance(shared, nn.Parameter) or shared is not embed.weight:
        return False
    head.weight = nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad)
    return True
