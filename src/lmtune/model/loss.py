"""The model run on a micro-batch for a loss: token cross-entropy summed over target tokens (so callers
normalise by a global count), and the loss module base that objectives extend."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.chunked_loss import linear_cross_entropy_sum, split_head, targets_of
from lmtune.model.dropout import TokenRuns, set_token_runs
from lmtune.model.neftune import example_runs
from lmtune.model.products import token_bucket

if TYPE_CHECKING:
    from lmtune.model.attention import Segments


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss and the number of target tokens it covers.

    Position ``t`` predicts token ``t + 1``; a target of ``IGNORE_INDEX`` (padding, prompt)
    contributes nothing. The loss is computed in fp32 whatever the logits' dtype.
    """
    # Shift the labels, not the logits: slicing the logits would copy the largest tensor of the step
    # (batch x length x vocab); the padded last target is ignored.
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, (targets != IGNORE_INDEX).sum()


# Rows with more padding than this run per-example attention even when not packed: below it, rows of
# nearly equal lengths run as they are, which costs fewer operations.
VARLEN_ABOVE_PADDING = 0.10
# SummedLoss holds the Hugging Face model as ``self.model``: state-dict keys of the wrapped module
# are the model's own names behind this prefix (checkpoints of a sharded run are keyed so).
WRAPPED_PREFIX = "model."


def _padding(attention_mask: torch.Tensor) -> float:
    """The share of a micro-batch's positions that are padding."""
    return 1.0 - float(attention_mask.sum()) / max(attention_mask.numel(), 1)


