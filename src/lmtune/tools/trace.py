"""The fake trace behind `lmtune plan`: what autograd saves for the backward pass of a model
built from its config under ``FakeTensorMode`` (tensors with shapes, dtypes and a device but no
storage), so nothing of the model is allocated, with the kernels and autocast rules of the device.
The model traces as it trains: with LoRA, peft's adapters beside a frozen base; with a quantized
base, bitsandbytes' layers; dropout as lmtune's keyed dropout saves it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lmtune.config.groups import LoraSettings
from lmtune.model.lora import is_target, target_modules
from lmtune.model.precision import low_precision_dtype
from lmtune.parallel.wrap import decoder_blocks


@dataclass(frozen=True)
class Saved:
    """Bytes autograd saves for the backward pass: in all, vocab-wide, and of the low-precision
    copies autocast makes of the weights for the products."""

    total: int
    wide: int = 0
    casts: int = 0

    def minus(self, other: Saved) -> Saved:
        return Saved(self.total - other.total, self.wide - other.wide, self.casts - other.casts)


@contextmanager
def fake_device(device: str) -> Iterator[None]:
    """Tensors with shape, dtype and device but no storage: nothing is allocated or initialised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), torch.device(device):
        yield


def fake_model(config: Any) -> torch.nn.Module:
    """Call inside :func:`fake_device`."""
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    return model


def lora_targets(model: torch.nn.Module, lora: LoraSettings) -> list[tuple[str, int, int]]:
    """(name, in, out) of every linear layer LoRA would adapt: as peft's all-linear, those in the
    decoder blocks; or those named by --lora-target-modules (a name or its dotted end, as peft
    matches them)."""
    names = target_modules(lora)
    in_blocks = {id(m) for b in decoder_blocks(model) for m in b.modules()}
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or weight.ndim != 2 or type(module).__name__ not in ("Linear", "Conv1D"):
            continue
        wanted = id(module) in in_blocks if names == "all-linear" else any(is_target(name, n) for n in names)
        if wanted:
            rows, cols = weight.shape
            # GPT-2's Conv1D stores the weight as [in, out], nn.Linear as [out, in].
            found.append((name, rows, cols) if type(module).__name__ == "Conv1D" else (name, cols, rows))
    return found


def quantizable_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers transformers' bitsandbytes integration quantizes: every linear layer (GPT-2's
    Conv1D too) but the output head."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return [
        m
        for m in model.modules()
        if m is not head
        and getattr(m, "weight", None) is not None
        and type(m).__name__ in ("Linear", "Conv1D")
    ]


class _Casts(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the copies made of the parameters (autocast's casts of the weights, trainable or
    frozen), kept alive so that no later tensor takes one's id."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.params = params
        self.copies: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args and id(args[0]) in self.params:
            self.copies[id(out)] = out
        return out


class _Packed(torch.autograd.Function):
    """A quantized layer's product as bitsandbytes computes it: in the compute dtype, the result
    cast back to the input's dtype, and only the (packed) weight saved for the backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor:
        ctx.save_for_backward(weight)
        b = None if bias is None else bias.to(dtype)
        return F.linear(x.to(dtype), weight.to(dtype), b).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:  # a trace never runs the backward
        raise NotImplementedError


class _TokenDropout(torch.nn.Module):
    """What lmtune's KeyedDropout saves in training: on token activations the kept-and-scaled mask
    in the activation's dtype (``nn.Dropout`` on a GPU would save a one-byte mask instead)."""

    def __init__(self, p: float, tokens: tuple[int, int]) -> None:
        super().__init__()
        self.p, self.tokens = p, tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[:-1]) != self.tokens:
            return F.dropout(x, self.p, True)
        return x * torch.empty_like(x)


