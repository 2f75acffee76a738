"""``--compile``: torch.compile per decoder block, attention left out of the graphs."""

from __future__ import annotations

from functools import partial
from types import MethodType
from typing import Any

import torch
from torch import nn

from lmtune.parallel.wrap import decoder_blocks

_MARK = "lmtune_compiled"  # on a block's forward that compile_blocks wrapped


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


def compile_record(model: nn.Module) -> dict[str, Any]:
    """What --compile compiled in ``model`` and the graphs torch.compile has made so far (0 after
    training: every graph failed and ran eagerly), for run.json."""
    import torch._dynamo.utils

    blocks = decoder_blocks(model)
    if blocks:
        done = sum(getattr(getattr(b.forward, "__func__", None), _MARK, False) for b in blocks)
        what = f"{done} of {len(blocks)} decoder blocks"
    else:
        what = "the whole model" if getattr(model, "_compiled_call_impl", None) is not None else "nothing"
    return {"compiled": what, "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"])}


def compiles_whole(model: nn.Module) -> bool:
    """Whether :func:`compile_blocks` compiles ``model``'s whole forward, logits included."""
    return not decoder_blocks(model)


def _checkpointing(block: nn.Module, forward: Any) -> Any | None:
    """The checkpoint function transformers' checkpointing wrapper of ``forward`` applies to
    ``block`` (its ``_gradient_checkpointing_func``: lmtune's kwargs bound), or None where the block
    is not checkpointed that way."""
    wrapper = getattr(getattr(forward, "__code__", None), "co_name", "") == "forward_with_checkpointing"
    if not (wrapper and hasattr(forward, "__wrapped__") and getattr(block, "gradient_checkpointing", False)):
        return None
    return getattr(block, "_gradient_checkpointing_func", None)


def _compile_training_forward(block: nn.Module) -> None:
    """The block's forward compiled where it computes gradients. Evaluation, generation, the
    start-up checks and a frozen reference run it eagerly: each would add its own graphs (no grad,
    other shapes) and push the block's frames past torch.compile's recompile limit, after which
    they run eagerly in training too."""
    own = type(block).forward
    # Under activation checkpointing the checkpoint goes around the compiled forward, not into it:
    # transformers' wrapper checkpoints inside the class's forward, and a checkpoint traced by
    # torch.compile takes no graph break (attention is one), so every block ran eagerly, unsaid.
    checkpoint = _checkpointing(block, own)
    inner = own.__wrapped__ if checkpoint is not None else own  # type: ignore[attr-defined]
    # dynamic: the token count changes every step; one graph for all of them, not a recompile for
    # the second count met.
    compiled = torch.compile(inner, dynamic=True)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return own(self, *args, **kwargs)
        if checkpoint is not None and self.training:
            return checkpoint(partial(compiled, self), *args, **kwargs)
        return compiled(self, *args, **kwargs)

    setattr(forward, _MARK, True)
    # The class's forward rebound to the block, not a closure over it: a deep copy (a preference
    # run's live reference) rebinds it to the copy, which then computes with its own weights.
    block.forward = MethodType(forward, block)  # type: ignore[method-assign]
