"""Preference tuning (``--objective dpo | ipo | simpo | orpo``) on pairs of answers to a prompt.

Both answers of every pair run in one forward pass (lmtune.data.pair_collate); their log-probs go
through the chunked head (lmtune.model.pair_head), so no logits of a micro-batch exist whole. The
loss is summed over pairs and normalised by the global number of pairs (all micro-steps and ranks,
``train_step``), so N ranks x GA k train exactly as one process on the whole batch.

The reference (dpo, ipo) is, per :class:`Reference`: log-probs precomputed before training and
carried by the batches (lmtune.training.reference), the policy's own base with its LoRA adapter
disabled, or a frozen model run in every step. simpo and orpo need none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmtune.data.batch import Batch
from lmtune.data.pair_collate import PairCollator, PairStepCollator
from lmtune.model.chunked_loss import split_head
from lmtune.model.loss import LossModule
from lmtune.model.masks import mask_obstacle
from lmtune.model.pair_head import Answers, logps_from_logits, pair_logps_chunked, pair_loss_chunked
from lmtune.objectives.base import LossSetup
from lmtune.objectives.pair_losses import PairLoss
from lmtune.objectives.pair_routing import route_pairs


@dataclass(frozen=True)
class Reference:
    """Where a step's reference log-probs come from: ``batch`` (precomputed, or none needed),
    ``adapter`` (the LoRA policy with its adapter disabled) or ``model`` (a frozen model)."""

    kind: str = "batch"
    # kind "model": a PreferenceLoss in reference_mode around the frozen model, on the device and
    # sharded under FSDP2; called whole, so FSDP2 gathers its parameters.
    module: nn.Module | None = None
    digest: str | None = None  # kind "model" of a --reference-model: its weights' hash


def disable_dropout(model: nn.Module) -> None:
    """Dropout off in the model, a LoRA adapter's included: with it the policy's log-probs would
    differ from the reference's by noise, and the first loss would not be ln 2. TRL's DPOTrainer
    (disable_dropout, on by default) zeroes every ``nn.Dropout`` after wrapping the model in peft,
    so the same LoRA settings train the same way here."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # The adapter's config as saved (adapter_config.json) says so too: it said 0.05, and a peft
        # user training the adapter on got dropout this run never used.
        for adapter in (getattr(module, "peft_config", None) or {}).values():
            if isinstance(getattr(adapter, "lora_dropout", None), float):
                adapter.lora_dropout = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


