"""How a micro-batch of preference pairs reaches the model: flattened to its real tokens with
per-example attention that keeps each pair's answers apart (lmtune.model.attention), as rows under
a pair mask (lmtune.model.masks), or, for a model no mask keeps apart (lmtune.model.masks.
mask_obstacle), as two rows a pair, each answer after its own copy of the prompt; and where each
position's pair and part are, for the loss."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.loss import LossModule
from lmtune.model.masks import given_mask, pair_causal_mask


@dataclass(frozen=True)
class Routed:
    labels: torch.Tensor  # the positions' labels, as the model runs them
    part: torch.Tensor  # 0 prompt, 1 chosen, 2 rejected; -1 padding and filler
    pair: torch.Tensor  # the pair of the micro-batch (in row order); -1 padding and filler
    inputs: dict[str, Any]  # the model's keyword arguments


def _parts(segment_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(part, pair) of every position of rows whose segment ids are ``3 k + part`` for the row's
    ``k``-th pair (lmtune.data.pair_collate), -1 for padding."""
    real = segment_ids >= 0
    part = torch.where(real, segment_ids % 3, -1)
    local = torch.div(segment_ids, 3, rounding_mode="floor")
    per_row = torch.where(real, local, -1).amax(dim=1) + 1
    first = torch.cumsum(per_row, 0) - per_row
    return part, torch.where(real, first[:, None] + local, -1)


def route_pairs(
    module: LossModule,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    segment_ids: torch.Tensor | None,
    apart: bool = False,
) -> Routed:
    """The micro-batch as ``module`` runs it (see the module docstring); ``apart``: two rows a
    pair."""
    if segment_ids is None or position_ids is None:  # an idle batch: one token, nothing to train
        labels, _, inputs = module.route(input_ids, attention_mask, labels, position_ids, None)
        none = torch.full_like(labels, -1)
        return Routed(labels, none, none, inputs)
    part, pair = _parts(segment_ids)
    if apart:
        return _answer_rows(input_ids, labels, part, pair)
    if not module.varlen:
        ids, positions = segment_ids, position_ids
        mask = given_mask(module.model, lambda window: pair_causal_mask(ids, positions, window))
        inputs = {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids}
        return Routed(labels, part, pair, inputs)
    from lmtune.model.attention import SEGMENTS, flatten, round_up
    from lmtune.model.products import token_bucket

    on_cpu = input_ids.device.type == "cpu"
    round_to = token_bucket if module.bucket_tokens else round_up if on_cpu else None
    local = torch.where(segment_ids >= 0, torch.div(segment_ids, 3, rounding_mode="floor"), -1)
    flat = flatten(input_ids, attention_mask, labels, position_ids, local, round_to=round_to)
    keep = attention_mask.bool()
    filler = flat.input_ids.size(1) - int(keep.sum())
    part, pair = (torch.cat([t[keep], t.new_full((filler,), -1)]) for t in (part, pair))
    pairs = int(pair.max()) + 1 if pair.numel() else 0
    prompts = torch.bincount(pair[part == 0], minlength=pairs).tolist()
    chosen = torch.bincount(pair[part == 1], minlength=pairs).tolist()
    layout = list(zip(prompts, chosen, strict=True)) + ([(filler, 0)] if filler else [])
    segments = replace(flat.segments, pairs=tuple(layout))
    inputs = {
        "input_ids": flat.input_ids,
        "attention_mask": torch.ones_like(flat.input_ids),
        "position_ids": flat.position_ids,
        SEGMENTS: segments,
    }
    return Routed(flat.labels, part, pair, inputs)


def _answer_rows(
    input_ids: torch.Tensor, labels: torch.Tensor, part: torch.Tensor, pair: torch.Tensor
) -> Routed:
    """Rows ``prompt + chosen``, ``prompt + rejected`` of every pair in turn, right-padded, under
    the model's own causal attention: what the shared layout computes, spelled out
    (lmtune.data.pair_collate.sequences). Each answer's labels stay: the rejected answer's first
    token is predicted by its prompt copy's last position, as by the prompt's in the shared layout
    (Answers.of finds it there: the pair's last prompt position), and a pair without a prompt
    starts each row with a token that has no target in both layouts."""
    flat_ids, flat_labels, flat_part, flat_pair = (t.reshape(-1) for t in (input_ids, labels, part, pair))
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
    for k in range(int(flat_pair.max()) + 1 if flat_pair.numel() else 0):
        mine = flat_pair == k
        prompt = mine & (flat_part == 0)
        for answer in (1, 2):
            where = prompt | (mine & (flat_part == answer))
            rows.append((flat_ids[where], flat_labels[where], flat_part[where], k))
    width = max(len(r[0]) for r in rows)
    shape = (len(rows), width)
    ids = input_ids.new_zeros(shape)
    new_labels = labels.new_full(shape, IGNORE_INDEX)
    new_part, new_pair = part.new_full(shape, -1), pair.new_full(shape, -1)
    mask = input_ids.new_zeros(shape)
    for i, (row_ids, row_labels, row_part, k) in enumerate(rows):
        n = len(row_ids)
        ids[i, :n], new_labels[i, :n], new_part[i, :n], new_pair[i, :n] = row_ids, row_labels, row_part, k
        mask[i, :n] = 1
    return Routed(new_labels, new_part, new_pair, {"input_ids": ids, "attention_mask": mask})