class LossModule(nn.Module):
    """Runs a causal LM on a micro-batch and returns its objective's loss vector, shape ``[1 + K]``
    (``lmtune.objectives.base``): subclasses implement :meth:`loss_output`.

    Computing the loss inside the wrapped module lets ``nn.DataParallel`` gather a few numbers per
    GPU instead of every replica's logits, and gives DP/DDP/FSDP2 one module to wrap. The rows
    reach the model flattened to their real tokens with per-example attention (``varlen``), or
    packed under a block-diagonal mask, or as they are.
    """

    def __init__(
        self,
        model: nn.Module,
        varlen: bool = False,
        loss_chunk: int = 0,
        fp32_products: bool = False,
        bucket_tokens: bool = False,
        neftune_alpha: float = 0.0,
    ):
        super().__init__()
        self.model = model
        self.fp32_products = fp32_products  # the chunked loss's products (lmtune.model.products)
        # A CPU bf16 run on oneDNN's bf16 kernels: every product sees a bucketed token count
        # (lmtune.model.products.token_bucket), the extra positions without targets.
        self.bucket_tokens = bucket_tokens
        # Tokens per chunk of the chunked linear cross-entropy (lmtune.model.chunked_loss); 0: the model
        # computes full logits. The decoder and head are looked up per call, not stored: DataParallel
        # replicates this module's children, and a stored reference would point at GPU 0's.
        self.loss_chunk = loss_chunk
        # The model runs lmtune.model.attention's per-example attention: used for packed rows and for
        # rows with much padding; rows of nearly equal lengths run as they are, which costs fewer
        # operations (on 11-token examples the flattened path was ~20% slower).
        self.varlen = varlen
        # NEFTune (lmtune.model.neftune): the noise's scale, for the forwards given noise seeds.
        self.neftune_alpha = neftune_alpha

    def loss_output(
        self, labels: torch.Tensor, segments: torch.Tensor | Segments | None, inputs: dict[str, Any]
    ) -> torch.Tensor:
        """The loss vector of rows given to the model as ``inputs``; ``labels`` align with the rows.
        ``segments`` tells the examples of a row apart: None (one example per row), packed rows'
        segment ids, or the flattened rows' :class:`~lmtune.model.attention.Segments`."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        token_seeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The loss vector; without ``labels``, each row's next-token logits (for generation,
        which must also pass through this module: under FSDP2 its call gathers the parameters).
        ``token_seeds`` (a training step's, per token: lmtune.model.neftune) key the model's
        dropout masks by example (lmtune.model.dropout) and NEFTune's noise on the input
        embeddings; without them dropout draws from the process's stream."""
        if labels is None:
            return self.next_token_logits(input_ids, attention_mask)
        labels, segments, inputs = self.route(input_ids, attention_mask, labels, position_ids, segment_ids)
        runs = None
        if token_seeds is not None:
            seeds = _laid_out(token_seeds, attention_mask, inputs)
            runs = TokenRuns(tuple(seeds.shape), tuple(example_runs(seeds, inputs.get("position_ids"))))
            if self.neftune_alpha:
                inputs = self._with_noise(inputs, seeds, runs)
        set_token_runs(self.model, runs)
        return self.loss_output(labels, segments, inputs)

    def _with_noise(self, inputs: dict[str, Any], seeds: torch.Tensor, runs: TokenRuns) -> dict[str, Any]:
        """``inputs`` with the input embeddings plus NEFTune's noise in place of the token ids;
        ``seeds`` are laid out as the rows are, ``runs`` their examples."""
        from lmtune.model.neftune import embedding_noise

        # Inside this module's forward: under FSDP2 the root's parameters, the embeddings among
        # them, are gathered here.
        embedding: nn.Module = self.model.get_input_embeddings()  # type: ignore[operator]
        embeds = embedding(inputs["input_ids"])
        positions = inputs.get("position_ids")
        width = embeds.size(-1)
        noise = embedding_noise(seeds, positions, width, self.neftune_alpha, embeds.dtype, list(runs.runs))
        rest = {k: v for k, v in inputs.items() if k != "input_ids"}
        return {**rest, "inputs_embeds": embeds + noise}

    def next_token_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        last: torch.Tensor = hidden.logits[:, -1]
        return last

    def route(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | Segments | None, dict[str, Any]]:
        """(labels, segments, model inputs) of the rows as the model runs them: flattened with
        per-example attention, packed under a block-diagonal mask, or as they are."""
        flat = (
            segment_ids is not None or self.bucket_tokens or _padding(attention_mask) > VARLEN_ABOVE_PADDING
        )
        if self.varlen and flat:
            return self._flat(input_ids, attention_mask, labels, position_ids, segment_ids)
        if self.bucket_tokens:  # rows as they are (masked attention): their length bucketed
            input_ids, attention_mask, labels, position_ids, segment_ids = _bucketed_rows(
                input_ids, attention_mask, labels, position_ids, segment_ids
            )
        mask: torch.Tensor | dict[str, torch.Tensor] = attention_mask
        if segment_ids is not None:
            # Packed rows: a block-diagonal causal mask keeps every example to itself.
            from lmtune.model.masks import block_causal_mask, given_mask

            ids = segment_ids
            mask = given_mask(self.model, lambda window: block_causal_mask(ids, window))
        inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}
        return labels, segment_ids, inputs

    def token_loss_sum(self, labels: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
        """The summed next-token loss of the rows, through the chunked head where it is set."""
        split = split_head(self.model) if self.loss_chunk else None
        if split is None:
            return token_loss_sum(self.model(**inputs, use_cache=False).logits, labels)[0]
        targets = targets_of(labels)  # before the decoder runs: see targets_of
        hidden = split.decoder(**inputs, use_cache=False).last_hidden_state
        return linear_cross_entropy_sum(
            hidden, split.head, targets, self.loss_chunk, self.fp32_products, self.bucket_tokens
        )

    def _flat(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
        segment_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Segments, dict[str, Any]]:
        """The rows' real tokens as one sequence, attention per example (lmtune.model.attention)."""
        from lmtune.model.attention import SEGMENTS, flatten, round_up

        round_to = (
            token_bucket if self.bucket_tokens else round_up if input_ids.device.type == "cpu" else None
        )
        flat = flatten(input_ids, attention_mask, labels, position_ids, segment_ids, round_to=round_to)
        # An all-ones mask rather than None: given None, transformers looks for packing in the
        # positions and builds an L x L mask that per-example attention has no use for.
        inputs = {
            "input_ids": flat.input_ids,
            "attention_mask": torch.ones_like(flat.input_ids),
            "position_ids": flat.position_ids,
            SEGMENTS: flat.segments,
        }
        return flat.labels, flat.segments, inputs


def _laid_out(seeds: torch.Tensor, attention_mask: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """Per-token seeds of the batch's rows laid out as :meth:`LossModule.route` laid out the tokens."""
    from lmtune.model.attention import SEGMENTS
    from lmtune.model.neftune import NO_NOISE

    ids = inputs["input_ids"]
    if SEGMENTS in inputs:  # flattened: the real tokens, then fillers
        seeds = seeds[attention_mask.bool()][None]
    # Rows right-padded (bucketed, flattened with fillers): the extra positions get none.
    return F.pad(seeds, (0, ids.size(1) - seeds.size(1)), value=NO_NOISE)


def _bucketed_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Rows right-padded to a bucketed length: masked out, no targets, and in packed rows a segment
    of their own, so no real token sees them (causal attention puts them after every real one).
    Their positions start again from 0, so they never pass the model's last position."""
    rows, length = input_ids.shape
    extra = token_bucket(length) - length
    if not extra:
        return input_ids, attention_mask, labels, position_ids, segment_ids

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return F.pad(t, (0, extra), value=value)

    arange = partial(torch.arange, device=input_ids.device)
    if position_ids is None:  # the model's own for right-padded rows: 0..length-1 on every row
        position_ids = arange(length).expand(rows, length)
    position_ids = torch.cat([position_ids, arange(extra).expand(rows, extra)], dim=1)
    if segment_ids is not None:
        segment_ids = pad(segment_ids, int(segment_ids.max()) + 1)
    return pad(input_ids, 0), pad(attention_mask, 0), pad(labels, IGNORE_INDEX), position_ids, segment_ids
