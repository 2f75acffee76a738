"""The reference of ``--objective dpo`` and ``ipo``: what a policy's log-probs are compared with.

``--reference logprobs`` (default): before training, one pass over every training and evaluation
pair computes the reference's log-probs of both answers; all ranks share the pass (fixed batches,
dealt round-robin, so each pair's log-probs come from the same batch whatever the world size), and
the result is cached next to the token cache, keyed by the content of the reference's weights, the
data and the settings that change log-probs, so a rerun or a resumed run reads it back. The
reference is the starting model (with ``--lora``, the base with the adapter disabled, which at the
start is the same), or ``--reference-model``.

``--reference live``: a reference runs in every step: with ``--lora`` the policy's base with its
adapter disabled (no second copy in memory), else a frozen copy of the starting model (or
``--reference-model``), sharded under FSDP2 like the policy.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from lmtune.data.batch import idle_batch
from lmtune.data.dataset import TokenizedDataset
from lmtune.data.pair_collate import PairCollator
from lmtune.errors import UserError, why_it_failed
from lmtune.model.attention import VARLEN, VARLEN_BUCKETED, use_varlen
from lmtune.model.chunked_loss import choose as choose_loss
from lmtune.model.modeling import load_model
from lmtune.model.precision import low_precision_dtype
from lmtune.model.products import Products
from lmtune.objectives.base import LossSetup, Objective
from lmtune.objectives.pair_losses import PairLoss
from lmtune.objectives.preference import PreferenceLoss, PreferenceObjective, Reference
from lmtune.outputs.runlog import InfoLog
from lmtune.parallel.distributed import DistEnv, all_reduce_sum, broadcast_object
from lmtune.parallel.wrap import unwrap, wrap_model
from lmtune.training.context import RunContext

if TYPE_CHECKING:
    from lmtune.training.build import Built

REFERENCE_DIR = "reference-logps"
REFERENCE_VERSION = 1
# Pairs per batch of the precomputing pass without --micro-batch-size: a pass without gradients
# takes far less memory than a training micro-batch; fixed, so the world size changes no batch.
PRECOMPUTE_PAIRS = 8


def needs_reference(objective: Objective) -> bool:
    return isinstance(objective, PreferenceObjective) and objective.loss.needs_reference


def precomputes(run: RunContext, objective: Objective) -> bool:
    """Whether this run computes its reference's log-probs before training."""
    return needs_reference(objective) and run.cfg.objective.reference == "logprobs"


