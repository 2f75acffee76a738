"""Matrix products of a CPU bf16 run: PyTorch's bf16 kernels on bucketed shapes, or fp32 products
of bf16 operands (which, lmtune.model.paths decides).

On a CPU without bf16 matrix instructions (no AVX-512 BF16, no AMX) PyTorch multiplies bf16
tensors in reference loops: 1-19 GFLOP/s depending on the operands' layout, against 120-170 in
fp32 on the same 2 cores (the backward's ``grad @ W`` took the 1 GFLOP/s layout), so a bf16 step
ran ~30x slower than an fp32 one. Rounding the operands to bf16, multiplying in fp32 and rounding
the product to bf16 is what bf16 matrix hardware computes (exact bf16 inputs, fp32 accumulation,
a bf16 result), so the run keeps bf16's numerics and memory and gets fp32's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lmtune.config import environment

PRODUCTS_ENV = environment.CPU_PRODUCTS


@dataclass(frozen=True)
class Products:
    """How a run multiplies matrices (run.json's ``resolved.products``; how that was decided is in
    ``resolved.paths``, see lmtune.model.paths)."""

    fp32: bool  # bf16 operands multiplied in fp32 (see the module docstring)
    description: str
    # The token dimension of the products is bucketed (token_bucket): a CPU bf16 run on oneDNN's bf16
    # kernels, which keep a compiled kernel per matrix shape.
    bucketed: bool = False


def native_products(precision: str) -> Products:
    """The precision's own kernels: GPUs, fp32 and fp16, ``--compile`` runs."""
    return Products(fp32=False, description=precision)


def cpu_bf16_products(fp32: bool, bucketed: bool) -> Products:
    """A CPU bf16 run's products: fp32 of bf16-rounded operands, or PyTorch's bf16 kernels; on
    bucketed token counts (:func:`token_bucket`) where those kernels keep one per shape."""
    what = "fp32 products of bf16-rounded operands" if fp32 else "bf16"
    if bucketed:
        what += ", token counts bucketed"
    return Products(fp32=fp32, description=what, bucketed=bucketed)


def onednn_bf16() -> bool:
    """Whether PyTorch's oneDNN runs bf16 products on this CPU (else they run in reference loops)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def token_bucket(tokens: int) -> int:
    """The token count a CPU bf16 run's products see for ``tokens``: a multiple of 32 up to 512, then
    a sixteenth of the power of two it falls in (at most 6.25% more).

    oneDNN compiles a kernel for every matrix shape it meets and keeps it: ~0.27 MB in its primitive
    cache and as much in ideep's (1,024 entries each), ~12 shapes per token count in a decoder's step.
    A new token count at every step grew a bf16 run by ~5 MB a step until both caches filled, and the
    churn after that fragmented the heap further. Bucketed, a run meets a few dozen counts and stays
    flat once it has met them.
    """
    step = max(32, 1 << max(tokens.bit_length() - 5, 0))
    return -(-tokens // step) * step


def linear_seconds(x: torch.Tensor, weight: torch.Tensor, fp32: bool) -> float:
    """One linear layer's forward and backward under CPU bf16 autocast, with the products in fp32
    of bf16 operands (``fp32``) or in PyTorch's bf16 kernels."""
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Products() if fp32 else nullcontext():
        out = F.linear(x, weight)
    out.float().sum().backward()  # type: ignore[no-untyped-call]
    return time.perf_counter() - start


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