def _token_dropout(model: torch.nn.Module, tokens: tuple[int, int]) -> None:
    """Every ``nn.Dropout`` that draws as a :class:`_TokenDropout` (see lmtune.model.dropout)."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    for name, module in found:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, _TokenDropout(module.p, tokens))


def _adapt(model: torch.nn.Module, lora: LoraSettings, quantized: bool, dtype: torch.dtype) -> None:
    """Make the fake model trace as peft's LoRA model trains: the base frozen, each target layer's
    output plus ``B(A(dropout(x)))`` (as peft's ``lora.Linear.forward``); with ``quantized``, its
    linear layers multiplied as bitsandbytes does (:class:`_Packed`)."""
    for param in model.parameters():
        param.requires_grad_(False)
    if quantized:
        for module in quantizable_modules(model):
            conv = type(module).__name__ == "Conv1D"  # GPT-2's: weight [in, out], x @ w + b

            def packed(x: torch.Tensor, m: Any = module, conv: bool = conv) -> torch.Tensor:
                weight = m.weight.t() if conv else m.weight
                out: torch.Tensor = _Packed.apply(x, weight, m.bias, dtype)  # type: ignore[no-untyped-call]
                return out

            module.forward = packed  # type: ignore[method-assign]
    modules = dict(model.named_modules())
    for name, inputs, outputs in lora_targets(model, lora):
        module = modules[name]
        down = torch.nn.Linear(inputs, lora.rank, bias=False)
        up = torch.nn.Linear(lora.rank, outputs, bias=False)
        drop = torch.nn.Dropout(lora.dropout) if lora.dropout > 0 else torch.nn.Identity()
        parts = torch.nn.ModuleList([down, up, drop])  # the dropout replaced later: read at call time
        module.add_module("lora_trace", parts)

        def adapted(x: torch.Tensor, base: Any = module.forward, parts: Any = parts) -> torch.Tensor:
            out: torch.Tensor = base(x)
            a, b, dropout = parts
            delta: torch.Tensor = b(a(dropout(x.to(a.weight.dtype))))  # peft casts x to A's dtype
            return (out + delta * (lora.alpha / lora.rank)).to(out.dtype)

        module.forward = adapted  # type: ignore[method-assign]


def saved_bytes(
    config: Any,
    precision: str,
    length: int,
    device: str,
    rows: int = 1,
    lora: LoraSettings | None = None,
    quantized: bool = False,
) -> Saved:
    """What autograd saves for the backward of ``rows`` rows of ``length`` tokens: of the model, or
    with ``lora`` its adapters beside a frozen base (``quantized``: packed as bitsandbytes does)."""
    from lmtune.model.loss import token_loss_sum

    dtype = low_precision_dtype(precision)
    with fake_device(device):
        model = fake_model(config)
        if lora is not None:
            _adapt(model, lora, quantized, dtype or torch.float32)
        _token_dropout(model, (rows, length))
        model.train()
        params = {id(p) for p in model.parameters()}
        casts = _Casts(params)
        saved: dict[int, tuple[int, bool, bool]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(t) in params or id(base) in params:
                return t
            shape = tuple(base.shape)
            # The attention mask: transformers builds one here that an unpadded run does not have;
            # padded and packed runs pay for theirs separately (see _mask_bytes).
            if len(shape) == 4 and shape[-1] == shape[-2] == length and shape[1] == 1 and shape[0] <= rows:
                return t
            wide = bool(shape) and shape[-1] == config.vocab_size
            saved[id(base)] = (base.numel() * base.element_size(), wide, id(base) in casts.copies)
            return t

        ids = torch.zeros(rows, length, dtype=torch.long)
        with (
            torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            casts,
        ):
            token_loss_sum(model(input_ids=ids, use_cache=False).logits, ids)
    values = saved.values()
    return Saved(
        total=sum(b for b, _, _ in values),
        wide=sum(b for b, wide, cast in values if wide and not cast),
        casts=sum(b for b, _, cast in values if cast),
    )


def cut_layers(config: Any, layers: int) -> Any:
    """The same architecture with only ``layers`` decoder blocks."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = layers
    types = getattr(small, "layer_types", None)
    if types:  # cut, or (for a cut of a cut) continued in the same pattern
        small.layer_types = [types[i % len(types)] for i in range(layers)]
    return small