def model_digest(model: nn.Module) -> str:
    """A hash of a model's weights (names, dtypes, shapes and bytes): what its log-probs depend on."""
    digest = hashlib.blake2b(digest_size=16)
    # 4-bit values are packed in bytes, or under FSDP2 in its gather dtype: the same bytes, named as
    # bytes, so that a QLoRA checkpoint's base is the same one under any strategy and precision.
    packed = {f"{n}.weight" for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"}
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        shown = (torch.uint8, (flat.numel(), 1)) if name in packed else (tensor.dtype, tuple(tensor.shape))
        digest.update(f"{name}|{shown[0]}|{shown[1]}".encode())
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()


def main_digest(model: nn.Module, env: DistEnv) -> str:
    """:func:`model_digest` of rank 0's copy, on every rank."""
    return broadcast_object(model_digest(model) if env.is_main else "", env)


def _check_vocabulary(reference: nn.Module, policy: nn.Module, name: str) -> None:
    rows = reference.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    wanted = policy.get_input_embeddings().weight.shape[0]  # type: ignore[operator]
    if rows != wanted:
        raise UserError(
            f"--reference-model {name}: its vocabulary has {rows:,} tokens, the policy's {wanted:,}; "
            "the reference must share the policy's tokenizer"
        )


def _per_example_attention(model: nn.Module) -> bool:
    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return name in (VARLEN, VARLEN_BUCKETED)


def reference_model(run: RunContext, policy: nn.Module) -> nn.Module:
    """The reference as a frozen model on this rank: ``--reference-model``, else a copy of the
    (unwrapped, pre-LoRA) starting model. It runs the policy's attention: the same inputs reach it."""
    cfg = run.cfg
    name = cfg.objective.reference_model
    if name is None:
        model = copy.deepcopy(policy)
    else:
        try:
            model = load_model(name, cfg.seed, cfg.model.trust_remote_code).model
        except UserError as e:  # load_model speaks of --model; here the folder is the reference's
            said = str(e)
            raise UserError(
                said.replace("--model ", "--reference-model ", 1) if said.startswith("--model ") else said
            ) from None
        _check_vocabulary(model, policy, name)
        cpu_bf16 = run.env.device.type == "cpu" and cfg.model.precision == "bf16"
        if _per_example_attention(policy) and not use_varlen(model, cpu_bf16):
            raise UserError(
                f"--reference-model {name}: it cannot run per-example attention as the policy does (its "
                "attention is not transformers' sdpa); choose a reference of an architecture that can"
            )
    model.requires_grad_(False)
    model.eval()
    return model


def with_live_reference(
    run: RunContext, base: nn.Module, objective: Objective, varlen: bool, products: Products
) -> Objective:
    """``objective`` with the reference a ``--reference live`` step runs (unchanged otherwise)."""
    if not needs_reference(objective) or run.cfg.objective.reference != "live":
        return objective
    assert isinstance(objective, PreferenceObjective)
    cfg = run.cfg
    if cfg.lora.enabled and cfg.objective.reference_model is None:
        return objective.with_reference(Reference(kind="adapter"))
    frozen = reference_model(run, base)
    # Its hash, where it is a model of its own: a resume checks that it is the one the run began with.
    digest = None if cfg.objective.reference_model is None else main_digest(frozen, run.env)
    module = reference_module(run, frozen, varlen, run.strategy == "fsdp", products)
    return objective.with_reference(Reference(kind="model", module=module, digest=digest))


def reference_module(
    run: RunContext, frozen: nn.Module, varlen: bool, sharded: bool, products: Products
) -> nn.Module:
    """A frozen reference as a module whose forward returns a batch's reference log-probs, on the
    device, sharded under FSDP2 (its own root: called whole, it gathers its parameters)."""
    cfg = run.cfg
    # False: a reference runs without gradients, so eagerly even in a --compile run (model.compiled).
    chunk = choose_loss(frozen, cfg.model.loss_chunk_size, False, device_type=run.env.device.type).chunk
    setup = LossSetup(varlen, chunk, products.fp32, products.bucketed)
    module = PreferenceLoss(frozen, setup, PairLoss(name=cfg.objective.name)).reference_mode()
    return wrap_model(
        module, "fsdp" if sharded else "single", run.env, low_precision_dtype(cfg.model.precision)
    )


@dataclass(frozen=True)
class Precomputed:
    """What precomputing did, for the log and run.json's ``data.reference``."""

    file: str
    computed: bool  # False: read from the cache
    pairs: int
    seconds: float


def cache_key(digest: str, data_key: str, run: RunContext, chunk: int, micro: int, products: Products) -> str:
    """Changes with the reference's weights, the data, and what changes computed log-probs."""
    cfg = run.cfg
    parts = {
        "version": REFERENCE_VERSION,
        "model": digest,
        "data": data_key,
        "precision": cfg.model.precision,
        "products": products.description,
        "loss_chunk": chunk,
        "pairs_per_batch": micro,
        "device": run.env.device.type,
    }
    if run.strategy == "fsdp" and cfg.model.precision != "fp32":
        # FSDP2 gathers weights in bf16/fp16 (rounded), where one process's autocast reads fp32 ones.
        parts["gathered"] = cfg.model.precision
    return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=12).hexdigest()


