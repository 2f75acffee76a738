"""fp32 products of bf16 operands (a CPU bf16 run's, where PyTorch's bf16 kernels are slower):
bf16's results, with every matrix product of the forward and the backward computed in fp32."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lmtune.model import products
from lmtune.model.attention import use_varlen
from lmtune.model.precision import autocast_context
from lmtune.model.products import Fp32Products, token_bucket
from lmtune.objectives.sft import SummedLoss
from lmtune.training.perf import Probe, _peak_key
from tests.unit.model.test_chunked_loss import _batch, _close, _model

CPU = torch.device("cpu")
BF16_ULP = 2**-7  # bf16's relative spacing: one rounding of a result apart


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.detach().bfloat16().float()


def test_a_linear_layer_is_its_bf16_rounded_operands_multiplied_in_fp32() -> None:
    """The output is the fp32 product of the bf16-rounded input and weight, plus the rounded bias,
    rounded to bf16 (what bf16 matrix hardware computes); the gradients likewise."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(12, 16, requires_grad=True)
    b = torch.randn(12, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), Fp32Products():
        out = F.linear(x, w, b)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, (_rounded(x) @ _rounded(w).t() + _rounded(b)).bfloat16())
    grad = torch.randn(out.shape).bfloat16()
    out.backward(grad)
    g = grad.float()
    assert x.grad is not None and w.grad is not None and b.grad is not None
    assert x.grad.dtype == w.grad.dtype == torch.float32  # through autocast's casts to the fp32 leaves
    assert torch.equal(x.grad, (g @ _rounded(w)).bfloat16().float())
    assert torch.equal(w.grad, (g.reshape(-1, 12).t() @ _rounded(x).reshape(-1, 16)).bfloat16().float())
    torch.testing.assert_close(b.grad, g.sum((0, 1)), rtol=BF16_ULP, atol=0)


@pytest.mark.parametrize("op", ["matmul-batched", "matmul-by-matrix", "mm", "bmm", "addmm", "@"])
def test_every_product_form_matches_bf16_rounding(op: str) -> None:
    torch.manual_seed(1)
    shapes = {
        "matmul-batched": ((2, 3, 4, 8), (2, 3, 8, 5)),
        "matmul-by-matrix": ((2, 4, 8), (8, 5)),
        "bmm": ((3, 4, 8), (3, 8, 5)),
    }
    a_shape, b_shape = shapes.get(op, ((4, 8), (8, 5)))
    a = torch.randn(a_shape).bfloat16().requires_grad_()  # bf16 operands, no autocast (FSDP's case)
    b = torch.randn(b_shape).bfloat16().requires_grad_()
    bias = torch.randn(5).bfloat16().requires_grad_()
    call = {
        "matmul-batched": lambda: torch.matmul(a, b),
        "matmul-by-matrix": lambda: a.matmul(b),
        "mm": lambda: torch.mm(a, b),
        "bmm": lambda: torch.bmm(a, b),
        "addmm": lambda: torch.addmm(bias, a, b),
        "@": lambda: a @ b,
    }[op]
    with Fp32Products():
        out = call()
    expected = a.detach().float() @ b.detach().float()
    if op == "addmm":
        expected = expected + bias.detach().float()
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.bfloat16())
    out.float().sum().backward()
    ones = torch.ones(out.shape)
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad.float(), ones @ b.detach().float().mT, rtol=BF16_ULP, atol=0)
    a_rows = a.detach().float().reshape(-1, a.size(-1)) if b.dim() == 2 else a.detach().float()
    ones_rows = ones.reshape(-1, ones.size(-1)) if b.dim() == 2 else ones
    torch.testing.assert_close(b.grad.float(), a_rows.mT @ ones_rows, rtol=BF16_ULP, atol=0)


def test_other_calls_run_as_they_are() -> None:
    """fp32 products outside autocast, vectors, broadcast batches, scaled addmm: left to PyTorch."""
    a, b = torch.randn(4, 8), torch.randn(8, 5)
    with Fp32Products():
        assert torch.equal(a @ b, torch.mm(a, b))  # fp32: nothing to do
        v = torch.randn(8).bfloat16()
        assert (a.bfloat16() @ v).shape == (4,)
        broadcast = torch.matmul(torch.randn(3, 4, 8).bfloat16(), torch.randn(1, 8, 5).bfloat16())
        assert broadcast.shape == (3, 4, 5)
        scaled = torch.addmm(torch.zeros(5).bfloat16(), a.bfloat16(), b.bfloat16(), alpha=2.0)
        assert scaled.dtype == torch.bfloat16


class _ProductDtypes(TorchDispatchMode):
    """The dtype of every matrix product PyTorch runs (forward and backward)."""

    OPS: ClassVar[set[str]] = {"mm", "addmm", "bmm", "baddbmm"}

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = func.overloadpacket.__name__
        if name in self.OPS:
            self.dtypes.append(args[1 if name in ("addmm", "baddbmm") else 0].dtype)
        return func(*args, **(kwargs or {}))


def _bf16_step(model: torch.nn.Module, fp32_products: bool, chunk: int) -> tuple[Any, ...]:
    model.zero_grad(set_to_none=True)
    ids, mask, labels = _batch()
    seen = _ProductDtypes()
    with seen:
        with autocast_context("bf16", CPU, fp32_products):
            loss = SummedLoss(model, loss_chunk=chunk, fp32_products=fp32_products)(ids, mask, labels).sum()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.item(), grads, set(seen.dtypes)


def _fp32_reference(model: torch.nn.Module, chunk: int) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids, mask, labels = _batch()
    loss = SummedLoss(model, loss_chunk=chunk)(ids, mask, labels).sum()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).norm() / b[n].norm()) for n in b)


