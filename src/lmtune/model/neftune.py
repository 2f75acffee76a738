"""NEFTune (Jain et al., 2023): uniform noise on the input embeddings of the examples trained on.

An example's noise is uniform in ``[-m, m)`` with ``m = alpha / sqrt(L * d)``, ``L`` its own
length and ``d`` the embedding width, drawn from a generator seeded by (run seed, optimizer step,
example id). What an example gets therefore does not depend on the rank, micro-batch, row or
padding it lands in: N ranks train as one process does, packed rows as padded ones, and a resumed
run as the uninterrupted one. (The Hugging Face Trainer's NEFTune, which TRL and Axolotl use,
scales by the padded batch's length and draws from the global generator, so there the noise
changes with the batch's layout.)
"""

from __future__ import annotations

import hashlib
import math

import torch

from lmtune.data.batch import Batch

NO_NOISE = -1  # the seed of a token that gets none (padding, fillers)


def example_seed(seed: int, step: int, example_id: int) -> int:
    """The seed of one example's noise at one optimizer step (below 2**63, as generators take);
    keyed dropout's masks (lmtune.model.dropout) are drawn from it too."""
    digest = hashlib.blake2b(f"neftune:{seed}:{step}:{example_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def token_seeds(batch: Batch, seed: int, step: int) -> torch.Tensor:
    """Per token of ``batch``'s rows, the seed of its example at this step (:data:`NO_NOISE` on
    padding): what its NEFTune noise and its keyed dropout masks are drawn from."""
    seeds = [example_seed(seed, step, e) for e in batch.example_ids] + [NO_NOISE]
    index = batch.token_examples()
    # Padding's index -1 picks the last entry, NO_NOISE; so does an idle batch's one token (FSDP's
    # lockstep), the only entry of a batch without examples.
    return torch.tensor(seeds, dtype=torch.long, device=index.device)[index]


def embedding_noise(
    seeds: torch.Tensor,
    position_ids: torch.Tensor | None,
    width: int,
    alpha: float,
    dtype: torch.dtype = torch.float32,
    runs: list[tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """The noise of rows whose tokens carry ``seeds`` (as the model gets them), ``[*seeds.shape, width]``
    in ``dtype`` (each example's drawn in fp32). An example is a run of tokens with one seed; where
    positions are given, a position 0 also starts one (an example met twice in a row)."""
    runs = example_runs(seeds, position_ids) if runs is None else runs  # the caller's, when it has them
    # One tensor filled example by example: the largest of a step's activations is not held twice.
    noise = torch.zeros(seeds.numel(), width, dtype=dtype, device=seeds.device)
    for seed, lo, hi in runs:
        length = hi - lo
        generator = torch.Generator(device=seeds.device)
        generator.manual_seed(seed)
        drawn = torch.rand(length, width, generator=generator, device=seeds.device)
        noise[lo:hi] = drawn.mul_(2).sub_(1).mul_(alpha / math.sqrt(length * width))
    return noise.view(*seeds.shape, width)


def example_runs(seeds: torch.Tensor, position_ids: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """The runs of tokens with one seed in rows ``seeds`` (``[rows, length]``), flattened, as
    ``(seed, start, end)``; where positions are given, a position 0 also starts one (an example met
    twice in a row). Runs of :data:`~lmtune.model.neftune.NO_NOISE` are left out."""
    seeds = seeds.contiguous()
    starts = torch.ones_like(seeds, dtype=torch.bool)
    starts[:, 1:] = seeds[:, 1:] != seeds[:, :-1]
    if position_ids is not None:
        starts |= position_ids == 0
    flat = seeds.reshape(-1)
    offsets = [*torch.nonzero(starts.reshape(-1)).flatten().tolist(), flat.numel()]
    firsts = flat[starts.reshape(-1)].tolist()
    return [(s, lo, hi) for s, lo, hi in zip(firsts, offsets, offsets[1:], strict=False) if s != NO_NOISE]