def precompute(
    run: RunContext,
    loss_module: nn.Module,
    data: TokenizedDataset,
    micro: int,
    pad_token_id: int,
    sharded: bool,
    autocast: Callable[[], AbstractContextManager[object]],
) -> np.ndarray:
    """Every pair's reference log-probs ``[pairs, 2]`` (float64), on every rank.

    Batches of ``micro`` pairs in data-set order are dealt round-robin over the ranks; under FSDP2
    (``sharded``) a rank with fewer runs idle forwards, as every forward gathers parameters.
    """
    env = run.env
    module = unwrap(loss_module)
    assert isinstance(module, PreferenceLoss)
    n = len(data)
    batches = -(-n // micro)
    rounds = -(-batches // env.world_size)
    out = torch.zeros(n, 2, dtype=torch.float64, device=env.device)
    collate = PairCollator(pad_token_id)
    was_training = module.training
    module.eval()
    # Rank 0's share of the pairs: hours on a large model, so it shows how far it is.
    run.log.start_progress(rounds, desc="reference log-probs", unit="batch")
    with torch.no_grad(), module.reference_pass():
        for k in range(rounds):
            run.stop.raise_if_requested()  # before training there is nothing to save: stop here
            run.heartbeat.beat("eval")
            number = k * env.world_size + env.rank
            if number >= batches and not sharded:
                break
            ids = list(range(number * micro, min(n, (number + 1) * micro)))
            batch = (collate([data[i] for i in ids]) if ids else idle_batch()).to(env.device)
            with autocast():
                logps = module(*batch.model_inputs())
            if ids:
                out[ids] = logps.double()
                run.log.advance()
    run.log.end_progress()
    module.train(was_training)
    return all_reduce_sum(out, env).cpu().numpy()


def _write(path: Path, values: np.ndarray, log: InfoLog) -> None:
    """Cache ``values`` at ``path``. A cache that cannot be written (a full or read-only disk)
    costs the next run this computation again, not this run."""
    tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}.npy")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(tmp, values)
        os.replace(tmp, path)
    except OSError as e:
        with suppress(OSError):
            tmp.unlink(missing_ok=True)
        log.info(
            f"warning: could not cache the reference log-probs at {path} ({e.strerror or e}); "
            "a later run computes them again"
        )


def _read(path: Path, pairs: int, log: InfoLog) -> np.ndarray | None:
    """The cached log-probs, or None when missing or not what lmtune wrote for this data (said:
    they are computed again): log-probs of ``pairs`` answer pairs are finite and never positive."""
    if not path.exists():
        return None
    try:
        values: np.ndarray = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        why = why_it_failed(e, 80)
    else:
        why = (
            f"shape {list(values.shape)}, {values.dtype}"
            if values.shape != (pairs, 2) or values.dtype != np.float64
            else "values that are not log-probs (non-finite, or above 0)"
            if not bool(np.isfinite(values).all() and (values <= 0).all())
            else ""
        )
        if not why:
            return values
    log.info(f"warning: {path}: not the reference log-probs of this data ({why}); computing them again")
    return None


def cached_reference(
    run: RunContext, data: TokenizedDataset, path: Path, compute: Any
) -> tuple[np.ndarray, Precomputed]:
    """The reference log-probs of ``data`` from ``path``, else computed by ``compute()`` (every
    rank) and cached by rank 0. Every rank agrees on which, by rank 0's look at the cache."""
    started = time.perf_counter()
    values = _read(path, len(data), run.log) if run.env.is_main else None
    found = broadcast_object(values is not None, run.env)
    if found:
        values = broadcast_object(values, run.env)
    else:
        # A forward over every pair before the first step: say so, or the wait looks like a hang.
        run.log.info(f"computing the reference log-probs of {len(data):,} pairs before training")
        values = compute()
        if run.env.is_main:
            _write(path, values, run.log)
    assert values is not None
    info = Precomputed(str(path), not found, len(data), time.perf_counter() - started)
    return values, info


@dataclass(frozen=True)
class PolicyParts:
    """What precomputing from the starting model needs of the built policy."""

    model: nn.Module  # the strategy's wrapper around the policy's PreferenceLoss
    digest: str | None  # model_digest of the starting model (rank 0's, on every rank)
    loss_chunk: int
    varlen: bool
    sharded: bool
    products: Products  # how the policy multiplies matrices (lmtune.model.products)
    autocast: Callable[[], AbstractContextManager[object]]  # the policy's


def precompute_references(
    run: RunContext,
    policy: PolicyParts,
    datasets: list[tuple[TokenizedDataset, str]],
    pad_token_id: int,
    data_cache: Path,
) -> tuple[dict[str, Any], str]:
    """Set the reference log-probs of every (data set, data key) from the cache or one pass, and
    say what was done (run.json's ``data.reference``), with the reference's weights' hash."""
    cfg = run.cfg
    micro = cfg.batch.micro_batch_size or PRECOMPUTE_PAIRS
    source = _ReferenceSource(run, policy)
    files = []
    for data, key in datasets:
        base = data.base()
        digest = source.digest()  # loads --reference-model, which decides its chunk
        path = (
            data_cache
            / REFERENCE_DIR
            / f"{cache_key(digest, key, run, source.chunk, micro, policy.products)}.npy"
        )
        values, info = cached_reference(
            run,
            base,
            path,
            lambda b=base: precompute(
                run, source.module(), b, micro, pad_token_id, policy.sharded, policy.autocast
            ),
        )
        base.set_reference(values)
        how = f"computed in {info.seconds:.1f}s" if info.computed else "from the cache"
        run.log.info(f"reference log-probs of {info.pairs:,} pairs ({how}): {path}")
        files.append(
            {"file": info.file, "pairs": info.pairs, "computed": info.computed, "seconds": info.seconds}
        )
    source.release()
    model = cfg.objective.reference_model or "the starting model" + (
        " (adapter disabled)" if cfg.lora.enabled else ""
    )
    return {"kind": "logprobs", "model": model, "files": files}, source.digest()


class _ReferenceSource:
    """The model the reference log-probs come from: the built policy (its own starting weights),
    or ``--reference-model``, loaded, hashed and wrapped only as far as needed."""

    def __init__(self, run: RunContext, policy: PolicyParts):
        self.run, self.policy = run, policy
        self._model: nn.Module | None = None
        self._wrapped: nn.Module | None = None
        self._digest = policy.digest
        self.chunk = policy.loss_chunk

    def _reference(self) -> nn.Module:
        if self._model is None:
            # reference_model's frozen copy is of the policy's starting weights: not needed here.
            assert self.run.cfg.objective.reference_model is not None
            policy = unwrap(self.policy.model).model
            assert isinstance(policy, nn.Module)
            self._model = reference_model(self.run, policy)
            self.chunk = choose_loss(
                self._model, self.run.cfg.model.loss_chunk_size, False, device_type=self.run.env.device.type
            ).chunk
        return self._model

    def digest(self) -> str:
        if self._digest is None:
            model = self._reference()
            self._digest = main_digest(model, self.run.env)
        return self._digest

    def module(self) -> nn.Module:
        if self.run.cfg.objective.reference_model is None:
            return self.policy.model
        if self._wrapped is None:
            self._wrapped = reference_module(
                self.run, self._reference(), self.policy.varlen, self.policy.sharded, self.policy.products
            )
        return self._wrapped

    def release(self) -> None:
        self._model = self._wrapped = None


def attach_references(run: RunContext, built: Built, cache_dir: Path) -> str | None:
    """The reference log-probs of every pair (cached by the starting weights' hash), where the
    objective precomputes them: before a checkpoint's weights are loaded into the policy.

    Returns:
        The --reference-model's weights' hash, where one is given (a resume checks it).
    """
    if not precomputes(run, built.objective):
        trained = built.parts.root  # the loss module, which runs the live reference
        return trained.reference.digest if isinstance(trained, PreferenceLoss) else None
    parts, loss = built.parts, built.loss
    policy = PolicyParts(
        built.model,
        built.starting_digest if run.cfg.objective.reference_model is None else None,
        loss.chunk,
        bool(parts.root.varlen),
        parts.sharded,
        built.products,
        built.autocast,
    )
    datasets = _distinct(built.train_data, built.eval_data, built.data_info)
    built.data_info["reference"], digest = precompute_references(
        run, policy, datasets, built.tokenizer.pad_token_id, cache_dir
    )
    return digest if run.cfg.objective.reference_model is not None else None


def _distinct(
    train: TokenizedDataset, held_out: TokenizedDataset | None, info: dict[str, Any]
) -> list[tuple[TokenizedDataset, str]]:
    """The data sets whose pairs need reference log-probs, with their cache keys: one for the
    training data and an --eval-split of it, two with --eval-data."""
    # Keyed by the tokens: the cache entry's name (the data key stays across lmtune's versions).
    found = [(train.base(), Path(info["train"]["cache"]).name)]
    if held_out is not None and held_out.base() is not train.base():
        found.append((held_out.base(), Path(info["eval"]["cache"]).name))
    return found