@pytest.mark.parametrize("kind", ["gpt2", "llama-tied", "qwen2"])
@pytest.mark.parametrize("chunk", [0, 16], ids=["full-logits", "chunked"])
def test_a_model_trains_with_bf16_results_and_fp32_products_only(kind: str, chunk: int) -> None:
    """Every product of a step (GPT-2's addmm and eager attention, Llama's and Qwen2's linear
    layers, the head, the chunked loss) runs in fp32, and the loss and gradients differ from
    fp32's by as much as PyTorch's own bf16 kernels' do: bf16's rounding, nothing more."""
    model = _model(kind)
    if kind == "gpt2":
        model.set_attn_implementation("eager")  # type: ignore[operator]  # 4-d matmuls too
    ref_loss, ref = _fp32_reference(model, chunk)
    native_loss, native, native_dtypes = _bf16_step(model, False, chunk)
    loss, grads, dtypes = _bf16_step(model, True, chunk)
    assert torch.bfloat16 in native_dtypes  # the recorder sees bf16 products when they happen
    assert dtypes == {torch.float32}
    assert loss == pytest.approx(native_loss, rel=1e-2) and loss == pytest.approx(ref_loss, rel=1e-2)
    _close(grads, native, 0.1)
    assert _worst(grads, ref) <= 2 * _worst(native, ref) + 1e-3


def test_the_context_is_reusable_like_autocast() -> None:
    """Evaluation enters one autocast context for every batch."""
    context = autocast_context("bf16", CPU, fp32_products=True)
    a, b = torch.randn(4, 8), torch.randn(5, 8)
    for _ in range(2):
        seen = _ProductDtypes()
        with seen, context:
            out = F.linear(a, b)
        assert out.dtype == torch.bfloat16 and seen.dtypes == [torch.float32]
    assert not torch.is_autocast_enabled("cpu")


def test_token_buckets_are_few_and_cost_little() -> None:
    """Every count maps to a bucket at least as large and at most 31 tokens (to 512) or 6.25% (above)
    larger; a bucket maps to itself; 1 to 16,384 tokens meet 96 buckets, not 16,384 shapes."""
    buckets = {token_bucket(n) for n in range(1, 16385)}
    assert len(buckets) == 96
    for n in range(1, 16385):
        b = token_bucket(n)
        assert n <= b <= max(n + 31, n * 17 // 16 + 1) and token_bucket(b) == b


def _bucketed_step(model: torch.nn.Module, batch: Any, bucket: bool, **kw: Any) -> tuple[Any, ...]:
    """Loss, gradients and the shapes of every product of one step, in fp32 (where padding's
    effect, if any, would show: bucketing must change nothing)."""
    model.zero_grad(set_to_none=True)
    seen = _ProductShapes()
    with seen:
        loss = SummedLoss(model, bucket_tokens=bucket, **kw)(*batch).sum()
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, seen.rows


class _ProductShapes(TorchDispatchMode):
    """The first dimension of every product's operands, flattened to matrices: token counts."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: set[int] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm"):
            a, b = args[-2], args[-1]
            self.rows |= {a.size(0), a.size(1), b.size(1)}  # the backward's grad_w puts tokens in K
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["llama-tied", "gpt2"])
@pytest.mark.parametrize("layout", ["flat", "rows", "packed-rows"])
@pytest.mark.parametrize("chunk", [0, 16], ids=["full-logits", "chunked"])
def test_bucketing_changes_no_result_and_leaves_few_shapes(kind: str, layout: str, chunk: int) -> None:
    """A CPU bf16 run on oneDNN's kernels pads the token dimension of its products to a bucket
    (flattened rows end with a filler example, masked rows get more padding, the chunked loss zero
    rows): the loss and gradients are those without it, to fp32 rounding, and the products see no
    token count other than a bucket (or the model's own widths, or the loss's chunk)."""
    model = _model(kind)
    ids, mask, labels = _batch(pad_from=8)
    batch: tuple[torch.Tensor | None, ...] = (ids, mask, labels)
    if layout == "packed-rows":
        segments = (torch.arange(ids.size(1)) >= 9).long().expand_as(ids).contiguous()
        positions = torch.where(segments.bool(), torch.arange(ids.size(1)) - 9, torch.arange(ids.size(1)))
        batch = (ids, torch.ones_like(mask), labels, positions.expand_as(ids).contiguous(), segments)
    varlen = layout == "flat" and use_varlen(model)
    ref_loss, ref, unbucketed = _bucketed_step(model, batch, False, varlen=varlen, loss_chunk=chunk)
    loss, grads, rows = _bucketed_step(model, batch, True, varlen=varlen, loss_chunk=chunk)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    _close(grads, ref, 1e-5)
    widths = {p.size(0) for p in model.parameters()} | {p.size(-1) for p in model.parameters()} | {chunk}
    buckets = {token_bucket(n) for n in range(1, 4096)}
    assert rows - widths <= buckets, rows - widths
    assert unbucketed - widths - buckets  # the batch's own counts, which bucketing replaced


def test_bf16_decisions_and_timings_are_in_lmtune_model_paths() -> None:
    """The timed helper runs both ways (the choice itself is tested in test_paths)."""
    x, w = torch.randn(32, 16), torch.randn(24, 16)
    assert products.linear_seconds(x, w, fp32=False) > 0 and products.linear_seconds(x, w, fp32=True) > 0


def test_mfu_divides_by_the_peak_of_the_products_the_run_uses() -> None:
    """fp32 products are another peak than PyTorch's bf16 kernels: cached apart."""
    native, fp32 = Probe(CPU, "bf16", 2), Probe(CPU, "bf16", 2, fp32_products=True)
    assert _peak_key(native) != _peak_key(fp32) and "fp32 products" in _peak_key(fp32)
