"""bitsandbytes in lmtune: the 8-bit optimizers' import, and the quantized frozen base of QLoRA
(``--load-in-4bit``, ``--load-in-8bit``): loading it quantized, preparing it, measuring it, and
dequantizing it again to merge an adapter.

The base loads quantized tensor by tensor (transformers' on-the-fly bitsandbytes quantization fed
by ``pread`` reads of the safetensors files), so no full-precision copy of the model, and no
memory map of its files, is ever resident: the process's peak is the quantized model plus one
tensor. What bitsandbytes does not quantize (embeddings, norms, the output head) stays fp32, as
every weight of an lmtune run does, so nothing needs the upcast peft's
``prepare_model_for_kbit_training`` would otherwise do.
"""

from __future__ import annotations

import ctypes
import json
import logging
import platform
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lmtune.config.groups import ModelSettings
from lmtune.config.verbosity import RUN_QUIETED_LOGGERS, verbose
from lmtune.errors import UserError
from lmtune.model.precision import low_precision_dtype

QUANTIZED_LAYERS = ("Linear4bit", "Linear8bitLt")
# peft names its LoRA parameters lora_A, lora_B, lora_embedding_A/B, lora_magnitude_vector.
_ADAPTER = re.compile(r"(^|\.)lora_")
DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.uint8: "uint8",
    torch.int8: "int8",
}
PIP = "pip install 'lmtune[memory]' (or bitsandbytes)"


def quiet_bitsandbytes() -> None:
    """bitsandbytes warns on CPU that optional 4-bit matmul kernels are missing (a faster kernel
    package), and at every int8 product that its inputs are cast to fp16 (its design); neither is
    something a user can act on. The int8 notice comes at every product of the run, so it is
    filtered for the run (by its text; lmtune.train puts the filters and levels back as it
    returns: verbosity.run_quiet_restored), unless -v/LMTUNE_VERBOSE=1 asks for everything.
    On an AVX-512 BF16 CPU its import asks the ``kernels`` package for that kernel from the hub,
    which logs, offline, that it skipped the publisher's trust check: the same notice again."""
    if verbose():
        return
    for name in RUN_QUIETED_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="MatMul8bitLt: inputs will be cast")


@dataclass(frozen=True)
class Quantization:
    """How the frozen base is quantized."""

    bits: int  # 4 | 8
    quant_type: str  # nf4 | fp4 (4-bit) | int8
    compute_dtype: torch.dtype  # what a 4-bit layer dequantizes to and multiplies in; merges use it
    storage_dtype: torch.dtype  # the dtype 4-bit values are packed in (FSDP2 gathers it as is)

    @property
    def description(self) -> str:
        """run.json's ``resolved.quantization``: ``nf4, double quant, compute bf16``."""
        if self.bits == 8:
            return "int8 (LLM.int8: int8 weights, fp16 products with outliers kept fp16)"
        text = f"{self.quant_type}, double quant, compute {DTYPE_NAMES[self.compute_dtype]}"
        if self.storage_dtype != torch.uint8:
            text += f", packed in {DTYPE_NAMES[self.storage_dtype]} (for FSDP2)"
        return text

    @property
    def option(self) -> str:
        return f"--load-in-{self.bits}bit"


def quantization_of(settings: ModelSettings, strategy: str) -> Quantization | None:
    """The quantization ``--load-in-4bit``/``--load-in-8bit`` ask for, on ``strategy``; None without.

    Under FSDP2 the 4-bit values are packed in the dtype FSDP2 gathers parameters in (the compute
    dtype), as Answer.AI's FSDP+QLoRA and accelerate do: a packed tensor then shards and gathers
    byte for byte, never cast.
    """
    compute = low_precision_dtype(settings.precision) or torch.float32
    if settings.load_in_4bit:
        storage = compute if strategy == "fsdp" else torch.uint8
        return Quantization(
            bits=4, quant_type=settings.bnb_4bit_quant_type, compute_dtype=compute, storage_dtype=storage
        )
    if settings.load_in_8bit:
        # bitsandbytes multiplies int8 layers in fp16 whatever the input; the compute dtype is the
        # rest of the model's, and what a merge dequantizes to.
        return Quantization(bits=8, quant_type="int8", compute_dtype=compute, storage_dtype=torch.int8)
    return None


def fingerprint_value(settings: ModelSettings) -> str | None:
    """What a checkpoint records of the base's quantization (the compute dtype follows --precision,
    which may change on resume; the quantized values do not)."""
    if settings.load_in_4bit:
        return f"4-bit {settings.bnb_4bit_quant_type}, double quant"
    return "8-bit int8" if settings.load_in_8bit else None


