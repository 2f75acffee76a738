"""fp32 products of bf16 operands (a CPU bf16 run's, where PyTorch's bf16 kernels are slower):
bf16's results, with every matrix product of the forward and the backward computed in fp32."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lmtune.errors import UserError
from lmtune.model import products
from lmtune.model.precision import autocast_context
from lmtune.model.products import PRODUCTS_ENV, Fp32Products, choose_products
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


def test_the_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PRODUCTS_ENV, raising=False)
    for precision, device, compiled in [
        ("fp32", CPU, False),
        ("bf16", torch.device("cuda"), False),
        ("bf16", CPU, True),
    ]:
        assert not choose_products(precision, device, compiled).fp32
    monkeypatch.setattr(products, "_bf16_matrix_instructions", lambda: False)
    no_instructions = choose_products("bf16", CPU)
    assert no_instructions.fp32 and "no bf16 matrix instructions" in no_instructions.description
    # With bf16 instructions the faster of the two is timed: each way in turn.
    monkeypatch.setattr(products, "_bf16_matrix_instructions", lambda: True)
    for bf16_s, fp32_s in [(0.01, 0.02), (0.02, 0.01)]:
        timed = {False: bf16_s, True: fp32_s}
        monkeypatch.setattr(products, "_linear_seconds", timed.__getitem__)
        assert choose_products("bf16", CPU).fp32 == (fp32_s < bf16_s)
    for forced, fp32 in [("fp32", True), ("bf16", False)]:
        monkeypatch.setenv(PRODUCTS_ENV, forced)
        choice = choose_products("bf16", CPU)
        assert choice.fp32 == fp32 and PRODUCTS_ENV in choice.description
    monkeypatch.setenv(PRODUCTS_ENV, "fp64")
    with pytest.raises(UserError, match=f"{PRODUCTS_ENV}='fp64': expected auto, fp32 or bf16"):
        choose_products("bf16", CPU)


def test_the_timed_probe_runs_both_ways() -> None:
    assert products._linear_seconds(False, size=64) > 0 and products._linear_seconds(True, size=64) > 0


def test_mfu_divides_by_the_peak_of_the_products_the_run_uses() -> None:
    """fp32 products are another peak than PyTorch's bf16 kernels: cached apart."""
    native, fp32 = Probe(CPU, "bf16", 2), Probe(CPU, "bf16", 2, fp32_products=True)
    assert _peak_key(native) != _peak_key(fp32) and "fp32 products" in _peak_key(fp32)
