"""Wrap the model for the chosen strategy, and the no-sync context for gradient accumulation."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lmtune.errors import UserError
from lmtune.parallel.distributed import DistEnv


def effective_strategy(strategy: str, world_size: int) -> str:
    """The strategy ``--strategy`` means on ``world_size`` processes: ``auto`` is ddp with several,
    single with one; ddp and fsdp in one process are the single-process run, without a wrapper."""
    if strategy == "auto" or (strategy in ("ddp", "fsdp") and world_size == 1):
        return "ddp" if world_size > 1 else "single"
    return strategy


def resolve_strategy(strategy: str, env: DistEnv) -> str:
    """The strategy this process runs (see :func:`effective_strategy`); one that cannot run here
    is a user error."""
    if strategy in ("auto", "ddp", "fsdp"):
        return effective_strategy(strategy, env.world_size)
    if env.distributed:
        raise UserError(
            f"--strategy {strategy} runs in one process, but {env.world_size} were launched; "
            "use --strategy ddp (or auto)"
        )
    if strategy == "dp":
        if env.device.type != "cuda":
            raise UserError(
                "--strategy dp (nn.DataParallel) needs CUDA GPUs and none is in use here; "
                "use --strategy single on CPU"
            )
        if torch.cuda.device_count() < 2:
            raise UserError(
                "--strategy dp needs at least 2 visible GPUs "
                f"(CUDA_VISIBLE_DEVICES shows {torch.cuda.device_count()})"
            )
    return strategy


def wrap_model(
    module: nn.Module, strategy: str, env: DistEnv, low_dtype: torch.dtype | None = None
) -> nn.Module:
    """Place the module on this rank's device and wrap it for ``strategy``; ``low_dtype``: the
    autocast dtype of a bf16/fp16 run (None under fp32), which FSDP2 gathers parameters in."""
    module = module.to(env.device)
    if strategy == "fsdp":
        return _fully_shard(module, low_dtype)
    if strategy == "dp":
        # Logical ids: with CUDA_VISIBLE_DEVICES=1,2 these are physical GPUs 1 and 2.
        return nn.DataParallel(module, device_ids=list(range(torch.cuda.device_count())))
    if strategy == "ddp":
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        # Rotary-embedding buffers are not state to synchronise; broadcasting them every forward
        # would cost a collective per micro-step (newer PyTorch names the switch differently).
        no_buffer_sync: dict[str, Any] = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else {"broadcast_buffers": False}
        )
        # Gradients as views into the all-reduce buckets: one copy of the gradients instead of two.
        return DistributedDataParallel(
            module, device_ids=device_ids, gradient_as_bucket_view=True, **no_buffer_sync
        )
    return module


def decoder_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, by the class names the model lists as ``_no_split_modules``,
    also once FSDP2 has sharded them (their class is then ``FSDP<name>``, a subclass)."""
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return [m for m in module.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def _fully_shard(module: nn.Module, low: torch.dtype | None) -> nn.Module:
    """FSDP2: each decoder block is one unit (its parameters are gathered just for its forward and
    backward), the root holds the rest (embeddings, final norm, head).

    Under bf16/fp16 the gathered parameters are cast to that dtype, which halves the all-gather,
    while gradients are reduced and the sharded master weights kept in fp32. The residual stream
    stays fp32, as autocast keeps it in one process: the blocks' inputs are not cast, and the
    input embeddings' output is fp32 (a bf16 stream rounded every block's sum: the same pairs'
    log-probs moved with the batch they came in, and a DPO run's first loss was not ln 2).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _check_packed_weights(module, low)
    blocks = decoder_blocks(module)
    if not blocks:
        raise UserError(
            "--strategy fsdp: found no decoder blocks to shard (the model lists no _no_split_modules); "
            "use --strategy ddp"
        )
    policy = MixedPrecisionPolicy(
        param_dtype=low, reduce_dtype=torch.float32 if low else None, cast_forward_inputs=False
    )
    embeddings = getattr(module, "get_input_embeddings", lambda: None)()
    if low is not None and isinstance(embeddings, nn.Module):
        embeddings.register_forward_hook(_as_fp32)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(module, mp_policy=policy)
    return module


def _as_fp32(module: nn.Module, inputs: Any, output: Any) -> Any:
    return output.float() if isinstance(output, torch.Tensor) and output.is_floating_point() else output


def _check_packed_weights(module: nn.Module, low: torch.dtype | None) -> None:
    """Refuse packed quantized weights (bitsandbytes 4-bit: values packed into the bytes of another
    dtype) that FSDP2 would cast when it gathers them: cast, the bytes are no longer the values,
    and training goes on silently on garbage (loss 0 or NaN; accelerate #3983)."""
    for name, p in module.named_parameters():
        if (
            getattr(p, "quant_state", None) is not None
            and p.is_floating_point()
            and low not in (None, p.dtype)
        ):
            raise UserError(
                f"--strategy fsdp: {name} holds 4-bit values packed in {p.dtype}, which FSDP2 would cast "
                f"to {low} when gathering it; pack them in {low} (lmtune does so under --load-in-4bit)"
            )


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DP/DDP wrapper (or the module itself)."""
    if isinstance(model, (nn.DataParallel, DistributedDataParallel)):
        inner: nn.Module = model.module
        return inner
    return model


def no_sync(model: nn.Module, sync: bool) -> AbstractContextManager[object]:
    """Skip the gradient all-reduce on a micro-step that is not the last of its optimizer step."""
    if not sync and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if is_sharded(model):
        return _fsdp_sync(model, sync)
    return nullcontext()


@contextmanager
def _fsdp_sync(model: nn.Module, sync: bool) -> Iterator[None]:
    """FSDP2's switch: without sync, gradients accumulate unsharded and unreduced on each rank."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
