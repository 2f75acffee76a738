"""``--compile``: torch.compile per decoder block, attention left out of the graphs."""

from __future__ import annotations

from types import MethodType
from typing import Any

import torch
from torch import nn

from lmtune.parallel.wrap import decoder_blocks


def compile_blocks(model: nn.Module) -> str | None:
    """torch.compile in place (parameter names unchanged, so checkpoints stay the same): each decoder
    block on its own, with attention left out of the graphs (lmtune.model.attention), so compiled
    runs keep per-example attention and the chunked loss; the whole model where it lists no blocks.
    Returns why it could not, if it could not (the run goes on eagerly)."""
    import torch._dynamo

    blocks = decoder_blocks(model)
    hooked = [b for b in blocks if getattr(b.forward, "__self__", None) is not b]
    if hooked:  # the compiled forward is the class's: it would leave the hook out
        name = type(hooked[0]).__name__
        return f"{name}'s forward is replaced on the instance (a hook, as accelerate's offloading sets)"
    # A graph that fails to compile at its first call runs eagerly instead of ending the run.
    torch._dynamo.config.suppress_errors = True
    try:
        for block in blocks:
            _compile_training_forward(block)
        if not blocks:
            model.compile()
    except Exception as e:  # compile support differs by platform and model; eager always works
        return f"{type(e).__name__}: {e}"
    return None


def compiles_whole(model: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiles ``model``'s whole forward, logits included."""
    return not decoder_blocks(model)


def _compile_training_forward(block: nn.Module) -> None:
    """The block's forward compiled where it computes gradients. Evaluation, generation, the
    start-up checks and a frozen reference run it eagerly: each would add its own graphs (no grad,
    other shapes) and push the block's frames past torch.compile's recompile limit, after which
    they run eagerly in training too."""
    own = type(block).forward
    # dynamic: the token count changes every step; one graph for all of them, not a recompile for
    # the second count met.
    compiled = torch.compile(own, dynamic=True)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return (compiled if torch.is_grad_enabled() else own)(self, *args, **kwargs)

    # The class's forward rebound to the block, not a closure over it: a deep copy (a preference
    # run's live reference) rebinds it to the copy, which then computes with its own weights.
    block.forward = MethodType(forward, block)  # type: ignore[method-assign]
