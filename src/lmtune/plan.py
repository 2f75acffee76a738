"""`lmtune plan`: predict the peak memory per device of a training setup before loading any weight.

The model is built from its config alone under ``FakeTensorMode`` (tensors with shapes, dtypes and a
device but no storage), so nothing of the model is allocated. Weights, gradients,
optimizer state and communication buffers follow from the parameter list and the strategy. The
activations are not guessed from a formula: a fake forward pass of one row records every tensor
autograd saves for the backward pass, with the kernels and autocast rules of this device, once for a
model cut to one decoder block and once to two; the difference is one block, the rest is embeddings,
head and loss.

On a GPU the allocator's peak counts exactly these tensors. On CPU the measured peak is the resident
size, which adds the process itself (Python, torch, transformers, kernel code) and the C heap's
habit of keeping freed activations resident; both are measured, not assumed, by training two real
steps of the same setup on the model cut to 1 and to 3 blocks (see ``measure_host``).

``--calibrate`` trains two real steps at two micro-batch sizes and fits the activation scale and a
fixed offset to what was measured; every candidate's prediction is then corrected with them.
"""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lmtune.config import TrainConfig, micro_batch_size
from lmtune.errors import UserError
from lmtune.lora import LoraSettings
from lmtune.parallel import decoder_blocks
from lmtune.perf import low_precision_dtype

MIB = 2**20
UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


@dataclass(frozen=True)
class Setup:
    strategy: str  # single | ddp | fsdp
    optimizer: str
    lora: bool
    activation_checkpointing: bool
    precision: str
    micro_batch_size: int
    length: int  # tokens per row of a micro-batch
    world_size: int
    accumulation: int  # micro-steps per optimizer step
    loss_chunk: int = 0  # tokens per chunk of the chunked linear cross-entropy; 0: full logits

    def label(self) -> str:
        extras = (
            [self.optimizer]
            + (["lora"] if self.lora else [])
            + (["ckpt"] if self.activation_checkpointing else [])
        )
        return f"{self.strategy} x{self.world_size} {self.precision} " + "+".join(extras)


@dataclass(frozen=True)
class Host:
    """What a CPU process holds besides the tensors the plan counts (a GPU allocator counts none of
    it): a fixed footprint (Python, torch, transformers, kernel code) and the allocator's resident
    bytes per live tensor byte (freed activations stay resident in the C heap)."""

    runtime: int = 0
    allocator: float = 1.0


@dataclass(frozen=True)
class Estimate:
    """Predicted peak bytes on one device, by what holds them."""

    setup: Setup
    weights: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward by the decoder blocks and embeddings
    logits: int  # vocab x length x batch: the saved log-softmax and its gradient
    buffers: int  # FSDP all-gather and reduce-scatter buffers (DDP's buckets are the gradients)
    host: Host = Host()
    activation_scale: float = 1.0  # set by --calibrate
    offset: int = 0  # set by --calibrate

    @property
    def tensors(self) -> int:
        """Peak bytes of live tensors."""
        dynamic = (self.activations + self.logits) * self.activation_scale
        state = self.weights + self.optimizer + self.buffers
        if self.setup.accumulation > 1 or self.setup.strategy == "ddp":
            # Gradients of earlier micro-steps stay while the next one's activations are alive;
            # DDP's gradients are views into its buckets, allocated once for the whole run.
            return int(state + self.gradients + dynamic)
        # One micro-step: gradients appear as the backward frees activations, so they overlap little.
        return int(state + max(dynamic, self.gradients + self.logits * 0.5 * self.activation_scale))

    @property
    def total(self) -> int:
        return int(self.host.runtime + self.host.allocator * self.tensors + self.offset)


@dataclass(frozen=True)
class ModelFacts:
    """What the fake model tells about one variant (with or without LoRA) at one row length."""

    params: list[tuple[str, int, bool]]  # name, elements, trainable (tied weights once)
    layers: int
    hidden: int
    vocab: int
    block_elements: int  # parameters of one decoder block
    per_layer: int  # bytes saved for backward by one block, one row
    other: int  # bytes saved outside the blocks (embeddings, final norm), one row
    logits: int  # bytes of vocab-wide tensors saved for the loss, one row


def parse_size(text: str) -> int:
    """``"24GiB"``, ``"80GB"``, ``"512M"`` -> bytes (binary units: G = GiB)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmgtKMGT]?)(i?[bB])?\s*", text)
    if not match:
        raise UserError(f"--memory-per-device: expected a size such as 24GiB or 512MiB, got {text!r}")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


@contextmanager
def _fake(device: str) -> Iterator[None]:
    """Tensors with shape, dtype and device but no storage: nothing is allocated or initialised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True), torch.device(device):
        yield


