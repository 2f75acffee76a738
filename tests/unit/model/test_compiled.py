"""--compile's wrapping of the decoder blocks, without compiling (calls without gradients run the
class's own forward eagerly)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from lmtune.model.compiled import compile_blocks, compile_record


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Model(nn.Module):
    _no_split_modules = ("Block",)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_deep_copy_computes_with_its_own_weights() -> None:
    """A preference run's live reference is a deep copy of the compiled model: its blocks must run
    with the copy's weights, not the policy's (a closure over the block did)."""
    torch.manual_seed(0)
    model = Model()
    assert compile_blocks(model) is None
    assert compile_record(model)["compiled"] == "2 of 2 decoder blocks"  # run.json's
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    with torch.no_grad():
        before = reference(x)
        for p in model.parameters():
            p.add_(1.0)
        assert torch.equal(reference(x), before)
        assert not torch.allclose(model(x), before)
    assert reference.blocks[0].forward.__self__ is reference.blocks[0]


def test_blocks_with_a_hooked_forward_are_left_eager() -> None:
    model = Model()
    hooked = model.blocks[1].forward
    model.blocks[1].forward = lambda x: hooked(x) * 2  # as accelerate's hooks replace it
    failure = compile_blocks(model)
    assert failure is not None and "Block's forward is replaced on the instance" in failure
    assert getattr(model.blocks[0].forward, "__self__", None) is model.blocks[0]
    assert model.blocks[0].forward.__func__ is Block.forward  # nothing was compiled
    assert compile_record(model)["compiled"] == "0 of 2 decoder blocks"


def test_blocks_are_found_once_fsdp_has_swapped_their_class() -> None:
    """FSDP2 makes each sharded block an FSDP<Block>: a compiled FSDP run's run.json said it had
    compiled "nothing" beside its 4 graphs."""
    model = Model()
    assert compile_blocks(model) is None
    for block in model.blocks:
        block.__class__ = type(f"FSDP{type(block).__name__}", (type(block),), {})
    assert compile_record(model)["compiled"] == "2 of 2 decoder blocks"