def require_bitsandbytes(option: str, device: torch.device | None = None) -> Any:
    """bitsandbytes, imported quietly; a :class:`UserError` with the pip command when it is missing
    or has no backend for ``device``."""
    quiet_bitsandbytes()
    try:
        import bitsandbytes
    except ImportError as e:
        raise UserError(f"{option} needs bitsandbytes, which is not installed here ({e}); {PIP}") from None
    supported = getattr(bitsandbytes, "supported_torch_devices", {"cuda"})
    if device is not None and device.type not in supported:
        raise UserError(
            f"{option}: bitsandbytes {bitsandbytes.__version__} has no {device.type} backend "
            f"(it supports {', '.join(sorted(supported))}); pip install -U bitsandbytes"
        )
    return bitsandbytes


def return_freed_buffers(device: torch.device) -> bool:
    """On CPU (glibc), serve buffers of 1 MiB and more from their own memory maps, returned to the
    system when freed; whether it was set.

    bitsandbytes dequantizes a quantized layer's whole weight for every product (forward, and again
    in backward), so a step allocates and frees weight-sized buffers by the hundred. glibc serves
    those from its heap once one has been freed (its mmap threshold rises to the largest freed
    block), and the heap, fragmented by the activations allocated between them, stays resident:
    measured on a 113M model, about 120 MiB more peak memory than plain LoRA's activations alone.
    A fixed threshold keeps every such buffer out of the heap (and the activations' large tensors
    too).
    """
    if device.type != "cpu" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_mmap_threshold = -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 1 << 20))


BASE_QUANTIZATION_FILE = "base_quantization.json"  # beside an adapter trained on a quantized base
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def write_base_quantization(folder: Path, q: Quantization | None) -> None:
    """Record beside an adapter (``final/``, a LoRA checkpoint) the quantized base it was trained
    on, so that loading the folder as a model merges it as ``--merge-lora`` does (nothing without)."""
    if q is None:
        return
    record = {"written_by": "lmtune", "bits": q.bits, "quant_type": q.quant_type}
    record["compute_dtype"] = DTYPE_NAMES[q.compute_dtype]
    (folder / BASE_QUANTIZATION_FILE).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def base_quantization(folder: Path) -> Quantization | None:
    """The quantization :func:`write_base_quantization` recorded in ``folder``; None without a record
    (an adapter of a full-precision base, or one lmtune did not write)."""
    path = folder / BASE_QUANTIZATION_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        bits, quant_type, compute = record["bits"], record["quant_type"], _DTYPES[record["compute_dtype"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = f"{type(e).__name__}: {e}"
        raise UserError(
            f"{path}: damaged, not lmtune's record of the adapter's quantized base ({problem})"
        ) from None
    if (bits, quant_type) not in {(4, "nf4"), (4, "fp4"), (8, "int8")}:
        raise UserError(f"{path}: an unknown quantization of the adapter's base ({bits} bits, {quant_type})")
    return Quantization(bits=bits, quant_type=quant_type, compute_dtype=compute, storage_dtype=torch.uint8)


def bnb_config(q: Quantization) -> Any:
    """transformers' ``BitsAndBytesConfig`` for ``q``; the output head is never quantized."""
    from transformers import BitsAndBytesConfig as Config

    BitsAndBytesConfig: Any = Config
    if q.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=q.compute_dtype,
        bnb_4bit_quant_storage=q.storage_dtype,
    )


def load_quantized(
    source: str,
    config: Any,
    q: Quantization,
    device: torch.device,
    *,
    local_only: bool,
    trust_remote_code: bool = False,
) -> nn.Module:
    """The model in ``source`` (a folder or hub id) with its linear layers quantized as it loads.

    Safetensors weights are read tensor by tensor with ``pread`` (no memory map), each quantized
    before the next is read. Other weights (``.bin``) and remote-code models load through
    transformers' own path, which maps the files while it quantizes.
    """
    require_bitsandbytes(q.option, device)
    files = _safetensors_files(source, local_only)
    model_class = _model_class(config)
    common: dict[str, Any] = {
        "dtype": torch.float32,
        "quantization_config": bnb_config(q),
        "device_map": {"": device},
    }
    if files and model_class is not None:
        state = _lazy_state(files)
        model: Any = model_class.from_pretrained(None, config=config, state_dict=state, **common)
        del state
        _copy_generation_config(model, files[0].parent)
        # Loaded from a state dict, the model would not know its source; peft names the adapter's
        # base from it (adapter_config.json's base_model_name_or_path).
        model.name_or_path = source
        model.config._name_or_path = source
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            source,
            local_files_only=local_only,
            use_safetensors=None,
            trust_remote_code=trust_remote_code,
            **common,
        )
    return prepare(model, q)