def _fake_model(config: Any) -> torch.nn.Module:
    """Call inside ``_fake``."""
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    return model


def _lora_targets(model: torch.nn.Module, lora: LoraSettings) -> list[tuple[str, int, int]]:
    """(name, in, out) of every linear layer LoRA would adapt: as peft's all-linear, those in the
    decoder blocks; or those named by --lora-target-modules."""
    names = {n.strip() for n in lora.target_modules.split(",") if n.strip()}
    in_blocks = {id(m) for b in decoder_blocks(model) for m in b.modules()}
    found = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or weight.ndim != 2 or type(module).__name__ not in ("Linear", "Conv1D"):
            continue
        wanted = id(module) in in_blocks if names == {"all-linear"} else name.rsplit(".", 1)[-1] in names
        if wanted:
            rows, cols = weight.shape
            # GPT-2's Conv1D stores the weight as [in, out], nn.Linear as [out, in].
            found.append((name, rows, cols) if type(module).__name__ == "Conv1D" else (name, cols, rows))
    return found


def _saved_bytes(config: Any, precision: str, length: int, device: str) -> tuple[int, int]:
    """Bytes autograd saves for the backward of one row of ``length`` tokens: all, and vocab-wide."""
    from lmtune.loss import token_loss_sum

    with _fake(device):
        model = _fake_model(config)
        params = {id(p) for p in model.parameters()}
        saved: dict[int, tuple[int, bool]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            base = t._base if t._base is not None else t
            if id(t) in params or id(base) in params:
                return t
            shape = tuple(base.shape)
            # The attention mask: transformers builds one here that an unpadded run does not have;
            # padded and packed runs pay for theirs separately (see _mask_bytes).
            if len(shape) == 4 and shape[-1] == shape[-2] == length and shape[1] == 1:
                return t
            wide = bool(shape) and shape[-1] == config.vocab_size
            saved[id(base)] = (base.numel() * base.element_size(), wide)
            return t

        ids = torch.zeros(1, length, dtype=torch.long)
        dtype = low_precision_dtype(precision)
        with (
            torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            token_loss_sum(model(input_ids=ids, use_cache=False).logits, ids)
    return sum(b for b, _ in saved.values()), sum(b for b, wide in saved.values() if wide)


def _cut(config: Any, layers: int) -> Any:
    """The same architecture with only ``layers`` decoder blocks."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = layers
    types = getattr(small, "layer_types", None)
    if types:  # cut, or (for a cut of a cut) continued in the same pattern
        small.layer_types = [types[i % len(types)] for i in range(layers)]
    return small


def model_facts(
    config: Any, lora: LoraSettings | None, precision: str, length: int, device: str
) -> ModelFacts:
    """Parameters of the whole model; saved activations of a one-block and a two-block cut of it."""
    one, logits = _saved_bytes(_cut(config, 1), precision, length, device)
    two, _ = _saved_bytes(_cut(config, 2), precision, length, device)
    per_layer = two - one
    with _fake(device):
        full = _fake_model(config)
        blocks = decoder_blocks(full)
        params = [(n, p.numel(), lora is None) for n, p in full.named_parameters()]
        block_elements = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
        targets = _lora_targets(full, lora) if lora is not None else []
    if lora is not None:
        if not targets:
            raise UserError(
                f"--lora-target-modules {lora.target_modules}: no linear layer of the model matches"
            )
        # Adapter weights A [r, in] and B [out, r]; per row they save A's output (r wide) and, with
        # dropout, the dropped input and its mask. The input itself was already saved for the
        # base layer in the full fine-tuning trace.
        params += [(f"{n}.lora", lora.rank * (i + o), True) for n, i, o in targets]
        extra = sum(length * (4 * lora.rank + (5 * i if lora.dropout > 0 else 0)) for _, i, _ in targets)
        per_layer += extra // max(len(blocks), 1)
    return ModelFacts(
        params=params,
        layers=len(blocks),
        hidden=int(config.hidden_size),
        vocab=int(config.vocab_size),
        block_elements=block_elements,
        per_layer=per_layer,
        other=one - per_layer - logits if lora is None else one - (two - one) - logits,
        logits=logits,
    )


def _optimizer_bytes(name: str, sizes: Sequence[int]) -> int:
    """State bytes for these trainable tensors: AdamW two fp32 moments and a step counter each;
    bitsandbytes 8-bit one byte per moment plus an fp32 absmax per 256-element block and two
    256-entry quantisation maps (fp32 moments under 4096 elements); SGD one momentum buffer."""
    if name == "sgd":
        return 4 * sum(sizes)
    if name in ("adamw8bit", "paged_adamw8bit"):
        return sum(8 * n if n < 4096 else 2 * n + 8 * math.ceil(n / 256) + 2 * 256 * 4 for n in sizes)
    return sum(8 * n + 4 for n in sizes)


def _mask_bytes(setup: Setup, padded: bool) -> int:
    """A padded or packed micro-batch carries a boolean [B, 1, L, L] attention mask."""
    return setup.micro_batch_size * setup.length * setup.length if padded else 0


def estimate(setup: Setup, facts: ModelFacts, host: Host, padded: bool) -> Estimate:
    world = setup.world_size
    shard = world if setup.strategy == "fsdp" else 1
    total_elements = sum(n for _, n, _ in facts.params)
    trainable = [n for _, n, t in facts.params if t]
    gathered_bytes = 2 if setup.precision in ("bf16", "fp16") else 4  # FSDP casts what it gathers
    weights = 4 * total_elements // shard
    gradients = 4 * sum(trainable) // shard
    buffers = 0
    if setup.strategy == "fsdp":
        root = total_elements - facts.block_elements * facts.layers
        gathered = (root + 2 * facts.block_elements) * gathered_bytes
        buffers = gathered + 4 * facts.block_elements  # plus one block's unsharded gradients
        if setup.accumulation > 1:
            gradients = 4 * sum(trainable)  # without sync, FSDP2 keeps gradients unsharded
    optimizer = _optimizer_bytes(setup.optimizer, trainable) // shard
    rows = setup.micro_batch_size
    if setup.activation_checkpointing:
        # Kept: each block's input; recomputed during its backward: one block's activations.
        # (The residual stream between blocks stays fp32 under autocast.)
        kept = facts.layers * setup.length * facts.hidden * 4 + facts.per_layer
    else:
        kept = facts.layers * facts.per_layer
    activations = rows * (kept + facts.other) + _mask_bytes(setup, padded)
    logits = _loss_bytes(setup, facts)
    return Estimate(setup, weights, gradients, optimizer, activations, logits, buffers, host)


def _loss_bytes(setup: Setup, facts: ModelFacts) -> int:
    """Bytes the loss holds at its peak."""
    tokens = setup.micro_batch_size * setup.length
    if not setup.loss_chunk:
        # The saved log-softmax plus, during the backward, the logits' gradient (fp32).
        return setup.micro_batch_size * facts.logits + 4 * tokens * facts.vocab
    # One chunk's logits in the compute dtype, their fp32 copy (the softmax and its gradient are
    # made in place) and the gradient cast back; kept from forward to backward: the gradients
    # of the hidden states and, unless LoRA freezes it, of the output layer's weight (fp32).
    low = 2 if low_precision_dtype(setup.precision) is not None else 0
    chunk = min(setup.loss_chunk, tokens) * facts.vocab * (4 + 2 * low)
    head = 0 if setup.lora else 4 * facts.vocab * facts.hidden
    return chunk + head + 4 * tokens * facts.hidden


def loss_chunk(cfg: TrainConfig, config: Any) -> int:
    """The chunk lmtune train would use (chunked_loss.choose decides it on the real model)."""
    from lmtune.chunked_loss import default_chunk_size

    if cfg.loss_chunk_size == 0 or cfg.compile or getattr(config, "final_logit_softcapping", None):
        return 0
    return cfg.loss_chunk_size or default_chunk_size(int(config.vocab_size))


def measure_host(
    cfg: TrainConfig,
    setup: Setup,
    config: Any,
    predict_cut: Callable[[Any, Setup], Estimate],
    workdir: Path,
) -> Host:
    """On CPU: train two real steps of this setup on the model cut to 1 and to 3 decoder blocks
    (random weights, saved as a model folder), and solve measured = runtime + allocator x tensors
    from the two peaks. Cheap next to the real model, and measured on this machine, not assumed."""
    from transformers import AutoModelForCausalLM

    from lmtune.modeling import load_tokenizer

    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    layers = (1, min(3, int(config.num_hidden_layers)))
    if layers[0] == layers[1]:
        layers = (1, 2)
    points = []
    for n in layers:
        folder = workdir / f"cut-{n}"
        with torch.random.fork_rng(devices=[]):
            model = AutoModelForCausalLM.from_config(_cut(config, n))  # type: ignore[no-untyped-call]
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        del model
        points.append(
            (predict_cut(_cut(config, n), setup).tensors, measure_peak(cfg, setup, workdir, str(folder)))
        )
    (t1, m1), (t2, m2) = points
    allocator = min(max((m2 - m1) / max(t2 - t1, 1), 1.0), 3.0)
    return Host(runtime=max(0, int(m1 - allocator * t1)), allocator=allocator)


@dataclass(frozen=True)
class Calibration:
    activation_scale: float
    offset: int
    points: list[tuple[int, int, int]]  # micro-batch size, predicted, measured


def apply(e: Estimate, c: Calibration | None) -> Estimate:
    return e if c is None else replace(e, activation_scale=c.activation_scale, offset=c.offset)


def calibrate(
    setup: Setup, predict: Callable[[Setup], Estimate], measure: Callable[[Setup], int]
) -> Calibration:
    """Two real runs of two steps, at the micro-batch size and at half (or double) of it; fit the
    activation scale and an offset so both measured peaks are matched."""
    other = setup.micro_batch_size // 2 if setup.micro_batch_size > 1 else 2
    points = []
    for b in (setup.micro_batch_size, other):
        s = replace(setup, micro_batch_size=b)
        points.append((b, predict(s), measure(s)))
    (_, e1, m1), (_, e2, m2) = points
    dynamic1 = e1.host.allocator * (e1.activations + e1.logits)
    dynamic2 = e2.host.allocator * (e2.activations + e2.logits)
    scale = (m1 - m2) / (dynamic1 - dynamic2) if dynamic1 != dynamic2 else 1.0
    scale = min(max(scale, 0.25), 4.0)  # a noisy pair must not turn the model upside down
    offset = m1 - apply(e1, Calibration(scale, 0, [])).total
    return Calibration(scale, offset, [(b, e.total, m) for b, e, m in points])


def measure_peak(cfg: TrainConfig, setup: Setup, workdir: Path, model: str | None = None) -> int:
    """Train two real steps with ``setup`` and return the largest peak of any rank."""
    out = workdir / f"run-{setup.micro_batch_size}-{Path(model).name if model else 'model'}"
    args = [
        *("train", "--model", model or cfg.model, "--data", cfg.data, "--max-steps", "2", "--no-progress"),
        *("--max-length", str(cfg.max_length), "--seed", str(cfg.seed), "--output-dir", str(out)),
        *("--micro-batch-size", str(setup.micro_batch_size), "--strategy", setup.strategy),
        *("--global-batch-size", str(setup.micro_batch_size * setup.world_size * setup.accumulation)),
        *("--precision", setup.precision, "--optimizer", setup.optimizer, "--resume", "never"),
        *("--nproc-per-node", str(setup.world_size), "--packing", cfg.packing, "--device", cfg.device),
        *("--loss-chunk-size", str(setup.loss_chunk)),
        # Every setting that changes what the run holds (the data's shape, the model's code).
        *("--data-format", cfg.data_format, "--text-field", cfg.text_field, "--truncation", cfg.truncation),
        *("--txt-mode", cfg.txt_mode),
    ]
    args += ["--trust-remote-code"] if cfg.trust_remote_code else []
    args += ["--compile"] if cfg.compile else []
    args += ["--chat-template", cfg.chat_template] if cfg.chat_template else []
    args += ["--train-on-prompt"] if cfg.train_on_prompt else []
    args += ["--cache-dir", cfg.cache_dir] if cfg.cache_dir else []
    args += ["--lora"] if setup.lora else []
    args += ["--activation-checkpointing"] if setup.activation_checkpointing else []
    if setup.lora:
        args += ["--lora-rank", str(cfg.lora_rank), "--lora-alpha", str(cfg.lora_alpha)]
        args += ["--lora-dropout", str(cfg.lora_dropout), "--lora-target-modules", cfg.lora_target_modules]
    proc = subprocess.run([sys.executable, "-m", "lmtune", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise UserError(f"--calibrate: the real run of {setup.label()} failed: " + " | ".join(tail))
    run = json.loads((out / "run.json").read_text())
    return int(max(run["result"]["peak_memory_per_rank"]))


def setup_from(cfg: TrainConfig, world_size: int, length: int, chunk: int = 0) -> Setup:
    """The setup ``lmtune train`` would run with these settings on ``world_size`` processes."""
    strategy = cfg.strategy
    if strategy == "auto" or (world_size == 1 and strategy in ("ddp", "fsdp")):
        strategy = "ddp" if world_size > 1 else "single"
    micro = micro_batch_size(cfg, world_size)
    return Setup(
        strategy=strategy,
        optimizer=cfg.optimizer,
        lora=cfg.lora,
        activation_checkpointing=cfg.activation_checkpointing,
        precision=cfg.precision,
        micro_batch_size=micro,
        length=length,
        world_size=world_size,
        accumulation=max(1, cfg.global_batch_size // (micro * world_size)),
        loss_chunk=chunk,
    )


def largest_micro_batch(setup: Setup, predict: Callable[[Setup], Estimate], memory: int, limit: int) -> int:
    """The largest micro-batch (up to ``limit``) whose predicted peak fits ``memory``; 0 if none."""
    best = 0
    lo, hi = 1, limit
    while lo <= hi:  # the peak grows with the micro-batch, so bisect
        mid = (lo + hi) // 2
        # As if accumulating (gradients alive beside activations): the safe side of either case.
        if predict(replace(setup, micro_batch_size=mid, accumulation=2)).total <= memory:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def candidates(setup: Setup) -> list[Setup]:
    """Alternatives to the requested setup: strategy x optimizer x checkpointing x LoRA."""
    strategies = ["ddp", "fsdp"] if setup.world_size > 1 else ["single"]
    out = []
    for strategy in strategies:
        for optimizer in ("adamw", "adamw8bit"):
            if strategy == "fsdp" and optimizer == "adamw8bit":
                continue  # bitsandbytes' 8-bit update does not take FSDP2's sharded parameters
            for lora in (False, True):
                for ckpt in (False, True):
                    out.append(
                        replace(
                            setup,
                            strategy=strategy,
                            optimizer=optimizer,
                            lora=lora,
                            activation_checkpointing=ckpt,
                        )
                    )
    return out


def format_row(e: Estimate) -> str:
    parts = [
        f"{e.setup.label():<40}",
        f"B={e.setup.micro_batch_size:<4}",
        *(
            f"{getattr(e, k) / MIB:>9,.0f}"
            for k in ("weights", "gradients", "optimizer", "activations", "logits", "buffers")
        ),
        f"{e.host.runtime / MIB:>9,.0f}",
        f"{e.total / MIB:>10,.0f}",
    ]
    return " ".join(parts)


HEADER = (
    f"{'setup':<40} {'micro':<6}"
    + "".join(f"{h:>10}" for h in ("weights", "grads", "optim", "activ.", "logits", "buffers", "runtime"))
    + f"{'total MiB':>11}"
)


def to_json(e: Estimate) -> dict[str, Any]:
    return {**asdict(e), "total": e.total}


def row_length(cfg: TrainConfig) -> tuple[int, bool, str]:
    """Tokens per row, whether rows carry a mask (padding or packing), and how that was decided.

    Packed rows are --max-length wide; otherwise a micro-batch is as wide as its longest example,
    found by tokenizing --data (through the same cache as training).
    """
    from lmtune.build import prepare_data
    from lmtune.distributed import read_dist_env
    from lmtune.modeling import load_tokenizer

    if cfg.packing == "on":
        return cfg.max_length, True, "--packing on: rows of --max-length"
    env = read_dist_env("cpu")
    quiet = _QuietLog()
    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    if cfg.chat_template is not None:  # the same tokens, and the same cache entry, as training
        from lmtune.chat import use_chat_template

        use_chat_template(tokenizer, cfg.chat_template)
    train, _, info = prepare_data(replace(cfg, eval_data=None), tokenizer, env, quiet)
    lengths = train.lengths()
    longest = int(lengths.max())
    if cfg.packing == "auto" and set(info["train"]["formats"]) == {"text"} and int(lengths.min()) < longest:
        return cfg.max_length, True, "text data may be packed into rows of --max-length"
    padded = int(lengths.min()) < longest
    return longest, padded, f"longest example of --data: {longest} tokens"


class _QuietLog:
    def info(self, message: str) -> None:
        pass


def device_memory(device_type: str, local_processes: int) -> int:
    """Memory one device offers: the GPU's, or this machine's RAM shared by its processes."""
    if device_type == "cuda":
        return int(torch.cuda.get_device_properties(0).total_memory)
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(local_processes, 1)


@dataclass(frozen=True)
class PlanReport:
    requested: Estimate
    candidates: list[tuple[Estimate, int]]  # estimate at the largest fitting micro-batch, that size
    memory: int
    length_reason: str
    calibration: Calibration | None


def plan(cfg: TrainConfig, memory: int | None, calibrate_runs: bool, workdir: Path) -> PlanReport:
    from lmtune.config import parse_nnodes
    from lmtune.distributed import read_dist_env
    from lmtune.modeling import load_config

    config = load_config(cfg.model, cfg.trust_remote_code)
    world = cfg.nproc_per_node * parse_nnodes(cfg.nnodes)[1]
    device = read_dist_env(cfg.device).device.type
    length, padded, reason = row_length(cfg)
    lora = LoraSettings(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_target_modules)
    facts: dict[tuple[int, bool, str], ModelFacts] = {}

    def predict_for(model_config: Any, setup: Setup, host: Host) -> Estimate:
        key = (int(model_config.num_hidden_layers), setup.lora, setup.precision)
        if key not in facts:
            adapters = lora if setup.lora else None
            facts[key] = model_facts(model_config, adapters, setup.precision, length, device)
        return estimate(setup, facts[key], host, padded)

    requested = setup_from(cfg, world, length, loss_chunk(cfg, config))
    host = Host()
    if device == "cpu":
        host = measure_host(cfg, requested, config, lambda c, s: predict_for(c, s, Host()), workdir)

    def predict(setup: Setup) -> Estimate:
        return predict_for(config, setup, host)

    calibration = None
    if calibrate_runs:
        calibration = calibrate(requested, predict, lambda s: measure_peak(cfg, s, workdir))
    budget = memory if memory is not None else device_memory(device, cfg.nproc_per_node)
    limit = max(1, cfg.global_batch_size // world)
    table = []
    for candidate in candidates(requested):
        best = largest_micro_batch(candidate, lambda s: apply(predict(s), calibration), budget, limit)
        chosen = replace(candidate, micro_batch_size=max(best, 1))
        accumulation = max(1, cfg.global_batch_size // (chosen.micro_batch_size * world))
        table.append((apply(predict(replace(chosen, accumulation=accumulation)), calibration), best))
    return PlanReport(apply(predict(requested), calibration), table, budget, reason, calibration)


def format_report(report: PlanReport) -> str:
    r = report.requested
    lines = [
        f"memory plan: {r.setup.label()}, micro-batch {r.setup.micro_batch_size} x {r.setup.length} "
        f"tokens ({report.length_reason}), {r.setup.accumulation} micro-step(s) per step, "
        + (f"loss in chunks of {r.setup.loss_chunk} tokens" if r.setup.loss_chunk else "full logits"),
        "",
        HEADER,
        format_row(r),
    ]
    if r.host.runtime:
        lines += [
            f"CPU process: {r.host.runtime / MIB:,.0f} MiB of its own, and {r.host.allocator:.2f} "
            "resident bytes per tensor byte (measured on 1- and 3-block cuts of the model)"
        ]
    if report.calibration is not None:
        c = report.calibration
        lines += [
            "",
            f"calibrated on two real runs: activations x{c.activation_scale:.2f}, "
            f"offset {c.offset / MIB:+,.0f} MiB",
        ]
        lines += [
            f"  micro-batch {b}: predicted {p / MIB:,.0f} MiB, measured {m / MIB:,.0f} MiB"
            for b, p, m in c.points
        ]
    lines += [
        "",
        f"setups that fit {report.memory / 2**30:,.1f} GiB per device (largest micro-batch for each):",
        HEADER,
    ]
    fitting = sorted((x for x in report.candidates if x[1] > 0), key=lambda x: (-x[1], x[0].total))
    lines += [format_row(e) for e, _ in fitting] or ["  none: even a micro-batch of 1 does not fit"]
    too_big = [e for e, best in report.candidates if best == 0]
    if too_big:
        lines += ["does not fit at micro-batch 1:"] + [
            f"  {e.setup.label()} ({e.total / MIB:,.0f} MiB)" for e in too_big
        ]
    return "\n".join(lines)


def report_json(report: PlanReport) -> dict[str, Any]:
    return {
        "requested": to_json(report.requested),
        "memory_per_device": report.memory,
        "candidates": [{**to_json(e), "largest_micro_batch": best} for e, best in report.candidates],
        "calibration": asdict(report.calibration) if report.calibration else None,
    }
