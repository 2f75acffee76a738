"""Matrix products of a CPU bf16 run: PyTorch's bf16 kernels, or fp32 products of bf16 operands
where those measure faster.

On a CPU without bf16 matrix instructions (no AVX-512 BF16, no AMX) PyTorch multiplies bf16
tensors in reference loops: 1-19 GFLOP/s depending on the operands' layout, against 120-170 in
fp32 on the same 2 cores (the backward's ``grad @ W`` took the 1 GFLOP/s layout), so a bf16 step
ran ~30x slower than an fp32 one. Rounding the operands to bf16, multiplying in fp32 and rounding
the product to bf16 is what bf16 matrix hardware computes (exact bf16 inputs, fp32 accumulation,
a bf16 result), so the run keeps bf16's numerics and memory and gets fp32's speed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lmtune.errors import UserError

PRODUCTS_ENV = "LMTUNE_CPU_PRODUCTS"  # auto | fp32 | bf16: overrides the measured choice


@dataclass(frozen=True)
class Products:
    """How a run multiplies matrices (run.json's ``resolved.products``)."""

    fp32: bool  # bf16 operands multiplied in fp32 (see the module docstring)
    description: str


def choose_products(precision: str, device: torch.device, compiled: bool = False) -> Products:
    """fp32 products for a CPU bf16 run where PyTorch's bf16 products are slower on this CPU;
    the precision's own kernels everywhere else (GPUs, fp32 and fp16, ``--compile`` runs, whose
    graphs are traced without this interception)."""
    if device.type != "cpu" or precision != "bf16" or compiled:
        return Products(False, precision)
    forced = os.environ.get(PRODUCTS_ENV, "auto")
    if forced not in ("auto", "fp32", "bf16"):
        raise UserError(f"{PRODUCTS_ENV}={forced!r}: expected auto, fp32 or bf16")
    if forced != "auto":
        return _products(forced == "fp32", f"set by {PRODUCTS_ENV}")
    if not _bf16_matrix_instructions():  # PyTorch's bf16 products then take its reference kernels
        return _products(True, "this CPU has no bf16 matrix instructions")
    bf16, fp32 = (_linear_seconds(upcast) for upcast in (False, True))
    return _products(fp32 < bf16, f"measured: bf16 {bf16 * 1e3:.1f} ms, fp32 {fp32 * 1e3:.1f} ms")


def _bf16_matrix_instructions() -> bool:
    """Whether PyTorch's oneDNN runs bf16 products on this CPU (else they run in reference loops)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _products(fp32: bool, why: str) -> Products:
    what = "fp32 products of bf16-rounded operands" if fp32 else "bf16"
    return Products(fp32, f"{what} ({why})")


def _linear_seconds(upcast: bool, size: int = 512) -> float:
    """A linear layer's forward and backward under bf16 autocast: the best of three, after one."""
    x = torch.randn(size, size, requires_grad=True)
    w = torch.randn(size, size, requires_grad=True)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Products() if upcast else nullcontext():
            out = F.linear(x, w)
        out.float().sum().backward()  # type: ignore[no-untyped-call]
        times.append(time.perf_counter() - start)
    return min(times[1:])


class _Product(torch.autograd.Function):
    """``a @ b (+ bias)`` of bf16 tensors computed in fp32, rounded to bf16; gradients likewise."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.bias = None if bias is None else (bias.shape, bias.dtype)
        with torch.autocast("cpu", enabled=False):
            out = torch.matmul(a.float(), b.float())
            if bias is not None:
                out += bias.float()
        return out.to(a.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        want_a, want_b, want_bias = ctx.needs_input_grad
        g = grad.float()
        grad_a = grad_b = grad_bias = None
        with torch.autocast("cpu", enabled=False):
            if want_a:
                grad_a = torch.matmul(g, b.float().mT).to(a.dtype)
            if want_b:
                af = a.float()
                if b.dim() == 2:  # one matrix for every row of a: sum over them all
                    grad_b = af.reshape(-1, af.size(-1)).t() @ g.reshape(-1, g.size(-1))
                else:
                    grad_b = af.mT @ g
                grad_b = grad_b.to(b.dtype)
            if want_bias and ctx.bias is not None:
                shape, dtype = ctx.bias
                grad_bias = g.sum_to_size(shape).to(dtype)
        return grad_a, grad_b, grad_bias


_MATMULS: set[Callable[..., Any]] = {
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.mm,
    torch.Tensor.mm,
    torch.bmm,
    torch.Tensor.bmm,
}
_ADDMMS: set[Callable[..., Any]] = {torch.addmm, torch.Tensor.addmm}


def _operands(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """``(a, b, bias)`` with ``func(...) == a @ b + bias``, for the products this handles; None for
    everything else (then the call runs as it is)."""
    if func is F.linear and len(args) >= 2 and set(kwargs) <= {"bias"}:
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if isinstance(w, torch.Tensor) and w.dim() == 2:
            return _checked(x, w.t(), bias)
    elif func in _MATMULS and len(args) == 2 and not kwargs:
        return _checked(args[0], args[1], None)
    elif func in _ADDMMS and len(args) == 3 and not kwargs:  # beta and alpha left at 1
        return _checked(args[1], args[2], args[0])
    return None


def _checked(a: Any, b: Any, bias: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    tensors = [t for t in (a, b, bias) if t is not None]
    # Plain tensors only: subclasses (DTensor, fake tensors) have their own product rules.
    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" for t in tensors):
        return None
    if a.dim() < 2 or b.dim() < 2 or (b.dim() > 2 and a.shape[:-2] != b.shape[:-2]):
        return None  # vectors and broadcast batches: left to PyTorch
    return a, b, bias


def _product_dtype(tensors: list[torch.Tensor]) -> torch.dtype | None:
    """bf16 where the product would run in bf16: under CPU bf16 autocast (which casts fp32 and bf16
    operands to bf16), or with bf16 operands only (FSDP's bf16 parameters, casts written out)."""
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
        return torch.bfloat16 if all(t.dtype in (torch.float32, torch.bfloat16) for t in tensors) else None
    return torch.bfloat16 if all(t.dtype == torch.bfloat16 for t in tensors) else None


class Fp32Products(TorchFunctionMode):
    """While active: the CPU's bf16 matrix products (linear layers, GPT-2's ``addmm``, matmuls of
    matrices or equal batches) run as fp32 products of bf16 operands with a bf16 result."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        found = _operands(func, args, kwargs)
        if found is not None:
            a, b, bias = found
            dtype = _product_dtype([t for t in found if t is not None])
            if dtype is not None:
                with torch.autocast("cpu", enabled=False):  # the casts autocast would have made
                    a, b = a.to(dtype), b.to(dtype)
                    bias = None if bias is None else bias.to(dtype)
                return _Product.apply(a, b, bias)  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)