def quantize_built(model: nn.Module, q: Quantization, device: torch.device) -> nn.Module:
    """A model built in memory (a preset) rebuilt with its linear layers quantized."""
    require_bitsandbytes(q.option, device)
    state = model.state_dict()
    quantized: Any = type(model).from_pretrained(  # type: ignore[attr-defined]
        None,
        config=model.config,
        state_dict=state,
        dtype=torch.float32,
        quantization_config=bnb_config(q),
        device_map={"": device},
    )
    quantized.generation_config = model.generation_config
    quantized.name_or_path = ""  # built from a config, as the preset was: no base to name
    quantized.config._name_or_path = ""
    return prepare(quantized, q)


def prepare(model: nn.Module, q: Quantization) -> nn.Module:
    """Once after loading: the base frozen, every quantized layer able to train, and a model
    bitsandbytes found nothing to quantize in refused.

    bitsandbytes repacks a 4-bit layer's weight for its CPU inference kernel the first time it
    runs in eval mode without gradients (evaluation, samples) on an AVX-512 BF16 CPU; that kernel
    has no backward, so training after an evaluation would silently lose the gradients through the
    base. The repacking is turned off: one kernel for training and evaluation alike.
    """
    layers: list[Any] = [m for m in model.modules() if type(m).__name__ in QUANTIZED_LAYERS]
    if not layers:
        raise UserError(
            f"{q.option}: bitsandbytes quantized no layer of this model (it quantizes torch.nn.Linear "
            "layers, and this architecture has none outside its output head); train it without "
            f"{q.option}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in layers:
        if hasattr(layer, "support_avx512bf16_for_cpu"):
            layer.support_avx512bf16_for_cpu = False
        weight = layer.weight
        if getattr(weight, "quant_state", None) is not None:
            # FSDP2 gathers the packed weight as a plain tensor; the layer recovers its
            # quantization constants from here.
            layer.quant_state = weight.quant_state
    return model


def _safetensors_files(source: str, local_only: bool) -> list[Path]:
    """The model's safetensors files (those its index lists, or the single file); [] when it has
    none (the caller then loads through transformers)."""
    folder = Path(source).expanduser()
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(
                snapshot_download(
                    source, allow_patterns=["*.safetensors", "*.json"], local_files_only=local_only
                )
            )
        except Exception:  # no such repo, no network: transformers' own path gives the clear error
            return []
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _lazy_state(files: list[Path]) -> dict[str, Any]:
    """Every tensor of ``files`` as a slice read on demand (``pread``: nothing is memory-mapped, so
    nothing read stays resident once quantized)."""
    from safetensors import safe_open

    state: dict[str, Any] = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu", backend="pread")
        except TypeError:  # safetensors before 0.6 has only the memory map
            handle = safe_open(str(file), framework="pt", device="cpu")
        names: list[str] = list(handle.keys())  # type: ignore[no-untyped-call]
        state.update({k: handle.get_slice(k) for k in names})  # type: ignore[no-untyped-call]
    return state


def _model_class(config: Any) -> Any:
    """The causal-LM class transformers builds for ``config``; None for remote code."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return None


def _copy_generation_config(model: nn.Module, folder: Path) -> None:
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)  # type: ignore[assignment]


def parameter_count(model: nn.Module, skip: set[int] | None = None) -> int:
    """Parameters of ``model`` (those not in ``skip``, by id), a packed quantized weight counted as
    the [out, in] weight it stands for (its storage holds two or more 4-bit values per element;
    FSDP2 replaces it by a shard, so its layer's shape is what says)."""
    logical = logical_sizes(model)
    skip = skip or set()
    return sum(logical.get(id(p), p.numel()) for p in model.parameters() if id(p) not in skip)


def logical_sizes(model: nn.Module) -> dict[int, int]:
    """The elements each quantized layer's weight stands for ([out, in]), by the weight's id."""
    layers: list[Any] = [m for m in model.modules() if type(m).__name__ in QUANTIZED_LAYERS]
    return {id(m.weight): int(m.in_features * m.out_features) for m in layers}


def base_summary(model: nn.Module, q: Quantization) -> str:
    """One line for the log: what is quantized and what stays fp32, in MiB."""
    quantized, other, _ = footprint(model)
    layers = sum(type(m).__name__ in QUANTIZED_LAYERS for m in model.modules())
    full = 4 * parameter_count(model)
    return (
        f"{q.bits}-bit base ({q.description}): {layers} linear layers in {quantized / 2**20:,.1f} MiB, "
        f"embeddings, norms and head kept fp32 in {other / 2**20:,.1f} MiB "
        f"({(quantized + other) / full:.2f}x the fp32 base's {full / 2**20:,.1f} MiB)"
    )


def footprint(model: nn.Module) -> tuple[int, int, int]:
    """Bytes of the base's quantized layers (packed weights and their constants), of the rest of
    the base, and of LoRA adapters put on it (peft's ``lora_*`` parameters)."""
    quantized = other = adapter = 0
    seen: set[int] = set()
    for module in model.modules():
        # peft's LoRA wrapper of a quantized layer has its class name too, and its weight is its
        # base layer's: counted once, where the weight is a parameter.
        if type(module).__name__ not in QUANTIZED_LAYERS or "weight" not in module._parameters:
            continue
        for p in module.parameters(recurse=False):
            seen.add(id(p))
            if p is module.weight:
                quantized += p.numel() * p.element_size()
            else:
                other += p.numel() * p.element_size()
        state = getattr(module.weight, "quant_state", None) or getattr(module, "quant_state", None)
        quantized += _state_bytes(state)
        scales = getattr(module.weight, "SCB", None)  # 8-bit: one fp32 scale per output row
        if isinstance(scales, torch.Tensor):
            quantized += scales.numel() * scales.element_size()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        if _ADAPTER.search(name):
            adapter += p.numel() * p.element_size()
        else:
            other += p.numel() * p.element_size()
    return quantized, other, adapter


def _state_bytes(state: Any) -> int:
    """Bytes of a 4-bit weight's constants: absmax, code book, offset, and the nested ones."""
    if state is None:
        return 0
    tensors = [getattr(state, k, None) for k in ("absmax", "code", "offset")]
    nested = getattr(state, "state2", None)
    if nested is not None:
        tensors += [getattr(nested, "absmax", None), getattr(nested, "code", None)]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def quantized_bytes(bits: int, rows: int, cols: int) -> int:
    """Bytes of one quantized [rows, cols] linear weight with its constants, as bitsandbytes keeps
    it: 4-bit: half a byte per value, a uint8 absmax per 64-value block, an fp32 absmax per 256 of
    those and the 16- and 256-entry code books; 8-bit: a byte per value and an fp32 scale per row."""
    n = rows * cols
    if bits == 8:
        return n + 4 * rows
    blocks = -(-n // 64)
    return -(-n // 2) + blocks + 4 * -(-blocks // 256) + 4 * (16 + 256) + 4


def dequantized(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with every quantized layer replaced by a ``torch.nn.Linear`` holding its weight
    dequantized to ``dtype`` (the values training multiplied by), kept in fp32 as every weight of
    the rest is, on the CPU, one layer at a time."""
    from transformers.integrations.bitsandbytes import dequantize_bnb_weight

    def exact(tensor: torch.Tensor) -> torch.Tensor:  # dtype's values; fp32 holds them all
        return tensor.detach().to("cpu", dtype).to(torch.float32)

    for name, module in list(model.named_modules()):
        if type(module).__name__ not in QUANTIZED_LAYERS:
            continue
        weight = exact(dequantize_bnb_weight(module.weight, getattr(module, "state", None)))
        linear = nn.Linear(
            module.in_features, module.out_features, bias=module.bias is not None, device="meta"
        )
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if module.bias is not None:
            linear.bias = nn.Parameter(exact(module.bias), requires_grad=False)
        model.set_submodule(name, linear)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # transformers then saves it as a plain model, and lets it be cast
        quantizer.remove_quantization_config(model)
    model.to("cpu", torch.float32)  # a weight left in the compute dtype by loading
    if getattr(model, "config", None) is not None:
        model.config.dtype = torch.float32  # what config.json says the weights are
    return model


def conv1d_restored(model: nn.Module) -> nn.Module:
    """``model``, merged into a :func:`dequantized` base, with each ``nn.Linear`` that stands where
    its architecture has a ``Conv1D`` (GPT-2's; bitsandbytes quantizes those as linear layers, their
    weight transposed) a ``Conv1D`` again: saved as a linear layer's, the weight had the other
    shape, and the model loaded neither in transformers nor in lmtune."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model.config)  # type: ignore[union-attr,no-untyped-call]
    except Exception:  # a model transformers builds only from remote code: no Conv1D of its own
        return model
    for name, module in skeleton.named_modules():
        current = model.get_submodule(name) if isinstance(module, Conv1D) else None
        if isinstance(current, nn.Linear):
            conv = Conv1D(current.out_features, current.in_features)  # type: ignore[no-untyped-call]
            conv.weight = nn.Parameter(current.weight.detach().t().contiguous())
            if current.bias is not None:
                conv.bias = nn.Parameter(current.bias.detach())
            model.set_submodule(name, conv)
    return model