class PreferenceLoss(LossModule):
    """``[loss_sum, *metric_sums]`` of a micro-batch of pairs; see the module docstring. With
    :meth:`reference_pass` on, the forward returns the pairs' summed answer log-probs ``[pairs, 2]``
    instead (for precomputing the reference, through the same wrapper as training)."""

    def __init__(
        self, model: nn.Module, setup: LossSetup, loss: PairLoss, reference: Reference | None = None
    ):
        super().__init__(model, setup.varlen, setup.loss_chunk, setup.fp32_products, setup.bucket_tokens)
        disable_dropout(model)
        self.loss = loss
        # Each pair as two rows where no mask keeps a pair's answers apart (lmtune.objectives.pair_routing).
        self.apart = mask_obstacle(model) is not None
        # Not a submodule: the frozen reference is no part of the policy's state, its checkpoints
        # or its gradient synchronisation.
        self._reference = (reference or Reference(),)
        self.logps_only = False

    def reference_mode(self) -> PreferenceLoss:
        """This module as a frozen reference: every forward returns log-probs."""
        self.logps_only = True
        self.requires_grad_(False)
        return self.eval()

    @property
    def reference(self) -> Reference:
        return self._reference[0]

    @contextmanager
    def reference_pass(self) -> Iterator[None]:
        """Forward passes return the reference's log-probs of the pairs (the policy's own, with a
        LoRA adapter disabled: at the start of training it is the reference)."""
        before, self.logps_only = self.logps_only, True
        try:
            yield
        finally:
            self.logps_only = before

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if labels is None:
            return self.next_token_logits(input_ids, attention_mask)
        batch = (input_ids, attention_mask, labels, position_ids, segment_ids, reference)
        # A batch without pairs is an idle one (FSDP2's lockstep): it runs the model all the same.
        pairs = 0 if reference is None else int(reference.size(0))
        routed = route_pairs(self, input_ids, attention_mask, labels, position_ids, segment_ids, self.apart)
        answers, inputs = Answers.of(routed.labels, routed.part, routed.pair, pairs), routed.inputs
        if self.logps_only:
            with self._adapter_disabled():
                return self._logps(answers, inputs)
        if self.reference.kind == "model":
            assert self.reference.module is not None
            ref = self.reference.module(*batch)
        elif self.reference.kind == "adapter":
            with self._adapter_disabled():
                ref = self._logps(answers, inputs)
        else:
            ref = torch.zeros(pairs, 2, dtype=torch.float64, device=input_ids.device)
            ref = reference.double() if reference is not None else ref
        loss_sum, logps = self._policy(answers, inputs, ref)
        metrics = self.loss.metrics(logps, answers.counts, ref).sum(0)
        return torch.cat([loss_sum.reshape(1).double(), metrics])

    def _policy(
        self, answers: Answers, inputs: dict[str, Any], reference: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed loss (differentiable) and the policy's log-probs (detached)."""
        split = split_head(self.model) if self.loss_chunk else None
        if split is None:
            logps = logps_from_logits(self.model(**inputs, use_cache=False).logits, answers)
            return self.loss.losses(logps, answers.counts, reference).sum(), logps.detach()
        hidden = split.decoder(**inputs, use_cache=False).last_hidden_state
        return pair_loss_chunked(
            hidden, split.head, answers, reference, self.loss.losses, self.loss_chunk, self.fp32_products
        )

    @torch.no_grad()
    def _logps(self, answers: Answers, inputs: dict[str, Any]) -> torch.Tensor:
        """The model's summed answer log-probs, in the chunks the policy's loss takes."""
        split = split_head(self.model) if self.loss_chunk else None
        if split is None:
            return logps_from_logits(self.model(**inputs, use_cache=False).logits, answers)
        hidden = split.decoder(**inputs, use_cache=False).last_hidden_state
        return pair_logps_chunked(hidden, split.head, answers, self.loss_chunk, self.fp32_products)

    def _adapter_disabled(self) -> Any:
        disable = getattr(self.model, "disable_adapter", None)
        return disable() if callable(disable) else _no_context()


@contextmanager
def _no_context() -> Iterator[None]:
    yield


class PreferenceObjective:
    """``--objective dpo | ipo | simpo | orpo``: see the module docstring."""

    unit = "pairs"

    def __init__(self, loss: PairLoss, reference: Reference | None = None):
        self.loss, self.reference = loss, reference or Reference()
        self.name = loss.name
        self.metric_names = loss.metric_names

    def with_reference(self, reference: Reference) -> PreferenceObjective:
        return PreferenceObjective(self.loss, reference)

    def count(self, batch: Batch) -> int:
        return batch.pairs

    def loss_module(self, model: nn.Module, setup: LossSetup) -> nn.Module:
        return PreferenceLoss(model, setup, self.loss, self.reference)

    def step_collator(self, pad_token_id: int, micro_batch_size: int, mode: str, max_length: int) -> Any:
        return PairStepCollator(
            pad_token_id=pad_token_id, micro_batch_size=micro_batch_size, mode=mode, max_length=max_length
        )

    def eval_collator(self, pad_token_id: int) -> Any:
        return PairCollator(pad_token_id)

    def report(self, loss: float, means: dict[str, float], count: int, prefix: str) -> dict[str, float]:
        return {f"{prefix}loss": loss} | {f"{prefix}{name}": value for name, value in means.items()}
